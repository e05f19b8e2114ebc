#!/usr/bin/env bash
# Validates the Kubernetes manifests under k8s/:
#   1. renders the kustomization (kubectl kustomize; a built-in renderer for the subset
#      k8s/ uses when kubectl is absent),
#   2. validates every object against the Kubernetes JSON schemas, strictly (unknown
#      fields are errors), for each version in K8S_VERSIONS (PyPI kubernetes-validate,
#      which bundles the schemas),
#   3. validates the ServiceMonitor against the prometheus-operator CRD schema (npm
#      @kubernetes-models/prometheus-operator), plus a structural check in Python,
#   4. runs cross-object consistency checks (selectors, ports, probes, grace period),
#   5. validates the standalone bulk Job (bulk-job.yaml, bulk-data-pvc.yaml: applied on
#      their own, not by the kustomization) against the same schemas, and checks it
#      against the kustomization (shard count, Service, claims).
# Tools are installed on first use under .cache/ (PyPI and npm only). Exit status 1 on
# any invalid manifest.
#   scripts/validate-k8s.sh [K8S_DIR]     (default: k8s)
# Env: K8S_VERSIONS (default "1.30.0 1.37.0"), K8S_RENDERER=auto|kubectl|builtin.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
K8S_DIR="${1:-$ROOT/k8s}"
CACHE="$ROOT/.cache"
VENV="$CACHE/validate-venv"
NODE_PREFIX="$CACHE/validate-node"
K8S_VERSIONS="${K8S_VERSIONS:-1.30.0 1.37.0}"
PY_REQS=(kubernetes-validate==1.37.0 PyYAML==6.0.3)
NPM_PKG="@kubernetes-models/prometheus-operator@6.0.0"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

say() { printf '== %s\n' "$*"; }
fail=0

# --- tools ---------------------------------------------------------------------------
stamp="$VENV/.installed-$(printf '%s ' "${PY_REQS[@]}" | sha256sum | cut -c1-12)"
if [[ ! -f "$stamp" ]]; then
  say "installing ${PY_REQS[*]} into .cache/validate-venv"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PY_REQS[@]}"
  touch "$stamp"
fi
PY="$VENV/bin/python"

have_node=0
if command -v node >/dev/null && command -v npm >/dev/null; then
  if [[ ! -f "$NODE_PREFIX/.installed-${NPM_PKG//[\/@]/_}" ]]; then
    say "installing $NPM_PKG into .cache/validate-node"
    mkdir -p "$NODE_PREFIX"
    [[ -f "$NODE_PREFIX/package.json" ]] || echo '{"private": true}' > "$NODE_PREFIX/package.json"
    npm install --silent --no-audit --no-fund --prefix "$NODE_PREFIX" "$NPM_PKG"
    touch "$NODE_PREFIX/.installed-${NPM_PKG//[\/@]/_}"
  fi
  have_node=1
fi

# --- 1. render ----------------------------------------------------------------------
RENDERED="$OUT/rendered.yaml"
RENDERER="${K8S_RENDERER:-auto}"   # auto | kubectl | builtin
if [[ $RENDERER == kubectl || ( $RENDERER == auto && -n "$(command -v kubectl)" ) ]]; then
  say "rendering $K8S_DIR with kubectl kustomize"
  kubectl kustomize "$K8S_DIR" > "$RENDERED"
else
  say "rendering $K8S_DIR with the built-in renderer (kubectl not used)"
  "$PY" "$ROOT/scripts/k8s_manifest_checks.py" render "$K8S_DIR" > "$RENDERED"
fi
echo "rendered $(grep -c '^kind:' "$RENDERED") objects"

# --- 2. Kubernetes schemas ----------------------------------------------------------
for v in $K8S_VERSIONS; do
  say "kubernetes-validate --strict, Kubernetes $v"
  log="$OUT/kv-$v.log"
  if ! "$VENV/bin/kubernetes-validate" --strict --kubernetes-version "$v" "$RENDERED" >"$log" 2>&1; then
    fail=1
  fi
  # The ServiceMonitor has no schema there (a CRD): checked in step 3.
  grep -v "Couldn't find schema for kind ServiceMonitor" "$log" | sed "s|$RENDERED|rendered|" || true
  if grep -q '^ERROR' "$log"; then fail=1; fi
  # Any other kind without a schema is an error too (e.g. a typo in apiVersion).
  if grep "Couldn't find schema" "$log" | grep -v 'kind ServiceMonitor ' | sed -e 's/^WARN/ERROR/' -e "s|$RENDERED|rendered|" | grep .; then
    fail=1
  fi
done

# --- 3. ServiceMonitor (CRD) ----------------------------------------------------------
"$PY" "$ROOT/scripts/k8s_manifest_checks.py" extract "$RENDERED" ServiceMonitor > "$OUT/servicemonitors.json"
if [[ $have_node == 1 ]]; then
  say "ServiceMonitor against the prometheus-operator CRD schema ($NPM_PKG)"
  node "$ROOT/scripts/servicemonitor_crd_check.mjs" "$NODE_PREFIX" "$OUT/servicemonitors.json" || fail=1
else
  say "node/npm not found: ServiceMonitor NOT checked against the CRD schema (structural check only)"
fi
say "ServiceMonitor structural check"
"$PY" "$ROOT/scripts/k8s_manifest_checks.py" servicemonitor "$RENDERED" || fail=1

# --- 4. consistency -------------------------------------------------------------------
say "cross-object consistency"
"$PY" "$ROOT/scripts/k8s_manifest_checks.py" consistency "$K8S_DIR" "$RENDERED" || fail=1

# --- 5. the bulk Job (standalone) -------------------------------------------------------
STANDALONE=()
for f in bulk-job.yaml bulk-data-pvc.yaml; do
  [[ -f "$K8S_DIR/$f" ]] && STANDALONE+=("$K8S_DIR/$f")
done
if [[ ${#STANDALONE[@]} -gt 0 ]]; then
  for v in $K8S_VERSIONS; do
    say "kubernetes-validate --strict, Kubernetes $v: ${STANDALONE[*]##*/}"
    log="$OUT/kv-bulk-$v.log"
    if ! "$VENV/bin/kubernetes-validate" --strict --kubernetes-version "$v" "${STANDALONE[@]}" >"$log" 2>&1; then
      fail=1
    fi
    sed "s|$K8S_DIR/||" "$log"
    if grep -q -e '^ERROR' -e "Couldn't find schema" "$log"; then fail=1; fi
  done
  say "bulk Job against the kustomization"
  "$PY" "$ROOT/scripts/k8s_manifest_checks.py" bulkjob "$K8S_DIR" "$RENDERED" || fail=1
fi

if [[ $fail != 0 ]]; then
  echo "FAIL: k8s manifests are invalid"
  exit 1
fi
echo "PASS: k8s manifests are valid"
