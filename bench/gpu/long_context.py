#!/usr/bin/env python3
"""Long-context check: one sequence of T tokens through `layertap serve`, against transformers.

Two cases, random weights (transformers' own initialisation, seed 0, bf16), built on the device
and saved with save_pretrained; fewer layers than the real models (the depth does not change what
one layer computes at a given length, and both sides run the same layers):

- `dense`: the Qwen3-8B shape (hidden 4096, intermediate 12288, 32 q / 8 kv heads of 128, rope
  theta 1e6, vocabulary 151936), 4 layers, T = 131,072;
- `hybrid`: the Qwen3.5/3.6-27B width (hidden 5120, intermediate 17408, gated attention 24 q / 4
  kv heads of 256 with partial rotary 0.25 and rope theta 1e7, Gated DeltaNet 16 key / 48 value
  heads of 128, vocabulary 248320), 4 layers [linear, linear, linear, full], T = 262,144.
  (`tiny-dense` and `tiny-hybrid` are the same code at toy sizes, for a check on the CPU.)

Per case: random ids (seed --seed), one request of `input_ids` with `tokens` picking --rows rows
at the start, the middle and the end, and the layers 1, L/2, L-1, "final_prenorm" and -1
(accept-encoding identity, a safetensors answer). The reference is transformers in the same
dtype on the same device (`attn_implementation="sdpa"`, the pure-torch Gated DeltaNet, no cache),
one forward pass of the whole sequence with forward hooks that keep only the selected rows of the
asked layers (index i = output of decoder layer i, L = the final norm's output, final_prenorm =
the last decoder layer's output). Per layer and row group: ||a - b|| / ||b|| and the largest
absolute difference (float64 math on the bf16 values), a row's worst relative error.

Also reported: the request's wall time (and the server's x-inference-time), the device memory
the batch took (device-wide used memory polled every --poll-ms from the server's /metrics and
from nvidia-smi before and during the request: the peak minus the idle figure after load and a
short warm-up request), transformers' forward time and its peak allocated memory.

Memory of transformers' Gated DeltaNet at T = 262,144: its torch_chunk_gated_delta_rule casts
q, k, v to f32 and keeps about ten [48 heads, T, 128] f32 tensors of 6.4 GB and three
[48, T/64, 64, 64] f32 chunk matrices of 3.2 GB alive at once, about 75 GB, plus about 20 GB of
bf16 projections around it, one layer at a time (measured on an H200: 96 GiB peak allocated,
6.8 s for the four layers). That fits, so all four layers are compared. Its sequential part is
one small loop step per 64-token chunk (4,096 steps). `--hf-layers N` runs the reference on the
first N layers only (transformers' own code, fewer layers) should a smaller device need it; the
indices past N are then reported as not compared.

Order per case: build and save the model, the transformers pass (the model still in memory),
free the device, start the server, warm-up, idle memory, the request, stop the server, compare.

One JSON line per case, layer and row group on stdout, then one summary line per case; a
readable summary on stderr. Exits 1 when a relative error is over --tolerance, when the server
refuses a request (its status and body are printed) or when the server does not start.

Usage (GPU machine, repository root, after `source bench/gpu/cuda-libs.sh`):
  python3 bench/gpu/long_context.py --bin .gpu/layertap [--case dense,hybrid] [--tolerance 0.05]
On the CPU against a CPU build: --bin target/debug/layertap --device cpu --case tiny
"""

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: random_checkpoint
from random_checkpoint import QWEN3_5_27B_WIDTH, base_parameters, hybrid_layer_types, random_model, save  # noqa: E402,E501


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the cases

def dense_config(layers, tokens, tiny):
    from transformers import Qwen3Config

    if tiny:
        shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, vocab_size=1000)
    else:
        shape = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936)
    return Qwen3Config(num_hidden_layers=layers, max_position_embeddings=max(131072, tokens),
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, **shape), "Qwen3ForCausalLM"


