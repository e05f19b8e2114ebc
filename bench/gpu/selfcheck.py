#!/usr/bin/env python3
"""The start-up self-check on the GPU: its figures per index (what sets the tolerances) and its cost.

Random-weight checkpoints (transformers' own initialisation, seed 0, bf16), built on the GPU
machine, four layers each (the self-check runs at most the first four layers of these models,
so deeper models cost the same):

- `dense`: the Qwen3-8B shape (bench/gpu/long_context.py's dense config, vocabulary 151,936);
- `27b`: the Qwen3.5/3.6-27B width, [lin, lin, lin, full] (long_context.py's hybrid config,
  vocabulary 248,320);
- `moe`: the Qwen3.5/3.6-35B-A3B width (bench/gpu/prepare_hybrid.py's moe config: 256 experts
  top 8, vocabulary 32,000).

Per model and dtype: `layertap serve --device cuda:0` is started with the self-check on (the
default) and then with `--selfcheck off`; each line reports the seconds from the process start
to `/ready` 200, the self-check's figures from `/v1/info` and `/metrics` (per index), and the
probe's and the reference's seconds from the server's log.

Usage (GPU machine, repository root, after `source bench/gpu/cuda-libs.sh`):
  python3 bench/gpu/selfcheck.py --bin .gpu/layertap [--models dense,27b,moe] [--dtypes bf16,f16]
(`--selfcheck off` is timed once per model, with the first dtype.)
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build(name, path):
    if os.path.exists(os.path.join(path, "config.json")):
        return
    import long_context as lc
    import prepare_hybrid as ph

    if name == "dense":
        cfg, cls = lc.dense_config(4, 8192, False)
    elif name == "27b":
        cfg, cls = lc.hybrid_config(4, 8192, False)
    else:
        cfg, cls = ph.configs(4, 4)["moe"]
    lc.build(cfg, cls, path, "cuda", torch.bfloat16)
    torch.cuda.empty_cache()


def get(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def serve(bin_path, model, dtype, port, log_path, extra):
    cmd = [bin_path, "serve", "--model", model, "--device", "cuda:0", "--dtype", dtype, "--host", "127.0.0.1",
           "--port", str(port), *extra]
    log = open(log_path, "w")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    ready_s, status = None, None
    while time.perf_counter() - start < 600:
        if proc.poll() is not None:
            break
        try:
            code, body = get(f"{base}/ready", 1.0)
            if code == 200:
                ready_s = time.perf_counter() - start
                break
        except urllib.error.HTTPError as e:
            status = json.loads(e.read() or b"{}").get("status")
            if status == "selfcheck_failed":
                break
        except Exception:
            pass
        time.sleep(0.05)
    out = {"ready_s": None if ready_s is None else round(ready_s, 2), "ready_status": status}
    try:
        out["selfcheck"] = json.loads(get(f"{base}/v1/info")[1]).get("selfcheck")
        metrics = get(f"{base}/metrics")[1].decode()
        out["errors"] = {m.group(1): float(m.group(2)) for m in
                         re.finditer(r'layertap_selfcheck_relative_error\{device="cuda:0",index="([^"]+)"\} (\S+)', metrics)}
    except Exception as e:  # the server stopped
        out["error"] = str(e)
    proc.terminate()
    proc.wait(timeout=60)
    log.close()
    text = open(log_path).read()
    m = re.search(r"probe_seconds=([0-9.e-]+) reference_seconds=([0-9.e-]+)", text)
    if m:
        out["probe_s"], out["reference_s"] = float(m.group(1)), float(m.group(2))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=".gpu/layertap")
    ap.add_argument("--models", default="dense,27b,moe")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--work", default="/dev/shm/layertap-selfcheck")
    ap.add_argument("--log-dir", default="bench/out/gpu")
    ap.add_argument("--port", type=int, default=18095)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.log_dir, exist_ok=True)
    for name in a.models.split(","):
        path = os.path.join(a.work, name)
        t0 = time.perf_counter()
        build(name, path)
        built = round(time.perf_counter() - t0, 1)
        for k, dtype in enumerate(a.dtypes.split(",")):
            # The cost without the check once per model (the first dtype's).
            for mode in ["enforce", "off"] if k == 0 else ["enforce"]:
                log = os.path.join(a.log_dir, f"server-selfcheck-{name}-{dtype}-{mode}.log")
                r = serve(a.bin, path, dtype, a.port, log, ["--selfcheck", mode])
                print(json.dumps({"step": "selfcheck", "model": name, "dtype": dtype, "mode": mode,
                                  "build_s": built, **r}), flush=True)


if __name__ == "__main__":
    main()
