#!/usr/bin/env python3
"""Generate tiny random-weight Gemma 4 checkpoints (built with transformers' own Gemma4TextConfig and
Gemma4Config) and Hugging Face reference hidden states and log-probabilities, used by tests/gemma4.rs.

Output layout (default: tests/fixtures/gemma4 relative to the repository root):

    <out>/<variant>/config.json              as save_pretrained writes it
    <out>/<variant>/model.safetensors        every parameter (and the layer_scalar buffers) in bfloat16
    <out>/<variant>/tokenizer.json, tokenizer_config.json
                                             copied from tests/fixtures/tiny/qwen3_qknorm (vocab <= 512)
    <out>/<variant>/reference.safetensors    seq{i}.input_ids        int64   [T_i]
                                             seq{i}.hidden_states    float32 [L+1, T_i, H]
                                             seq{i}.final_prenorm    float32 [T_i, H] (the last decoder
                                                 layer's output before the final norm, same pass)
                                             seq{i}.logprob_ids      int64   [T_i, K] top-K next-token ids
                                             seq{i}.logprobs         float32 [T_i, K] their log-probabilities
                                                 (after the final-logit softcapping)
                                             seq{i}.target_logprobs  float32 [T_i] lp of the next token (NaN last)
    <out>/<variant>/reference.json           facts, transformers-f32's per-index distance from float64

Every variant: hidden 48 (so the embedding scale sqrt(48) is no power of two), 6 layers [sliding,
sliding, full, sliding, sliding, full] (the last full, as transformers forces), window 12, 4 query
heads; sliding layers 2 key-value heads of 16 with default rotary (theta 10,000); full layers heads
of 32 with proportional rotary (partial 0.25, theta 1,000,000), attention scaling 1.0, q/k norms and
the scale-free v norm, sandwich norms, a random layer_scalar per layer, GELU-tanh, final-logit
softcapping 5.0 (the largest raw logits are about twice that), vocab 512, tied head:

    gemma4_dense  Gemma4ForCausalLM (weights under "model."); full layers keep 2 key-value heads
                  and their own v_proj.
    gemma4_moe    Gemma4ForConditionalGeneration without vision or audio towers (the decoder under
                  "model.language_model.", the text config nested as text_config), with
                  attention_k_eq_v (full layers: 1 key-value head, values from k_proj) and the MoE
                  block beside the dense MLP (6 experts of 16, top 3; router: scale-free norm,
                  scale, hidden^-1/2, softmax, top-k, renormalised, per-expert scale).
    gemma4_e2b    Gemma4ForConditionalGeneration as gemma4_moe is saved, shaped as E2B and E4B
                  are: full layers keep 2 key-value heads and their own v_proj, no experts;
                  per-layer embeddings (16 per layer; the table scaled by sqrt(16), the
                  projection of the embeddings by hidden^-1/2, its RMSNorm, the two added and
                  scaled by 2^-1/2; in each layer after the feed-forward block a gate, GELU-tanh,
                  the product with the layer's input, a projection, a norm and a residual add),
                  key-value sharing of the last 3 layers (layers 3 and 4, sliding, attend over
                  layer 1's keys and values; layer 5, full, over layer 2's), and the double-wide
                  MLP of those 3 layers (use_double_wide_mlp).

Every parameter is random (norm weights 1 + 0.3 randn, router scale and per-expert scale too); the
layer_scalar buffers 0.8 + 0.2 randn. The references are computed in float32 with eager attention and
experts, each sequence alone (batch 1, use_cache=False); the float64 run (model.double(), RMSNorm in
float64; the rotary tables and the router's softmax stay float32, as transformers computes them) gives
transformers-f32's own distance per index. Every parameter is rounded to bfloat16 first, so the
bfloat16 files hold the reference's weights exactly.

Usage: python scripts/make_gemma4_fixtures.py [--out tests/fixtures/gemma4] [--only VARIANT ...]
"""

import importlib.util
import os
import sys

_FORBIDDEN = [p for p in ("fla", "causal_conv1d") if importlib.util.find_spec(p) is not None]
if _FORBIDDEN:
    sys.exit(f"refusing to run: {', '.join(_FORBIDDEN)} importable; use a venv without them")
os.environ["HF_HUB_OFFLINE"] = "1"

import math  # noqa: E402

import torch  # noqa: E402
from transformers import (  # noqa: E402
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
)
from transformers.models.gemma4 import modeling_gemma4  # noqa: E402

