#!/usr/bin/env python3
"""GPU benchmark inputs, made on the GPU machine (speed does not depend on the weights' values):

- a Qwen3-8B-shaped checkpoint with random weights (36 layers, hidden 4096, 32 heads, 8 KV heads,
  head_dim 128, intermediate 12288, vocab 151936, bf16), via `from_config` + `save_pretrained`;
- the workload: 2,000 sequences (fixed seed), lengths 100..4096 (log-normal, mean about 1,000),
  random ids, 5 layers spread like DFlash's: hidden_states indices [2, 10, 19, 27, 34];
- the bf16 matmul rate of this GPU (8192^3, CUDA events), the denominator of MFU.

Usage: python3 bench/gpu/prepare.py --model-dir /tmp/qwen3-8b-random --out-dir bench/out/gpu
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: random_checkpoint
from random_checkpoint import base_parameters, random_model, save  # noqa: E402

QWEN3_8B = dict(
    num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
)


def make_model(path, shape=QWEN3_8B):
    """A random-weight Qwen3 checkpoint of `shape` (Qwen3Config arguments) at `path`, bf16."""
    from transformers import Qwen3Config

    if os.path.exists(os.path.join(path, "config.json")):
        return
    cfg = Qwen3Config(**shape, torch_dtype="bfloat16")
    model = random_model(cfg, device="cuda", dtype=torch.bfloat16, from_config=True)
    save(model, path, max_shard_size="5GB")
    with open(os.path.join(path, "params.json"), "w") as f:
        json.dump({"base_model_parameters": base_parameters(model)}, f)
    del model
    torch.cuda.empty_cache()


def workload_lengths(rng, n):
    """n sequence lengths of 100..4096 tokens, log-normal (mean about 1,000), drawn from rng."""
    return np.clip(np.round(rng.lognormal(mean=np.log(750), sigma=0.75, size=n)), 100, 4096).astype(int)


def make_workload(out_dir, n=2000, seed=0):
    rng = np.random.default_rng(seed)
    lens = workload_lengths(rng, n)
    with open(os.path.join(out_dir, "workload_gpu.jsonl"), "w") as f:
        for i, t in enumerate(lens):
            ids = rng.integers(100, 151000, size=int(t)).tolist()
            f.write(json.dumps({"id": f"s{i}", "input_ids": ids}) + "\n")
    with open(os.path.join(out_dir, "workload_gpu.json"), "w") as f:
        json.dump({"layers": [2, 10, 19, 27, 34], "dtype": "bfloat16", "file": "workload_gpu.jsonl"}, f)
    return {"sequences": n, "tokens": int(lens.sum()), "mean_len": float(lens.mean()), "min": int(lens.min()),
            "max": int(lens.max())}


def matmul_rate():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 50
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    secs = start.elapsed_time(end) / 1000 / reps
    return 2 * 8192**3 / secs / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out-dir", required=True)
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    make_model(a.model_dir)
    w = make_workload(a.out_dir)
    info = {"workload": w, "bf16_matmul_tflops": round(matmul_rate(), 1), "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__}
    with open(os.path.join(a.model_dir, "params.json")) as f:
        info.update(json.load(f))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
