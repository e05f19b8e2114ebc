#!/usr/bin/env python3
"""Generate tiny random-weight gpt-oss checkpoints (GptOssForCausalLM, built with transformers' own
GptOssConfig) and Hugging Face reference hidden states and log-probabilities, used by tests/gpt_oss.rs.

Output layout (default: tests/fixtures/gpt_oss relative to the repository root):

    <out>/<variant>/config.json              transformers' GptOssConfig as save_pretrained writes it
                                             (gpt_oss_mxfp4: plus the released quantization_config)
    <out>/<variant>/model.safetensors        written by this script (see the variants)
    <out>/<variant>/tokenizer.json, tokenizer_config.json, chat_template.jinja
                                             copied from tests/fixtures/tiny/qwen3_qknorm (vocab <= 512)
    <out>/<variant>/reference.safetensors    seq{i}.input_ids        int64   [T_i]
                                             seq{i}.hidden_states    float32 [L+1, T_i, H]
                                             seq{i}.final_prenorm    float32 [T_i, H] (the last decoder
                                                 layer's output before the final norm, same pass)
                                             seq{i}.logprob_ids      int64   [T_i, K] top-K next-token ids
                                             seq{i}.logprobs         float32 [T_i, K] their log-probabilities
                                             seq{i}.target_logprobs  float32 [T_i] lp of the next token (NaN last)
                                             seq2.hidden_states_bf16 float32 [L+1, T_2, H] (transformers
                                                 run in bfloat16, for comparison)
    <out>/<variant>/reference.json           facts, transformers-f32's per-index distance from float64
    <out>/rope_reference.json                the rotary embedding of gpt-oss-20b's released shape (head_dim
                                             64, YaRN factor 32 over 4,096 positions, theta 150,000), with
                                             truncate false (as released) and true: transformers' config,
                                             inv_freq, attention scaling and cos/sin at a few positions

Variants (hidden 64, 4 layers [sliding, full, sliding, full], window 12, 4 query / 2 key-value heads
of 16, 8 experts of 32, top-4, vocab 512, YaRN factor 32 over 4,096 positions, truncate false):

    gpt_oss_mxfp4   the released layout: every float parameter stored as bfloat16; the experts'
                    gate_up_proj and down_proj as MXFP4 (mlp.experts.{gate_up_proj,down_proj}_blocks
                    uint8 [E, out, in/32, 16], two e2m1 values a byte, the low nibble first, and
                    _scales uint8 [E, out, in/32], E8M0), their biases bfloat16; untied lm_head;
                    config.json declares quantization_config {"quant_method": "mxfp4", ...}.
    gpt_oss_bf16    the same weights as transformers' GptOss saves them (gate_up_proj [E, H, 2I] with
                    gate in the even columns, down_proj [E, I, H], biases), all bfloat16, no
                    quantization_config; the embeddings tied to the head (no lm_head). Its hidden
                    states equal gpt_oss_mxfp4's bit for bit (every MXFP4 value is a bf16 value).

Every parameter is random: the MXFP4 experts are random nibbles and scales written by this script,
dequantised by this script's own code; transformers' Mxfp4 loader (from_pretrained with
Mxfp4Config(dequantize=True)) reading the written folder is checked to give the same parameters
and the same hidden states. swiglu_limit is 1.5 (the released 7 would clamp nothing in a model this
small; reference.json gives the share of gate and up values clamped). The references are computed
in float32 with eager attention and eager experts, each sequence alone (batch 1, use_cache=False);
the float64 run (model.double(), RMSNorm computing in the input's dtype; the rotary tables stay
float32, as transformers computes them) gives transformers-f32's own distance per index.

Usage: python scripts/make_gptoss_fixtures.py [--out tests/fixtures/gpt_oss] [--only VARIANT ...]
"""

import importlib.util
import os
import sys

_FORBIDDEN = [p for p in ("fla", "causal_conv1d") if importlib.util.find_spec(p) is not None]
if _FORBIDDEN:
    sys.exit(f"refusing to run: {', '.join(_FORBIDDEN)} importable; use a venv without them")
os.environ["HF_HUB_OFFLINE"] = "1"

import json  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402
from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402

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

DEFAULT_OUT = os.path.join(FIXTURES_DIR, "gpt_oss")
TOKENIZER_DIR = os.path.join(TINY_DIR, "qwen3_qknorm")
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]