from fixture_common import logprob_tensors as shared_logprob_tensors  # noqa: E402
from fixture_common import (  # noqa: E402
    FIXTURES_DIR,
    TINY_DIR,
    check_final_prenorm,
    copy_files,
    dir_size,
    drift_per_index,
    dump_json,
    fixture_args,
    fresh_dir,
    layer_output,
    randn,
    random_sequences,
    read_file,
    reference_tensors,
    save_tensors,
    selected,
    setup_torch,
    versions,
)

DEFAULT_OUT = os.path.join(FIXTURES_DIR, "gemma4")
TOKENIZER_DIR = os.path.join(TINY_DIR, "qwen3_qknorm")
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json"]

H, L, VOCAB = 48, 6, 512
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
GLOBAL_HEAD_DIM, GLOBAL_KV_HEADS = 32, 1
INTER = 64
EXPERTS, TOP_K, MOE_INTER = 6, 3, 16
WINDOW = 12
SOFTCAP = 5.0
SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL]
ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}
SEQ_LENGTHS = [1, 3, 12, 13, 40, 100]  # 12 and 13: the window's edge; 40 and 100 well past it
SEQ_SEED = 1234
WEIGHT_SEED = 0
MAX_SEED_ATTEMPTS = 50
MIN_ROUTER_GAP = 1e-5  # probability_k - probability_(k+1), every token of every layer
MAX_F32_DRIFT = 5e-6
LOGPROB_K = 5

EMBED_STD = 0.3
LINEAR_STD = 0.15
NORM_STD = 0.3  # 1 + NORM_STD * randn
SCALAR_MEAN, SCALAR_STD = 0.8, 0.2


PLE_DIM = 16
KV_SHARED = 3


def text_config(variant):
    kw = dict(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER, num_hidden_layers=L,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        global_head_dim=GLOBAL_HEAD_DIM, sliding_window=WINDOW, layer_types=list(LAYER_TYPES),
        rope_parameters={k: dict(v) for k, v in ROPE.items()}, final_logit_softcapping=SOFTCAP,
        hidden_size_per_layer_input=0, num_kv_shared_layers=0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=2, pad_token_id=0,
    )
    if variant == "gemma4_e2b":
        kw.update(hidden_size_per_layer_input=PLE_DIM, vocab_size_per_layer_input=VOCAB,
                  num_kv_shared_layers=KV_SHARED, use_double_wide_mlp=True)
    if variant == "gemma4_moe":
        kw.update(attention_k_eq_v=True, num_global_key_value_heads=GLOBAL_KV_HEADS, enable_moe_block=True,
                  num_experts=EXPERTS, top_k_experts=TOP_K, moe_intermediate_size=MOE_INTER)
    return kw


def build(variant):
    if variant == "gemma4_dense":
        cfg = Gemma4TextConfig(**text_config(variant), architectures=["Gemma4ForCausalLM"])
        cls = Gemma4ForCausalLM
    else:
        cfg = Gemma4Config(text_config=text_config(variant), vision_config=None, audio_config=None,
                           tie_word_embeddings=True, architectures=["Gemma4ForConditionalGeneration"])
        cls = Gemma4ForConditionalGeneration
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    if hasattr(cfg, "text_config"):
        cfg.text_config._attn_implementation = "eager"
        cfg.text_config._experts_implementation = "eager"
    torch.manual_seed(WEIGHT_SEED)
    return cls(cfg).float().eval()


def text_model(model):
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


def randomise(model, gen):
    """Every parameter and every layer_scalar random; counts per category."""
    counts, done = {}, set()

    def put(p, v, what):
        assert p.shape == v.shape, (what, p.shape, v.shape)
        p.copy_(v)
        counts[what] = counts.get(what, 0) + 1
        done.add(id(p))

    with torch.no_grad():
        for mname, mod in model.named_modules():
            cls = type(mod).__name__
            for pname, p in mod.named_parameters(recurse=False):
                full = f"{mname}.{pname}"
                if cls == "Gemma4RMSNorm":
                    put(p, randn(p.shape, gen, NORM_STD, 1.0), f"RMSNorm weight: 1 + {NORM_STD}*randn")
                elif cls == "Gemma4TextRouter" and pname in ("scale", "per_expert_scale"):
                    put(p, randn(p.shape, gen, NORM_STD, 1.0), f"router {pname}: 1 + {NORM_STD}*randn")
                elif cls == "Gemma4TextExperts":
                    put(p, randn(p.shape, gen, LINEAR_STD), f"experts {pname}: {LINEAR_STD}*randn")
                elif isinstance(mod, torch.nn.Embedding):
                    put(p, randn(p.shape, gen, EMBED_STD), f"embed_tokens: {EMBED_STD}*randn")
                elif isinstance(mod, torch.nn.Linear) and pname == "weight":
                    if id(p) in done:  # the tied head
                        continue
                    put(p, randn(p.shape, gen, LINEAR_STD), f"Linear weight: {LINEAR_STD}*randn")
                else:
                    raise AssertionError(f"no randomisation rule for {full} ({cls})")
            for bname, b in mod.named_buffers(recurse=False):
                if bname == "layer_scalar":
                    b.copy_(randn(b.shape, gen, SCALAR_STD, SCALAR_MEAN))
                    counts["layer_scalar"] = counts.get("layer_scalar", 0) + 1
    missing = [n for n, p in model.named_parameters() if id(p) not in done]
    assert not missing, f"not randomised: {missing}"
    return counts