def hybrid_config(layers, tokens, tiny):
    from transformers import Qwen3_5TextConfig

    if tiny:
        shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                     linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=1000)
    else:
        shape = dict(QWEN3_5_27B_WIDTH, vocab_size=248320)
    # Full attention every 4th layer, as in the real model; 4 layers = 3 Gated DeltaNet + 1 attention.
    return Qwen3_5TextConfig(num_hidden_layers=layers, max_position_embeddings=max(262144, tokens),
                             rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
                             layer_types=hybrid_layer_types(layers), tie_word_embeddings=True, **shape), \
        "Qwen3_5ForCausalLM"


# name: (config builder, tokens, layers, tiny)
CASES = {
    "dense": (dense_config, 131072, 4, False),
    "hybrid": (hybrid_config, 262144, 4, False),
    "tiny-dense": (dense_config, 1000, 4, True),
    "tiny-hybrid": (hybrid_config, 1000, 4, True),
}


def build(cfg, cls_name, path, device, dtype):
    """The random model on `device` in `dtype` (transformers' init, seed 0), saved to `path`.

    Built with from_config(dtype=...), as from_pretrained(dtype=...) would build it: buffers that
    transformers computes in f32 (the rotary inverse frequencies) stay f32."""
    t0 = time.perf_counter()
    model = random_model(cfg, cls_name, device=device, dtype=dtype, from_config=True, attn_implementation="sdpa")
    model.eval()
    built = time.perf_counter() - t0
    if os.path.exists(path):
        shutil.rmtree(path)
    t0 = time.perf_counter()
    save(model, path, max_shard_size="5GB")
    saved = time.perf_counter() - t0
    inv = getattr(model.model.rotary_emb, "inv_freq", None)
    if inv is not None and inv.dtype != torch.float32:
        raise SystemExit(f"the rotary inverse frequencies are {inv.dtype}, not float32: the reference would be off")
    return model, {"build_s": round(built, 2), "save_s": round(saved, 2),
                   "base_parameters": base_parameters(model)}


def row_groups(t, rows):
    mid = t // 2 - rows // 2
    groups = [("start", 0, rows), ("middle", mid, mid + rows), ("end", t - rows, t)]
    for (_, a, b), (_, c, _) in zip(groups, groups[1:]):
        if b > c:
            raise SystemExit(f"--rows {rows} is too many for {t} tokens: the row groups overlap")
    return groups


