#!/usr/bin/env python3
"""Inputs of the hybrid GPU benchmark, made on the GPU machine (speed does not depend on the
weights' values):

- two random-weight checkpoints (transformers' own initialisation, bf16), at the real widths and
  with the real 3 : 1 pattern of Gated DeltaNet and gated-attention layers, but fewer layers than
  the real models so both contenders' runs fit the GPU time (both run the same layers):
  - `27b`: Qwen3.5/3.6-27B width (hidden 5120, GDN 16 key / 48 value heads of 128, attention
    24 q / 4 kv heads of 256, partial rotary 0.25, intermediate 17408), --dense-layers layers;
  - `moe`: Qwen3.5/3.6-35B-A3B width (hidden 2048, GDN 16 / 32 heads, attention 16 / 2 heads of
    256, 256 experts top 8, expert and shared intermediate 512), --moe-layers layers;
  vocabulary 32,000 instead of 248,320 (only the embedding table, which is not matmul work);
- the workload: --sequences sequences (seed 0) of 100..4,096 tokens (log-normal, as bench/gpu's
  dense workload), random ids, with taps spread as DFlash spreads them over the real depth;
- the bf16 matmul rate of this GPU (8192^3), the denominator of MFU, and each model's matmul
  parameters: those of the layers up to the deepest tap, the experts counted top-k of 256.

Prints one JSON line. Usage:
  python3 bench/gpu/prepare_hybrid.py --work /tmp/hyb [--dense-layers 16] [--moe-layers 8] [--bf16-init]
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

from prepare import matmul_rate, workload_lengths

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: random_checkpoint
from random_checkpoint import base_parameters, hybrid_configs, random_model, save  # noqa: E402

VOCAB = 32000


def configs(dense_layers, moe_layers):
    return hybrid_configs(dense_layers, moe_layers, VOCAB)


def taps(n):
    """DFlash's five layers (1, 1/4, 1/2, 3/4 of the way, and the second last), as HF indices."""
    ids = sorted({1, round((n - 1) / 4), round((n - 1) / 2), round(3 * (n - 1) / 4), n - 2})
    return [i + 1 for i in ids]


def matmul_params(model, deepest, top_k):
    """Parameters of the matrix products a token runs in layers 1..deepest: 2-D weights of the
    decoder layers (conv1d, norms, biases and the embedding excluded), experts top_k / E."""
    total = 0
    for layer in model.model.layers[:deepest]:
        for name, p in layer.named_parameters():
            if "experts." in name and p.dim() == 3:  # fused experts [E, out, in]
                total += p.numel() * top_k // p.shape[0]
            elif ".experts." in name and p.dim() == 2:
                total += p.numel() * top_k // model.config.num_experts
            elif p.dim() == 2:
                total += p.numel()
    return total


def make(path, cfg, cls_name, layers, bf16_init=False):
    info_path = os.path.join(path, "bench.json")
    if os.path.exists(info_path):
        return json.load(open(info_path))
    # bf16_init: built in bf16 from the start: a full-depth 27B model in f32 would not fit the GPU.
    model = random_model(cfg, cls_name, device="cuda", dtype=torch.bfloat16,
                         init_dtype=torch.bfloat16 if bf16_init else None)
    save(model, path, max_shard_size="5GB")
    top_k = getattr(cfg, "num_experts_per_tok", 0)
    info = {"layers": cfg.num_hidden_layers, "taps": layers, "layer_types": cfg.layer_types,
            "matmul_parameters": matmul_params(model, max(layers), top_k),
            "base_parameters": base_parameters(model)}
    json.dump(info, open(info_path, "w"))
    del model
    torch.cuda.empty_cache()
    return info


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--dense-layers", type=int, default=16)
    ap.add_argument("--moe-layers", type=int, default=8)
    ap.add_argument("--sequences", type=int, default=200)
    ap.add_argument("--models", default="27b,moe", help="comma-separated: which of 27b, moe to write")
    ap.add_argument("--taps", default=None,
                    help="comma-separated HF indices instead of DFlash's spread (e.g. 2,17,32,47,62 at full depth)")
    ap.add_argument("--bf16-init", action="store_true",
                    help="initialise the weights in bf16 (for full-depth models whose f32 copy would not fit)")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    rng = np.random.default_rng(0)
    lens = workload_lengths(rng, a.sequences)
    with open(os.path.join(a.work, "workload.jsonl"), "w") as f:
        for i, t in enumerate(lens):
            f.write(json.dumps({"id": f"s{i}", "input_ids": rng.integers(100, VOCAB, size=int(t)).tolist()}) + "\n")
    out = {"workload": {"sequences": a.sequences, "tokens": int(lens.sum()), "min": int(lens.min()),
                        "max": int(lens.max())}}
    for name, (cfg, cls_name) in configs(a.dense_layers, a.moe_layers).items():
        if name not in a.models.split(","):
            continue
        layers = [int(x) for x in a.taps.split(",")] if a.taps else taps(cfg.num_hidden_layers)
        with open(os.path.join(a.work, f"workload_{name}.json"), "w") as f:
            json.dump({"layers": layers, "dtype": "bfloat16", "file": "workload.jsonl"}, f)
        out[name] = make(os.path.join(a.work, name), cfg, cls_name, layers, a.bf16_init)
    out["bf16_matmul_tflops"] = round(matmul_rate(), 1)
    out["gpu"] = torch.cuda.get_device_name(0)
    out["torch"] = torch.__version__
    print(json.dumps(out))


if __name__ == "__main__":
    main()