H, L, VOCAB = 64, 4, 512
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
EXPERTS, TOP_K, INTER = 8, 4, 32
WINDOW = 12
SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = [SLIDING, FULL, SLIDING, FULL]
SWIGLU_LIMIT = 1.5
ROPE = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=4096)
SEQ_LENGTHS = [1, 3, 12, 13, 40, 100]  # 12 and 13: the window's edge; 40 and 100 well past it
SEQ_SEED = 1234
WEIGHT_SEED = 0
ROUTER_SEED = 100
MAX_ROUTER_ATTEMPTS = 200
MIN_ROUTER_GAP = 1e-4  # logit_k - logit_(k+1), every token of every layer
MAX_F32_DRIFT = 3e-6
LOGPROB_K = 5

# --- randomisation (std of normal draws)
EMBED_STD = 0.5
LINEAR_STD = 0.1
BIAS_STD = 0.1
SINK_STD = 1.0
NORM_STD = 0.3  # 1 + NORM_STD * randn
ROUTER_STD, ROUTER_BIAS_STD = 0.25, 0.5
MXFP4_SCALES = (122, 123, 124)  # E8M0 exponents 2^-5 .. 2^-3
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def config(tied):
    return GptOssConfig(
        hidden_size=H, intermediate_size=INTER, num_hidden_layers=L, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        vocab_size=VOCAB, sliding_window=WINDOW, layer_types=list(LAYER_TYPES), max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=dict(ROPE), swiglu_limit=SWIGLU_LIMIT, tie_word_embeddings=tied,
        attention_bias=True, bos_token_id=None, eos_token_id=2, pad_token_id=0,
    )


def build(tied):
    cfg = config(tied)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(WEIGHT_SEED)
    return GptOssForCausalLM(cfg).float().eval()


# --------------------------------------------------------------------------- MXFP4 (this script's own code)


def mxfp4_dequantise(blocks, scales):
    """[E, out, G, 16] uint8 e2m1 pairs (low nibble first) and [E, out, G] E8M0 -> [E, out, G * 32] f32."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    lo, hi = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack([lo, hi], dim=-1).reshape(*blocks.shape[:-1], 32)  # [E, out, G, 32]
    values = values * torch.pow(2.0, scales.to(torch.float64) - 127).to(torch.float32)[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


def random_mxfp4(e, out, inp, gen):
    blocks = torch.randint(0, 256, (e, out, inp // 32, 16), generator=gen, dtype=torch.int64).to(torch.uint8)
    pick = torch.randint(0, len(MXFP4_SCALES), (e, out, inp // 32), generator=gen)
    scales = torch.tensor(MXFP4_SCALES, dtype=torch.uint8)[pick]
    return blocks, scales


# --------------------------------------------------------------------------- randomisation


def randomise(model, gen, router_gen):
    """Every parameter random; returns the MXFP4 tensors of the experts and counts per category."""
    counts, done, mx = {}, set(), {}

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
                if cls == "GptOssRMSNorm":
                    put(p, randn(p.shape, gen, NORM_STD, 1.0), f"RMSNorm weight: 1 + {NORM_STD}*randn")
                elif cls == "GptOssAttention" and pname == "sinks":
                    put(p, randn(p.shape, gen, SINK_STD), f"attention sinks: {SINK_STD}*randn")
                elif cls == "GptOssTopKRouter":
                    std = ROUTER_STD if pname == "weight" else ROUTER_BIAS_STD
                    put(p, randn(p.shape, router_gen, std), f"router {pname}: {std}*randn")
                elif cls == "GptOssExperts" and pname in ("gate_up_proj", "down_proj"):
                    e, inp, out = p.shape  # transformers multiplies x @ W[e]: [in, out]
                    blocks, scales = random_mxfp4(e, out, inp, gen)
                    mx[f"{mname}.{pname}"] = (blocks, scales)
                    put(p, mxfp4_dequantise(blocks, scales).transpose(1, 2),
                        f"experts {pname}: random MXFP4 (nibbles uniform, E8M0 scales in {MXFP4_SCALES})")
                elif cls == "GptOssExperts":
                    put(p, randn(p.shape, gen, BIAS_STD), f"experts {pname}: {BIAS_STD}*randn")
                elif isinstance(mod, torch.nn.Embedding):
                    put(p, randn(p.shape, gen, EMBED_STD), f"embed_tokens: {EMBED_STD}*randn")
                elif isinstance(mod, torch.nn.Linear) and pname == "weight":
                    put(p, randn(p.shape, gen, LINEAR_STD), f"Linear weight: {LINEAR_STD}*randn")
                elif isinstance(mod, torch.nn.Linear) and pname == "bias":
                    put(p, randn(p.shape, gen, BIAS_STD), f"Linear bias: {BIAS_STD}*randn")
                else:
                    raise AssertionError(f"no randomisation rule for {full} ({cls})")
    missing = [n for n, p in model.named_parameters() if id(p) not in done]
    assert not missing, f"not randomised: {missing}"
    return mx, counts


def randomise_routers(model, gen):
    with torch.no_grad():
        for mod in model.modules():
            if type(mod).__name__ == "GptOssTopKRouter":
                mod.weight.copy_(randn(mod.weight.shape, gen, ROUTER_STD))
                mod.bias.copy_(randn(mod.bias.shape, gen, ROUTER_BIAS_STD))


def round_to_bf16(model):
    """Every parameter rounded to bfloat16 (kept as float32, so the float32 reference is exact for the
    stored values); the MXFP4 values are bfloat16 values already (checked)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                assert torch.equal(p, p.to(torch.bfloat16).float()), name
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


