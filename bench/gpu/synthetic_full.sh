#!/usr/bin/env bash
# The real shapes at full depth on random weights that are never written to disk (layertap
# --synthetic-weights, transformers --from-config; speed does not depend on the weights' values):
# one step per command, so each fits the GPU machine's 10-minute command limit. Run on the GPU
# machine from the repository root, with the CUDA build of layertap and the HTTP client
# (examples/bench_http.rs) in .gpu/:
#
#   source bench/gpu/cuda-libs.sh && PYTHONPATH=<fla> bench/gpu/synthetic_full.sh STEP
#
# STEP:
#   27b-layertap      Qwen3.5/3.6-27B (64 layers, taps 2,17,32,47,62): the bf16 and FP8 matmul
#                     rates of its projection shapes, then layertap bf16 and FP8 (the FP8
#                     releases' layout), each as the engine in process and as the server (zstd,
#                     64 in flight)
#   27b-stages        the 27B shape's engine in bf16 in one stage, in two stages on the one GPU
#                     (layertap bench --pipeline 2: what the stages cost), and in one again
#   27b-transformers  the same shape and workload in transformers + hooks (+ fla when PYTHONPATH
#                     holds it), bf16, its cold pass (warmup_seconds: every batch once, in which
#                     fla's kernels compile and autotune) and its warm pass
#   moe               Qwen3.5/3.6-35B-A3B (40 layers, taps 2,11,20,29,38): layertap engine bf16 and FP8
#   122b              Qwen3.5-122B-A10B in FP8 (48 layers, DFlash's taps 2,13,25,36,47): layertap
#                     engine and server; peak GPU memory from nvidia-smi, sampled every 0.5 s
#   27b-bf16          the 27B shape in bf16, every contender in one command: transformers + hooks
#                     (+ fla), its cold and warm passes; layertap's engine built before the change
#                     under test (BIN_BEFORE, when set) and after; the server after (zstd, 64 in
#                     flight), with its time to /ready and to a first answer; the matmul rates
#                     of the 27B projection shapes (for MFU)
#   moe-bf16          the same for the 35B-A3B shape (transformers with grouped_mm experts)
#                     (27b-bf16, moe-bf16: with SERVER_BEFORE set, the server built before too;
#                     after each server's HTTP run, its batches and their tokens from /metrics)
#   kernels           kernel by kernel (bench/gpu/kernel_times.py, ncu) on 8 layers of the 27B and
#                     35B-A3B shapes (40 sequences), BIN_BEFORE (when set) and BIN; KERNEL_MODELS
#                     ("27b-8 moe-8") picks the shapes
#
# SEQUENCES (200), WORK (/tmp/layertap-synthetic), OUT_DIR (bench/out/gpu). One JSON line per
# contender in $OUT_DIR/synthetic.jsonl.
set -euo pipefail
cd "$(dirname "$0")/../.."
work="${WORK:-/tmp/layertap-synthetic}"
out="${OUT_DIR:-bench/out/gpu}"
seqs="${SEQUENCES:-200}"
mkdir -p "$out" "$work"
results="$out/synthetic.jsonl"
# shellcheck source=bench/gpu/serve.sh
source bench/gpu/serve.sh
step="${1:?STEP: 27b-layertap, 27b-stages, 27b-transformers, moe, 122b, 27b-bf16, moe-bf16 or kernels}"

manifest() {  # manifest NAME SHAPE [FLAGS...]: the model folder NAME, its bench.json line tagged
  local name="$1" shape="$2"
  shift 2
  [[ -f "$work/$name/bench.json" ]] && return
  python3 bench/gpu/synthetic_manifest.py --shape "$shape" --out "$work/$name" --sequences "${MANIFEST_SEQUENCES:-$seqs}" "$@" \
    | sed "s/^{/{\"step\":\"manifest\",\"model\":\"$name\",/" | tee -a "$results"
}

