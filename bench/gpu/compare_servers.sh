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
results="$OUT_DIR/results.jsonl"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for spec in "$@"; do
    name="${spec%%=*}"
    IFS=, read -r -a parts <<<"${spec#*=}"
    bin="${parts[0]}"
    env_vars=("${parts[@]:1}")
    env "${env_vars[@]}" "$bin" serve --model "$model" --device "${DEVICE:-cuda:0}" --dtype "${DTYPE:-bf16}" --host 127.0.0.1 --port "$PORT" \
      --max-batch-tokens 32768 --max-input-tokens 4096 --max-queue-tokens 1000000 2>"$OUT_DIR/server-$name-$round.log" &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    for _ in $(seq 1 1200); do curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break; sleep 0.25; done
    for enc in ${ENCODINGS:-zstd identity}; do
      python3 bench/gpu/thread_cpu.py --pid "$server" -- "$CLIENT" --url "http://127.0.0.1:$PORT" \
        --workload "$workload" --dtype "${ANSWER_DTYPE:-bfloat16}" --concurrency "${CONCURRENCY:-64}" --encoding "$enc" \
        | sed "s/^{/{\"server\":\"$name\",\"round\":$round,/" | tee -a "$results"
    done
    kill -TERM "$server"; wait "$server" || true
    trap - EXIT
  done
done
