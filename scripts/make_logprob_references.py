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

Then the same model, its f32 weights widened to float64 (`model.double()`), runs the same
sequences again in float64 end to end, which stands for the exact answer: transformers asks for
float32 in places whatever the model's dtype (RMSNorm's `x.to(torch.float32)` or `x.float()`,
attention's `softmax(..., dtype=torch.float32)`, the rotary angles, the gated delta rule's
`.to(torch.float32)`, the MoE router's softmax), so the pass runs under a torch function mode that
turns every float32 asked for into float64, with float64 as the default dtype, and the rotary
inverse frequencies computed again in float64 (they were computed in float32 when the model was
built). Every op's floating output is checked to be float64; logprobs.json lists any op that gave
another dtype under `float64.ops_not_float64` (empty: the whole pass, the hybrids' gated delta rule
and short convolution included, ran in float64). The MoE models' experts run transformers' eager
implementation in that pass (a loop over the experts; the float32 pass keeps the default,
grouped_mm, whose torch._grouped_mm refuses float64), recorded as `float64.experts_implementation`.
With lp64 = log_softmax(logits64[0], -1), float64 (written to logprobs_f64.safetensors, the same
rows as logprobs.safetensors):

    seq{i}.topk_ids              int64   [R, K]   lp64's top K, ties by ascending id
    seq{i}.topk_logprobs         float64 [R, K]   their lp64
    seq{i}.target_logprobs       float64 [R]      lp64[t, ids[t + 1]]; NaN at the last position
    seq{i}.head_topk_ids         int64   [R, K]   the head alone in float64 on the float32 pass's
    seq{i}.head_topk_logprobs    float64 [R, K]   final_state: log_softmax(lm_head(final_state)),
    seq{i}.head_target_logprobs  float64 [R]      its top K and target

plus logprobs.json: K, the versions, the smallest gap between the K-th and (K+1)-th lp of any row
(the references hold no tie at the cut when it is > 0) and whether any two of the top K are
equal, and the largest difference between the final-norm state of this forward pass and the
committed hidden_states[L] (the same setup as the committed reference); and under `float64`,
transformers-f32's own distance from the float64 run over the kept rows: `f32_topk` (the largest
|lp[t, i] - lp64[t, i]| over lp64's top-K ids i, lp gathered from the whole f32 log-softmax),
`f32_target`, the same for the head alone on the f32 final state (`f32_head_topk`,
`f32_head_target`), and how many top-K ranks of the f32 reference hold another id than lp64's
(`f32_ids_differ`).