engine() {  # engine LABEL MODEL [BINARY [FLAGS...]]
  local label="$1" model="$2" bin="${3:-$BIN}"
  shift $(($# < 3 ? $# : 3))
  "$bin" bench --workload "$work/$model/workload.json" --model "$work/$model" --device cuda:0 --dtype bf16 \
    --max-batch-tokens "$MAX_BATCH_TOKENS" --synthetic-weights "$@" 2>"$out/engine-$label.log" \
    | sed "s/^{/{\"contender\":\"layertap $label\",/" | tee -a "$results"
}

server() {  # server LABEL MODEL: the server's startup (process start to /ready, to a first answer) and its HTTP run
  local t0 t1 t2
  t0=$(date +%s.%N)
  start_server "$work/$2" cuda:0 "$out/server-$1.log" --synthetic-weights
  t1=$(date +%s.%N)
  # The first answer: the workload's first sequence, every tap, once the server is ready.
  python3 -c 'import json, sys; w = json.load(open(sys.argv[1])); seq = json.loads(open(sys.argv[2]).readline())
print(json.dumps({"inputs": [{"input_ids": seq["input_ids"]}], "layers": w["layers"]}))' \
    "$work/$2/workload.json" "$work/$2/workload.jsonl" >"$work/first.json"
  curl -sf "http://127.0.0.1:$PORT/v1/hidden-states" -H 'content-type: application/json' \
    --data-binary "@$work/first.json" -o /dev/null
  t2=$(date +%s.%N)
  echo "{\"contender\":\"layertap $1 server start\",\"seconds_to_ready\":$(python3 -c "print(round($t1 - $t0, 2))"),\"seconds_to_first_answer\":$(python3 -c "print(round($t2 - $t0, 2))"),\"first_answer_tokens\":$(python3 -c "import json; print(len(json.load(open('$work/first.json'))['inputs'][0]['input_ids']))")}" | tee -a "$results"
  clients "$work/$2/workload.json" 64 zstd | sed "s/^{/{\"contender\":\"layertap $1 http\",/" | tee -a "$results"
  batches "layertap $1 http"
  grep -i "self-check" "$out/server-$1.log" | tail -2 | cut -c1-400 || true
  kill -TERM "$server"
  wait "$server" || true
  trap - EXIT
}

batches() {  # batches LABEL: the server's batches so far (count, tokens) from its /metrics, as JSON
  curl -sf "http://127.0.0.1:$PORT/metrics" | python3 -c 'import json, sys
m = {l.split()[0]: float(l.split()[1]) for l in sys.stdin if l.startswith("layertap_batch_tokens_")}
print(json.dumps({"contender": sys.argv[1], "batches": int(m.get("layertap_batch_tokens_count", 0)), "batch_tokens": int(m.get("layertap_batch_tokens_sum", 0))}))' "$1" | tee -a "$results"
}

rates() {  # the bf16 and FP8 matmul rates of the 27B shape's projections, for MFU in the same command
  python3 -c 'import json, sys; sys.path.insert(0, "bench/gpu"); import fp8_bench as f
print(json.dumps({"step": "matmul_rates", "tokens": 8192, "shapes": f.matmul_rates(f.SHAPES_27B)}))' | tee -a "$results"
}

peak_memory() {  # runs "$@" while sampling the GPU's used memory; prints the peak (MiB) as JSON
  local log="$out/nvidia-smi-$1.log"
  shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$log" &
  local smi=$!
  "$@"
  kill "$smi" 2>/dev/null || true
  echo "{\"step\":\"peak_gpu_memory\",\"during\":\"$*\",\"mib\":$(sort -n "$log" | tail -1)}" | tee -a "$results"
}

case "$step" in
  27b-layertap)
    manifest 27b 27b --taps 2,17,32,47,62
    manifest 27b-fp8 27b --fp8 --taps 2,17,32,47,62
    rates
    engine bf16 27b
    engine fp8 27b-fp8
    server bf16 27b
    server fp8 27b-fp8
    ;;
  27b-stages)
    manifest 27b 27b --taps 2,17,32,47,62
    engine bf16-1-stage 27b "$BIN" --pipeline 1
    engine bf16-2-stages-1-gpu 27b "$BIN" --pipeline 2
    engine bf16-1-stage-again 27b "$BIN" --pipeline 1
    ;;
  27b-transformers)
    manifest 27b 27b --taps 2,17,32,47,62
    python3 bench/gpu/hf_baseline.py --model-dir "$work/27b" --workload "$work/27b/workload.json" \
      --max-batch-tokens 16384 --from-config | sed "s/^{/{\"contender\":\"transformers\",/" | tee -a "$results"
    ;;
  moe)
    manifest moe 35b-a3b --taps 2,11,20,29,38
    manifest moe-fp8 35b-a3b --fp8 --taps 2,11,20,29,38
    engine moe-bf16 moe
    engine moe-fp8 moe-fp8
    ;;
  122b)
    manifest 122b-fp8 122b-a10b --fp8
    peak_memory engine-122b engine 122b-fp8 122b-fp8
    peak_memory server-122b server 122b-fp8 122b-fp8
    ;;
  27b-bf16)
    manifest 27b 27b --taps 2,17,32,47,62
    python3 bench/gpu/hf_baseline.py --model-dir "$work/27b" --workload "$work/27b/workload.json" \
      --max-batch-tokens 16384 --from-config | sed "s/^{/{\"contender\":\"transformers\",/" | tee -a "$results"
    rates
    [[ -n "${BIN_BEFORE:-}" ]] && engine 27b-bf16-before 27b "$BIN_BEFORE"
    engine 27b-bf16 27b
    [[ -n "${BIN_BEFORE:-}" && -n "${SERVER_BEFORE:-}" ]] && BIN="$BIN_BEFORE" server 27b-bf16-before 27b
    server 27b-bf16 27b
    ;;
  moe-bf16)
    manifest moe 35b-a3b --taps 2,11,20,29,38
    python3 bench/gpu/hf_baseline.py --model-dir "$work/moe" --workload "$work/moe/workload.json" \
      --max-batch-tokens 16384 --from-config --experts-implementation grouped_mm \
      | sed "s/^{/{\"contender\":\"transformers\",/" | tee -a "$results"
    rates
    [[ -n "${BIN_BEFORE:-}" ]] && engine moe-bf16-before moe "$BIN_BEFORE"
    engine moe-bf16 moe
    [[ -n "${BIN_BEFORE:-}" && -n "${SERVER_BEFORE:-}" ]] && BIN="$BIN_BEFORE" server moe-bf16-before moe
    server moe-bf16 moe
    ;;
  kernels)
    # 8 layers (6 Gated DeltaNet, 2 attention), 40 sequences (33,893 tokens, two batches).
    MANIFEST_SEQUENCES=40 manifest 27b-8 27b --layers 8 --taps 2,3,5,6,7
    MANIFEST_SEQUENCES=40 manifest moe-8 35b-a3b --layers 8 --taps 2,7
    for m in ${KERNEL_MODELS:-27b-8 moe-8}; do
      for b in ${BIN_BEFORE:+before} after; do
        bin=$BIN
        [[ $b == before ]] && bin=$BIN_BEFORE
        python3 bench/gpu/kernel_times.py --bin "$bin" --model "$work/$m" --workload "$work/$m/workload.json" \
          --label "$m-$b" --synthetic-weights --detail ucopy --detail cast_f32 | tee -a "$results"
      done
    done
    ;;
  *)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
