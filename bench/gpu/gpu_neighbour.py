#!/usr/bin/env python3
"""A neighbour on the server's GPU: another process that does what a training step fed from
host memory does to the GPU (copies from pinned host buffers, a kernel over every copied value,
a wait for it), at a given rate, until killed or for --seconds. Run beside a benchmark to see
what a second CUDA context on the same GPU costs the server (the GPU time-slices between
processes). Prints one JSON line when done: GB copied, seconds, its rate.

    python3 bench/gpu/gpu_neighbour.py --device cuda:0 --gb-per-s 1.0 --seconds 30 [--kernels 5]

--kernels N: N sums over the chunk, each waited for, per chunk (the online benchmark's stand-in
step waits once per tensor of a sample, about 5 of them). 0: copies only, no kernel.
"""

from __future__ import annotations

import argparse
import json
import signal
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--gb-per-s", type=float, default=1.0)
    ap.add_argument("--chunk-mb", type=int, default=24, help="one sample's size")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--kernels", type=int, default=1, help="sums over the chunk, each waited for, per chunk")
    a = ap.parse_args()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    host = torch.empty(a.chunk_mb << 20, dtype=torch.uint8, pin_memory=True).view(torch.bfloat16)
    host.normal_()
    copied, kernels, t0 = 0, 0, time.perf_counter()
    while not stop and time.perf_counter() - t0 < a.seconds:
        dev = host.to(a.device, non_blocking=True)
        for _ in range(a.kernels):
            float(dev.sum(dtype=torch.float32))
            kernels += 1
        if not a.kernels:
            torch.cuda.current_stream(a.device).synchronize()
        copied += host.numel() * host.element_size()
        ahead = copied / (a.gb_per_s * 1e9) - (time.perf_counter() - t0)
        if ahead > 0:
            time.sleep(ahead)
    wall = time.perf_counter() - t0
    print(json.dumps({"neighbour_gb": round(copied / 1e9, 3), "seconds": round(wall, 2), "gb_per_s": round(copied / 1e9 / wall, 3), "kernels_per_s": round(kernels / wall, 1)}))


if __name__ == "__main__":
    main()
