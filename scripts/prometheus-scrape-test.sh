#!/usr/bin/env bash
# End-to-end metrics test: a real Prometheus scrapes a real layertap.
#   - installs Debian's prometheus package when `prometheus` is not on PATH (root + apt),
#   - starts layertap ($LAYERTAP_BIN, default target/debug/layertap; tiny test model) and
#     Prometheus (own config and temporary storage, scrape interval 1 s) on free loopback ports,
#   - sends requests and polls Prometheus' HTTP API until layertap_tokens_total, a rate and
#     a latency quantile are present and > 0 (bounded by SCRAPE_TEST_TIMEOUT, default 60 s),
#   - evaluates every query of deploy/grafana/layertap-dashboard.json in Prometheus and
#     checks the dashboard's metric names against a /metrics scrape,
#   - stops everything it started. Exit 0 when all checks pass, 1 otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LAYERTAP_BIN="${LAYERTAP_BIN:-target/debug/layertap}"
MODEL="${LAYERTAP_TEST_MODEL:-tests/fixtures/tiny/qwen3_qknorm}"
TIMEOUT="${SCRAPE_TEST_TIMEOUT:-60}"
DASHBOARD="deploy/grafana/layertap-dashboard.json"

WORK="$(mktemp -d)"
pids=()
# shellcheck disable=SC2329  # called by the EXIT trap
cleanup() {
  local rc=$?
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  if [[ $rc != 0 ]]; then
    for f in "$WORK"/*.log; do
      [[ -f $f ]] || continue
      echo "--- last lines of $(basename "$f")"
      tail -n 20 "$f"
    done
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say() { printf '== %s\n' "$*"; }

[[ -x $LAYERTAP_BIN ]] || { echo "FAIL: $LAYERTAP_BIN not found (build it, or set LAYERTAP_BIN)"; exit 1; }

# --- Prometheus ------------------------------------------------------------------------
if ! command -v prometheus >/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    say "installing Debian's prometheus package"
    # Keep the package's own service from starting (harmless where policy-rc.d exists).
    own_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
      chmod +x /usr/sbin/policy-rc.d
      own_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -qq --no-install-recommends prometheus >"$WORK/apt.log" 2>&1; then
      apt-get update -qq >>"$WORK/apt.log" 2>&1
      apt-get install -y -qq --no-install-recommends prometheus >>"$WORK/apt.log" 2>&1
    fi
    [[ $own_policy == 1 ]] && rm -f /usr/sbin/policy-rc.d
  else
    echo "FAIL: prometheus is not installed and cannot be installed here (needs root and apt-get)"
    exit 1
  fi
fi
say "$(prometheus --version 2>&1 | head -n 1)"

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_http() { # URL SECONDS PID
  local url=$1 secs=$2 pid=$3 i
  for ((i = 0; i < secs * 4; i++)); do
    curl -fsS -o /dev/null "$url" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || { echo "FAIL: process for $url exited"; return 1; }
    sleep 0.25
  done
  echo "FAIL: $url not up after ${secs}s"
  return 1
}

# --- layertap ---------------------------------------------------------------------------
LT_PORT="$(free_port)"
say "starting layertap on 127.0.0.1:$LT_PORT ($MODEL)"
LAYERTAP_LOG=warn "$LAYERTAP_BIN" serve --model "$MODEL" --host 127.0.0.1 --port "$LT_PORT" \
  >"$WORK/layertap.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$LT_PORT/ready" 60 "${pids[-1]}"

# --- Prometheus, scraping layertap every second ------------------------------------------
PROM_PORT="$(free_port)"
cat >"$WORK/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: layertap
    static_configs:
      - targets: ["127.0.0.1:$LT_PORT"]
YAML
if command -v promtool >/dev/null; then
  promtool check config "$WORK/prometheus.yml" >"$WORK/promtool.log" 2>&1 \
    || { cat "$WORK/promtool.log"; exit 1; }
fi
say "starting Prometheus on 127.0.0.1:$PROM_PORT"
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
  --web.listen-address="127.0.0.1:$PROM_PORT" --log.level=warn >"$WORK/prometheus.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$PROM_PORT/-/ready" 30 "${pids[-1]}"

# --- checks -------------------------------------------------------------------------------
say "querying Prometheus (up to ${TIMEOUT}s)"
rc=0
python3 scripts/prom_query_check.py --prom "http://127.0.0.1:$PROM_PORT" \
  --layertap "http://127.0.0.1:$LT_PORT" --timeout "$TIMEOUT" --dashboard "$DASHBOARD" || rc=1

say "dashboard metric names against a /metrics scrape"
curl -fsS "http://127.0.0.1:$LT_PORT/metrics" >"$WORK/metrics.txt"
python3 scripts/check_dashboard_metrics.py "$DASHBOARD" "$WORK/metrics.txt" || rc=1

if [[ $rc == 0 ]]; then
  echo "PASS: Prometheus scraped layertap and every check passed"
else
  echo "FAIL: see above"
fi
exit "$rc"
