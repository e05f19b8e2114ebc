#!/usr/bin/env python3
"""A model folder for `layertap --synthetic-weights`: the config.json of a real shape and the
manifest (synthetic-weights.json: every tensor's name, dtype and shape, the layout of a
safetensors header without offsets) of its checkpoint, bf16 as transformers saves it or in the
layout of Qwen's block-wise FP8 releases (--fp8). layertap draws the values itself (see
src/engine/synthetic.rs), so a shape whose checkpoint is larger than this machine's disk and memory
(Qwen3.5-122B-A10B: ~125 GB in FP8) loads at its real size. Speed does not depend on the weights'
values.

The names and shapes come from transformers' own model of the config, built on the meta device (no
memory). The FP8 layout, as Qwen's releases (Qwen3.6-27B-FP8, Qwen3.6-35B-A3B-FP8,
Qwen3.5-122B-A10B-FP8): the attention, MLP and shared-expert projections and the Gated DeltaNet's
in_proj_qkv, in_proj_z and out_proj are F8_E4M3 with a `weight_scale_inv` of 128 x 128 blocks; the
routed experts are written one module per expert (`mlp.experts.{e}.{gate,up,down}_proj`);
embeddings, norms, conv1d, A_log, dt_bias, in_proj_a / in_proj_b, the router and
shared_expert_gate, and lm_head stay bf16.

Shapes (the published configs' text models; vocabulary 248,320, untied lm_head, full attention every
4th layer, rope theta 1e7 on a quarter of each head):
  27b        Qwen3.5/3.6-27B: 64 layers, hidden 5120, intermediate 17408
  35b-a3b    Qwen3.5/3.6-35B-A3B: 40 layers, hidden 2048, 256 experts top 8 of 512, shared 512
  122b-a10b  Qwen3.5-122B-A10B: 48 layers, hidden 3072, attention 32 / 2 heads of 256, GDN 16 / 64
             heads of 128, 256 experts top 8 of 1024, shared 1024

Also writes bench.json (layers, taps, matmul parameters of the layers up to the deepest tap, the
experts counted top-k of E, as prepare_hybrid.py counts them) and, with --sequences, the workload
(workload.jsonl and workload.json: log-normal lengths 100..4,096 around 800, seed 0, random ids).

Usage: python3 bench/gpu/synthetic_manifest.py --shape 122b-a10b --fp8 --out /tmp/w/122b-fp8 \
         [--layers N] [--taps 2,13,25,37,47] [--sequences 300] [--scale-dtype bf16]
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from random_checkpoint import QWEN3_5_27B_WIDTH, QWEN3_5_35B_A3B_WIDTH, hybrid_layer_types, model_class  # noqa: E402

QWEN3_5_122B_A10B_WIDTH = dict(
    hidden_size=3072, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024,
    shared_expert_intermediate_size=1024,
)
SHAPES = {
    "27b": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", QWEN3_5_27B_WIDTH, 64),
    "35b-a3b": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", QWEN3_5_35B_A3B_WIDTH, 40),
    "122b-a10b": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", QWEN3_5_122B_A10B_WIDTH, 48),
}
VOCAB = 248320
# The projections Qwen's FP8 releases store in F8_E4M3 (as bench/gpu/fp8_bench.py quantises them).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
               "in_proj_z", "out_proj")
BLOCK = 128
DTYPES = {"bf16": "BF16", "f16": "F16", "f32": "F32"}


def build(shape, layers):
    import transformers

    cfg_name, cls_name, width, depth = SHAPES[shape]
    n = layers or depth
    cfg = getattr(transformers, cfg_name)(
        **width, num_hidden_layers=n, vocab_size=VOCAB, max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        layer_types=hybrid_layer_types(n), tie_word_embeddings=False)
    with torch.device("meta"):
        model = model_class(cls_name)(cfg)
    model.config.architectures = [cls_name]
    return model


def release_layout(params, fp8, scale_dtype):
    """{name: {"dtype", "shape"}} of the checkpoint: bf16 as transformers saves the model, or the FP8
    release layout."""
    out = {}

    def fp8_projection(name, n, k):
        out[name] = {"dtype": "F8_E4M3", "shape": [n, k]}
        out[name + "_scale_inv"] = {"dtype": scale_dtype, "shape": [-(-n // BLOCK), -(-k // BLOCK)]}

    for name, shape in params:
        shape = list(shape)
        if not fp8 or ".layers." not in name:
            out[name] = {"dtype": "BF16", "shape": shape}
        elif name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] -> per expert gate_proj, up_proj [I, H]
            e, two_i, h = shape
            for x in range(e):
                for part in ("gate_proj", "up_proj"):
                    fp8_projection(f"{name[:-len('gate_up_proj')]}{x}.{part}.weight", two_i // 2, h)
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I] -> per expert down_proj [H, I]
            e, h, i = shape
            for x in range(e):
                fp8_projection(f"{name[:-len('down_proj')]}{x}.down_proj.weight", h, i)
        elif name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS and len(shape) == 2:
            fp8_projection(name, *shape)
        else:
            out[name] = {"dtype": "BF16", "shape": shape}
    return out


def matmul_params(params, deepest, top_k, experts):
    """Parameters of the matrix products a token runs in layers 1..deepest: 2-D weights of the
    decoder layers (conv1d, norms and the embedding excluded), the routed experts top_k / E."""
    total = 0
    for name, shape in params:
        if ".layers." not in name or int(name.split(".layers.")[1].split(".")[0]) >= deepest:
            continue
        count = int(np.prod(shape))
        if "mlp.experts." in name and len(shape) == 3:
            total += count * top_k // experts
        elif len(shape) == 2:
            total += count
    return total


def dflash_taps(n):
    """DFlash's five layers (1, 1/4, 1/2, 3/4 of the way, and the second last), as HF indices."""
    ids = sorted({1, round((n - 1) / 4), round((n - 1) / 2), round(3 * (n - 1) / 4), n - 2})
    return [i + 1 for i in ids]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fp8", action="store_true", help="the layout of Qwen's block-wise FP8 releases")
    ap.add_argument("--scale-dtype", choices=sorted(DTYPES), default="bf16", help="FP8 block scales' dtype")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the real depth)")
    ap.add_argument("--taps", default=None, help="comma-separated HF indices (default: DFlash's spread)")
    ap.add_argument("--sequences", type=int, default=0, help="also write a workload of this many sequences")
    a = ap.parse_args()
    model = build(a.shape, a.layers)
    cfg = model.config
    params = [(n, tuple(p.shape)) for n, p in model.state_dict().items()]
    os.makedirs(a.out, exist_ok=True)
    cfg.save_pretrained(a.out)
    if a.fp8:
        path = os.path.join(a.out, "config.json")
        c = json.load(open(path))
        c["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ["lm_head"],
        }
        json.dump(c, open(path, "w"), indent=2)
    tensors = release_layout(params, a.fp8, DTYPES[a.scale_dtype])
    json.dump({"__metadata__": {"shape": a.shape, "fp8": str(a.fp8)}, **tensors},
              open(os.path.join(a.out, "synthetic-weights.json"), "w"))
    n = cfg.num_hidden_layers
    taps = [int(x) for x in a.taps.split(",")] if a.taps else dflash_taps(n)
    experts = getattr(cfg, "num_experts", 0)
    info = {"shape": a.shape, "fp8": a.fp8, "layers": n, "taps": taps, "tensors": len(tensors),
            "bytes": int(sum(np.prod(t["shape"]) * (1 if t["dtype"] == "F8_E4M3" else 4 if t["dtype"] == "F32" else 2)
                             for t in tensors.values())),
            "matmul_parameters": matmul_params(params, max(taps), getattr(cfg, "num_experts_per_tok", 0), experts),
            "base_parameters": sum(int(np.prod(s)) for name, s in params if not name.startswith("lm_head"))}
    json.dump(info, open(os.path.join(a.out, "bench.json"), "w"))
    if a.sequences:
        from prepare import workload_lengths

        rng = np.random.default_rng(0)
        lens = workload_lengths(rng, a.sequences)
        with open(os.path.join(a.out, "workload.jsonl"), "w") as f:
            for i, t in enumerate(lens):
                f.write(json.dumps({"id": f"s{i}", "input_ids": rng.integers(100, 32000, size=int(t)).tolist()}) + "\n")
        json.dump({"layers": taps, "dtype": "bfloat16", "file": "workload.jsonl"},
                  open(os.path.join(a.out, "workload.json"), "w"))
        info["workload"] = {"sequences": a.sequences, "tokens": int(lens.sum())}
    print(json.dumps(info))


if __name__ == "__main__":
    main()
