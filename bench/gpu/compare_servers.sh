#!/usr/bin/env bash
# Servers side by side on one model and workload, started in turn for every client run, in rounds:
#
#   bench/gpu/compare_servers.sh MODEL WORKLOAD NAME=BINARY[,VAR=VALUE...] ...
#
# e.g. bench/gpu/compare_servers.sh /dev/shm/hyb/moe /dev/shm/hyb/workload_moe.json \
#        old=.gpu/old/layertap spin=.gpu/layertap,LAYERTAP_SPIN_WAIT=1 new=.gpu/layertap
#
# Each server answers the same client (CLIENT, default .gpu/bench_http) at CONCURRENCY (64) in flight
# for each encoding in ENCODINGS ("zstd identity"), ROUNDS (2) times in alternation, on DEVICE
# (cuda:0) in DTYPE (bf16), answers in ANSWER_DTYPE (bfloat16). Every client
# line, with the server's CPU per thread name (bench/gpu/thread_cpu.py) and "server"/"round" added,
# goes to $OUT_DIR/results.jsonl (default bench/out/gpu).
set -euo pipefail
cd "$(dirname "$0")/../.."
model="$1" workload="$2"
shift 2
CLIENT="${CLIENT:-.gpu/bench_http}"
OUT_DIR="${OUT_DIR:-bench/out/gpu}"
PORT="${PORT:-18082}"
mkdir -p "$OUT_DIR"
# shellcheck source=bench/gpu/serve.sh
source bench/gpu/serve.sh
results="$OUT_DIR/results.jsonl"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for spec in "$@"; do
    name="${spec%%=*}"
    IFS=, read -r -a parts <<<"${spec#*=}"
    bin="${parts[0]}"
    env_vars=("${parts[@]:1}")
    # The server's variables, for it alone.
    for v in "${env_vars[@]}"; do export "${v?}"; done
    BIN="$bin" start_server "$model" "${DEVICE:-cuda:0}" "$OUT_DIR/server-$name-$round.log"
    for v in "${env_vars[@]}"; do unset "${v%%=*}"; done
    for enc in ${ENCODINGS:-zstd identity}; do
      clients "$workload" "${CONCURRENCY:-64}" "$enc" | sed "s/^{/{\"server\":\"$name\",\"round\":$round,/" | tee -a "$results"
    done
    kill -TERM "$server"; wait "$server" || true
    trap - EXIT
  done
done
