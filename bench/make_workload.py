#!/usr/bin/env python3
"""Write a deterministic CPU benchmark workload.

Default (--preset cpu), for SmolLM2-135M:

    bench/workload_cpu.jsonl   48 lines {"id": "s<k>", "input_ids": [...]}
                               lengths uniform in [32, 512], ids uniform in [17, 49152)
                               (ids 0..16 are SmolLM2's special tokens)
    bench/workload_cpu.json    {"layers": [...], "dtype": "float32", "file": "workload_cpu.jsonl"}

--preset hybrid, for the Qwen3.5-shaped model of bench/make_hybrid_model.py (8 layers, vocab 8192):

    bench/workload_hybrid.jsonl   32 lines, lengths uniform in [32, 512], ids uniform in [0, 8192)
    bench/workload_hybrid.json    layers [2, 5, 8], float32

Both use seed 0. Layer indices are Hugging Face `hidden_states` indices: 0 = embeddings,
i in 1..L-1 = output of decoder layer i-1, L = final normed output (L = 30 for SmolLM2-135M,
8 for the hybrid).

--n-seqs / --min-len / --max-len / --name override the preset (e.g. a tiny smoke-test workload:
--preset hybrid --n-seqs 3 --max-len 48 --name workload_tiny --out-dir /tmp/wl).

Usage: python bench/make_workload.py [--preset cpu|hybrid] [--out-dir bench]
           [--n-seqs N] [--min-len N] [--max-len N] [--name STEM]
"""

import argparse
import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

SEED = 0
PRESETS = {
    "cpu": dict(n_seqs=48, min_len=32, max_len=512, first_id=17, vocab=49152, layers=[2, 8, 15, 22, 30],
                name="workload_cpu"),
    "hybrid": dict(n_seqs=32, min_len=32, max_len=512, first_id=0, vocab=8192, layers=[2, 5, 8],
                   name="workload_hybrid"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=HERE, help="output folder (default: bench/)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--n-seqs", type=int)
    ap.add_argument("--min-len", type=int)
    ap.add_argument("--max-len", type=int)
    ap.add_argument("--name", help="file stem: writes STEM.jsonl and STEM.json")
    args = ap.parse_args()

    p = dict(PRESETS[args.preset])
    for key in ("n_seqs", "min_len", "max_len", "name"):
        if getattr(args, key) is not None:
            p[key] = getattr(args, key)
    assert 1 <= p["min_len"] <= p["max_len"] and p["n_seqs"] >= 1, p
    jsonl, sidecar = p["name"] + ".jsonl", p["name"] + ".json"

    rng = np.random.default_rng(SEED)
    lengths = rng.integers(p["min_len"], p["max_len"], size=p["n_seqs"], endpoint=True)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, jsonl), "w") as f:
        for k, n in enumerate(lengths):
            ids = rng.integers(p["first_id"], p["vocab"], size=int(n))
            f.write(json.dumps({"id": f"s{k}", "input_ids": [int(x) for x in ids]}, separators=(",", ":")))
            f.write("\n")
    with open(os.path.join(args.out_dir, sidecar), "w") as f:
        json.dump({"layers": p["layers"], "dtype": "float32", "file": jsonl}, f)
        f.write("\n")
    print(f"{p['n_seqs']} sequences, {int(lengths.sum())} tokens -> {os.path.join(args.out_dir, jsonl)}")


if __name__ == "__main__":
    main()
