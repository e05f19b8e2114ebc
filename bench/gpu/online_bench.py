#!/usr/bin/env python3
"""The online source (layertap_client.online) feeding a consumer from a running server: the
workload of a bench_http workload file (the same sequences, layers and dtype), one pass, every
sample's tensors touched by a stand-in training step. Prints one JSON line: tokens delivered per
second, the time the consumer waited for samples (and its share of the wall time), the client's
CPU seconds per GB of states, its peak resident memory, and the source's peak buffered bytes
against the bound it was given.

    python3 bench/gpu/online_bench.py --url http://127.0.0.1:18080 --workload W/workload.json \
        [--workers 0|1|4] [--step-ms 0] [--max-requests 32] [--request-tokens 16384] \
        [--max-buffered-mb 2048] [--encoding zstd|identity] [--device cuda:0] [--touch sum|sum-once|none]

--workers 0 iterates the source in this process; N > 0 runs N torch DataLoader workers over
OnlineIterableDataset (each with its share and its own requests: --max-requests each; with
--device the DataLoader pins memory and the step copies each sample to the GPU, as a trainer
does). --step-ms adds that much sleep to each step (a consumer slower than the server).
--touch none: the step takes the sample and does nothing with it (the copy to the GPU, where
there is one, still happens: the source's own work). --touch sum reads every tensor and waits for
each sum (one device sync per tensor); --touch sum-once adds the sums up on the device and waits
once per sample, as a training step that reads its loss once does.

With --device, the CUDA context is made before the clock starts: a trainer has one before its
data source starts (bench_http's clock likewise starts after its untimed warm-up request). The
clock then covers everything the source does, its pinned memory and first requests included;
first_sample_s is the wait for the first sample, tokens_per_s_after_first the rate from then on.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import tempfile
import time

import numpy as np


try:
    import torch as _torch

    _F32 = _torch.float32
except ImportError:
    _torch = _F32 = None


def touch(sample) -> float:
    """A stand-in training step: reads every value of every tensor of the sample once."""
    total = 0.0
    for v in sample.values():
        if hasattr(v, "is_floating_point"):  # torch: floats summed in float32, without a widened copy
            total += float(v.sum(dtype=_F32) if v.is_floating_point() else v.sum())
        elif isinstance(v, np.ndarray) and v.dtype.kind in "fiub":
            total += float(v.sum(dtype=np.float64))
    return total


def touch_once(sample) -> float:
    """The same reads as :func:`touch`, summed on the sample's device: one wait per sample."""
    parts = [v.sum(dtype=_F32) if v.is_floating_point() else v.sum().to(_F32) for v in sample.values() if hasattr(v, "is_floating_point")]
    return float(_torch.stack(parts).sum()) if parts else 0.0


def _worker_stats_dataset(dir_: str):
    """OnlineIterableDataset whose workers each write their source's stats() to DIR when their
    share is done (the main process cannot ask them)."""
    from layertap_client.online import OnlineIterableDataset
    from torch.utils.data import get_worker_info

    class WithStats(OnlineIterableDataset):
        def __iter__(self):
            yield from super().__iter__()
            info = get_worker_info()
            with open(os.path.join(dir_, f"worker-{info.id if info else 0}.json"), "w") as f:
                json.dump(self.stats(), f)

    return WithStats


def _sum_workers(dir_: str) -> dict:
    out = {"worker_waited_s": 0.0, "retries": 0, "throttled": 0, "failures": 0, "requests": 0, "peak_mb": []}
    for path in sorted(glob.glob(os.path.join(dir_, "worker-*.json"))):
        st = json.load(open(path))
        out["worker_waited_s"] += st["waited_s"]
        out["retries"] += st["retries"]
        out["failures"] += st["failures"]
        out["peak_mb"].append(round(st["peak_bytes"] / 2**20, 1))
        for v in st["servers"].values():
            out["throttled"] += v["throttled"]
            out["requests"] += v["requests"]
    out["worker_waited_s"] = round(out["worker_waited_s"], 3)
    return out


def cpu_seconds() -> float:
    return own_cpu_seconds() + workers_cpu_seconds()


