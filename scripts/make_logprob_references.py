#!/usr/bin/env python3
"""Hugging Face transformers references for next-token log-probabilities (`logprobs` in
`/v1/hidden-states`), next to the existing hidden-state references, which stay untouched.

For every tiny checkpoint in tests/fixtures/tiny/* (each holds an lm_head or ties it to the
embeddings) and for the default GGUF model (SmolLM2-135M-Instruct Q4_1, dequantised to f32 by
transformers, as scripts/make_smollm2_reference.py does), the model runs in float32 with eager
attention on the same input sequences its reference.safetensors holds, and

    lp = log_softmax(model(ids[None]).logits[0].float(), -1)      # [T, vocab]

gives (written to logprobs.safetensors in the fixture's folder):

    seq{i}.input_ids        int64   [T]      the sequence (a copy, to check it is the same)
    seq{i}.positions        int64   [R]      the positions kept: all of them up to 48 tokens,
                                             else the first 24 and the last 24
    seq{i}.topk_ids         int64   [R, K]   ids sorted by descending lp, ties by ascending id
    seq{i}.topk_logprobs    float32 [R, K]   their lp
    seq{i}.target_logprobs  float32 [R]      lp[t, ids[t + 1]]; NaN at the last position
    seq{i}.final_state      float32 [R, H]   hidden_states[L] (after the final norm) of this pass,
                                             so a test can check the head alone on the same state

plus logprobs.json: K, the versions, the smallest gap between the K-th and (K+1)-th lp of any row
(the references hold no tie at the cut when it is > 0) and whether any two of the top K are
equal, and the largest difference between the final-norm state of this forward pass and the
committed hidden_states[L] (the same setup as the committed reference).

The committed files were generated with ATEN_CPU_CAPABILITY=avx2, as the hidden-state references
were (the default model's final state then equals its committed reference bit for bit).

Usage:  ATEN_CPU_CAPABILITY=avx2 python scripts/make_logprob_references.py [--gguf .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf]
"""

import argparse
import glob
import json
import os

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from fixture_common import FIXTURES_DIR, REPO_ROOT, TINY_DIR, setup_torch, versions

K = 16
NOTES = (
    "lp = log_softmax(model(ids[None]).logits[0].float(), -1), float32, eager attention; topk_ids and "
    "topk_logprobs by a stable descending sort (ties by ascending id); target_logprobs[t] = lp[t, ids[t + 1]], "
    "NaN at the last position; positions: every position up to 48 tokens, else the first 24 and the last 24."
)
# Rows kept at each end of a longer sequence.
EDGE = 24
DEFAULT_GGUF = os.path.join(REPO_ROOT, ".cache", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def references(model, seqs, final_states):
    """The tensors and facts for `seqs` ({name: ids}); `final_states` {name: [T, H]} committed."""
    out, min_gap, tied, state_diff, ties_at_cut = {}, float("inf"), False, 0.0, {}
    for name, ids in seqs.items():
        with torch.no_grad():
            o = model(input_ids=ids[None], output_hidden_states=True)
        lp = torch.log_softmax(o.logits[0].float(), dim=-1)
        if name in final_states:
            state_diff = max(state_diff, (o.hidden_states[-1][0].float() - final_states[name]).abs().max().item())
        # Stable sort: equal values keep ascending ids.
        vals, idx = torch.sort(lp, dim=-1, descending=True, stable=True)
        k = min(K, lp.shape[-1] - 1)
        min_gap = min(min_gap, (vals[:, k - 1] - vals[:, k]).min().item())
        tied = tied or bool((vals[:, : k - 1] == vals[:, 1:k]).any())
        # Rows whose K-th and (K+1)-th lp are equal: the K-th id is then one of several.
        out_ties = int((vals[:, k - 1] == vals[:, k]).sum())
        ties_at_cut[name] = out_ties
        target = torch.full((ids.shape[0],), float("nan"))
        if ids.shape[0] > 1:
            target[:-1] = lp[torch.arange(ids.shape[0] - 1), ids[1:]]
        t = ids.shape[0]
        keep = torch.arange(t) if t <= 2 * EDGE else torch.cat([torch.arange(EDGE), torch.arange(t - EDGE, t)])
        out[f"{name}.input_ids"] = ids.clone()
        out[f"{name}.positions"] = keep.to(torch.int64)
        out[f"{name}.topk_ids"] = idx[keep, :k].contiguous().to(torch.int64)
        out[f"{name}.topk_logprobs"] = vals[keep, :k].contiguous()
        out[f"{name}.target_logprobs"] = target[keep].contiguous()
        out[f"{name}.final_state"] = o.hidden_states[-1][0][keep].float().contiguous()
    return out, {"k": K, "rows_tied_at_k": ties_at_cut, "min_gap_at_k": min_gap, "ties_within_top_k": tied, "final_state_max_abs_diff": state_diff}


def model_class(folder):
    with open(os.path.join(folder, "config.json")) as f:
        return getattr(transformers, json.load(f)["architectures"][0])


def write(folder, tensors, facts, extra):
    save_file(tensors, os.path.join(folder, "logprobs.safetensors"))
    facts = {**versions(), **extra, **facts, "notes": NOTES}
    with open(os.path.join(folder, "logprobs.json"), "w") as f:
        json.dump(facts, f, indent=2)
        f.write("\n")
    print(os.path.basename(folder.rstrip("/")), json.dumps(facts["min_gap_at_k"]), facts["final_state_max_abs_diff"])


def tiny():
    for folder in sorted(glob.glob(os.path.join(TINY_DIR, "*", ""))):
        ref = os.path.join(folder, "reference.safetensors")
        if not os.path.isfile(ref):
            continue
        with safe_open(ref, "pt") as r:
            names = sorted({k.split(".")[0] for k in r.keys()})
            seqs = {n: r.get_tensor(f"{n}.input_ids") for n in names}
            finals = {n: r.get_tensor(f"{n}.hidden_states")[-1] for n in names}
        cls = model_class(folder)
        model = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
        tensors, facts = references(model, seqs, finals)
        write(folder, tensors, facts, {"model_class": cls.__name__})


def smollm2(gguf):
    folder = os.path.join(FIXTURES_DIR, "smollm2")
    with safe_open(os.path.join(folder, "reference.safetensors"), "pt") as r:
        names = sorted({k.split(".")[0] for k in r.keys() if k.startswith("hs")})
        seqs = {n: r.get_tensor(f"{n}.input_ids") for n in names}
        # hs_layers ends with index 30, the final-norm output.
        finals = {n: r.get_tensor(f"{n}.hidden_states")[-1] for n in names}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tensors, facts = references(model, seqs, finals)
    # Names as the hidden-state reference spells them (hs0, hs1, ...), so a test reads both.
    write(folder, tensors, facts, {"gguf_file": os.path.basename(gguf)})


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", default=DEFAULT_GGUF)
    p.add_argument("--skip-tiny", action="store_true")
    a = p.parse_args()
    setup_torch()
    if not a.skip_tiny:
        tiny()
    smollm2(a.gguf)


if __name__ == "__main__":
    main()