# --------------------------------------------------------------------------- reference


@torch.no_grad()
def run_reference(model, ids, stats=None):
    base = model.model
    cap = {"router": []}

    def keep(key):
        def hook(_mod, _inp, out):
            cap[key] = layer_output(out)
        return hook

    def keep_router(_mod, _inp, out):
        cap["router"].append(out[0].detach().clone())

    def keep_gate_up(mod, inp, out):
        # the experts' inputs: count the gate / up values the clamp changes
        x, idx = inp[0], inp[1]
        for e in idx.unique().tolist():
            rows = (idx == e).any(-1)
            gu = x[rows] @ mod.gate_up_proj[e] + mod.gate_up_proj_bias[e]
            g, u = gu[..., ::2], gu[..., 1::2]
            stats["gate_clamped"] += (g > mod.limit).sum().item()
            stats["up_clamped"] += (u.abs() > mod.limit).sum().item()
            stats["values"] += g.numel()

    hooks = [base.embed_tokens.register_forward_hook(keep("embed")), base.norm.register_forward_hook(keep("norm"))]
    hooks += [layer.register_forward_hook(keep(f"layer{i}")) for i, layer in enumerate(base.layers)]
    hooks += [m.register_forward_hook(keep_router) for m in model.modules() if type(m).__name__ == "GptOssTopKRouter"]
    if stats is not None:
        hooks += [m.register_forward_hook(keep_gate_up) for m in model.modules()
                  if type(m).__name__ == "GptOssExperts"]
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
    gaps = []
    for logits in cap["router"]:
        top = torch.sort(logits, dim=-1, descending=True).values
        gaps.append((top[:, TOP_K - 1] - top[:, TOP_K]).min().item())
    return hs, prenorm, min(gaps), out.logits[0].float()


def references(model, seqs, stop_at_gap=False, stats=None):
    refs, prenorms, logits, gap = [], [], [], math.inf
    for ids in seqs:
        hs, prenorm, g, lg = run_reference(model, ids, stats)
        refs.append(hs)
        prenorms.append(prenorm)
        logits.append(lg)
        gap = min(gap, g)
        if stop_at_gap and gap <= MIN_ROUTER_GAP:
            return None, None, None, gap
    return refs, prenorms, logits, gap


def norm_in_input_dtype(self, x):
    variance = x.pow(2).mean(-1, keepdim=True)
    return self.weight.to(x.dtype) * (x * torch.rsqrt(variance + self.variance_epsilon))


@torch.no_grad()
def float64_run(model, seqs):
    """Hidden states and logits of the model in float64, its RMSNorm computing in float64 too."""
    original = modeling_gpt_oss.GptOssRMSNorm.forward
    modeling_gpt_oss.GptOssRMSNorm.forward = norm_in_input_dtype
    model.double()
    try:
        outs = [model(ids[None], output_hidden_states=True, use_cache=False) for ids in seqs]
        return [torch.stack(o.hidden_states)[:, 0] for o in outs], [o.logits[0] for o in outs]
    finally:
        model.float()
        modeling_gpt_oss.GptOssRMSNorm.forward = original






# --------------------------------------------------------------------------- files




def file_tensors(model, mx, variant):
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    out = {}
    for k, v in state.items():
        if variant == "gpt_oss_mxfp4" and k in mx:
            blocks, scales = mx[k]
            out[f"{k}_blocks"] = blocks.contiguous()
            out[f"{k}_scales"] = scales.contiguous()
        elif variant == "gpt_oss_bf16" and k == "lm_head.weight":
            continue  # tied to the embeddings
        else:
            out[k] = v.to(torch.bfloat16)
    return out


QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
}


