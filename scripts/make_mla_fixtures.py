#!/usr/bin/env python3
"""Generate tiny random-weight checkpoints of the multi-head latent attention families (DeepSeek-V3,
DeepSeek-V2, GLM-4.7-Flash, DeepSeek-V3.2, GLM-5), built with transformers' own config classes, and Hugging Face reference
hidden states and log-probabilities, used by tests/mla.rs.

Output layout (default: tests/fixtures/mla relative to the repository root):

    <out>/<variant>/config.json              the config class's save_pretrained, "dtype": "bfloat16"
    <out>/<variant>/model.safetensors        the model's state as save_pretrained names it, bfloat16
                                             (deepseek_v3: plus one multi-token-prediction layer,
                                             model.layers.{L}.*, that the decoder never reads)
    <out>/<variant>/tokenizer.json, tokenizer_config.json, chat_template.jinja
                                             copied from tests/fixtures/tiny/qwen3_qknorm (vocab 512)
    <out>/<variant>/reference.safetensors    seq{i}.input_ids        int64   [T_i]
                                             seq{i}.hidden_states    float32 [L+1, T_i, H]
                                             seq{i}.hidden_states_f64 float64 [L+1, T_i, H]
                                             seq{i}.final_prenorm    float32 [T_i, H]
                                             seq{i}.logprob_ids      int64   [T_i, K] top-K next-token ids
                                             seq{i}.logprobs         float32 [T_i, K] their log-probabilities
                                             seq{i}.target_logprobs  float32 [T_i] lp of the next token (NaN last)
    <out>/<variant>/reference.json           facts: the routing's margins, how often the expert groups
                                             change a token's experts, transformers-f32's distance from f64

Variants (hidden 64, 3 layers: the first a dense MLP of 96, then mixtures of 8 experts of 16, top 3;
4 heads; vocab 512):

    deepseek_v3        DeepseekV3Config: q_lora_rank 24, kv_lora_rank 32, qk_nope 16, qk_rope 8, v 12;
                       interleaved rope, YaRN (factor 4 over 32 positions, mscale 1, mscale_all_dim 0.8:
                       the softmax scale changes); sigmoid scores with a random correction bias, 4 groups
                       of 2 of which 2 are kept, norm_topk_prob, routed_scaling_factor 2.5, one shared
                       expert; first_k_dense_replace 1; num_nextn_predict_layers 1.
    deepseek_v2_lite   DeepseekV2Config as DeepSeek-V2-Lite sets it: q_lora_rank null (a plain q_proj),
                       softmax scores, topk_method greedy, no renormalisation, routed_scaling_factor 1.5,
                       two shared experts, first_k_dense_replace 1; YaRN (factor 4, mscale 0.707 both).
    deepseek_v2_grouped  the same with topk_method group_limited_greedy (4 groups, 2 kept).
    glm4_moe_lite      Glm4MoeLiteConfig (GLM-4.7-Flash): q_lora_rank 24, v_head_dim 32 (larger than
                       qk 24), default rope (theta 10,000), mlp_layer_types [dense, sparse, sparse],
                       sigmoid scores, 2 groups of 4 with 1 kept, routed_scaling_factor 1.8, tied
                       embeddings.
    deepseek_v32       DeepseekV32Config (DeepSeek-V3.2): as deepseek_v3 (no multi-token-prediction layer),
                       with its sparse attention's lightning indexer in every layer: index_topk 16, 2 indexer
                       heads of 16; sequences of 1, 5, 11 and 16 tokens, so every query keeps all its keys.
    glm_moe_dsa        GlmMoeDsaConfig (GLM-5): as glm4_moe_lite with routed_scaling_factor 2.5, untied,
                       the same indexer, indexer_types [full, shared, full] (layer 1 stores no indexer and
                       reuses layer 0's choice); the same sequences.

Every parameter (the indexers' LayerNorm too) and the correction bias are random; every stored value is a bfloat16 value (the
float32 reference is exact for the stored values). The references are computed in float32 with eager
attention and experts, each sequence alone; the float64 run (model.double(), the RMSNorms computing in
float64; the routers stay float32 as transformers computes them) gives transformers-f32's own distance.
Router seeds are drawn until every token's choice (groups and experts) has a margin of at least
MIN_GAP and the groups change some tokens' experts.

Usage: python scripts/make_mla_fixtures.py [--out tests/fixtures/mla] [--only VARIANT ...]
"""

