#!/usr/bin/env bash
# FP8 at the Qwen3.5/3.6-27B hybrid width at full depth, every contender in one command: the
# engine and the server (zstd, 64 in flight) on the bf16 checkpoint and on its block-wise FP8
# quantisation (the layout of Qwen's FP8 releases, made by bench/gpu/fp8_bench.py), and
# transformers + hooks (+ fla when PYTHONPATH holds it) on the bf16 checkpoint, whose line carries
# its cold pass (warmup_seconds: one pass over every batch, in which fla's kernels compile and
# autotune) and its warm pass. Run on the GPU machine from the repository root, with the CUDA
# build of layertap and the HTTP client (examples/bench_http.rs) in .gpu/:
#
#   source bench/gpu/cuda-libs.sh && PYTHONPATH=<fla> bench/gpu/fp8_full.sh
#
# LAYERS (64), SEQUENCES (150), TAPS (2,17,32,47,62), WORK (/dev/shm/layertap-fp8: the models
# live in memory), OUT_DIR (bench/out/gpu), ENGINE (1; 0 skips the in-process engine runs). One JSON line per contender in $OUT_DIR/fp8-full.jsonl.
set -euo pipefail
cd "$(dirname "$0")/../.."
work="${WORK:-/dev/shm/layertap-fp8}"
out="${OUT_DIR:-bench/out/gpu}"
mkdir -p "$out" "$work"
results="$out/fp8-full.jsonl"
# shellcheck source=bench/gpu/serve.sh
source bench/gpu/serve.sh

python3 bench/gpu/prepare_hybrid.py --work "$work" --models 27b --dense-layers "${LAYERS:-64}" \
  --sequences "${SEQUENCES:-150}" --taps "${TAPS:-2,17,32,47,62}" --bf16-init | tee -a "$results"
python3 bench/gpu/fp8_bench.py --quantise "$work/27b" "$work/27b-fp8" | tee -a "$results"
python3 -c 'import json, sys; sys.path.insert(0, "bench/gpu"); import fp8_bench as f
print(json.dumps({"step": "matmul_rates", "tokens": 8192, "shapes": f.matmul_rates(f.SHAPES_27B)}))' | tee -a "$results"
wl="$work/workload_27b.json"
for label in bf16 fp8; do
  model="$work/27b"
  [[ "$label" == fp8 ]] && model="$work/27b-fp8"
  tag="s/^{/{\"contender\":\"layertap $label\",/"
  if [[ "${ENGINE:-1}" == 1 ]]; then
    "$BIN" bench --workload "$wl" --model "$model" --device cuda:0 --dtype bf16 \
      --max-batch-tokens "$MAX_BATCH_TOKENS" 2>"$out/engine-$label.log" | sed "$tag" | tee -a "$results"
  fi
  start_server "$model" cuda:0 "$out/server-$label.log"
  clients "$wl" 64 zstd | sed "s/^{/{\"contender\":\"layertap $label http\",/" | tee -a "$results"
  kill -TERM "$server"
  wait "$server" || true
  trap - EXIT
done
python3 bench/gpu/hf_baseline.py --model-dir "$work/27b" --workload "$wl" --max-batch-tokens 16384 \
  | sed "s/^{/{\"contender\":\"transformers\",/" | tee -a "$results"
