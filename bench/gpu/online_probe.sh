#!/usr/bin/env bash
# Where the online source's time goes on one server of the dense Qwen3-8B shape (the model and
# workload of online_8b.sh, made first by it or by load_check.sh + online_8b.sh): the GPU
# consumer with and without its step's kernels, a second process using the same GPU beside
# bench_http (what another CUDA context costs the server), DataLoader workers with each worker's
# own stats, and, with PYSPY set to a py-spy binary, sampled stacks of the GPU consumer and of
# four workers written to OUTDIR. Run on the GPU machine from the repository root:
#
#   source bench/gpu/cuda-libs.sh && PYTHONPATH=<layertap_client> OUTDIR=<dir> bench/gpu/online_probe.sh
#
# SHORT=1 leaves out the CPU consumers, the neighbour, the CPU-consuming workers and one worker.
# One JSON line per contender on stdout.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/dev/shm/load-check}
OUTDIR=${OUTDIR:-/tmp/online-probe}
STEP_MS=${STEP_MS:-40}
mkdir -p "$OUTDIR"
# shellcheck source=bench/gpu/serve.sh
source bench/gpu/serve.sh
w="$WORK/workload.json"
start_server "$WORK" cuda:0 "$WORK.serve.log"
url="http://127.0.0.1:$PORT"
b=(timeout 150 python3 bench/gpu/online_bench.py --url "$url" --workload "$w")
clients "$w" 64 zstd | sed 's/^{/{"contender":"bench_http zstd, 64 in flight",/'
"${b[@]}" --device cuda:0
"${b[@]}" --device cuda:0 --touch none
"${b[@]}" --device cuda:0
if [[ -z "${SHORT:-}" ]]; then
  "${b[@]}"
  "${b[@]}" --touch none
  python3 bench/gpu/gpu_neighbour.py --device cuda:0 --gb-per-s 1.0 --seconds 120 > "$OUTDIR/neighbour.json" &
  nb=$!
  sleep 3
  clients "$w" 64 zstd | sed 's/^{/{"contender":"bench_http zstd, 64 in flight, beside a neighbour copying 1 GB\/s to the GPU",/'
  kill -TERM $nb; wait $nb || true
  cat "$OUTDIR/neighbour.json"
  "${b[@]}" --workers 4
  "${b[@]}" --workers 4 --touch none
fi
"${b[@]}" --workers 4 --device cuda:0
[[ -n "${SHORT:-}" ]] || "${b[@]}" --workers 1 --device cuda:0
"${b[@]}" --device cuda:0 --step-ms "$STEP_MS"
if [[ -n "${PYSPY:-}" ]]; then
  "$PYSPY" record --idle --threads --subprocesses --rate 250 --format raw -o "$OUTDIR/workers4.txt" -- "${b[@]}" --workers 4 --device cuda:0 || true
  "$PYSPY" record --idle --threads --rate 250 --format raw -o "$OUTDIR/gpu.txt" -- "${b[@]}" --device cuda:0 || true
fi
clients "$w" 64 zstd | sed 's/^{/{"contender":"bench_http zstd, 64 in flight (again)",/'
kill -TERM "$server"
wait "$server" || true
trap - EXIT