def asked_layers(n):
    """HF indices 1, L/2, L-1 (each once), then final_prenorm and -1 (= L)."""
    idx = sorted({i for i in (1, n // 2, n - 1) if 1 <= i < n})
    return idx + ["final_prenorm", -1]


# ----------------------------------------------------------------------------- transformers

def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def hf_rows(model, ids, idx, layers, device, hf_layers):
    """Selected rows of the asked layers, from hooks; (rows by layer name, seconds, memory)."""
    base = model.model
    n = len(base.layers)
    kept, handles = {}, []

    def keep(name):
        def hook(_mod, _inp, out):
            o = out[0] if isinstance(out, tuple) else out
            kept[name] = o[0].index_select(0, idx).float().cpu()
        return hook

    cuda = device.startswith("cuda")
    with torch.inference_mode():
        # Warm-up (kernels, libraries) on a short prefix, before the hooks are in place.
        base(input_ids=ids[None, :256], use_cache=False)
    sync(device)
    for lay in layers:
        name = str(lay)
        if lay == "final_prenorm":
            mod = base.layers[n - 1]
        elif lay == -1 or lay == n:
            mod = base.norm
        elif lay == 0:
            mod = base.embed_tokens
        else:
            mod = base.layers[lay - 1]
        handles.append(mod.register_forward_hook(keep(name)))
    if hf_layers < n:
        # transformers' own forward with its decoder stack cut to the first hf_layers layers.
        base.layers = base.layers[:hf_layers]
        base.config.num_hidden_layers = hf_layers
    try:
        with torch.inference_mode():
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            base(input_ids=ids[None], use_cache=False)
            sync(device)
            secs = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    mem = None
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        mem = {"hf_peak_allocated_bytes": peak, "hf_peak_above_weights_bytes": peak - before}
    return kept, secs, mem


# ----------------------------------------------------------------------------- the server

class Server:
    def __init__(self, args, model_dir, tokens, log_path):
        self.url = f"http://127.0.0.1:{args.port}"
        cmd = [args.bin, "serve", "--model", model_dir, "--device", args.device, "--dtype", args.dtype,
               "--host", "127.0.0.1", "--port", str(args.port)]
        if not args.default_limits:
            cmd += ["--max-input-tokens", str(tokens), "--max-request-tokens", str(tokens),
                    "--max-queue-tokens", str(tokens), "--max-batch-tokens", str(tokens),
                    "--max-answer-bytes", str(args.max_answer_bytes), "--max-body-bytes", str(64 << 20),
                    "--request-timeout", str(args.request_timeout)]
        self.log_path = log_path
        self.log = open(log_path, "w")
        log("  server: " + " ".join(cmd))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before it was ready:\n"
                                   + self.log_tail())
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the server was not ready within {timeout} s:\n" + self.log_tail())

    def log_tail(self, n=30):
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Refused(Exception):
    pass


def post(url, body, timeout):
    """POST JSON; (status, headers, bytes). Raises Refused with the body on a non-200 answer."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/hidden-states", data=data, method="POST", headers={
        "content-type": "application/json", "accept-encoding": "identity"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        raise Refused(f"HTTP {e.code}: {e.read().decode(errors='replace')}") from None


def metrics_memory(url, device):
    """layertap_device_memory_used_bytes for `device` from /metrics (None if absent)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=2) as r:
            text = r.read().decode()
    except (urllib.error.URLError, ConnectionError, OSError):
        return None
    for line in text.splitlines():
        if line.startswith("layertap_device_memory_used_bytes{") and f'device="{device}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def smi_memory(gpu):
    """nvidia-smi's memory.used of GPU `gpu`, in bytes (None where there is no nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                              str(gpu)], capture_output=True, text=True, timeout=5)
        return float(out.stdout.strip().splitlines()[0]) * 2**20 if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError, ValueError):
        return None


class Poller(threading.Thread):
    """Samples the server's and nvidia-smi's device memory every `every` seconds until stopped."""

    def __init__(self, url, device, every):
        super().__init__(daemon=True)
        self.url, self.device, self.every = url, device, every
        self.gpu = int(device.split(":")[1]) if device.startswith("cuda:") else None
        self.metrics, self.smi = [], []
        self.halt = threading.Event()

    def sample(self):
        m = metrics_memory(self.url, self.device)
        if m is not None:
            self.metrics.append(m)
        if self.gpu is not None:
            s = smi_memory(self.gpu)
            if s is not None:
                self.smi.append(s)

    def run(self):
        while not self.halt.is_set():
            self.sample()
            self.halt.wait(self.every)

    def stop(self):
        self.halt.set()
        self.join()
        self.sample()


def idle_memory(url, device, samples=6, every=0.1):
    p = Poller(url, device, every)
    for _ in range(samples):
        p.sample()
        time.sleep(every)
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return med(p.metrics), med(p.smi)


# ----------------------------------------------------------------------------- one case

def compare(ours, ref):
    a, b = ours.double(), ref.double()
    d = a - b
    rows = d.norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)
    return {"rel_err": (d.norm() / b.norm().clamp_min(1e-30)).item(), "max_abs_diff": d.abs().max().item(),
            "worst_row_rel_err": rows.max().item(), "ref_rms": (b.norm() / math.sqrt(b.numel())).item()}


def run_case(name, args):
    builder, default_t, default_layers, tiny = CASES[name]
    t = args.tokens or default_t
    n = args.layers or default_layers
    cfg, cls_name = builder(n, t, tiny)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    answer_dtype = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}[args.dtype]
    path = os.path.join(args.work, name)
    groups = row_groups(t, args.rows)
    layers = asked_layers(n)
    hf_layers = min(args.hf_layers or n, n)
    summary = {"test": "long_context", "case": name, "architecture": cls_name, "num_layers": n,
               "layer_types": list(getattr(cfg, "layer_types", None) or []), "tokens": t,
               "hidden_size": cfg.hidden_size, "layers": layers, "dtype": args.dtype, "device": args.device,
               "row_groups": {g: [a, b] for g, a, b in groups}, "tolerance": args.tolerance,
               "hf_layers": hf_layers}
    log(f"== {name}: {cls_name}, {n} layers {summary['layer_types'] or ''}, hidden {cfg.hidden_size}, "
        f"T = {t:,}, layers {layers}, {args.dtype} on {args.device}")

    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.vocab_size, (t,), generator=g)
    idx_cpu = torch.cat([torch.arange(a, b) for _, a, b in groups])

    model, info = build(cfg, cls_name, path, args.device, dtype)
    summary.update(info)
    log(f"  built in {info['build_s']} s, saved in {info['save_s']} s ({info['base_parameters'] / 1e9:.2f}B "
        f"base parameters)")

    # transformers first, while the model is in memory; then the device is freed for the server.
    failures = []
    try:
        ref, hf_s, hf_mem = hf_rows(model, ids.to(args.device), idx_cpu.to(args.device), layers, args.device,
                                    hf_layers)
        summary["hf_forward_s"] = round(hf_s, 3)
        if hf_mem:
            summary.update(hf_mem)
        log(f"  transformers: {hf_s:.2f} s" + (
            f", peak allocated {hf_mem['hf_peak_allocated_bytes'] / 2**30:.1f} GiB "
            f"({hf_mem['hf_peak_above_weights_bytes'] / 2**30:.1f} above the weights)" if hf_mem else ""))
    except torch.OutOfMemoryError as e:
        # The server still runs, for its time and memory; nothing is compared.
        ref = None
        msg = str(e).splitlines()[0]
        log(f"  FAIL: transformers ran out of device memory ({msg}); --hf-layers N runs fewer of its layers")
        failures.append(f"{name}: transformers ran out of device memory: {msg}")
        summary["hf_error"] = msg
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    server = Server(args, path, t, os.path.join(args.log_dir or args.work, f"server-long-{name}.log"))
    try:
        summary["server_ready_s"] = round(server.wait_ready(args.ready_timeout), 2)
        tokens_sel = [[[a, b] for _, a, b in groups]]
        body = {"inputs": [{"input_ids": ids.tolist()}], "layers": layers, "dtype": answer_dtype,
                "tokens": tokens_sel}
        # A short warm-up request (kernels, libraries, buffers), then the idle figure.
        post(server.url, {"inputs": [{"input_ids": ids[:256].tolist()}], "layers": layers, "dtype": answer_dtype},
             args.request_timeout + 60)
        time.sleep(0.5)
        idle_m, idle_s = idle_memory(server.url, args.device)
        poller = Poller(server.url, args.device, args.poll_ms / 1000)
        poller.start()
        t0 = time.perf_counter()
        try:
            _, headers, raw = post(server.url, body, args.request_timeout + 60)
        finally:
            wall = time.perf_counter() - t0
            poller.stop()
        summary["layertap_wall_s"] = round(wall, 3)
        hdr = {k.lower(): v for k, v in headers.items()}
        summary["layertap_inference_ms"] = float(hdr["x-inference-time"]) if "x-inference-time" in hdr else None
        summary["layertap_queue_ms"] = float(hdr["x-queue-time"]) if "x-queue-time" in hdr else None
        summary["answer_bytes"] = len(raw)
        summary["memory_samples"] = {"metrics": len(poller.metrics), "nvidia_smi": len(poller.smi)}
        if idle_m is not None and poller.metrics:
            summary["server_idle_memory_bytes"] = int(idle_m)
            summary["batch_memory_bytes_metrics"] = int(max(poller.metrics) - idle_m)
        if idle_s is not None and poller.smi:
            summary["gpu_idle_memory_bytes_nvidia_smi"] = int(idle_s)
            summary["batch_memory_bytes_nvidia_smi"] = int(max(poller.smi) - idle_s)
    except Refused as e:
        log(f"  FAIL: the server refused the request: {e}")
        failures.append(f"{name}: the server refused the request: {e}")
        summary["refused"] = str(e)
        raw = None
    except RuntimeError as e:
        log(f"  FAIL: {e}")
        failures.append(f"{name}: {e}")
        summary["server_error"] = str(e).splitlines()[0]
        raw = None
    finally:
        server.stop()
    if not args.keep:
        shutil.rmtree(path, ignore_errors=True)
    if raw is None or ref is None:
        summary["passed"] = False
        return [], summary, failures

    from safetensors.torch import load

    ans = load(raw)
    hs = ans["hidden_states"]
    pos = ans["positions"]
    if pos.tolist() != idx_cpu.tolist():
        failures.append(f"{name}: the answer's positions are not the rows asked")
    if ans["input_ids"].tolist() != ids[idx_cpu].tolist():
        failures.append(f"{name}: the answer's input_ids are not the ids at the rows asked")
    if tuple(hs.shape) != (len(idx_cpu), len(layers), cfg.hidden_size):
        failures.append(f"{name}: hidden_states has shape {tuple(hs.shape)}")
        summary["passed"] = False
        return [], summary, failures

    lines, worst = [], 0.0
    row = 0
    offsets = {}
    for gname, a, b in groups:
        offsets[gname] = (row, row + b - a)
        row += b - a
    for j, lay in enumerate(layers):
        resolved = n if lay == -1 else lay
        for gname, a, b in groups:
            line = {"test": "long_context", "case": name, "tokens": t, "layer": lay, "group": gname, "rows": [a, b]}
            r = ref.get(str(lay))
            covered = hf_layers == n or (lay not in (-1, "final_prenorm") and resolved <= hf_layers)
            if r is None or not covered:
                line["compared"] = False
                line["why"] = f"the reference ran {hf_layers} of {n} layers"
                lines.append(line)
                continue
            lo, hi = offsets[gname]
            c = compare(hs[lo:hi, j].float(), r[lo:hi])
            line.update({k: float(f"{v:.6g}") for k, v in c.items()})
            line["ok"] = c["rel_err"] <= args.tolerance
            worst = max(worst, c["rel_err"])
            if not line["ok"]:
                failures.append(f"{name}: layer {lay}, {gname} rows {a}..{b}: relative error {c['rel_err']:.4g} "
                                f"> {args.tolerance}")
            lines.append(line)
    summary["worst_rel_err"] = float(f"{worst:.6g}")
    summary["passed"] = not failures
    return lines, summary, failures


def fmt_bytes(x):
    return "-" if x is None else f"{x / 2**30:.2f} GiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=".gpu/layertap", help="the layertap binary")
    ap.add_argument("--case", default="dense,hybrid",
                    help="comma-separated: dense, hybrid, tiny-dense, tiny-hybrid; tiny = both tiny cases")
    ap.add_argument("--device", default="cuda:0", help="cuda:N or cpu (both sides run there)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"], help="compute and answer dtype")
    ap.add_argument("--tokens", type=int, default=0, help="sequence length instead of the case's")
    ap.add_argument("--layers", type=int, default=0, help="number of decoder layers instead of the case's (4)")
    ap.add_argument("--hf-layers", type=int, default=0,
                    help="run transformers on the first N layers only (indices past N are not compared)")
    ap.add_argument("--rows", type=int, default=64, help="rows per group (start, middle, end)")
    ap.add_argument("--tolerance", type=float, default=0.05, help="largest relative error that passes")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random ids")
    ap.add_argument("--work", default="/tmp/layertap-long", help="where the models and server logs go")
    ap.add_argument("--log-dir", default="", help="where the server logs go (default: --work)")
    ap.add_argument("--port", type=int, default=18090)
    ap.add_argument("--poll-ms", type=float, default=50, help="memory polling interval during the request")
    ap.add_argument("--ready-timeout", type=float, default=300, help="seconds for the server to load")
    ap.add_argument("--request-timeout", type=int, default=900, help="the server's --request-timeout and ours")
    ap.add_argument("--max-answer-bytes", type=int, default=2 << 30)
    ap.add_argument("--default-limits", action="store_true",
                    help="start the server with its default limits and batch budget (on CUDA the longest input "
                         "is the model's context, which these configs set to at least T) instead of raising each")
    ap.add_argument("--keep", action="store_true", help="keep the saved models")
    args = ap.parse_args()

    names = []
    for c in args.case.split(","):
        c = c.strip()
        names += ["tiny-dense", "tiny-hybrid"] if c == "tiny" else [c]
    for c in names:
        if c not in CASES:
            raise SystemExit(f"unknown case {c!r}; one of {', '.join(CASES)} or tiny")
    if not os.access(args.bin, os.X_OK):
        raise SystemExit(f"{args.bin} is not an executable layertap binary")
    os.makedirs(args.work, exist_ok=True)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    all_failures, summaries = [], []
    t_all = time.perf_counter()
    for c in names:
        t0 = time.perf_counter()
        lines, summary, failures = run_case(c, args)
        summary["case_wall_s"] = round(time.perf_counter() - t0, 1)
        for line in lines:
            print(json.dumps(line), flush=True)
        print(json.dumps(summary), flush=True)
        summaries.append((summary, lines))
        all_failures += failures
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    log("")
    log("long-context check: layertap vs transformers, relative error ||a-b||/||b|| per layer and row group")
    for s, lines in summaries:
        log(f"{s['case']}: {s['architecture']} {s['num_layers']} layers, T = {s['tokens']:,}, {s['dtype']} on "
            f"{s['device']}  ({s['case_wall_s']} s in all)")
        by_layer = {}
        for line in lines:
            by_layer.setdefault(str(line["layer"]), []).append(line)
        for lay, ls in by_layer.items():
            cells = []
            for line in ls:
                if line.get("compared") is False:
                    cells.append(f"{line['group']:>6} (not compared)")
                else:
                    cells.append(f"{line['group']:>6} {line['rel_err']:.2e} (max |d| {line['max_abs_diff']:.3g})")
            log(f"  layer {lay:>13}: " + "   ".join(cells))
        if "layertap_wall_s" in s:
            log(f"  layertap: {s['layertap_wall_s']:.2f} s wall ({s['layertap_inference_ms']:.0f} ms inference), "
                f"batch memory {fmt_bytes(s.get('batch_memory_bytes_metrics'))} (/metrics), "
                f"{fmt_bytes(s.get('batch_memory_bytes_nvidia_smi'))} (nvidia-smi)")
        log(f"  transformers: {s.get('hf_forward_s', '-')} s, peak allocated "
            f"{fmt_bytes(s.get('hf_peak_allocated_bytes'))} "
            f"({fmt_bytes(s.get('hf_peak_above_weights_bytes'))} above the weights)")
        log(f"  worst relative error {s.get('worst_rel_err', '-')} (tolerance {s['tolerance']}): "
            + ("PASS" if s["passed"] else "FAIL"))
    log(f"total {time.perf_counter() - t_all:.1f} s")
    if all_failures:
        log("FAILED:")
        for f in all_failures:
            log("  " + f)
        sys.exit(1)


if __name__ == "__main__":
    main()
