#!/usr/bin/env python3
"""FP8 against bf16 on the GPU, every contender in one run: the engine on a bf16 checkpoint and on
its block-wise FP8 quantisation (Qwen's FP8 release layout), alternating, plus the bf16 and FP8
matmul rates of this GPU on the model's own projection shapes.

- The bf16 checkpoint is the Qwen3-8B shape with random weights (bench/gpu/prepare.py; speed does
  not depend on the values). The FP8 one is made from it here: every decoder projection quantised
  in 128 x 128 blocks (scale = amax / 448, stored as `weight_scale_inv` in float32, weights
  float8_e4m3fn), embeddings, norms and lm_head kept in bf16, and config.json's
  `quantization_config` as Qwen's releases write it.
- The workload: bench/gpu/prepare.py's (log-normal lengths 100..4096 around 800, random ids, taps
  [2, 10, 19, 27, 34]), its first `--sequences` sequences.
- The rates: torch matmul (bf16) and torch._scaled_mm (e4m3 x e4m3 -> bf16, per-tensor scales)
  on [tokens, K] x [K, N] for the model's projection shapes, CUDA events, the best of a few runs.
- MFU counts the decoder's matmul parameters (no embeddings, no lm_head).
- Fidelity (`--fidelity`): on a few sequences, every tapped index of layertap FP8 on the GPU
  against layertap FP8 on the CPU in f32 (the W8A8 reference path, exact against transformers on
  the fixtures), next to layertap bf16 on the GPU against layertap f32 on the CPU for the bf16
  checkpoint; both at 4 layers of the real widths.

Usage (GPU machine, repository root, CUDA build in .gpu/):
  source bench/gpu/cuda-libs.sh
  python3 bench/gpu/fp8_bench.py --bin .gpu/layertap --rounds 2 | tee -a bench/gpu/results/DATE-fp8.jsonl
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prepare import QWEN3_8B, make_model, make_workload  # noqa: E402

# 27b: the hybrid's checkpoint and workload come from prepare_hybrid.py, run as a script.

# The projections Qwen's FP8 releases quantise: attention and MLP, and the Gated DeltaNet's
# in_proj_qkv, in_proj_z and out_proj (in_proj_a / in_proj_b stay bf16).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
               "in_proj_z", "out_proj")
# The Qwen3.5/3.6-27B projection shapes (K, N) for the matmul rates.
SHAPES_27B = {"in_proj_qkv": (5120, 10240), "in_proj_z": (5120, 6144), "out_proj": (6144, 5120),
              "q_proj_gated": (5120, 12288), "gate_up": (5120, 34816), "down": (17408, 5120)}
BLOCK = 128
FP8_MAX = 448.0


def log(**kv):
    print(json.dumps(kv), flush=True)


def quantise_checkpoint(src, dst, device="cuda"):
    """The FP8 release layout of the bf16 checkpoint at `src`, written to `dst` (quantised on `device`)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if os.path.exists(os.path.join(dst, "config.json")):
        return
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": ["lm_head"],
    }
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    weight_map = {}
    shards = sorted(p for p in os.listdir(src) if p.endswith(".safetensors"))
    for shard in shards:
        out = {}
        with safe_open(os.path.join(src, shard), "pt", device=device) as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS and ".layers." in name:
                    n, k = t.shape
                    b = t.float().reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
                    scale = (b.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
                    q = (b / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
                    out[name] = q.reshape(n, k).contiguous()
                    out[name + "_scale_inv"] = scale.contiguous()
                else:
                    out[name] = t.contiguous()
        save_file({k: v.cpu() for k, v in out.items()}, os.path.join(dst, shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in out})
        del out
        if device == "cuda":
            torch.cuda.empty_cache()
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    for extra in ("generation_config.json", "params.json"):
        p = os.path.join(src, extra)
        if os.path.exists(p):
            with open(p) as a, open(os.path.join(dst, extra), "w") as b:
                b.write(a.read())


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e) / 1000 / reps)
    return best


def dense_shapes(shape):
    h, i = shape["hidden_size"], shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * i), "down": (i, h)}


def matmul_rates(shapes, m=8192):
    """bf16 and FP8 TFLOP/s on [m, K] x [K, N] for each projection shape (K, N) of the model."""
    out = {}
    for name, (k, n) in shapes.items():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        flops = 2 * m * k * n
        bf16 = flops / timed(lambda: a @ b.t()) / 1e12
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        fp8 = flops / timed(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                      out_dtype=torch.bfloat16)) / 1e12
        out[name] = {"k": k, "n": n, "bf16_tflops": round(bf16, 1), "fp8_tflops": round(fp8, 1)}
        out[name].update(blockwise_rate(a8, b8, m, k, n, flops))
    return out


def blockwise_rate(a8, b8, m, k, n, flops):
    """torch._scaled_mm with the scaling layertap's FP8 GEMMs use (1 x 128 activation scales,
    128 x 128 weight scales): its TFLOP/s, or why it did not run. The scales' memory layout that
    torch accepts differs between versions, so each is tried."""
    kb, nb = k // 128, n // 128
    layouts = {
        "a outer-major, b outer-major": (torch.ones(kb, m, device="cuda").t(), torch.ones(nb, kb, device="cuda").t()),
        "a outer-major, b row-major": (torch.ones(kb, m, device="cuda").t(), torch.ones(kb, nb, device="cuda")),
        "both row-major": (torch.ones(m, kb, device="cuda"), torch.ones(kb, nb, device="cuda")),
    }
    errors = []
    for label, (sa, sb) in layouts.items():
        try:
            f = lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
            f()
            torch.cuda.synchronize()
            return {"fp8_block_tflops": round(flops / timed(f) / 1e12, 1), "fp8_block_layout": label}
        except Exception as e:  # noqa: BLE001 - recorded, not hidden
            errors.append(f"{label}: {str(e).splitlines()[0][:200]}")
    return {"fp8_block_tflops": None, "fp8_block_errors": errors}