def write_variant(name, model, mx, out_dir, seqs, refs, prenorms, logits, logits64, drift, facts):
    vdir = os.path.join(out_dir, name)
    fresh_dir(vdir)
    model.save_pretrained(vdir)
    saved = read_file(os.path.join(vdir, "model.safetensors"))
    assert set(saved) == {k for k in model.state_dict()} - ({"lm_head.weight"} if name == "gpt_oss_bf16" else set()), \
        sorted(saved)[:5]
    tensors = file_tensors(model, mx, name)
    if name == "gpt_oss_bf16":  # what transformers' GptOss saves, in bfloat16
        for k, v in saved.items():
            assert torch.equal(v.float(), tensors[k].float()), k
    save_tensors(tensors, os.path.join(vdir, "model.safetensors"), metadata={"format": "pt"}, mode=0o644)
    copy_files(TOKENIZER_DIR, vdir, TOKENIZER_FILES)
    cfg_path = os.path.join(vdir, "config.json")
    cfg_json = read_json(cfg_path)
    cfg_json["dtype"] = "bfloat16"
    if name == "gpt_oss_mxfp4":
        cfg_json["quantization_config"] = dict(QUANTIZATION_CONFIG)
    write_json(cfg_json, cfg_path, sort_keys=True)

    # ---- the folder as transformers reads it reproduces the parameters and the reference
    kwargs = dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    if name == "gpt_oss_mxfp4":
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    loaded = GptOssForCausalLM.from_pretrained(vdir, **kwargs).eval()
    with torch.no_grad():
        for p in loaded.parameters():  # fresh aligned copies (see make_hybrid_fixtures.py)
            p.data = p.data.clone()
    theirs, ours = loaded.state_dict(), model.state_dict()
    for k, v in ours.items():
        assert torch.equal(theirs[k].float(), v), f"{name}: transformers reads {k} otherwise"
    if name == "gpt_oss_mxfp4":  # and its dequantisation of the blocks is ours
        assert sum(k.endswith("_blocks") for k in tensors) == 2 * L, sorted(tensors)
        for k, (blocks, scales) in mx.items():
            assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32),
                               mxfp4_dequantise(blocks, scales).transpose(1, 2)), k
    with torch.no_grad():
        for ids, ref in zip(seqs, refs):
            got = torch.stack(loaded(ids[None], output_hidden_states=True, use_cache=False).hidden_states)[:, 0]
            assert torch.equal(got, ref), f"{name}: from_pretrained(folder) differs from the reference"
    del loaded

    half = GptOssForCausalLM.from_pretrained(vdir, **dict(kwargs, dtype=torch.bfloat16)).eval()
    with torch.no_grad():
        half_hs = torch.stack(half(seqs[2][None], output_hidden_states=True,
                                   use_cache=False).hidden_states)[:, 0].float()
    bf16_err = [((half_hs[i] - refs[2][i]).norm() / refs[2][i].norm()).item() for i in range(L + 1)]
    del half

    ref_tensors = reference_tensors(seqs, refs, prenorms)
    lp_tensors, lp_f32_err, lp_gap = logprob_tensors(seqs, logits, logits64, LOGPROB_K)
    ref_tensors.update(lp_tensors)
    ref_tensors["seq2.hidden_states_bf16"] = half_hs.contiguous()
    save_tensors(ref_tensors, os.path.join(vdir, "reference.safetensors"), mode=0o644)
    ref = {
        **versions(),
        "model_class": "GptOssForCausalLM",
        "lengths": SEQ_LENGTHS,
        "num_hidden_layers": L,
        "hidden_size": H,
        "layer_types": LAYER_TYPES,
        "sliding_window": WINDOW,
        "rope_parameters": ROPE,
        "swiglu_limit": SWIGLU_LIMIT,
        "tie_word_embeddings": name == "gpt_oss_bf16",
        "file_dtypes": sorted({str(v.dtype).replace("torch.", "") for v in tensors.values()}),
        "f32_vs_f64_relative_error_per_index": drift,
        "logprobs_top_k": LOGPROB_K,
        "logprobs_f32_vs_f64_max_abs": lp_f32_err,
        "logprobs_min_gap_at_k": lp_gap,
        "transformers_bf16_vs_f32_seq2_per_index": bf16_err,
        **facts,
        "notes": "hidden_states = torch.stack(model(ids[None], output_hidden_states=True, use_cache=False)"
                 ".hidden_states)[:, 0], each sequence alone, float32, eager attention and experts; index L is "
                 "after the final norm; final_prenorm from a hook on the last decoder layer. The float64 run "
                 "computes RMSNorm in float64 too; its rotary tables stay float32 (transformers computes them so). "
                 "transformers' from_pretrained of the written folder (MXFP4 via Mxfp4Config(dequantize=True)) "
                 "reproduces every parameter and the reference bit for bit.",
    }
    dump_json(ref, os.path.join(vdir, "reference.json"))
    print(f"{name}: dtypes {ref['file_dtypes']}, size {dir_size(vdir) / 1e3:.0f} kB, bf16 err "
          + " ".join(f"{e:.1e}" for e in bf16_err))


