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
# goes to $OUT_DIR/results.jsonl (default bench/out/gpu); TAG=NAME adds "model":"NAME" to each.
#
# MODE=engine compares engines in process instead: each NAME runs `BINARY bench` on the workload
# (MAX_BATCH_TOKENS, default 32768) with its variables, its stderr (the profile, with
# LAYERTAP_PROFILE=1) in $OUT_DIR/engine-NAME-ROUND.log, e.g.
#   MODE=engine bench/gpu/compare_servers.sh MODEL WORKLOAD simple=.gpu/layertap,LAYERTAP_ATTENTION_KERNEL=simple \
#     w4=.gpu/layertap,LAYERTAP_ATTENTION_KERNEL=w4
set -euo pipefail
cd "$(dirname "$0")/../.."
model="$1" workload="$2"
shift 2
OUT_DIR="${OUT_DIR:-bench/out/gpu}"
PORT="${PORT:-18082}"
mkdir -p "$OUT_DIR"
# shellcheck source=bench/gpu/serve.sh
source bench/gpu/serve.sh
results="$OUT_DIR/results.jsonl"
tag="${TAG:+\"model\":\"$TAG\",}"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for spec in "$@"; do
    name="${spec%%=*}"
    IFS=, read -r -a parts <<<"${spec#*=}"
    bin="${parts[0]}"
    env_vars=("${parts[@]:1}")
    if [[ "${MODE:-http}" == engine ]]; then
      env "${env_vars[@]}" "$bin" bench --workload "$workload" --model "$model" --device "${DEVICE:-cuda:0}" \
        --dtype "${DTYPE:-bf16}" --max-batch-tokens "${MAX_BATCH_TOKENS:-32768}" 2>"$OUT_DIR/engine-$name-$round.log" \
        | sed "s/^{/{$tag\"engine\":\"$name\",\"round\":$round,/" | tee -a "$results"
      continue
    fi
    # The server's variables, for it alone.
    for v in "${env_vars[@]}"; do export "${v?}"; done
    BIN="$bin" start_server "$model" "${DEVICE:-cuda:0}" "$OUT_DIR/server-$name-$round.log"
    for v in "${env_vars[@]}"; do unset "${v%%=*}"; done
    for enc in ${ENCODINGS:-zstd identity}; do
      clients "$workload" "${CONCURRENCY:-64}" "$enc" | sed "s/^{/{$tag\"server\":\"$name\",\"round\":$round,/" | tee -a "$results"
    done
    kill -TERM "$server"; wait "$server" || true
    trap - EXIT
  done
done
