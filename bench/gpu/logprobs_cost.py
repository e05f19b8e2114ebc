#!/usr/bin/env python3
"""What the teacher log-probabilities cost on the GPU, per 1,000 selected rows.

The head (final norm, lm_head, log-softmax over the vocabulary, top-k) runs once per selected row,
whatever the depth, so the models here have the real widths and vocabularies with few layers:

- "8b":  Qwen3-8B widths (hidden 4096, vocabulary 151,936), 2 layers;
- "27b": Qwen3.5/3.6-27B widths (hidden 5120, vocabulary 248,320), 4 layers (3 Gated DeltaNet + 1 attention).

For each, `layertap bench` runs the same workload (every row selected), alternating: layers [-1]
alone, then with `--top-k K` (the engine computes every row's target log-probability with it); the
cost per 1,000 rows is the difference of the best timed seconds over the rows. Also printed: the lm_head GEMM's
FLOPs per row and the rate the difference implies, and the answer bytes per row of the
log-probabilities (K ids int64 + K log-probabilities f32 + 1 target f32) against full f32 logits.

Usage (GPU machine, repository root, the CUDA build in .gpu/):
  source bench/gpu/cuda-libs.sh && python3 bench/gpu/logprobs_cost.py --bin .gpu/layertap --work /tmp/lp
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: random_checkpoint
from random_checkpoint import QWEN3_5_27B_WIDTH, hybrid_layer_types, random_model, save  # noqa: E402


def make_models(work):
    from transformers import Qwen3_5TextConfig, Qwen3Config

    shapes = {
        "8b": (Qwen3Config(num_hidden_layers=2, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960,
                           rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False), None),
        "27b": (Qwen3_5TextConfig(**QWEN3_5_27B_WIDTH, num_hidden_layers=4, vocab_size=248320,
                                  max_position_embeddings=8192, layer_types=hybrid_layer_types(4),
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                   "partial_rotary_factor": 0.25},
                                  tie_word_embeddings=False), "Qwen3_5ForCausalLM"),
    }
    out = {}
    for name, (cfg, cls) in shapes.items():
        path = os.path.join(work, f"model-{name}")
        if not os.path.exists(os.path.join(path, "config.json")):
            model = random_model(cfg, cls, device="cuda", dtype=torch.bfloat16, from_config=True)
            save(model, path, max_shard_size="5GB")
            del model
            torch.cuda.empty_cache()
        out[name] = (path, cfg.hidden_size, cfg.vocab_size)
    return out


def make_workload(work, n, seed=0):
    rng = np.random.default_rng(seed)
    lens = np.clip(np.round(rng.lognormal(mean=np.log(750), sigma=0.75, size=n)), 100, 4096).astype(int)
    with open(os.path.join(work, "lp.jsonl"), "w") as f:
        for t in lens:
            f.write(json.dumps({"input_ids": rng.integers(100, 150000, size=int(t)).tolist()}) + "\n")
    path = os.path.join(work, "lp.json")
    with open(path, "w") as f:
        json.dump({"layers": [-1], "dtype": "bfloat16", "file": "lp.jsonl"}, f)
    return path, int(lens.sum())


def bench(binary, workload, model, flags, max_batch_tokens):
    cmd = [binary, "bench", "--workload", workload, "--model", model, "--device", "cuda:0", "--dtype", "bf16",
           "--max-batch-tokens", str(max_batch_tokens), *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    for line in p.stdout.splitlines():
        if line.startswith("{") and '"contender"' in line:
            return json.loads(line)
    raise RuntimeError(f"no result line from {cmd}: {p.stdout[-2000:]} {p.stderr[-2000:]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=".gpu/layertap")
    ap.add_argument("--work", required=True)
    ap.add_argument("--sequences", type=int, default=200)
    ap.add_argument("--top-k", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-batch-tokens", type=int, default=32768)
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    models = make_models(args.work)
    workload, rows = make_workload(args.work, args.sequences)
    k = args.top_k
    variants = {"states": [], "top_k": ["--top-k", str(k)]}
    for name, (path, hidden, vocab) in models.items():
        secs = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v, flags in variants.items():
                secs[v].append(bench(args.bin, workload, path, flags, args.max_batch_tokens)["seconds"])
        base = min(secs["states"])
        for v in ("top_k",):
            extra = min(secs[v]) - base
            flops = 2 * hidden * vocab  # the lm_head GEMM, per row
            print(json.dumps({
                "bench": "logprobs_cost", "shape": name, "hidden": hidden, "vocab": vocab, "top_k": k, "variant": v,
                "rows": rows, "seconds_states": secs["states"], "seconds_with": secs[v],
                "ms_per_1000_rows": extra / rows * 1000 * 1000,
                "head_tflops_implied": flops * rows / extra / 1e12 if extra > 0 else None,
                "answer_bytes_per_row": k * 12, "answer_bytes_per_row_with_target": k * 12 + 4,
                "full_logits_bytes_per_row": vocab * 4,
            }), flush=True)


if __name__ == "__main__":
    main()
