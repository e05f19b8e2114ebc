#!/usr/bin/env python3
"""Out of memory never fails a request, on a real GPU: the server is started with a batch budget far
past what fits (--max-batch-tokens 2,000,000) while this script holds most of the GPU's memory (as
another tenant would), then many requests are sent at once. Every answer must be 200 with the right
shape and finite values; the server must have split and retried batches (layertap_oom_retries_total)
and lowered its budget (/v1/info max_batch_tokens). Sequences also sent alone first are compared with
their answers under load.

Usage (GPU machine, repository root, CUDA build in .gpu/):
  source bench/gpu/cuda-libs.sh && python3 bench/gpu/oom_check.py --bin .gpu/layertap [--leave-gb 12]
Prints one JSON line.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import torch
from safetensors.torch import load as st_load

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prepare import make_model  # noqa: E402

LAYERS = [2, 10, 19, 27, -1]


# A Qwen3-1.7B shape: 28 layers, hidden 2048.
QWEN3_1_7B = dict(
    num_hidden_layers=28, hidden_size=2048, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True,
)


def post(url, ids, timeout=600):
    body = json.dumps({"inputs": [{"input_ids": ids}], "layers": LAYERS, "dtype": "bfloat16"}).encode()
    req = urllib.request.Request(url + "/v1/hidden-states", data=body,
                                 headers={"content-type": "application/json", "accept-encoding": "identity"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, st_load(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:300]


def get(url, path):
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return r.read().decode()


def metric(text, name):
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name) and not line.startswith("#"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model-dir", default="/tmp/qwen3-1.7b-random")
    ap.add_argument("--leave-gb", type=float, default=12.0, help="GPU memory left free for the server")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--port", type=int, default=18090)
    a = ap.parse_args()
    make_model(a.model_dir, QWEN3_1_7B)
    free, total = torch.cuda.mem_get_info()
    hog_bytes = int(free - a.leave_gb * 2**30)
    hog = torch.empty(max(hog_bytes, 0), dtype=torch.uint8, device="cuda")
    free_after, _ = torch.cuda.mem_get_info()
    url = f"http://127.0.0.1:{a.port}"
    log = open("/tmp/oom_check_server.log", "w")
    server = subprocess.Popen(
        [a.bin, "serve", "--model", a.model_dir, "--device", "cuda:0", "--dtype", "bf16", "--host", "127.0.0.1",
         "--port", str(a.port), "--max-batch-tokens", "2000000", "--max-input-tokens", "8192",
         "--max-queue-tokens", "4000000", "--max-request-tokens", "8192", "--request-timeout", "900"],
        stderr=log, stdout=log)
    try:
        for _ in range(600):
            try:
                if json.loads(get(url, "/ready"))["status"] == "ok":
                    break
            except Exception:
                pass
            time.sleep(0.5)
        budget_before = json.loads(get(url, "/v1/info"))["max_batch_tokens"]
        g = torch.Generator().manual_seed(3)
        lens = torch.randint(1500, 8192, (a.requests,), generator=g).tolist()
        seqs = [torch.randint(100, 151000, (n,), generator=g).tolist() for n in lens]
        alone = {}
        for k in range(3):
            code, t = post(url, seqs[k])
            assert code == 200, (code, t)
            alone[k] = t["hidden_states"]
        results = [None] * len(seqs)

        def worker(i):
            results[i] = post(url, seqs[i])

        t0 = time.time()
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(seqs))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        secs = time.time() - t0
        statuses = {}
        bad = []
        for i, (code, t) in enumerate(results):
            statuses[code] = statuses.get(code, 0) + 1
            if code != 200:
                bad.append((i, code, t))
                continue
            hs = t["hidden_states"]
            if list(hs.shape) != [lens[i], len(LAYERS), 2048] or not torch.isfinite(hs.float()).all():
                bad.append((i, "shape or non-finite", list(hs.shape)))
        for k, v in alone.items():
            if not torch.isfinite(v.float()).all():
                bad.append((k, "non-finite when sent alone", list(v.shape)))
        diffs = {k: (results[k][1]["hidden_states"].float() - v.float()).abs().max().item()
                 for k, v in alone.items() if results[k][0] == 200}
        m = get(url, "/metrics")
        info = json.loads(get(url, "/v1/info"))
        out = {
            "check": "oom", "gpu_free_gb_for_server": round(free_after / 2**30, 1), "gpu_total_gb": round(total / 2**30, 1),
            "requests": len(seqs), "tokens": sum(lens), "seconds": round(secs, 1), "statuses": statuses,
            "bad": bad[:5], "oom_retries_total": metric(m, "layertap_oom_retries_total"),
            "batch_budget_before": budget_before, "batch_budget_after": info["max_batch_tokens"],
            "batches": metric(m, "layertap_batch_tokens_count"), "alone_vs_loaded_max_abs": diffs,
        }
        print(json.dumps(out), flush=True)
        if bad or statuses != {200: len(seqs)} or out["oom_retries_total"] < 1:
            raise SystemExit("oom check failed: " + json.dumps({"bad": bad[:5], "statuses": statuses}))
    finally:
        server.terminate()
        server.wait(timeout=60)
        del hog


if __name__ == "__main__":
    main()