def round_to_bf16(model):
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(b.to(torch.bfloat16).to(torch.float32))


@torch.no_grad()
def run_reference(model, ids):
    base = text_model(model)
    cap = {"router": []}

    def keep(key):
        def hook(_mod, _inp, out):
            cap[key] = layer_output(out)
        return hook

    def keep_router(_mod, _inp, out):
        cap["router"].append(out[0].detach().clone())  # the probabilities over every expert

    hooks = [base.norm.register_forward_hook(keep("norm"))]
    hooks += [layer.register_forward_hook(keep(f"layer{i}")) for i, layer in enumerate(base.layers)]
    hooks += [m.register_forward_hook(keep_router) for m in model.modules() if type(m).__name__ == "Gemma4TextRouter"]
    try:
        out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    hs = torch.stack(out.hidden_states)[:, 0].contiguous()
    T = ids.shape[0]
    assert hs.dtype == torch.float32 and hs.shape == (L + 1, T, H), hs.shape
    assert torch.isfinite(hs).all()
    emb = base.embed_tokens(ids[None])[0]
    assert torch.equal(hs[0], emb), "index 0 is not the scaled embedding"
    for i in range(1, L):
        assert torch.equal(hs[i], cap[f"layer{i - 1}"][0]), f"index {i} is not decoder layer {i - 1}'s output"
    assert torch.equal(hs[L], cap["norm"][0])
    prenorm = cap[f"layer{L - 1}"][0].contiguous()
    check_final_prenorm(base.norm, prenorm, hs[L])
    gap = math.inf
    for probs in cap["router"]:
        top = torch.sort(probs, dim=-1, descending=True).values
        gap = min(gap, (top[:, TOP_K - 1] - top[:, TOP_K]).min().item())
    return hs, prenorm, gap, out.logits[0].float()


def references(model, seqs):
    refs, prenorms, logits, gap = [], [], [], math.inf
    for ids in seqs:
        hs, prenorm, g, lg = run_reference(model, ids)
        refs.append(hs)
        prenorms.append(prenorm)
        logits.append(lg)
        gap = min(gap, g)
    return refs, prenorms, logits, gap


def norm_in_input_dtype(self, hidden_states):
    normed = self._norm(hidden_states)
    return normed * self.weight.to(hidden_states.dtype) if self.with_scale else normed


@torch.no_grad()
def float64_run(model, seqs):
    original = modeling_gemma4.Gemma4RMSNorm.forward
    modeling_gemma4.Gemma4RMSNorm.forward = norm_in_input_dtype
    model.double()
    try:
        outs = [model(input_ids=ids[None], output_hidden_states=True, use_cache=False) for ids in seqs]
        return [torch.stack(o.hidden_states)[:, 0] for o in outs], [o.logits[0] for o in outs]
    finally:
        model.float()
        modeling_gemma4.Gemma4RMSNorm.forward = original




def logprob_tensors(seqs, logits, logits64, refs, head):
    """The log-probabilities; also the largest raw logit (before the cap) over the cap."""
    capped = 0.0
    for i, lg in enumerate(logits):
        raw = refs[i][L] @ head.T
        assert torch.allclose(torch.tanh(raw / SOFTCAP) * SOFTCAP, lg, atol=1e-5), "the softcap"
        capped = max(capped, raw.abs().max().item() / SOFTCAP)
    return (*shared_logprob_tensors(seqs, logits, logits64, LOGPROB_K), capped)