The committed files were generated with ATEN_CPU_CAPABILITY=avx2, as the hidden-state references
were (the default model's final state then equals its committed reference bit for bit).

Usage:  ATEN_CPU_CAPABILITY=avx2 python scripts/make_logprob_references.py [--gguf .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--skip-tiny]
"""

import argparse
import glob
import json
import os

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from fixture_common import FIXTURES_DIR, REPO_ROOT, TINY_DIR, setup_torch, versions

K = 16
NOTES = (
    "lp = log_softmax(model(ids[None]).logits[0].float(), -1), float32, eager attention; topk_ids and "
    "topk_logprobs by a stable descending sort (ties by ascending id); target_logprobs[t] = lp[t, ids[t + 1]], "
    "NaN at the last position; positions: every position up to 48 tokens, else the first 24 and the last 24."
)
NOTES64 = (
    "float64: the float32 weights widened, every float32 the pass asks for turned into float64 (torch function "
    "mode), rotary inverse frequencies computed in float64; f32_*: the largest |lp32 - lp64| on lp64's top-K ids "
    "(lp32 gathered from the whole f32 log-softmax) and on the targets, over the kept rows; f32_head_*: the same "
    "for the head alone on the f32 final state."
)
# Rows kept at each end of a longer sequence.
EDGE = 24
DEFAULT_GGUF = os.path.join(REPO_ROOT, ".cache", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def kept(t):
    """The positions kept of a sequence of `t` tokens: all of them up to 2 x EDGE, else the first
    and the last EDGE."""
    keep = torch.arange(t) if t <= 2 * EDGE else torch.cat([torch.arange(EDGE), torch.arange(t - EDGE, t)])
    return keep.to(torch.int64)


def next_ids(ids, keep):
    """The next input token of each kept position, -1 at the last one."""
    return torch.tensor([int(ids[p + 1]) if p + 1 < ids.shape[0] else -1 for p in keep.tolist()], dtype=torch.int64)


def at(lp, nxt):
    """lp[r, nxt[r]] for each row r of `lp`, NaN where nxt[r] is -1."""
    t = torch.full((lp.shape[0],), float("nan"), dtype=lp.dtype)
    has = nxt >= 0
    t[has] = lp[torch.arange(lp.shape[0])[has], nxt[has]]
    return t


def references(model, seqs, final_states):
    """The tensors and facts for `seqs` ({name: ids}); `final_states` {name: [T, H]} committed.
    Also, for each sequence, the whole f32 log-softmax of the kept rows, of the pass and of the head
    alone on the kept final states (the float64 comparison gathers from them)."""
    out, min_gap, tied, state_diff, ties_at_cut, full = {}, float("inf"), False, 0.0, {}, {}
    head = model.get_output_embeddings()
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
        keep = kept(ids.shape[0])
        final_state = o.hidden_states[-1][0][keep].float().contiguous()
        with torch.no_grad():
            full[name] = (lp[keep], torch.log_softmax(head(final_state).float(), dim=-1))
        out[f"{name}.input_ids"] = ids.clone()
        out[f"{name}.positions"] = keep
        out[f"{name}.topk_ids"] = idx[keep, :k].contiguous().to(torch.int64)
        out[f"{name}.topk_logprobs"] = vals[keep, :k].contiguous()
        out[f"{name}.target_logprobs"] = target[keep].contiguous()
        out[f"{name}.final_state"] = final_state
    facts = {
        "k": K,
        "rows_tied_at_k": ties_at_cut,
        "min_gap_at_k": min_gap,
        "ties_within_top_k": tied,
        "final_state_max_abs_diff": state_diff,
    }
    return out, facts, full


class Float64Everywhere(TorchFunctionMode):
    """Within it, every float32 a torch function or tensor method is asked for (a dtype argument,
    `x.float()`) is float64 instead, and the default dtype is float64; `not_float64` collects the
    ops that still gave a floating output of another dtype."""

    def __init__(self):
        super().__init__()
        self.not_float64 = set()

    def __enter__(self):
        self.default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self.default)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        def wide(a):
            return torch.float64 if a is torch.float32 else a

        if func is torch.Tensor.float:
            func = torch.Tensor.double
        out = func(*map(wide, args), **{k: wide(v) for k, v in (kwargs or {}).items()})
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                self.not_float64.add(f"{getattr(func, '__qualname__', func)} -> {t.dtype}")
        return out


def to_float64(model):
    """`model` with its (float32) weights widened to float64 and its rotary inverse frequencies
    computed again in float64 (those built with the model hold float32 values); and the experts
    implementation its float64 pass uses. The MoE models' default, grouped_mm, refuses float64
    (torch._grouped_mm: "Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double"):
    their float64 pass runs the eager one, a loop over the experts with the same arithmetic (the
    float32 pass keeps grouped_mm)."""
    experts = None
    if model._can_set_experts_implementation():
        model.set_experts_implementation("eager")
        experts = model.config._experts_implementation
    model.double()
    for m in model.modules():
        if hasattr(m, "inv_freq") and hasattr(m, "rope_type") and hasattr(m, "config"):
            # As the module picks it: its own compute_<type>_rope_parameters (default, axial), else
            # the library's.
            init = getattr(m, f"compute_{m.rope_type}_rope_parameters", None) or ROPE_INIT_FUNCTIONS[m.rope_type]
            with Float64Everywhere():
                inv_freq, m.attention_scaling = init(m.config)
            assert inv_freq.dtype == torch.float64 and inv_freq.shape == m.inv_freq.shape, m
            m.inv_freq = inv_freq
            m.original_inv_freq = inv_freq.clone()
    return model, experts


def float64_references(model, experts, seqs, f32, full):
    """The float64 pass of `model` (widened by to_float64, which gives `experts`) on `seqs`, on the
    rows of the float32 tensors `f32`: the tensors of logprobs_f64.safetensors, and the facts on
    transformers-f32's distance from it, gathered from the whole f32 log-softmax `full` (both from
    references)."""
    out, mode = {}, Float64Everywhere()
    facts = {"f32_topk": 0.0, "f32_target": 0.0, "f32_head_topk": 0.0, "f32_head_target": 0.0, "f32_ids_differ": 0}
    head = model.get_output_embeddings()
    for name, ids in seqs.items():
        keep, k = f32[f"{name}.positions"], f32[f"{name}.topk_ids"].shape[1]
        with torch.no_grad(), mode:
            lp = torch.log_softmax(model(input_ids=ids[None]).logits[0], dim=-1)[keep]
            # The head alone, on the float32 pass's final-norm state (exact in float64).
            head_lp = torch.log_softmax(head(f32[f"{name}.final_state"].double()), dim=-1)
        assert lp.dtype == head_lp.dtype == torch.float64
        nxt = next_ids(ids, keep)
        has = nxt >= 0
        for prefix, x, x32 in (("", lp, full[name][0]), ("head_", head_lp, full[name][1])):
            vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
            top_ids, top = idx[:, :k].contiguous().to(torch.int64), vals[:, :k].contiguous()
            target = at(x, nxt)
            out[f"{name}.{prefix}topk_ids"] = top_ids
            out[f"{name}.{prefix}topk_logprobs"] = top
            out[f"{name}.{prefix}target_logprobs"] = target
            x32 = x32.double()
            topk_err = (x32.gather(1, top_ids) - top).abs().max().item()
            target_err = (at(x32, nxt) - target)[has].abs().max().item() if has.any() else 0.0
            facts[f"f32_{prefix}topk"] = max(facts[f"f32_{prefix}topk"], topk_err)
            facts[f"f32_{prefix}target"] = max(facts[f"f32_{prefix}target"], target_err)
        facts["f32_ids_differ"] += int((f32[f"{name}.topk_ids"] != out[f"{name}.topk_ids"]).sum())
    facts["ops_not_float64"] = sorted(mode.not_float64)
    facts["experts_implementation"] = experts
    facts["notes"] = NOTES64
    return out, facts


def model_class(folder):
    with open(os.path.join(folder, "config.json")) as f:
        return getattr(transformers, json.load(f)["architectures"][0])


def run(model, seqs, finals):
    """The float32 pass, then the float64 one (which widens `model`): the tensors of both files
    and the facts."""
    tensors, facts, full = references(model, seqs, finals)
    tensors64, facts["float64"] = float64_references(*to_float64(model), seqs, tensors, full)
    return tensors, tensors64, facts


def write(folder, tensors, tensors64, facts, extra):
    save_file(tensors, os.path.join(folder, "logprobs.safetensors"))
    save_file(tensors64, os.path.join(folder, "logprobs_f64.safetensors"))
    facts = {**versions(), **extra, **facts, "notes": NOTES}
    with open(os.path.join(folder, "logprobs.json"), "w") as f:
        json.dump(facts, f, indent=2)
        f.write("\n")
    f64 = facts["float64"]
    print(
        os.path.basename(folder.rstrip("/")),
        json.dumps(facts["min_gap_at_k"]),
        facts["final_state_max_abs_diff"],
        f"f32 against float64: top-k {f64['f32_topk']:.3g}, target {f64['f32_target']:.3g}, head alone "
        f"{f64['f32_head_topk']:.3g} {f64['f32_head_target']:.3g}; ids differ {f64['f32_ids_differ']}; "
        f"not float64: {f64['ops_not_float64']}",
    )


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
        write(folder, *run(model, seqs, finals), {"model_class": cls.__name__})


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
    # Names as the hidden-state reference spells them (hs0, hs1, ...), so a test reads both.
    write(folder, *run(model, seqs, finals), {"gguf_file": os.path.basename(gguf)})


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
