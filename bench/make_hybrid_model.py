#!/usr/bin/env python3
"""Write a random-weight, Qwen3.5-shaped small hybrid checkpoint for the CPU benchmark.

Text-only `Qwen3_5ForCausalLM` (model_type qwen3_5_text), saved with `save_pretrained` (config.json,
generation_config.json, model.safetensors; f32; no tokenizer: the benchmark sends token ids):

    hidden 512, 8 layers, full_attention_interval 4
        -> layer_types [lin, lin, lin, full, lin, lin, lin, full] (6 Gated DeltaNet + 2 gated attention)
    attention: 8 query heads, 2 KV heads, head_dim 64, partial_rotary_factor 0.25 (16 rotary dims)
    Gated DeltaNet: 4 key heads, 8 value heads, key/value head dim 64, conv kernel 4
    MLP intermediate 1536, vocab 8192, untied lm_head

Weights are transformers' own initialisation under a fixed seed (torch.manual_seed(SEED) before the
model is built): Linear and embedding normal(0, 0.02), zero-centred RMSNorm weights 0 (applied as
1 + w), gated RMSNorm weights 1, dt_bias 1, A_log = log(uniform(0.01, 16)), conv1d normal(0, 0.02).
Throughput does not depend on the values; the run is deterministic (same bytes for the same
torch / transformers versions).

Hidden-state indices for this model: 0 = embeddings, 1..7 = outputs of decoder layers 0..6,
8 = final normed output.

Usage: python bench/make_hybrid_model.py [--out .cache/models/qwen3_5-hybrid-small]
"""

import argparse
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # everything is built from the config in code

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

from random_checkpoint import random_model, save  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
DEFAULT_OUT = os.path.join(REPO_ROOT, ".cache", "models", "qwen3_5-hybrid-small")
SEED = 0

CONFIG = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    full_attention_interval=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    initializer_range=0.02,
    tie_word_embeddings=False,
    # Qwen3.5 keeps its M-RoPE keys in rope_parameters; rotary dim 64 * 0.25 = 16, i.e. 8
    # frequencies, split [3, 3, 2] like the released [11, 11, 10] of 32 (text-only inputs give all
    # three sections the same position: plain 1-D RoPE)
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10000000.0,
        partial_rotary_factor=0.25,
        mrope_section=[3, 3, 2],
        mrope_interleaved=True,
    ),
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def count(model):
    total = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    lm_head = model.lm_head.weight.numel()
    matmul = 0
    for mod in model.model.layers.modules():
        if isinstance(mod, torch.nn.Linear):
            matmul += mod.weight.numel()
    return total, embed, lm_head, matmul


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    args = ap.parse_args()

    cfg = Qwen3_5TextConfig(**CONFIG)
    lin = cfg.layer_types.count("linear_attention")
    full = cfg.layer_types.count("full_attention")
    assert (lin, full) == (6, 2), cfg.layer_types

    model = random_model(cfg, Qwen3_5ForCausalLM, seed=SEED).eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())

    os.makedirs(args.out, exist_ok=True)
    save(model, args.out)  # safetensors, one file at this size

    written = sorted(os.listdir(args.out))
    assert "model.safetensors" in written, written
    with open(os.path.join(args.out, "config.json")) as f:
        saved = json.load(f)
    assert saved["model_type"] == "qwen3_5_text", saved["model_type"]
    assert saved["layer_types"] == cfg.layer_types, saved.get("layer_types")

    total, embed, lm_head, matmul = count(model)
    print(f"wrote {args.out}: {', '.join(written)} (torch {torch.__version__}, transformers {transformers.__version__})")
    print(f"layer_types: {cfg.layer_types}")
    print(f"parameters: {total:,} in all ({total - lm_head:,} without lm_head; embed_tokens {embed:,}, lm_head {lm_head:,})")
    print(f"matmul parameters (Linear weights of the decoder layers, no embedding / lm_head): {matmul:,}")


if __name__ == "__main__":
    main()
