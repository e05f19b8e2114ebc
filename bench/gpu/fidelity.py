#!/usr/bin/env python3
"""Fidelity on the GPU: layertap in bf16 on CUDA against Hugging Face transformers in f32.

- the real-size random checkpoint: HF f32 reference (computed here, on the GPU, eager attention,
  no TF32) for three sequences (100, 810, 4096 tokens) at several indices; layertap bf16 with the
  three packed in one batch and each alone: relative error per index (||ours - ref|| / ||ref||) and
  the largest difference between packed and alone; for scale, HF's own bf16 model loaded with
  `from_pretrained(dtype=torch.bfloat16)`, and (to show what an earlier version of this script
  measured) the f32 model cast with `.to(torch.bfloat16)`, which rounds the rotary frequencies too;
- the tiny fixtures of every family (tests/fixtures/tiny): bf16 on CUDA against their committed
  f32 references (their head dimensions take the portable attention path);
- small random models of every family with head dimensions 64 and 128 (the CUDA attention
  kernel's cases; Mistral with a sliding window shorter than the longest sequence), made here,
  against HF f32 (eager attention) on the GPU.

Usage: python3 bench/gpu/fidelity.py --bin .gpu/layertap --model-dir /tmp/qwen3-8b-random
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: random_checkpoint
from random_checkpoint import random_model, save  # noqa: E402

LAYERS = [0, 1, 2, 10, 19, 27, 34, 35, 36]
SEQ_LENS = (100, 810, 4096)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def extract(binary, model, seqs, layers, out):
    cmd = [binary, "extract", "--model", model, "--device", "cuda:0", "--dtype", "bf16", "--out-dtype", "f32",
           "--layers", ",".join(map(str, layers)), "--out", out]
    for s in seqs:
        cmd += ["--input-ids", ",".join(map(str, s))]
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
    return load_file(out)


def kernel_families(binary, tmp):
    """Worst relative error over every index, layertap bf16 (3 sequences packed) vs HF f32."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(intermediate_size=1024, num_hidden_layers=4, vocab_size=1000, max_position_embeddings=4096,
                  initializer_range=0.05, tie_word_embeddings=False)
    configs = {
        "llama_d64_gqa": LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                     **common),
        "mistral_d128_window100": MistralConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=128, sliding_window=100, **common),
        "qwen2_d64_bias": Qwen2Config(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, **common),
        "qwen3_d128_qknorm": Qwen3Config(hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                                         head_dim=128, **common),
    }
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 150, 700)]
    out = {}
    for name, cfg in configs.items():
        cfg._attn_implementation = "eager"
        m = random_model(cfg, dtype=torch.float32, from_config=True)
        d = os.path.join(tmp, name)
        save(m, d)
        base = m.model.cuda().eval()
        n = cfg.num_hidden_layers
        ours = extract(binary, d, seqs, list(range(n + 1)), os.path.join(tmp, name + ".safetensors"))
        cu = ours["cu_seqlens"].tolist()
        worst = 0.0
        with torch.inference_mode():
            for k, s in enumerate(seqs):
                hs = base(torch.tensor([s], device="cuda"), output_hidden_states=True, use_cache=False).hidden_states
                for i in range(n + 1):
                    worst = max(worst, rel(ours["hidden_states"][cu[k]:cu[k + 1], i], hs[i][0].cpu()))
        out[name] = round(worst, 6)
        del base, m
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model-dir", required=True)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp()
    tiny = {}
    for d in sorted(glob.glob("tests/fixtures/tiny/*/reference.safetensors")):
        model = os.path.dirname(d)
        ref = load_file(d)
        n = ref["seq2.hidden_states"].shape[0] - 1
        ids = ref["seq2.input_ids"].tolist()
        ours = extract(a.bin, model, [ids], list(range(n + 1)), os.path.join(tmp, "tiny.safetensors"))
        hs = ours["hidden_states"]
        tiny[os.path.basename(model)] = round(max(rel(hs[:, i], ref["seq2.hidden_states"][i]) for i in range(n + 1)), 6)
    print(json.dumps({"tiny_bf16_worst_rel_err": tiny}), flush=True)
    print(json.dumps({"kernel_families_bf16_worst_rel_err": kernel_families(a.bin, tmp)}), flush=True)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(100, 151000, (n,), generator=g).tolist() for n in SEQ_LENS]
    from transformers import AutoModelForCausalLM

    # The reference: f32 weights, f32 matmuls (no TF32), eager attention.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    def hf_states(base, k):
        s = seqs[k]
        hs = base(torch.tensor([s], device="cuda"), output_hidden_states=True, use_cache=False).hidden_states
        return [hs[i][0].float().cpu() for i in LAYERS]

    def worst_against_refs(base):
        w = {i: 0.0 for i in LAYERS}
        for k in range(len(seqs)):
            for j, st in enumerate(hf_states(base, k)):
                w[LAYERS[j]] = max(w[LAYERS[j]], rel(st, refs[k][:, j]))
        return w

    m = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32, attn_implementation="eager")
    base = m.model.cuda().eval()
    with torch.inference_mode():
        refs = [torch.stack(hf_states(base, k), dim=1) for k in range(len(seqs))]  # [T, L, H] each
        # What an earlier version of this script compared against: the f32 model cast with
        # `.to(bfloat16)`, which also rounds buffers such as the rotary inverse frequencies to
        # bf16 (a phase error that grows with the position). Kept to show the difference.
        base.to(torch.bfloat16)
        hf_bf16_cast = worst_against_refs(base)
    del base, m
    torch.cuda.empty_cache()
    # For scale: transformers' own bf16 model as users load it, against its f32 one.
    m = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.bfloat16, attn_implementation="eager")
    base = m.model.cuda().eval()
    with torch.inference_mode():
        hf_bf16 = worst_against_refs(base)
    inv_freq = getattr(getattr(base, "rotary_emb", None), "inv_freq", None)
    del base, m
    torch.cuda.empty_cache()

    packed = extract(a.bin, a.model_dir, seqs, LAYERS, os.path.join(tmp, "packed.safetensors"))
    cu = packed["cu_seqlens"].tolist()
    result = {"random_8b": {"layers": LAYERS, "per_index_rel_err": {}, "packed_vs_alone_max_abs": 0.0}}
    worst = {i: 0.0 for i in LAYERS}
    for k, s in enumerate(seqs):
        ours = packed["hidden_states"][cu[k]:cu[k + 1]]
        for j, i in enumerate(LAYERS):
            worst[i] = max(worst[i], rel(ours[:, j], refs[k][:, j]))
        alone = extract(a.bin, a.model_dir, [s], LAYERS, os.path.join(tmp, f"alone{k}.safetensors"))
        diff = (alone["hidden_states"] - ours).abs().max().item()
        result["random_8b"]["packed_vs_alone_max_abs"] = max(result["random_8b"]["packed_vs_alone_max_abs"], diff)
    result["random_8b"]["per_index_rel_err"] = {str(i): round(e, 6) for i, e in worst.items()}
    result["random_8b"]["hf_bf16_per_index_rel_err"] = {str(i): round(e, 6) for i, e in hf_bf16.items()}
    result["random_8b"]["hf_f32_cast_to_bf16_per_index_rel_err"] = {
        str(i): round(e, 6) for i, e in hf_bf16_cast.items()}
    result["random_8b"]["hf_bf16_rotary_inv_freq_dtype"] = str(inv_freq.dtype) if inv_freq is not None else None
    result["random_8b"]["sequence_lengths"] = list(SEQ_LENS)

    print(json.dumps(result))


if __name__ == "__main__":
    main()