ROPE_POSITIONS = [0, 1, 2, 127, 128, 4095, 4096, 65535, 131071]


@torch.no_grad()
def write_rope_reference(out_dir):
    """transformers' GptOssRotaryEmbedding for the released 20b shape (GptOssConfig's defaults with 24
    layers and 32 experts), YaRN truncate false (released) and true."""
    cases = []
    for truncate in (False, True):
        rope = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=truncate,
                    original_max_position_embeddings=4096)
        cfg = GptOssConfig(num_hidden_layers=24, num_local_experts=32, rope_parameters=rope,
                           architectures=["GptOssForCausalLM"])
        emb = modeling_gpt_oss.GptOssRotaryEmbedding(cfg)
        cos, sin = emb(torch.zeros(1, dtype=torch.float32), torch.tensor([ROPE_POSITIONS]))
        assert cos.dtype == torch.float32 and cos.shape == (1, len(ROPE_POSITIONS), 32), cos.shape
        cases.append({
            "config": json.loads(cfg.to_json_string()),
            "inv_freq": [float(x) for x in emb.inv_freq.tolist()],
            "attention_scaling": emb.attention_scaling,
            "positions": ROPE_POSITIONS,
            "cos": cos[0].tolist(),
            "sin": sin[0].tolist(),
        })
    dump_json({**versions(), "cases": cases}, os.path.join(out_dir, "rope_reference.json"))


def main():
    args = fixture_args(__doc__.split("\n")[0], DEFAULT_OUT)
    setup_torch()
    os.makedirs(args.out, exist_ok=True)
    write_rope_reference(args.out)
    seqs = random_sequences(VOCAB, SEQ_LENGTHS, SEQ_SEED)

    model = build(tied=False)
    mx, counts = randomise(model, torch.Generator().manual_seed(WEIGHT_SEED), torch.Generator().manual_seed(ROUTER_SEED))
    round_to_bf16(model)
    rejected = []
    for attempt in range(MAX_ROUTER_ATTEMPTS):
        seed = ROUTER_SEED + attempt
        randomise_routers(model, torch.Generator().manual_seed(seed))
        round_to_bf16(model)
        refs, _, _, gap = references(model, seqs, stop_at_gap=True)
        if refs is not None and max(drift_per_index(refs, float64_run(model, seqs)[0])) <= MAX_F32_DRIFT:
            break
        rejected.append(seed)
    else:
        raise AssertionError("no router seed gives a top-k logit gap and an f32 drift within bounds")
    stats = {"gate_clamped": 0, "up_clamped": 0, "values": 0}
    refs, prenorms, logits, gap = references(model, seqs, stats=stats)
    exact, logits64 = float64_run(model, seqs)
    drift = drift_per_index(refs, exact)
    print(f"router seed {seed} ({len(rejected)} rejected), min top-{TOP_K} logit gap {gap:.2e}, "
          f"f32 vs f64 per index " + " ".join(f"{d:.1e}" for d in drift))
    clamped = {k: stats[k] / stats["values"] for k in ("gate_clamped", "up_clamped")}
    print(f"clamped: {clamped}")
    assert all(0.02 < v < 0.5 for v in clamped.values()), clamped
    facts = {
        "router_seed": seed,
        "router_seeds_rejected": len(rejected),
        "min_router_topk_logit_gap": gap,
        "share_clamped": clamped,
        "randomised": counts,
    }

    tied = build(tied=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    tied.load_state_dict(state, strict=False)
    assert torch.equal(tied.lm_head.weight, model.model.embed_tokens.weight)
    tied_refs, tied_prenorms, tied_logits, _ = references(tied, seqs)
    for a, b in zip(tied_refs, refs):
        assert torch.equal(a, b), "the tied variant's states differ"
    _, tied_logits64 = float64_run(tied, seqs)

    variants = {
        "gpt_oss_mxfp4": (model, refs, prenorms, logits, logits64),
        "gpt_oss_bf16": (tied, tied_refs, tied_prenorms, tied_logits, tied_logits64),
    }
    total = 0
    for name, (m, r, p, lg, lg64) in selected(variants, args.only):
        write_variant(name, m, mx, args.out, seqs, r, p, lg, lg64, drift, facts)
        total += dir_size(os.path.join(args.out, name))
    print(f"total size: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
