#!/usr/bin/env bash
# The online source's host buffers on the way to a GPU consumer, on one server of the dense
# Qwen3-8B shape (the model of load_check.sh in WORK; the workloads of online_8b.sh: the default
# 300 sequences and SEQUENCES, default 900): pinned, the whole bound made ready when the pass
# starts (the default until this benchmark), pinned with one 256 MB slab made ready and the rest
# on demand, and pageable buffers (the copies then go through the driver's staging); each against
# bench_http in the same command, and bench_http beside a process whose kernels match the step's.
#
#   source bench/gpu/cuda-libs.sh && PYTHONPATH=<layertap_client> bench/gpu/online_host.sh
#
# SHORT=1: the longer workload only, without the one-sync step and the one-kernel neighbour.
# One JSON line per contender on stdout.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/dev/shm/load-check}
SEQUENCES=${SEQUENCES:-900}
# shellcheck source=bench/gpu/serve.sh
source bench/gpu/serve.sh
online_workloads "$SEQUENCES"
start_server "$WORK" cuda:0 "$WORK.serve.log"
url="http://127.0.0.1:$PORT"
b=(timeout 200 python3 bench/gpu/online_bench.py --url "$url" --device cuda:0)
if [[ -z "${SHORT:-}" ]]; then
  clients "$w" 64 zstd | label "bench_http zstd, 64 in flight"
  "${b[@]}" --workload "$w"
  "${b[@]}" --workload "$w" --pin-memory 0
fi
clients "$long" 64 zstd | label "bench_http zstd, 64 in flight, $SEQUENCES sequences"
"${b[@]}" --workload "$long"
"${b[@]}" --workload "$long" --warm-mb 256
"${b[@]}" --workload "$long" --pin-memory 0
[[ -n "${SHORT:-}" ]] || "${b[@]}" --workload "$long" --pin-memory 0 --touch sum-once
kernels=(5)
[[ -n "${SHORT:-}" ]] || kernels=(1 5)
for k in "${kernels[@]}"; do
  python3 bench/gpu/gpu_neighbour.py --device cuda:0 --gb-per-s 1.0 --seconds 120 --kernels "$k" > "$WORK.neighbour.json" &
  nb=$!
  sleep 3
  clients "$long" 64 zstd | label "bench_http zstd, 64 in flight, $SEQUENCES sequences, beside a process copying 1 GB/s to the GPU with $k waited-for kernels a chunk"
  kill -TERM $nb; wait $nb || true
  cat "$WORK.neighbour.json"
done
clients "$long" 64 zstd | label "bench_http zstd, 64 in flight, $SEQUENCES sequences (again)"
[[ -n "${SHORT:-}" ]] || clients "$w" 64 zstd | label "bench_http zstd, 64 in flight (again)"
kill -TERM "$server"
wait "$server" || true
trap - EXIT
