#!/usr/bin/env bash
# The online source (layertap_client.online, bench/gpu/online_bench.py) against the HTTP client
# (examples/bench_http.rs) on one running server: every contender on the same workload, one
# after the other, on the same server. Sourced by online_8b.sh and online_27b.sh after they made
# the model and the workload:
#
#   online_compare MODEL WORKLOAD STEP_MS [SERVER FLAGS...]
#
# STEP_MS: the stand-in step's sleep per sample for the slow-consumer contender (longer than the
# server needs per sample). SHORT=1: only the GPU consumer, fast and slow, then bench_http again.
# One JSON line per contender on stdout.
online_compare() {
  local model="$1" w="$2" step="$3"
  shift 3
  start_server "$model" cuda:0 "$model.serve.log" "$@"
  local url="http://127.0.0.1:$PORT"
  clients "$w" 64 zstd | sed 's/^{/{"contender":"bench_http zstd, 64 in flight",/'
  local b=(timeout 120 python3 bench/gpu/online_bench.py --url "$url" --workload "$w")
  if [[ -n "${SHORT:-}" ]]; then  # the GPU consumer, fast and slow, between two bench_http runs
    "${b[@]}" --workers 0 --device cuda:0
    "${b[@]}" --workers 0 --device cuda:0 --step-ms "$step"
    clients "$w" 64 zstd | sed 's/^{/{"contender":"bench_http zstd, 64 in flight (again)",/'
    kill -TERM "$server"
    wait "$server" || true
    trap - EXIT
    return
  fi
  "${b[@]}" --workers 0 --device cuda:0
  "${b[@]}" --workers 0 --device cuda:0 --encoding identity
  "${b[@]}" --workers 0
  "${b[@]}" --workers 0 --encoding identity
  "${b[@]}" --workers 1
  "${b[@]}" --workers 4
  "${b[@]}" --workers 0 --device cuda:0 --step-ms "$step"
  clients "$w" 64 identity | sed 's/^{/{"contender":"bench_http identity, 64 in flight",/'
  kill -TERM "$server"
  wait "$server" || true
  trap - EXIT
}