import importlib.util
import os
import sys
import types

_FORBIDDEN = [p for p in ("fla", "causal_conv1d") if importlib.util.find_spec(p) is not None]
if _FORBIDDEN:
    sys.exit(f"refusing to run: {', '.join(_FORBIDDEN)} importable; use a venv without them")
os.environ["HF_HUB_OFFLINE"] = "1"

import math  # noqa: E402

import torch  # noqa: E402
from transformers import (  # noqa: E402
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    Glm4MoeLiteConfig,
    Glm4MoeLiteForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
)

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
    logprob_tensors,
    randn,
    random_sequences,
    read_file,
    read_json,
    reference_tensors,
    save_tensors,
    selected,
    setup_torch,
    versions,
    write_json,
)

DEFAULT_OUT = os.path.join(FIXTURES_DIR, "mla")
TOKENIZER_DIR = os.path.join(TINY_DIR, "qwen3_qknorm")
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]

H, L, VOCAB, HEADS = 64, 3, 512, 4
EXPERTS, TOP_K, MOE_INTER, INTER = 8, 3, 16, 96
SEQ_LENGTHS = [1, 3, 17, 48]  # 48: past YaRN's 32 original positions
# The sparse-attention variants: index_topk 16, so every sequence (at most 16 tokens) keeps all its
# keys, and attention is dense (longer ones are refused by the engine).
INDEX_TOPK = 16
SPARSE_LENGTHS = [1, 5, 11, 16]
SEQ_SEED = 4321
WEIGHT_SEED = 0
ROUTER_SEED = 100
MAX_ROUTER_ATTEMPTS = 300
MIN_GAP = 2e-5
MAX_F32_DRIFT = 3e-6
LOGPROB_K = 5

EMBED_STD, LINEAR_STD, EXPERT_STD = 0.5, 0.1, 0.15
NORM_STD = 0.3  # 1 + NORM_STD * randn
ROUTER_STD, CORRECTION_STD = 0.3, 0.05

COMMON = dict(
    hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB,
    n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=MOE_INTER, intermediate_size=INTER,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, max_position_embeddings=128, bos_token_id=None,
    eos_token_id=2, pad_token_id=0,
)

VARIANTS = {
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
        q_lora_rank=24, v_head_dim=12, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        n_shared_experts=1, first_k_dense_replace=1, rope_interleave=True, rms_norm_eps=1e-6,
        num_nextn_predict_layers=1, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8),
    )),
    "deepseek_v2_lite": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(
        q_lora_rank=None, v_head_dim=12, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=1.5, n_shared_experts=2, first_k_dense_replace=1, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                             beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707),
    )),
    "deepseek_v2_grouped": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(
        q_lora_rank=None, v_head_dim=12, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        norm_topk_prob=False, routed_scaling_factor=1.5, n_shared_experts=2, first_k_dense_replace=1,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                             beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707),
    )),
    "glm4_moe_lite": (Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, dict(
        q_lora_rank=24, v_head_dim=32, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8,
        n_shared_experts=1, mlp_layer_types=["dense", "sparse", "sparse"], rope_interleave=True, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    )),
    "deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM, dict(
        q_lora_rank=24, v_head_dim=12, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        n_shared_experts=1, first_k_dense_replace=1, rms_norm_eps=1e-6, tie_word_embeddings=False,
        index_topk=INDEX_TOPK, index_n_heads=2, index_head_dim=16, lengths=SPARSE_LENGTHS,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8),
    )),
    "glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM, dict(
        q_lora_rank=24, v_head_dim=32, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        n_shared_experts=1, mlp_layer_types=["dense", "sparse", "sparse"], first_k_dense_replace=1,
        rms_norm_eps=1e-5, tie_word_embeddings=False, index_topk=INDEX_TOPK, index_n_heads=2, index_head_dim=16,
        indexer_types=["full", "shared", "full"], lengths=SPARSE_LENGTHS,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    )),
}


def build(name):
    cfg_cls, model_cls, kw = VARIANTS[name]
    kw = dict(kw)
    kw.pop("lengths", None)
    mtp = kw.pop("num_nextn_predict_layers", 0)
    cfg = cfg_cls(**COMMON, **kw)
    if mtp:
        cfg.num_nextn_predict_layers = mtp
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(WEIGHT_SEED)
    return model_cls(cfg).float().eval()


