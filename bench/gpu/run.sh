#!/usr/bin/env bash
# The GPU benchmark, run on the GPU machine from the repository root with the CUDA build of
# layertap and the project's HTTP client (examples/bench_http.rs) in .gpu/:
#
#   source bench/gpu/cuda-libs.sh && bench/gpu/run.sh [prepare|engine|http|hf|fidelity|all]
#
# prepare:  random Qwen3-8B-shaped checkpoint, workload, bf16 matmul rate (bench/gpu/prepare.py)
# engine:   layertap's engine in process (layertap bench)
# http:     the server (DEVICES=cuda:0 or cuda:all) with the concurrent HTTP client, every answer decoded,
#           for each encoding in ENCODINGS (default zstd; identity takes zstd off the host's load) and
#           each number in flight in CONCURRENCIES (default 64); each line carries the server's CPU
#           seconds per thread (bench/gpu/thread_cpu.py)
# hf:       Hugging Face transformers + hooks, tuned (bf16, sdpa, sorted padded batches, pinned copies)
# fidelity: bf16 on CUDA against HF f32, per index; packed against alone (bench/gpu/fidelity.py)
# zstd:     the server at each zstd level in LEVELS (default "3 1 -1 -3"), clients at 64 and 256 in
#           flight, default encoding; then identity at 64 and 256: tokens/s, the server's and the client's
#           CPU seconds (from /proc and getrusage), bytes sent
# answers:  the engine on the same workload as served (non-finite screen on), without the screen,
#           with fp8 answers (quantised on the device), and as served again; each line also reports the
#           last batch's answer sizes (raw, zstd), the fp8 error per index and the checksum's speed
# hybrid:   the Gated DeltaNet hybrids (bench/gpu/prepare_hybrid.py: the Qwen3.5/3.6-27B and
#           35B-A3B MoE widths, fewer layers; HYBRID_ARGS passes its flags): per model, the engine,
#           the engine with LAYERTAP_PROFILE=1 (where the time goes), HTTP (each of
#           ENCODINGS × CONCURRENCIES as in http), and transformers + hooks at each budget in
#           HF_BUDGETS (with fla when PYTHONPATH holds it; grouped_mm experts for the MoE model;
#           HF_BUDGETS= skips it)
# long:     long context (bench/gpu/long_context.py): one sequence through the server against transformers
#           bf16 + hooks at rows of its start, middle and end: the dense Qwen3-8B shape at 131,072 tokens
#           and the Qwen3.5-27B hybrid width at 262,144 (4 layers each); relative error per layer and row
#           group, the request's time and batch memory, transformers' time and peak memory; LONG_ARGS passes
#           its flags (e.g. "--case dense --tolerance 0.03"); fails on an error over the tolerance
# Each step appends one JSON line to $OUT_DIR/results.jsonl (long: one per case, layer and row group).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL_DIR="${MODEL_DIR:-/tmp/qwen3-8b-random}"
OUT_DIR="${OUT_DIR:-bench/out/gpu}"
WORK_DIR="${WORK_DIR:-/tmp/layertap-bench}"
mkdir -p "$OUT_DIR" "$WORK_DIR"
results="$OUT_DIR/results.jsonl"
step="${1:-all}"
workload="${WORKLOAD:-$WORK_DIR/workload_gpu.json}"

# start_server and clients: bench/gpu/serve.sh.
# shellcheck source=bench/gpu/serve.sh
source bench/gpu/serve.sh

if [[ "$step" == prepare || "$step" == all ]]; then
  python3 bench/gpu/prepare.py --model-dir "$MODEL_DIR" --out-dir "$WORK_DIR" | tee -a "$results"
fi
if [[ "$step" == engine || "$step" == all ]]; then
  "$BIN" bench --workload "$workload" --model "$MODEL_DIR" --device cuda:0 --dtype bf16 \
    --max-batch-tokens "$MAX_BATCH_TOKENS" | tee -a "$results"
fi
if [[ "$step" == http || "$step" == all ]]; then
  devices="${DEVICES:-cuda:0}"
  start_server "$MODEL_DIR" "$devices" "$OUT_DIR/server-${devices//[:,]/_}.log"
  for enc in ${ENCODINGS:-${ENCODING:-zstd}}; do
    for c in ${CONCURRENCIES:-${CONCURRENCY:-64}}; do
      clients "$workload" "$c" "$enc" | sed "s/^{/{\"devices\":\"$devices\",/" | tee -a "$results"
    done
  done
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^layertap_(device_memory|batch_tokens_(sum|count)|tokens_total)' \
    | tee -a "$OUT_DIR/metrics.txt"
  kill -TERM $server; wait $server || true
  trap - EXIT
