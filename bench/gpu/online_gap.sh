#!/usr/bin/env bash
# Where the GPU consumer's gap on the dense Qwen3-8B shape comes from: on one server (the model of
# load_check.sh in WORK, the workloads of online_8b.sh: the default 300 sequences and, with
# SEQUENCES set (default 900), a longer one), in one command:
#   - bench_http, and the online source into a GPU consumer whose step waits once per tensor
#     (--touch sum), once per sample (sum-once), or not at all (none);
#   - bench_http beside a second process doing on the same GPU what that step does (a copy, and
#     KERNELS sums each waited for, per 24 MB sample at the source's rate): what another CUDA
#     context's kernels cost the server itself;
#   - bench_http and the source over the longer workload, zstd and identity.
# Run on the GPU machine from the repository root, after load_check.sh has written the model:
#
#   source bench/gpu/cuda-libs.sh && PYTHONPATH=<layertap_client> bench/gpu/online_gap.sh
#
# One JSON line per contender on stdout.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/dev/shm/load-check}
SEQUENCES=${SEQUENCES:-900}
KERNELS=${KERNELS:-5}
# shellcheck source=bench/gpu/serve.sh
source bench/gpu/serve.sh
online_workloads "$SEQUENCES"
start_server "$WORK" cuda:0 "$WORK.serve.log"
url="http://127.0.0.1:$PORT"
b=(timeout 200 python3 bench/gpu/online_bench.py --url "$url" --device cuda:0)
clients "$w" 64 zstd | label "bench_http zstd, 64 in flight"
"${b[@]}" --workload "$w"
"${b[@]}" --workload "$w" --touch sum-once
"${b[@]}" --workload "$w" --touch none
"${b[@]}" --workload "$w"
neighbour() {
  python3 bench/gpu/gpu_neighbour.py --device cuda:0 --gb-per-s 1.0 --seconds 120 --kernels "$1" > "$WORK.neighbour.json" &
  nb=$!
  sleep 3
  clients "$w" 64 zstd | label "bench_http zstd, 64 in flight, beside a process copying 1 GB/s to the GPU with $1 waited-for kernels a chunk"
  kill -TERM $nb; wait $nb || true
  cat "$WORK.neighbour.json"
}
neighbour "$KERNELS"
neighbour 0
clients "$w" 64 zstd | label "bench_http zstd, 64 in flight (again)"
clients "$long" 64 zstd | label "bench_http zstd, 64 in flight, $SEQUENCES sequences"
"${b[@]}" --workload "$long"
"${b[@]}" --workload "$long" --touch sum-once
"${b[@]}" --workload "$long" --encoding identity
clients "$long" 64 identity | label "bench_http identity, 64 in flight, $SEQUENCES sequences"
clients "$long" 64 zstd | label "bench_http zstd, 64 in flight, $SEQUENCES sequences (again)"
kill -TERM "$server"
wait "$server" || true
trap - EXIT
