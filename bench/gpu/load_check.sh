#!/usr/bin/env bash
# What the load-time finite check adds to a server's start: a random bf16 checkpoint of the
# Qwen3-8B shape (16.4 GB, written to RAM-backed /dev/shm) served on GPU 0; prints the server's
# "weights checked" log line (tensors, GiB, seconds of the check) and the time from the start
# of the process to /ready answering 200.
#
#   source bench/gpu/cuda-libs.sh && BIN=.gpu/layertap bench/gpu/load_check.sh
#
# CHECKPOINT_ONLY=1: only write the checkpoint (for the benchmarks that serve it themselves).
set -euo pipefail
BIN=${BIN:-.gpu/layertap}
WORK=${WORK:-/dev/shm/load-check}
PORT=${PORT:-18431}
mkdir -p "$WORK"
if [ ! -f "$WORK/config.json" ]; then
    python3 - "$WORK" <<'EOF'
import sys, time, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
t = time.time()
cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                  max_position_embeddings=40960, rope_theta=1e6)
with torch.device("cuda"):
    m = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
m.save_pretrained(sys.argv[1], safe_serialization=True, max_shard_size="5GB")
print(f"checkpoint written in {time.time() - t:.1f} s", flush=True)
EOF
fi
du -sh "$WORK"
[[ -z "${CHECKPOINT_ONLY:-}" ]] || exit 0
start=$(date +%s.%N)
LAYERTAP_LOG=info "$BIN" serve --model "$WORK" --device cuda:0 --host 127.0.0.1 --port "$PORT" >"$WORK.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
until curl -fs "127.0.0.1:$PORT/ready" >/dev/null; do
    kill -0 $pid 2>/dev/null || { cat "$WORK.log"; exit 1; }
    sleep 0.1
done
ready=$(date +%s.%N)
grep -E "weights checked|model loaded|self-check done|ready" "$WORK.log" | sed 's/\x1b\[[0-9;]*m//g'
python3 -c "print(f'ready after {$ready - $start:.2f} s')"
