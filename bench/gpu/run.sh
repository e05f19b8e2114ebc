#!/usr/bin/env bash
# The GPU benchmark, run on the GPU machine from the repository root with the CUDA build of
# layertap (and the CPU-built HTTP client) in .gpu/:
#
#   source .gpu/device-env.sh && bench/gpu/run.sh [prepare|layertap|hf|fidelity|all]
#
# prepare: random Qwen3-8B-shaped checkpoint, workload, bf16 matmul rate
# layertap: engine in process (layertap bench), then the server with the concurrent HTTP client
# hf: Hugging Face transformers + hooks, tuned (bf16, sdpa, sorted padded batches, pinned copies)
# fidelity: bf16 on CUDA against HF f32, per index; packed against alone
# Each prints one JSON line per result into $OUT_DIR/results.jsonl.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL_DIR="${MODEL_DIR:-/tmp/qwen3-8b-random}"
OUT_DIR="${OUT_DIR:-bench/out/gpu}"
BIN="${BIN:-.gpu/layertap}"
CLIENT="${CLIENT:-.gpu/bench_http}"
MAX_BATCH_TOKENS="${MAX_BATCH_TOKENS:-32768}"
PORT="${PORT:-18080}"
mkdir -p "$OUT_DIR"
results="$OUT_DIR/results.jsonl"
step="${1:-all}"

if [[ "$step" == prepare || "$step" == all ]]; then
  python3 bench/gpu/prepare.py --model-dir "$MODEL_DIR" --out-dir "$OUT_DIR" | tee -a "$results"
fi
if [[ "$step" == layertap || "$step" == all ]]; then
  "$BIN" bench --workload "$OUT_DIR/workload_gpu.json" --model "$MODEL_DIR" --device cuda:0 --dtype bf16 \
    --max-batch-tokens "$MAX_BATCH_TOKENS" | tee -a "$results"
  "$BIN" serve --model "$MODEL_DIR" --device "${DEVICES:-cuda:0}" --dtype bf16 --host 127.0.0.1 --port "$PORT" \
    --max-input-tokens 4096 --max-queue-tokens 1000000 ${SERVE_ARGS:-} 2>"$OUT_DIR/server.log" &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  for _ in $(seq 1 1200); do curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break; sleep 0.25; done
  "$CLIENT" --url "http://127.0.0.1:$PORT" --workload "$OUT_DIR/workload_gpu.json" --dtype bfloat16 \
    --concurrency "${CONCURRENCY:-64}" | tee -a "$results"
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^layertap_(device_memory|batch_tokens_(sum|count)|tokens_total)' \
    | tee "$OUT_DIR/metrics.txt"
  kill -TERM $server; wait $server || true
fi
if [[ "$step" == hf || "$step" == all ]]; then
  python3 bench/gpu/hf_baseline.py --model-dir "$MODEL_DIR" --workload "$OUT_DIR/workload_gpu.json" \
    --max-batch-tokens "${HF_MAX_BATCH_TOKENS:-16384}" | tee -a "$results"
fi
if [[ "$step" == fidelity || "$step" == all ]]; then
  python3 bench/gpu/fidelity.py --bin "$BIN" --model-dir "$MODEL_DIR" | tee -a "$results"
fi
