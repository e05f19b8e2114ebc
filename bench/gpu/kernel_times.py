#!/usr/bin/env python3
"""Where the GPU's time goes, kernel by kernel: `layertap bench` under Nsight Compute (ncu), which
times every kernel launch alone (gpu__time_duration, the GPU's clocks left as they are), summed
per kernel name and per class of work (GEMM, attention, Gated DeltaNet, FP8 quantisation,
elementwise, copies...).

ncu runs the kernels one at a time, so the sum is the time of the kernels themselves without the
gaps between them; the engine's own tokens/s (bench/gpu/fp8_bench.py, run.sh) are measured without
ncu. Only launches after the first `--skip` are kept (the load and the start-up self-check run
kernels too), and at most `--count`.

Usage (GPU machine, repository root, CUDA build in .gpu/):
  source bench/gpu/cuda-libs.sh
  python3 bench/gpu/kernel_times.py --bin .gpu/layertap --model DIR --workload W.json --label fp8
"""

import argparse
import collections
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import time

# Kernel-name fragments, first match wins, and the class they count under.
CLASSES = [
    ("fp8_quantise", "fp8 quantise"),
    ("fp8_", "fp8 other"),
    ("gemm", "gemm"),
    ("xmma", "gemm"),
    ("cutlass", "gemm"),
    ("sm90_", "gemm"),
    ("nvjet", "gemm"),
    ("attention", "attention"),
    ("attn", "attention"),
    ("gdn", "gated deltanet"),
    ("delta", "gated deltanet"),
    ("conv", "gated deltanet"),
    ("moe", "moe"),
    ("rms", "norm"),
    ("norm", "norm"),
    ("rope", "rope"),
    ("silu", "silu·up"),
    ("swiglu", "silu·up"),
    ("copy", "copy / cast"),
    ("cast", "copy / cast"),
    ("ucopy", "copy / cast"),
]


def ncu_path():
    found = shutil.which("ncu")
    if found:
        return found
    cands = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu") + glob.glob("/usr/local/cuda*/bin/ncu"))
    if not cands:
        raise SystemExit("ncu not found")
    return cands[-1]


def classify(name):
    low = name.lower()
    for frag, cls in CLASSES:
        if frag in low:
            return cls
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=".gpu/layertap")
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--max-batch-tokens", type=int, default=32768)
    ap.add_argument("--skip", type=int, default=0, help="kernel launches not kept (load, self-check)")
    ap.add_argument("--count", type=int, default=100000)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the engine")
    ap.add_argument("--detail", action="append", default=[],
                    help="for kernels whose name holds this: launches by grid size and by the kernels "
                         "launched just before and after (where in the forward pass they run)")
    ap.add_argument("--synthetic-weights", action="store_true",
                    help="the model folder holds a synthetic-weights.json (bench/gpu/synthetic_manifest.py)")
    a = ap.parse_args()
    cmd = [ncu_path(), "--csv", "--print-units", "base", "--clock-control", "none", "--metrics",
           "gpu__time_duration.sum", "--launch-skip", str(a.skip), "--launch-count", str(a.count),
           a.bin, "bench", "--workload", a.workload, "--model", a.model, "--device", "cuda:0", "--dtype", "bf16",
           "--max-batch-tokens", str(a.max_batch_tokens)] + (["--synthetic-weights"] if a.synthetic_weights else [])
    env = dict(os.environ)
    env.update(kv.split("=", 1) for kv in a.env)
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    lines = r.stdout.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith('"ID"'))
    per_name = collections.defaultdict(lambda: [0, 0.0])
    order = []  # (name, grid, ns) in launch order
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "ns")
        ns = v * {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}.get(unit, 1)
        p = per_name[row["Kernel Name"]]
        p[0] += 1
        p[1] += ns
        order.append((row["Kernel Name"], row.get("Grid Size", "?"), ns))
    detail = {}
    for frag in a.detail:
        where = collections.defaultdict(lambda: [0, 0.0])
        for i, (name, grid, ns) in enumerate(order):
            if frag not in name:
                continue
            before = order[i - 1][0][:40] if i > 0 else "-"
            after = order[i + 1][0][:40] if i + 1 < len(order) else "-"
            w = where[f"grid {grid} after {before} before {after}"]
            w[0] += 1
            w[1] += ns
        detail[frag] = [{"where": k, "launches": c, "s": round(ns / 1e9, 4)}
                        for k, (c, ns) in sorted(where.items(), key=lambda kv: -kv[1][1])[:15]]
    total = sum(v[1] for v in per_name.values())
    per_class = collections.defaultdict(float)
    for name, (_, ns) in per_name.items():
        per_class[classify(name)] += ns
    top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[: a.top]
    bench = [x for x in r.stdout.splitlines() if x.startswith("{")]
    print(json.dumps({
        "step": "kernel-times", "label": a.label, "model": a.model, "wall_s": round(time.time() - t0, 1),
        "launches": sum(v[0] for v in per_name.values()), "kernel_s": round(total / 1e9, 4),
        "classes_s": {k: round(v / 1e9, 4) for k, v in sorted(per_class.items(), key=lambda kv: -kv[1])},
        "top": [{"name": n[:160], "launches": c, "s": round(ns / 1e9, 4), "share": round(ns / total, 4)}
                for n, (c, ns) in top],
        "detail": detail,
        "bench": json.loads(bench[-1]) if bench else None,
    }), flush=True)


if __name__ == "__main__":
    main()