def matmul_params(shape):
    h, i, l = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    return l * (h * (q + 2 * kv) + q * h + 3 * h * i)


def engine(binary, model, workload, mbt, label, profile=False):
    cmd = [binary, "bench", "--workload", workload, "--model", model, "--device", "cuda:0", "--dtype", "bf16",
           "--max-batch-tokens", str(mbt)]
    t0 = time.time()
    env = dict(os.environ, LAYERTAP_PROFILE="1") if profile else None
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{label}: {' '.join(cmd)} failed:\n{r.stderr[-4000:]}")
    line = json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1])
    line.update({"checkpoint": label, "wall_s": round(time.time() - t0, 1)})
    fp8_log = [x for x in r.stderr.splitlines() if "FP8 projections" in x]
    if fp8_log:
        line["fp8_log"] = fp8_log[-1][-300:]
    return line


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=".gpu/layertap")
    ap.add_argument("--work", default="/tmp/layertap-fp8")
    ap.add_argument("--sequences", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-batch-tokens", type=int, default=32768)
    ap.add_argument("--prepare-only", action="store_true", help="make the checkpoints and the workload, then stop")
    ap.add_argument("--rates-only", action="store_true", help="prepare, measure the matmul rates, then stop")
    ap.add_argument("--shape", choices=["8b", "27b"], default="8b",
                    help="8b: the Qwen3-8B shape; 27b: the Qwen3.5/3.6-27B hybrid width, --layers layers "
                         "(bench/gpu/prepare_hybrid.py, taps spread as DFlash spreads them)")
    ap.add_argument("--layers", type=int, default=16, help="27b: decoder layers")
    ap.add_argument("--profile", action="store_true", help="one more run of each checkpoint with LAYERTAP_PROFILE=1")
    ap.add_argument("--quantise", nargs=2, metavar=("BF16_DIR", "FP8_DIR"),
                    help="only write the FP8 release layout of the bf16 checkpoint BF16_DIR to FP8_DIR")
    a = ap.parse_args()
    if a.quantise:
        t0 = time.time()
        quantise_checkpoint(*a.quantise)
        log(step="quantise", src=a.quantise[0], dst=a.quantise[1], seconds=round(time.time() - t0, 1))
        return
    os.makedirs(a.work, exist_ok=True)
    t0 = time.time()
    if a.shape == "8b":
        bf16_dir, fp8_dir = os.path.join(a.work, "qwen3-8b-bf16"), os.path.join(a.work, "qwen3-8b-fp8")
        make_model(bf16_dir)
        w = make_workload(a.work, n=a.sequences)
        workload = os.path.join(a.work, "workload_gpu.json")
        params, shapes = matmul_params(QWEN3_8B), dense_shapes(QWEN3_8B)
    else:
        hyb = os.path.join(a.work, "hybrid")
        r = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "prepare_hybrid.py"),
                            "--work", hyb, "--models", "27b", "--dense-layers", str(a.layers),
                            "--sequences", str(a.sequences), "--bf16-init"], capture_output=True, text=True, check=True)
        w = json.loads(r.stdout.strip().splitlines()[-1])
        bf16_dir, fp8_dir = os.path.join(hyb, "27b"), os.path.join(hyb, "27b-fp8")
        workload = os.path.join(hyb, "workload_27b.json")
        params, shapes = w["27b"]["matmul_parameters"], SHAPES_27B
    quantise_checkpoint(bf16_dir, fp8_dir)
    log(step="prepare", shape=a.shape, seconds=round(time.time() - t0, 1), workload=w,
        gpu=torch.cuda.get_device_name(0), torch=torch.__version__, matmul_params=params)
    if a.prepare_only:
        return
    rates = matmul_rates(shapes)
    log(step="matmul_rates", tokens=8192, shapes=rates)
    if a.rates_only:
        return
    bf16_rate = sum(r["bf16_tflops"] for r in rates.values()) / len(rates)
    fp8_rate = sum(r["fp8_tflops"] for r in rates.values()) / len(rates)
    for rnd in range(a.rounds):
        for label, model in (("bf16", bf16_dir), ("fp8", fp8_dir)):
            line = engine(a.bin, model, workload, a.max_batch_tokens, label)
            tps = line["tokens_per_s"]
            line.update({"round": rnd, "mfu_vs_bf16_rate": round(2 * params * tps / 1e12 / bf16_rate, 3),
                         "mfu_vs_fp8_rate": round(2 * params * tps / 1e12 / fp8_rate, 3)})
            log(step="engine", shape=a.shape, **line)
    if a.profile:
        for label, model in (("bf16", bf16_dir), ("fp8", fp8_dir)):
            line = engine(a.bin, model, workload, a.max_batch_tokens, label, profile=True)
            log(step="engine-profile", shape=a.shape, **line)


if __name__ == "__main__":
    main()
