#!/usr/bin/env python3
"""The start-up self-check's figure for an FP8 checkpoint at the Qwen3.5/3.6-27B width, on the CPU:
the random 4-layer checkpoint bench/gpu/prepare_hybrid.py makes (27B width, transformers' own
initialisation drawn in bf16, seed 0, vocabulary 32,000), written here on the CPU, and its FP8
quantisation in the layout of Qwen's releases (bench/gpu/fp8_bench.py). `layertap serve` is started
on each with --dtype bf16 on the CPU; its self-check compares the serving path (bf16 compute) with
the portable f32 path on 200 tokens through the first 4 layers and logs the worst relative error.
On the CPU both checkpoints' serving paths use no CUDA kernel, so the FP8 checkpoint's figure there
says how far bf16 activations quantised to e4m3 move from the f32 W8A8 reference by themselves.

Usage: python bench/fp8_width_cpu.py --bin target/release/layertap [--work /tmp/layertap-fp8-cpu]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "gpu"))
from fp8_bench import quantise_checkpoint  # noqa: E402
from random_checkpoint import hybrid_configs, random_model, save  # noqa: E402


def selfcheck(binary, model, port):
    log = os.path.join(os.path.dirname(model), f"serve-{os.path.basename(model)}.log")
    with open(log, "w") as err:
        p = subprocess.Popen([binary, "serve", "--model", model, "--device", "cpu", "--dtype", "bf16", "--host",
                              "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=err)
    try:
        for _ in range(1200):
            text = open(log).read()
            m = re.search(r"self-check done.*?worst_relative_error=(\S+) worst_index=(\d+) tolerance=(\S+)", text)
            if m:
                return {"worst_relative_error": float(m.group(1)), "worst_index": int(m.group(2)),
                        "tolerance": float(m.group(3)), "refused": "readiness refused" in text}
            if p.poll() is not None:
                raise SystemExit(f"{model}: the server stopped:\n{text[-2000:]}")
            time.sleep(0.5)
        raise SystemExit(f"{model}: no self-check line")
    finally:
        p.terminate()
        p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/layertap")
    ap.add_argument("--work", default="/tmp/layertap-fp8-cpu")
    a = ap.parse_args()
    bf16, fp8 = os.path.join(a.work, "27b"), os.path.join(a.work, "27b-fp8")
    if not os.path.exists(os.path.join(bf16, "config.json")):
        cfg, cls = hybrid_configs(4, 1)["27b"]
        save(random_model(cfg, cls, dtype=torch.bfloat16, init_dtype=torch.bfloat16), bf16, max_shard_size="5GB")
    quantise_checkpoint(bf16, fp8, device="cpu")
    for port, (label, model) in enumerate((("bf16", bf16), ("fp8", fp8)), start=18190):
        print(json.dumps({"checkpoint": label, "device": "cpu", "dtype": "bf16", **selfcheck(a.bin, model, port)}),
              flush=True)


if __name__ == "__main__":
    main()