fi
if [[ "$step" == hf || "$step" == all ]]; then
  python3 bench/gpu/hf_baseline.py --model-dir "$MODEL_DIR" --workload "$workload" \
    --max-batch-tokens "${HF_MAX_BATCH_TOKENS:-16384}" | tee -a "$results"
fi
if [[ "$step" == fidelity || "$step" == all ]]; then
  python3 bench/gpu/fidelity.py --bin "$BIN" --model-dir "$MODEL_DIR" | tee -a "$results"
fi
if [[ "$step" == answers ]]; then
  # The first configuration again at the end bounds the run-to-run noise.
  for extra in "" "--no-screen" "--fp8" ""; do
    # shellcheck disable=SC2086
    "$BIN" bench --workload "$workload" --model "$MODEL_DIR" --device cuda:0 --dtype bf16 \
      --max-batch-tokens "$MAX_BATCH_TOKENS" $extra | tee -a "$results"
  done
fi
if [[ "$step" == zstd ]]; then
  tick=$(getconf CLK_TCK)
  cpu_of() { awk -v t="$tick" '{print ($14 + $15) / t}' "/proc/$1/stat"; }
  levels="${LEVELS:-3 1 -1 -3}"
  for level in $levels; do
    start_server "$MODEL_DIR" cuda:0 "$OUT_DIR/server-zstd$level.log" --zstd-level "$level"
    encodings="zstd"
    [[ "$level" == "${levels##* }" ]] && encodings="zstd identity"
    for enc in $encodings; do
      for c in 64 256; do
        before=$(cpu_of "$server")
        line=$("$CLIENT" --url "http://127.0.0.1:$PORT" --workload "$workload" --dtype bfloat16 \
          --concurrency "$c" --encoding "$enc")
        after=$(cpu_of "$server")
        used=$(awk -v a="$after" -v b="$before" 'BEGIN { print a - b }')
        echo "$line" | sed "s/^{/{\"zstd_level\":$level,\"server_cpu_seconds\":$used,/" | tee -a "$results"
      done
    done
    kill -TERM $server; wait $server || true
  done
fi
if [[ "$step" == hybrid ]]; then
  work="${HYBRID_WORK:-/tmp/layertap-hybrid}"
  # shellcheck disable=SC2086
  python3 bench/gpu/prepare_hybrid.py --work "$work" ${HYBRID_ARGS:-} | tee -a "$results"
  for name in ${HYBRID_MODELS:-27b moe}; do
    wl="$work/workload_$name.json"
    tag="s/^{/{\"model\":\"$name\",/"
    "$BIN" bench --workload "$wl" --model "$work/$name" --device cuda:0 --dtype bf16 \
      --max-batch-tokens "$MAX_BATCH_TOKENS" | sed "$tag" | tee -a "$results"
    LAYERTAP_PROFILE=1 "$BIN" bench --workload "$wl" --model "$work/$name" --device cuda:0 --dtype bf16 \
      --max-batch-tokens "$MAX_BATCH_TOKENS" 2>"$OUT_DIR/profile-$name.log" | sed "s/^{/{\"model\":\"$name\",\"profiled\":true,/" \
      | tee -a "$results"
    tail -n 20 "$OUT_DIR/profile-$name.log"
    start_server "$work/$name" cuda:0 "$OUT_DIR/server-$name.log"
    for enc in ${ENCODINGS:-${ENCODING:-zstd}}; do
      for c in ${CONCURRENCIES:-${CONCURRENCY:-64}}; do
        clients "$wl" "$c" "$enc" | sed "$tag" | tee -a "$results"
      done
    done
    kill -TERM $server; wait $server || true
    trap - EXIT
    experts=()
    [[ "$name" == moe ]] && experts=(--experts-implementation grouped_mm)
    for budget in ${HF_BUDGETS-16384}; do
      python3 bench/gpu/hf_baseline.py --model-dir "$work/$name" --workload "$wl" --max-batch-tokens "$budget" \
        "${experts[@]}" | sed "$tag" | tee -a "$results"
    done
  done
fi
if [[ "$step" == long ]]; then
  # shellcheck disable=SC2086
  python3 bench/gpu/long_context.py --bin "$BIN" --work "${LONG_WORK:-/tmp/layertap-long}" --log-dir "$OUT_DIR" \
    --port "$PORT" ${LONG_ARGS:-} | tee -a "$results"
fi
