#!/usr/bin/env bash
# Checks that every metric deploy/grafana/layertap-dashboard.json queries is exported by a
# real layertap: starts $LAYERTAP_BIN (default target/debug/layertap) with the tiny test
# model on a free loopback port, sends one request so histograms have samples, saves
# /metrics and runs scripts/check_dashboard_metrics.py on it. Also checks that the checker
# rejects a copy of the dashboard with a made-up metric. Exit 0 on success, 1 otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LAYERTAP_BIN="${LAYERTAP_BIN:-target/debug/layertap}"
MODEL="${LAYERTAP_TEST_MODEL:-tests/fixtures/tiny/qwen3_qknorm}"
DASHBOARD="${1:-deploy/grafana/layertap-dashboard.json}"

WORK="$(mktemp -d)"
pid=""
# shellcheck disable=SC2329  # called by the EXIT trap
cleanup() {
  local rc=$?
  if [[ -n $pid ]]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  [[ $rc != 0 && -f $WORK/layertap.log ]] && tail -n 20 "$WORK/layertap.log"
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

[[ -x $LAYERTAP_BIN ]] || { echo "FAIL: $LAYERTAP_BIN not found (build it, or set LAYERTAP_BIN)"; exit 1; }
PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
LAYERTAP_LOG=warn "$LAYERTAP_BIN" serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" >"$WORK/layertap.log" 2>&1 &
pid=$!
for ((i = 0; i < 240; i++)); do
  curl -fsS -o /dev/null "http://127.0.0.1:$PORT/ready" 2>/dev/null && break
  kill -0 "$pid" 2>/dev/null || { echo "FAIL: layertap exited"; exit 1; }
  sleep 0.25
done
code="$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/v1/hidden-states" \
  -H 'content-type: application/json' -d '{"inputs":[{"input_ids":[1,2,3]}],"layers":[1]}')"
[[ $code == 200 ]] || { echo "FAIL: /v1/hidden-states answered $code"; exit 1; }
curl -fsS "http://127.0.0.1:$PORT/metrics" >"$WORK/metrics.txt"

rc=0
python3 scripts/check_dashboard_metrics.py "$DASHBOARD" "$WORK/metrics.txt" || rc=1

# The checker must fail on a metric the service does not export.
python3 - "$DASHBOARD" "$WORK/bogus.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
panel = next(p for p in d["panels"] if p.get("targets"))
panel["targets"].append({"expr": "sum(rate(layertap_no_such_metric_total[5m]))", "refId": "Z"})
json.dump(d, open(sys.argv[2], "w"))
PY
if python3 scripts/check_dashboard_metrics.py "$WORK/bogus.json" "$WORK/metrics.txt" >"$WORK/bogus.out"; then
  echo "FAIL: the checker accepted a dashboard with a bogus metric"; rc=1
elif grep -q layertap_no_such_metric_total "$WORK/bogus.out"; then
  echo "ok: the checker rejects a dashboard with a bogus metric"
else
  cat "$WORK/bogus.out"; echo "FAIL: the checker failed without naming the bogus metric"; rc=1
fi

[[ $rc == 0 ]] && echo "PASS: dashboard metrics" || echo "FAIL: dashboard metrics"
exit "$rc"
