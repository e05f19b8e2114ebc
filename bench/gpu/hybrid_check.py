#!/usr/bin/env python3
"""Hybrid and MoE fidelity at real widths on the GPU machine: layertap on CUDA against
transformers' pure-torch path (no fla, no causal_conv1d), f32 reference, every index.

Two random-weight checkpoints, 5 layers each ([linear, linear, linear, full, linear], so the
full-attention layer's output is an index of its own before the final norm) at the widths of the
real models (the depth does not change what each layer computes), stored in bf16:
- Qwen3.5/3.6-27B width: hidden 5120, GDN 16 key / 48 value heads of 128, attention 24 q / 4 kv
  heads of 256 (partial rotary 0.25), intermediate 17408;
- Qwen3.5/3.6-35B-A3B width: hidden 2048, GDN 16 / 32 heads of 128, attention 16 / 2 heads of
  256, 256 experts (top 8, intermediate 512) + a shared expert of 512.
Vocabulary 32,000 instead of 248,320 (only the embedding table's size changes).

Sequences of 1, 100, 810 and 4,096 tokens. transformers runs each sequence alone in f32 (TF32
off, eager attention, eager experts) and in bf16 (its own rounding, the yardstick); layertap runs
them packed in one batch (`layertap extract --device cuda:0`) in f32, in bf16, and in bf16 with
the Gated DeltaNet's chunk products kept f32 (`LAYERTAP_GDN_TF32=0`). Prints, per
model and compute dtype, the worst relative error ||ours - ref|| / ||ref|| over the sequences at
each index, with transformers' bf16 beside it; one JSON line per model at the end.

Usage (GPU machine, repository root): python3 bench/gpu/hybrid_check.py --bin .gpu/layertap --work /tmp/hyb
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: random_checkpoint
from random_checkpoint import hybrid_configs, random_model, save  # noqa: E402

assert importlib.util.find_spec("fla") is None, "fla is importable: transformers would use its kernels"
assert importlib.util.find_spec("causal_conv1d") is None, "causal_conv1d is importable"
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

LENGTHS = [1, 100, 810, 4096]
VOCAB = 32000


def configs():
    # 5 layers: [linear, linear, linear, full, linear]
    c = hybrid_configs(5, 5, VOCAB)
    return {"qwen3_5_27b_width": c["27b"], "qwen3_5_35b_a3b_width": c["moe"]}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def from_folder(cls, path, dtype):
    try:
        m = cls.from_pretrained(path, dtype=dtype, attn_implementation="eager", experts_implementation="eager")
    except TypeError:  # transformers without the experts_implementation switch
        m = cls.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return m.cuda().eval()


def hf_states(model, seqs):
    out = []
    with torch.no_grad():
        for ids in seqs:
            hs = model(input_ids=ids[None].cuda(), output_hidden_states=True, use_cache=False).hidden_states
            out.append(torch.stack(hs)[:, 0].float().cpu())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=".gpu/layertap")
    ap.add_argument("--work", default="/tmp/hybrid-check")
    ap.add_argument("--models", default="27b,35b", help="comma-separated: check the models whose names hold one")
    args = ap.parse_args()
    import transformers
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    summary = []
    for name, (cfg, cls_name) in configs().items():
        if not any(m in name for m in args.models.split(",")):
            continue
        cls = getattr(transformers, cls_name)
        path = os.path.join(args.work, name)
        cfg._attn_implementation = "eager"
        cfg._experts_implementation = "eager"
        # random init, values rounded to bf16 = what is stored
        model = random_model(cfg, cls, device="cuda", dtype=torch.bfloat16)
        save(model, path)
        del model
        # The f32 reference is loaded from the folder, as users load it: casting the bf16 model
        # with .float() would keep its bf16-rounded buffers (the rotary inverse frequencies).
        model = from_folder(cls, path, torch.float32)
        ref = hf_states(model, seqs)
        del model
        torch.cuda.empty_cache()
        half = from_folder(cls, path, torch.bfloat16)
        t0 = time.perf_counter()
        theirs16 = hf_states(half, seqs)
        hf_bf16_s = time.perf_counter() - t0
        del half
        torch.cuda.empty_cache()
        n = cfg.num_hidden_layers
        row = {"model": name, "layer_types": cfg.layer_types, "tokens": sum(LENGTHS)}
        hf16 = [max(rel(theirs16[s][i], ref[s][i]) for s in range(len(seqs))) for i in range(n + 1)]
        row["transformers_bf16"] = hf16
        # bf16 runs the Gated DeltaNet's chunk products on tensor cores (TF32); the last variant
        # keeps them f32 (LAYERTAP_GDN_TF32=0) to show what that rounding costs.
        for dtype, compute, env in [("f32", "f32", {}), ("bf16", "bf16", {}),
                                    ("bf16_f32_products", "bf16", {"LAYERTAP_GDN_TF32": "0"})]:
            out = os.path.join(args.work, f"{name}-{dtype}.safetensors")
            ids = ";".join(",".join(str(int(x)) for x in s) for s in seqs)
            t0 = time.perf_counter()
            subprocess.run([args.bin, "extract", "--model", path, "--device", "cuda:0", "--dtype", compute,
                            "--out-dtype", "f32", "--layers", ",".join(str(i) for i in range(n + 1)),
                            "--input-ids", ids, "--out", out], check=True, env={**os.environ, **env})
            wall = time.perf_counter() - t0
            got = load_file(out)
            hs, cu = got["hidden_states"], got["cu_seqlens"].tolist()
            per_seq = [[rel(hs[cu[s]:cu[s + 1], i], ref[s][i]) for i in range(n + 1)] for s in range(len(seqs))]
            errs = [max(p[i] for p in per_seq) for i in range(n + 1)]
            row[f"layertap_{dtype}"] = errs
            row[f"layertap_{dtype}_per_sequence"] = {str(LENGTHS[s]): per_seq[s] for s in range(len(seqs))}
            for s in range(len(seqs)):
                print(f"  {dtype} T={LENGTHS[s]}: " + " ".join(f"{e:.1e}" for e in per_seq[s]))
            # Where the worst index's error sits: per-token relative error, the largest few.
            worst = max(range(n + 1), key=lambda i: errs[i])
            s = max(range(len(seqs)), key=lambda s: per_seq[s][worst])
            a, b = hs[cu[s]:cu[s + 1], worst].double(), ref[s][worst].double()
            tok = ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30))
            top = torch.topk(tok, min(5, tok.numel()))
            print(f"  {dtype} worst index {worst}, T={LENGTHS[s]}: per-token errors, largest "
                  + ", ".join(f"row {int(r)}: {v:.1e}" for v, r in zip(top.values.tolist(), top.indices.tolist()))
                  + f"; median {tok.median().item():.1e}")
            row[f"layertap_{dtype}_extract_wall_s"] = round(wall, 2)
            print(f"{name} layertap {dtype}: " + " ".join(f"{e:.1e}" for e in errs)
                  + f"   (transformers bf16: " + " ".join(f"{e:.1e}" for e in hf16) + f")", flush=True)
        row["transformers_bf16_wall_s"] = round(hf_bf16_s, 2)
        summary.append(row)
    for row in summary:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