def write_variant(name, model, out_dir, seqs, refs, prenorms, logits, logits64, drift, facts):
    vdir = os.path.join(out_dir, name)
    fresh_dir(vdir)
    model.save_pretrained(vdir)
    path = os.path.join(vdir, "model.safetensors")
    saved = read_file(path)
    assert "lm_head.weight" not in saved, "the head is tied"
    assert any(k.endswith("layer_scalar") for k in saved), "layer_scalar is saved"
    save_tensors({k: v.to(torch.bfloat16).contiguous() for k, v in saved.items()}, path,
                 metadata={"format": "pt"}, mode=0o644)
    for f in os.listdir(vdir):
        if f == "generation_config.json":
            os.remove(os.path.join(vdir, f))
    copy_files(TOKENIZER_DIR, vdir, TOKENIZER_FILES)

    # The folder as transformers reads it reproduces the reference bit for bit.
    cls = type(model)
    loaded = cls.from_pretrained(vdir, dtype=torch.float32, attn_implementation="eager",
                                 experts_implementation="eager").eval()
    with torch.no_grad():
        for ids, ref in zip(seqs, refs):
            got = torch.stack(loaded(input_ids=ids[None], output_hidden_states=True,
                                     use_cache=False).hidden_states)[:, 0]
            assert torch.equal(got, ref), f"{name}: from_pretrained(folder) differs from the reference"
    del loaded

    ref_tensors = reference_tensors(seqs, refs, prenorms)
    head = text_model(model).embed_tokens.weight.detach()
    lp_tensors, lp_f32_err, lp_gap, capped = logprob_tensors(seqs, logits, logits64, refs, head)
    ref_tensors.update(lp_tensors)
    save_tensors(ref_tensors, os.path.join(vdir, "reference.safetensors"), mode=0o644)
    ref = {
        **versions(),
        "model_class": cls.__name__,
        "lengths": SEQ_LENGTHS,
        "num_hidden_layers": L,
        "hidden_size": H,
        "layer_types": LAYER_TYPES,
        "sliding_window": WINDOW,
        "rope_parameters": ROPE,
        "final_logit_softcapping": SOFTCAP,
        "largest_logit_over_cap": capped,
        "f32_vs_f64_relative_error_per_index": drift,
        "logprobs_top_k": LOGPROB_K,
        "logprobs_f32_vs_f64_max_abs": lp_f32_err,
        "logprobs_min_gap_at_k": lp_gap,
        **facts,
        "notes": "hidden_states = torch.stack(model(ids[None], output_hidden_states=True, use_cache=False)"
                 ".hidden_states)[:, 0], each sequence alone, float32, eager attention and experts; index L is "
                 "after the final norm; final_prenorm from a hook on the last decoder layer. The float64 run "
                 "computes RMSNorm in float64; its rotary tables and router softmax stay float32.",
    }
    dump_json(ref, os.path.join(vdir, "reference.json"))
    print(f"{name}: size {dir_size(vdir) / 1e3:.0f} kB, logits up to {capped:.2f} x cap")


def main():
    args = fixture_args(__doc__.split("\n")[0], DEFAULT_OUT)
    setup_torch()
    os.makedirs(args.out, exist_ok=True)
    seqs = random_sequences(VOCAB, SEQ_LENGTHS, SEQ_SEED)
    variants = {"gemma4_dense": None, "gemma4_moe": None, "gemma4_e2b": None}
    total = 0
    for name, _ in selected(variants, args.only):
        model = build(name)
        moe = name == "gemma4_moe"
        for attempt in range(MAX_SEED_ATTEMPTS):
            seed = WEIGHT_SEED + attempt
            counts = randomise(model, torch.Generator().manual_seed(seed))
            round_to_bf16(model)
            refs, prenorms, logits, gap = references(model, seqs)
            exact, logits64 = float64_run(model, seqs)
            drift = drift_per_index(refs, exact)
            if (not moe or gap > MIN_ROUTER_GAP) and max(drift) <= MAX_F32_DRIFT:
                break
            print(f"{name}: seed {seed} rejected (router gap {gap:.1e}, drift {max(drift):.1e})")
        else:
            raise AssertionError("no seed gives a router gap and an f32 drift within bounds")
        print(f"{name}: seed {seed}, min top-{TOP_K} probability gap {gap:.2e}, f32 vs f64 per index "
              + " ".join(f"{d:.1e}" for d in drift))
        facts = {"weight_seed": seed, "randomised": counts}
        if moe:
            facts["min_router_topk_probability_gap"] = gap
        tcfg = model.config.get_text_config()
        if tcfg.hidden_size_per_layer_input:
            modes = tcfg.kv_sharing_modes
            assert modes == [None, "store", "store", "reuse", "reuse", "reuse"], modes
            facts.update(hidden_size_per_layer_input=tcfg.hidden_size_per_layer_input,
                         num_kv_shared_layers=tcfg.num_kv_shared_layers, kv_sharing_modes=modes,
                         use_double_wide_mlp=tcfg.use_double_wide_mlp)
        write_variant(name, model, args.out, seqs, refs, prenorms, logits, logits64, drift, facts)
        total += dir_size(os.path.join(args.out, name))
    print(f"total size: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