def own_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def workers_cpu_seconds() -> float:
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return c.ru_utime + c.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--step-ms", type=float, default=0.0)
    ap.add_argument("--max-requests", type=int, default=32)
    ap.add_argument("--request-tokens", type=int, default=16384)
    ap.add_argument("--max-buffered-mb", type=int, default=2048)
    ap.add_argument("--dtype", default=None, help="the answer dtype (default: the workload's)")
    ap.add_argument("--encoding", default="zstd", choices=["zstd", "identity"], help="the answers' encoding")
    ap.add_argument("--device", default=None, help="cuda:N: the samples copied to that GPU (by the source; with workers by the step)")
    ap.add_argument("--touch", default="sum", choices=["sum", "sum-once", "none"], help="what the stand-in step does with a sample")
    ap.add_argument("--pin-memory", type=int, default=1, choices=[0, 1], help="with --device: the host buffers pinned (1) or pageable (0)")
    ap.add_argument("--warm-mb", type=int, default=None, help="with --device: host memory made ready when the pass starts (default: one slab)")
    a = ap.parse_args()

    from layertap_client.online import OnlineSource

    side = json.load(open(a.workload))
    jsonl = a.workload.rsplit("/", 1)[0] + "/" + side["file"] if "/" in a.workload else side["file"]
    samples = [{"id": str(i), "input_ids": json.loads(line)["input_ids"]} for i, line in enumerate(open(jsonl)) if line.strip()]
    kw = dict(
        layers=side["layers"],
        dtype=a.dtype or side.get("dtype", "bfloat16"),
        max_requests=a.max_requests,
        request_tokens=a.request_tokens,
        max_buffered_bytes=a.max_buffered_mb << 20,
        encoding=a.encoding,
    )
    if a.device and a.workers == 0:
        kw["device"] = a.device
        kw["pin_memory"] = bool(a.pin_memory)
    if a.device:  # the trainer's CUDA context exists before its source starts
        _torch.zeros(1, device=a.device)
        _torch.cuda.synchronize(a.device)
    cpu0, own0, t0 = cpu_seconds(), own_cpu_seconds(), time.perf_counter()
    waited = first_wait = 0.0
    first_tokens = 0
    tokens = nbytes = n = 0
    src = None
    if _torch is not None:  # torch tensors, as a trainer takes them, where torch is installed
        kw["as_torch"] = True
    if a.workers == 0:
        src = OnlineSource(samples, a.url, **kw)
        if a.warm_mb is not None:
            src._warm_bytes = a.warm_mb << 20
        it = iter(src)
    else:
        stats_dir = tempfile.mkdtemp(prefix="online-bench-")
        layers = kw.pop("layers")
        kw.pop("as_torch", None)
        ds = _worker_stats_dataset(stats_dir)(samples, a.url, layers, **kw)
        it = iter(_torch.utils.data.DataLoader(ds, batch_size=None, num_workers=a.workers, pin_memory=bool(a.device)))
    to_device = a.workers > 0 and a.device
    while True:
        w = time.perf_counter()
        try:
            s = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - w
        if n == 0:
            first_wait = waited
            first_tokens = len(s["input_ids"])
        if to_device:
            s = {k: v.to(a.device, non_blocking=True) if hasattr(v, "to") else v for k, v in s.items()}
        if a.touch == "sum":
            touch(s)
        elif a.touch == "sum-once":
            touch_once(s)
        if a.step_ms:
            time.sleep(a.step_ms / 1000)
        tokens += len(s["input_ids"])
        hs = s["hidden_states"]
        nbytes += hs.nbytes if isinstance(hs, np.ndarray) else hs.numel() * hs.element_size()
        n += 1
    # the source's own accounting is in this process only without workers
    st = src.stats() if src is not None else {}
    peak_buffered = st.get("peak_bytes")
    budget = getattr(src, "_budget", None) if src is not None else None
    requests = sum(v["requests"] for v in st["servers"].values()) if st else None
    if src is not None:
        src.close()
    wall = time.perf_counter() - t0
    cpu = cpu_seconds() - cpu0
    own = own_cpu_seconds() - own0
    print(json.dumps({
        "contender": f"online source, {a.encoding}, {a.workers} workers" + (f", step {a.step_ms} ms" if a.step_ms else "") + (f", to {a.device}" if a.device else "") + (", pageable host buffers" if a.device and not a.pin_memory else "") + (f", {a.warm_mb} MB made ready at the start" if a.warm_mb is not None else "") + (", step does nothing" if a.touch == "none" else ", one sync a sample" if a.touch == "sum-once" else ""),
        "samples": n, "tokens": tokens, "seconds": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
        "first_sample_s": round(first_wait, 3),
        "tokens_per_s_after_first": round((tokens - first_tokens) / max(wall - first_wait, 1e-9), 1),
        "consumer_waited_s": round(waited, 3), "waited_share": round(waited / wall, 4),
        # after the first sample: the steady state, without the wait for the first answers
        "waited_after_first_share": round((waited - first_wait) / max(wall - first_wait, 1e-9), 4),
        "state_gb": round(nbytes / 1e9, 3), "client_cpu_s_per_gb": round(cpu / max(nbytes / 1e9, 1e-9), 2),
        "main_process_cpu_s_per_gb": round(own / max(nbytes / 1e9, 1e-9), 2),
        # ru_maxrss of this process (KiB on Linux); DataLoader workers are separate processes
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "peak_rss_workers_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "peak_buffered_mb": None if peak_buffered is None else round(peak_buffered / 2**20, 1),
        "max_buffered_mb": a.max_buffered_mb, "max_requests": a.max_requests, "request_tokens": a.request_tokens,
        "request_tokens_used": budget, "requests": requests,
        "retries": st.get("retries"), "throttled": sum(v["throttled"] for v in st["servers"].values()) if st else None,
        "pinned_mb": round(st["pinned_bytes"] / 2**20, 1) if st.get("pinned_bytes") else None,
        "pinning_s": round(st["pinning_s"], 3) if st.get("pinned_bytes") else None,
        "touch": a.touch,
        "workers_stats": _sum_workers(stats_dir) if a.workers else None,
    }))


if __name__ == "__main__":
    main()