def routing_of(model):
    """(router module, its config) of each MoE layer."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]


def randomise(model, gen):
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
                if cls.endswith("RMSNorm"):
                    put(p, randn(p.shape, gen, NORM_STD, 1.0), f"RMSNorm weight: 1 + {NORM_STD}*randn")
                elif cls.endswith("TopkRouter"):
                    put(p, randn(p.shape, gen, ROUTER_STD), f"router weight: {ROUTER_STD}*randn")
                elif cls.endswith("Experts"):
                    put(p, randn(p.shape, gen, EXPERT_STD), f"experts {pname}: {EXPERT_STD}*randn")
                elif isinstance(mod, torch.nn.Embedding):
                    put(p, randn(p.shape, gen, EMBED_STD), f"embed_tokens: {EMBED_STD}*randn")
                elif isinstance(mod, torch.nn.LayerNorm):  # the sparse attention's indexer
                    mean = 1.0 if pname == "weight" else 0.0
                    put(p, randn(p.shape, gen, NORM_STD, mean), f"LayerNorm {pname}: {mean} + {NORM_STD}*randn")
                elif isinstance(mod, torch.nn.Linear) and pname == "weight":
                    put(p, randn(p.shape, gen, LINEAR_STD), f"Linear weight: {LINEAR_STD}*randn")
                else:
                    raise AssertionError(f"no randomisation rule for {mname}.{pname} ({cls})")
    missing = [n for n, p in model.named_parameters() if id(p) not in done]
    assert not missing, f"not randomised: {missing}"
    return counts


def randomise_routers(model, gen):
    with torch.no_grad():
        for r in routing_of(model):
            r.weight.copy_(randn(r.weight.shape, gen, ROUTER_STD))
            if hasattr(r, "e_score_correction_bias"):
                r.e_score_correction_bias.copy_(randn(r.e_score_correction_bias.shape, gen, CORRECTION_STD))


def round_to_bf16(model):
    with torch.no_grad():
        biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for t in list(model.parameters()) + biases:
            t.copy_(t.to(torch.bfloat16).to(torch.float32))


def choice_margins(router, logits):
    """This script's own reading of the router: the smallest margin of the groups kept and of the
    experts chosen over the tokens of `logits` [T, E], and how many tokens' experts the groups change."""
    cfg = router
    e = logits.shape[-1]
    sigmoid = hasattr(router, "e_score_correction_bias")
    scores = logits.sigmoid() if sigmoid else logits.softmax(-1)
    choice = scores + router.e_score_correction_bias if sigmoid else scores
    gap, changed = math.inf, 0
    groups = getattr(cfg, "num_group", None) or 1
    keep = getattr(cfg, "topk_group", None) or groups
    limited = sigmoid or getattr(cfg, "topk_method", "greedy") == "group_limited_greedy"
    masked = choice.clone()
    if limited and keep < groups:
        per = choice.view(-1, groups, e // groups)
        gs = per.topk(2, -1).values.sum(-1) if sigmoid else per.max(-1).values
        top = gs.sort(-1, descending=True)
        gap = min(gap, (top.values[:, keep - 1] - top.values[:, keep]).min().item())
        mask = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, top.indices[:, :keep], True)
        masked = choice.masked_fill(~mask.repeat_interleave(e // groups, 1), -math.inf)
    top = masked.sort(-1, descending=True).values
    if torch.isfinite(top[:, TOP_K]).any():
        fin = torch.isfinite(top[:, TOP_K])
        gap = min(gap, (top[fin, TOP_K - 1] - top[fin, TOP_K]).min().item())
    a = masked.topk(TOP_K, -1).indices.sort(-1).values
    b = choice.topk(TOP_K, -1).indices.sort(-1).values
    changed = int((a != b).any(-1).sum().item())
    return gap, changed


@torch.no_grad()
def run_reference(model, ids):
    base = model.model
    cap = {"router": []}

    def keep(key):
        def hook(_mod, _inp, out):
            cap[key] = layer_output(out)
        return hook

    def keep_router(mod, _inp, out):
        cap["router"].append((mod, out[0].detach().clone()))

    hooks = [base.embed_tokens.register_forward_hook(keep("embed")), base.norm.register_forward_hook(keep("norm"))]
    hooks += [layer.register_forward_hook(keep(f"layer{i}")) for i, layer in enumerate(base.layers)]
    hooks += [m.register_forward_hook(keep_router) for m in routing_of(model)]
    try:
        out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    hs = torch.stack(out.hidden_states)[:, 0].contiguous()
    T = ids.shape[0]
    assert hs.dtype == torch.float32 and hs.shape == (L + 1, T, H), hs.shape
    assert torch.isfinite(hs).all()
    assert torch.equal(hs[0], cap["embed"][0])
    for i in range(1, L):
        assert torch.equal(hs[i], cap[f"layer{i - 1}"][0]), f"index {i} is not decoder layer {i - 1}'s output"
    assert torch.equal(hs[L], cap["norm"][0])
    prenorm = cap[f"layer{L - 1}"][0].contiguous()
    check_final_prenorm(base.norm, prenorm, hs[L])
    gap, changed = math.inf, 0
    for mod, logits in cap["router"]:
        g, c = choice_margins(mod, logits)
        gap, changed = min(gap, g), changed + c
    return hs, prenorm, gap, changed, out.logits[0].float()


def references(model, seqs):
    refs, prenorms, logits, gap, changed = [], [], [], math.inf, 0
    for ids in seqs:
        hs, prenorm, g, c, lg = run_reference(model, ids)
        refs.append(hs)
        prenorms.append(prenorm)
        logits.append(lg)
        gap, changed = min(gap, g), changed + c
    return refs, prenorms, logits, gap, changed


def norm_in_input_dtype(self, x):
    variance = x.pow(2).mean(-1, keepdim=True)
    return self.weight.to(x.dtype) * (x * torch.rsqrt(variance + self.variance_epsilon))


@torch.no_grad()
def float64_run(model, seqs):
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    for m in norms:
        m.forward = types.MethodType(norm_in_input_dtype, m)
    model.double()
    try:
        outs = [model(ids[None], output_hidden_states=True, use_cache=False) for ids in seqs]
        return [torch.stack(o.hidden_states)[:, 0] for o in outs], [o.logits[0] for o in outs]
    finally:
        model.float()
        for m in norms:
            del m.forward








def mtp_tensors(saved):
    """One multi-token-prediction layer as DeepSeek-V3's release stores it after the decoder's
    (layers.{L}: a decoder layer plus enorm, hnorm, eh_proj and its own norm), random values."""
    gen = torch.Generator().manual_seed(7)
    out = {}
    for k, v in saved.items():
        prefix = f"model.layers.{L - 1}."
        if k.startswith(prefix):
            out[f"model.layers.{L}." + k[len(prefix):]] = randn(v.shape, gen, 0.1).to(torch.bfloat16)
    for n, shape in [("enorm.weight", (H,)), ("hnorm.weight", (H,)), ("eh_proj.weight", (H, 2 * H)),
                     ("shared_head.norm.weight", (H,))]:
        out[f"model.layers.{L}.{n}"] = randn(shape, gen, 0.1).to(torch.bfloat16)
    return out


def write_variant(name, model, out_dir, seqs, refs, facts):
    vdir = os.path.join(out_dir, name)
    fresh_dir(vdir)
    model.save_pretrained(vdir)
    saved = read_file(os.path.join(vdir, "model.safetensors"))
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in saved.items()}
    for k, v in saved.items():
        assert torch.equal(tensors[k].float(), v), f"{k} is not a bfloat16 value"
    assert any("e_score_correction_bias" in k for k in tensors) == (name not in ("deepseek_v2_lite",
                                                                                  "deepseek_v2_grouped"))
    if name == "deepseek_v3":
        tensors.update(mtp_tensors(saved))
    save_tensors(tensors, os.path.join(vdir, "model.safetensors"), metadata={"format": "pt"}, mode=0o644)
    copy_files(TOKENIZER_DIR, vdir, TOKENIZER_FILES)
    cfg_path = os.path.join(vdir, "config.json")
    cfg_json = read_json(cfg_path)
    cfg_json["dtype"] = "bfloat16"
    write_json(cfg_json, cfg_path, sort_keys=True)

    # The references are those of the folder as transformers reads it (the in-memory model's differ
    # in the last bits: its weights sit elsewhere in memory), their margins and drift checked again.
    model_cls = VARIANTS[name][1]
    loaded = model_cls.from_pretrained(vdir, dtype=torch.float32, attn_implementation="eager",
                                       experts_implementation="eager").eval()
    with torch.no_grad():
        for p in loaded.parameters():
            p.data = p.data.clone()
    memory_refs = refs
    refs, prenorms, logits, gap, changed = references(loaded, seqs)
    for a, b in zip(refs, memory_refs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), f"{name}: the folder model is another model: {(a - b).abs().max().item()} {[(a[i] - b[i]).abs().max().item() for i in range(L + 1)]}"
    assert gap >= MIN_GAP and changed == facts["expert_choices_changed_by_groups"], (gap, changed)
    exact, logits64 = float64_run(loaded, seqs)
    facts["f32_vs_f64_relative_error_per_index"] = drift_per_index(refs, exact)
    facts["min_routing_margin"] = gap
    assert max(facts["f32_vs_f64_relative_error_per_index"]) <= MAX_F32_DRIFT
    del loaded

    ref_tensors = reference_tensors(seqs, refs, prenorms)
    for i, ex in enumerate(exact):
        ref_tensors[f"seq{i}.hidden_states_f64"] = ex.contiguous()
    lp_tensors, lp_f32_err, lp_gap = logprob_tensors(seqs, logits, logits64, LOGPROB_K)
    ref_tensors.update(lp_tensors)
    save_tensors(ref_tensors, os.path.join(vdir, "reference.safetensors"), mode=0o644)
    ref = {
        **versions(),
        "model_class": model_cls.__name__,
        "lengths": [len(s) for s in seqs],
        "num_hidden_layers": L,
        "hidden_size": H,
        "logprobs_top_k": LOGPROB_K,
        "logprobs_f32_vs_f64_max_abs": lp_f32_err,
        "logprobs_min_gap_at_k": lp_gap,
        **facts,
        "notes": "hidden_states = torch.stack(model(ids[None], output_hidden_states=True, use_cache=False)"
                 ".hidden_states)[:, 0], each sequence alone, float32, eager attention and experts; index L is "
                 "after the final norm; final_prenorm from a hook on the last decoder layer; hidden_states_f64 "
                 "from model.double() with RMSNorm in float64 (routers in float32, as transformers computes "
                 "them). from_pretrained of the written folder reproduces the reference bit for bit.",
    }
    dump_json(ref, os.path.join(vdir, "reference.json"))
    print(f"{name}: size {dir_size(vdir) / 1e3:.0f} kB")


def main():
    args = fixture_args(__doc__.split("\n")[0], DEFAULT_OUT)
    setup_torch()
    os.makedirs(args.out, exist_ok=True)
    total = 0
    for name, (_, _, kw) in selected(VARIANTS, args.only):
        seqs = random_sequences(VOCAB, kw.get("lengths", SEQ_LENGTHS), SEQ_SEED)
        model = build(name)
        counts = randomise(model, torch.Generator().manual_seed(WEIGHT_SEED))
        rejected = []
        for attempt in range(MAX_ROUTER_ATTEMPTS):
            seed = ROUTER_SEED + attempt
            randomise_routers(model, torch.Generator().manual_seed(seed))
            round_to_bf16(model)
            refs, _, _, gap, changed = references(model, seqs)
            grouped = name != "deepseek_v2_lite"
            if gap >= MIN_GAP and (changed > 0 or not grouped):
                exact, _ = float64_run(model, seqs)
                drift = drift_per_index(refs, exact)
                if max(drift) <= MAX_F32_DRIFT:
                    break
            rejected.append(seed)
        else:
            raise AssertionError(f"{name}: no router seed gives margins and an f32 drift within bounds")
        print(f"{name}: router seed {seed} ({len(rejected)} rejected), min margin {gap:.2e}, tokens whose experts "
              f"the groups change {changed}, f32 vs f64 per index " + " ".join(f"{d:.1e}" for d in drift))
        facts = {
            "router_seed": seed,
            "router_seeds_rejected": len(rejected),
            "min_routing_margin": gap,
            "expert_choices_changed_by_groups": changed,
            "f32_vs_f64_relative_error_per_index": drift,
            "randomised": counts,
        }
        write_variant(name, model, args.out, seqs, refs, facts)
        total += dir_size(os.path.join(args.out, name))
    print(f"total size: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
