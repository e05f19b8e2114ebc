#!/usr/bin/env python3
"""Write the deterministic CPU benchmark workload.

    bench/workload_cpu.jsonl   48 lines {"id": "s<k>", "input_ids": [...]}
                               lengths uniform in [32, 512], ids uniform in [17, 49152)
                               (ids 0..16 are SmolLM2's special tokens)
    bench/workload_cpu.json    {"layers": [...], "dtype": "float32", "file": "workload_cpu.jsonl"}

Layer indices are Hugging Face `hidden_states` indices: 0 = embeddings, i in 1..L-1 = output
of decoder layer i-1, L = final normed output (L = 30 for SmolLM2-135M).

Usage: python bench/make_workload.py [--out-dir bench]
"""

import argparse
import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

SEED = 0
N_SEQS = 48
MIN_LEN, MAX_LEN = 32, 512
VOCAB = 49152
FIRST_ID = 17
LAYERS = [2, 8, 15, 22, 30]
JSONL = "workload_cpu.jsonl"
SIDECAR = "workload_cpu.json"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=HERE, help="output folder (default: bench/)")
    args = ap.parse_args()

    rng = np.random.default_rng(SEED)
    lengths = rng.integers(MIN_LEN, MAX_LEN, size=N_SEQS, endpoint=True)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, JSONL), "w") as f:
        for k, n in enumerate(lengths):
            ids = rng.integers(FIRST_ID, VOCAB, size=int(n))
            f.write(json.dumps({"id": f"s{k}", "input_ids": [int(x) for x in ids]}, separators=(",", ":")))
            f.write("\n")
    with open(os.path.join(args.out_dir, SIDECAR), "w") as f:
        json.dump({"layers": LAYERS, "dtype": "float32", "file": JSONL}, f)
        f.write("\n")
    print(f"{N_SEQS} sequences, {int(lengths.sum())} tokens -> {os.path.join(args.out_dir, JSONL)}")


if __name__ == "__main__":
    main()
