#!/usr/bin/env bash
# CPU benchmark: layertap engine (in process), layertap over HTTP, and Hugging Face transformers
# with forward hooks, on the same workload, model and machine, in one run.
#
#   bench/run_cpu.sh            # needs `make model` and a Python with scripts/requirements-fixtures.txt
#   PYTHON=/path/to/python THREADS=2 bench/run_cpu.sh
#   # hybrid (Gated DeltaNet): bench/make_hybrid_model.py + bench/make_workload.py --preset hybrid first
#   MODEL=.cache/models/qwen3_5-hybrid-small WORKLOAD=bench/workload_hybrid.json bench/run_cpu.sh
#
# MODEL is a .gguf file or a Hugging Face folder (config.json + safetensors); hf_baseline.py gets it
# as --gguf or --model accordingly.
#
# Prints one JSON line per contender and writes them to bench/out/cpu-<date>.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
THREADS="${THREADS:-$(nproc)}"
MODEL="${MODEL:-.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
WORKLOAD="${WORKLOAD:-bench/workload_cpu.json}"
MAX_BATCH_TOKENS="${MAX_BATCH_TOKENS:-4096}"
PORT="${PORT:-18181}"
TARGET_DIR="${CARGO_TARGET_DIR:-target}"
if [ -d "$MODEL" ]; then
  hf_model=(--model "$MODEL")
elif [[ "$MODEL" == *.gguf ]]; then
  hf_model=(--gguf "$MODEL")
else
  echo "MODEL=$MODEL is neither a model folder nor a .gguf file" >&2
  exit 2
fi
mkdir -p bench/out
out="bench/out/cpu-$(date +%Y%m%d-%H%M%S).jsonl"

cargo build --release --quiet --examples --bin layertap
export RAYON_NUM_THREADS="$THREADS"

echo "== layertap engine (in process)" >&2
"$TARGET_DIR/release/layertap" bench --workload "$WORKLOAD" --model "$MODEL" \
  --max-batch-tokens "$MAX_BATCH_TOKENS" | tail -n 1 | tee -a "$out"

echo "== layertap over HTTP" >&2
"$TARGET_DIR/release/layertap" serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --max-batch-tokens "$MAX_BATCH_TOKENS" --max-input-tokens "$MAX_BATCH_TOKENS" 2>bench/out/server.log &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break
  sleep 0.1
done
"$TARGET_DIR/release/examples/bench_http" --url "http://127.0.0.1:$PORT" --workload "$WORKLOAD" \
  --concurrency "${CONCURRENCY:-16}" | tail -n 1 | tee -a "$out"
kill -TERM $server; wait $server || true

echo "== Hugging Face transformers + hooks" >&2
"$PYTHON" bench/hf_baseline.py --workload "$WORKLOAD" "${hf_model[@]}" --threads "$THREADS" \
  --max-batch-tokens "$MAX_BATCH_TOKENS" | tail -n 1 | tee -a "$out"
echo "results: $out" >&2
