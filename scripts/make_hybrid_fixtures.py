#!/usr/bin/env python3
"""Generate tiny random-weight checkpoints of the hybrid (Gated DeltaNet + gated attention) and
mixture-of-experts Qwen families plus Hugging Face reference hidden states, used by the Rust
test-suite. Companion of scripts/make_fixtures.py (dense families).

Output layout (default: tests/fixtures/tiny relative to the repository root):

    <out>/<variant>/config.json, generation_config.json
    <out>/<variant>/model.safetensors        the checkpoint, written by this script (see below)
    <out>/<variant>/tokenizer.json, tokenizer_config.json, chat_template.jinja
                                             copied from <out>/qwen3_qknorm (vocab <= 512)
    <out>/<variant>/reference.safetensors    seq{i}.input_ids      int64   [T_i]
                                             seq{i}.hidden_states  float32 [L+1, T_i, H]
                                             seq{i}.final_prenorm  float32 [T_i, H]
                                                 the last decoder layer's output BEFORE the final
                                                 norm (forward hook on the last decoder layer, same
                                                 forward pass; hidden_states[L] is after the norm)
                                             seq2.hidden_states_bf16 float32 [L+1, T_2, H]
                                                 (transformers run in bfloat16, for comparison)
    <out>/<variant>/reference.json

Variants (hidden 32, 4 layers unless said otherwise, vocab 512):

    qwen3_5_hybrid          Qwen3_5ForConditionalGeneration (tiny vision tower), text weights under
                            model.language_model., layer_types [lin, lin, lin, full], fake mtp.*
                            tensors in the file that must be ignored; float32.
    qwen3_5_deep            as qwen3_5_hybrid but 6 layers, [lin, full, lin, lin, full, lin] (each kind more
                            than once, a linear-attention layer last), no mtp.* tensors; float32.
    qwen3_5_moe_fused       Qwen3_5MoeForConditionalGeneration, no layer_types in config.json but
                            full_attention_interval 2 ([lin, full, lin, full]); experts FUSED
                            (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]);
                            stored bfloat16 except A_log and linear_attn.norm.weight (float32).
    qwen3_next_per_expert   Qwen3NextForCausalLM, fused in_proj_qkvz / in_proj_ba, experts written
                            PER EXPERT (mlp.experts.{e}.{gate,up,down}_proj.weight), layer 1 dense.
    qwen3_moe               Qwen3MoeForCausalLM, decoder_sparse_step 2 (layers 1, 3 MoE), per expert.
    qwen3_5_text            Qwen3_5ForCausalLM (model_type qwen3_5_text), weights under model.,
                            layer_types [lin, full, lin, lin]; float32.

The reference of every sequence is computed alone (batch 1, no padding, use_cache=False), float32,
eager attention, eager experts, with the pure-torch Gated DeltaNet path: the script refuses to run
when `fla` or `causal_conv1d` is importable, because transformers would silently use their kernels.

Pinned package versions: scripts/requirements-fixtures.txt.
Usage: python scripts/make_hybrid_fixtures.py [--out tests/fixtures/tiny] [--only VARIANT ...]

The committed files were generated with torch's default CPU kernels on an AVX-512 machine
(ATEN_CPU_CAPABILITY unset); AVX2 kernels give other last bits and another router seed.
"""

import importlib.util
import os
import sys

_FORBIDDEN = [p for p in ("fla", "causal_conv1d") if importlib.util.find_spec(p) is not None]
if _FORBIDDEN:
    sys.exit(
        f"refusing to run: {', '.join(_FORBIDDEN)} importable; transformers would use their kernels "
        "instead of the pure-torch reference path. Use a venv without them "
        "(scripts/requirements-fixtures.txt)."
    )
os.environ["HF_HUB_OFFLINE"] = "1"  # everything is built from configs in code

import math  # noqa: E402
import re  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5TextConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from fixture_common import (  # noqa: E402
    TINY_DIR,
    check_final_prenorm,
    copy_files,
    dir_size,
    dump_json,
    fixture_args,
    fresh_dir,
    layer_output,
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

DEFAULT_OUT = TINY_DIR
TOKENIZER_SOURCE = "qwen3_qknorm"  # variant folder (inside --out) whose tokenizer files are copied
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]

# lengths cross the Gated DeltaNet chunk size (64) of transformers' torch_chunk_gated_delta_rule
SEQ_LENGTHS = [1, 3, 63, 64, 65, 130, 300]
SEQ_SEED = 1234
WEIGHT_SEED = 0
ROUTER_SEED = 100  # router weights use their own generator: seed ROUTER_SEED + attempt
MAX_ROUTER_ATTEMPTS = 400
MIN_ROUTER_GAP = 1e-4  # p_k - p_{k+1} (softmax probabilities) for every token and MoE layer

# --- randomisation (std of normal draws unless said otherwise)
EMBED_STD = 0.5
# every text Linear / expert matrix. 0.15 made the tiny model chaotic: transformers' own f32 drifted
# 1e-5 from its f64 result and bf16 by 0.1-0.2; at 0.1 f32 stays within 2e-6 of f64 (checked below,
# MAX_F32_DRIFT) while activations stay O(1).
LINEAR_STD = 0.1
# The references must be well conditioned: transformers' f32 states within this relative error of
# the same model in float64, at every index of every sequence (otherwise a 1e-5 comparison in f32
# would measure the model's chaos, not the engine).
MAX_F32_DRIFT = 3e-6
# Router: with |x| ~ sqrt(32) after the (1 + w) norm, std 0.25 gives logits of std ~1.5, where
# near-ties of the k-th/(k+1)-th softmax probabilities are least likely (std 0.5 -> logits ~3 is
# worse: the top expert takes most of the mass and p_2 - p_3 shrinks). Even so an i.i.d. draw has
# only a few % chance that all ~2500 (token, layer) gaps of qwen3_5_moe_fused exceed 1e-4, so the
# router seed is searched (deterministically, ROUTER_SEED, ROUTER_SEED + 1, ...).
ROUTER_STD = 0.25
SHARED_GATE_STD = 0.5
CONV_STD = 0.5  # GDN depthwise conv1d
NORM_STD = 0.3  # zero-centred RMSNorm: w ~ NORM_STD*randn (applied as 1 + w); plain: 1 + NORM_STD*randn
A_RANGE = (0.5, 8.0)  # A_log = log(uniform(A_RANGE))
VISION_STD = 0.1  # vision tower: weights VISION_STD*randn, biases 0.1*randn, LayerNorm 1 + 0.1*randn

H = 32
L = 4
VOCAB = 512
LIN = "linear_attention"
FULL = "full_attention"

COMMON_TEXT = dict(
    hidden_size=H,
    num_hidden_layers=L,
    vocab_size=VOCAB,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    tie_word_embeddings=False,
    # ids of the special tokens of the tiny tokenizer (see make_fixtures.py)
    bos_token_id=None,
    eos_token_id=2,
    pad_token_id=0,
)
ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
GDN = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
SHARED = dict(shared_expert_intermediate_size=24)
ROPE_PARTIAL = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)
# Qwen3.5 writes its M-RoPE keys into rope_parameters; rotary dim = 16 * 0.25 = 4, i.e. 2
# frequencies, so the (interleaved) sections are [1, 1, 0]. Text-only inputs give the same
# position to all three sections, i.e. plain 1-D RoPE.
ROPE_MROPE = dict(ROPE_PARTIAL, mrope_section=[1, 1, 0], mrope_interleaved=True)
VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    in_channels=3,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=H,
    num_position_embeddings=16,
)

# fake multi-token-prediction tensors written into qwen3_5_hybrid; the engine must ignore them
FAKE_MTP = {
    "mtp.fc.weight": [H, 2 * H],
    "mtp.layers.0.input_layernorm.weight": [H],
    "mtp.layers.0.self_attn.q_proj.weight": [2 * 4 * 16, H],
    "mtp.norm.weight": [H],
    "mtp.pre_fc_norm_embedding.weight": [H],
    "mtp.pre_fc_norm_hidden.weight": [H],
}

# parameters kept in float32 when a checkpoint is stored in bfloat16
KEEP_F32 = re.compile(r"(\.A_log|\.linear_attn\.norm\.weight)$")


def qwen3_5_hybrid_config():
    return Qwen3_5Config(
        text_config=dict(
            **COMMON_TEXT, **ATTN, **GDN,
            intermediate_size=64,
            layer_types=[LIN, LIN, LIN, FULL],
            rope_parameters=dict(ROPE_MROPE),
        ),
        vision_config=dict(VISION),
        tie_word_embeddings=False,
    )


DEEP_LAYER_TYPES = [LIN, FULL, LIN, LIN, FULL, LIN]


def qwen3_5_deep_config():
    return Qwen3_5Config(
        text_config=dict(
            COMMON_TEXT, **ATTN, **GDN,
            num_hidden_layers=len(DEEP_LAYER_TYPES),
            intermediate_size=64,
            layer_types=list(DEEP_LAYER_TYPES),
            rope_parameters=dict(ROPE_MROPE),
        ),
        vision_config=dict(VISION),
        tie_word_embeddings=False,
    )


def qwen3_5_moe_config():
    return Qwen3_5MoeConfig(
        text_config=dict(
            **COMMON_TEXT, **ATTN, **GDN, **MOE, **SHARED,
            full_attention_interval=2,
            rope_parameters=dict(ROPE_MROPE),
        ),
        vision_config=dict(VISION),
        tie_word_embeddings=False,
    )


def qwen3_next_config():
    return Qwen3NextConfig(
        **COMMON_TEXT, **ATTN, **GDN, **MOE, **SHARED,
        intermediate_size=64,
        layer_types=[LIN, LIN, LIN, FULL],
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        rope_parameters=dict(ROPE_PARTIAL),
    )


def qwen3_moe_config():
    return Qwen3MoeConfig(
        **COMMON_TEXT, **ATTN, **MOE,
        intermediate_size=64,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        mlp_only_layers=[],
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    )


def qwen3_5_text_config():
    return Qwen3_5TextConfig(
        **COMMON_TEXT, **ATTN, **GDN,
        intermediate_size=64,
        layer_types=[LIN, FULL, LIN, LIN],
        rope_parameters=dict(ROPE_MROPE),
    )


VARIANTS = {
    "qwen3_5_hybrid": dict(
        config_fn=qwen3_5_hybrid_config,
        model_cls=Qwen3_5ForConditionalGeneration,
        layer_types=[LIN, LIN, LIN, FULL],
        moe_layers=[],
        experts="none",
        storage="float32",
        extra_tensors=FAKE_MTP,
    ),
    "qwen3_5_deep": dict(
        config_fn=qwen3_5_deep_config,
        model_cls=Qwen3_5ForConditionalGeneration,
        layer_types=list(DEEP_LAYER_TYPES),
        moe_layers=[],
        experts="none",
        storage="float32",
        # model.double() is not float64 throughout: transformers' Qwen3.5 code casts the norms, the
        # gated norm, the gates, the delta rule and the attention softmax to float32 explicitly, so
        # the drift measured against it carries that rounding too. With those casts turned to float64
        # as well, this fixture's f32 references stay within 1.9e-6 of the float64 result (so do the
        # engine's f32 states); against model.double() the worst is 3.7e-6.
        max_f32_drift=5e-6,
    ),
    "qwen3_5_moe_fused": dict(
        config_fn=qwen3_5_moe_config,
        model_cls=Qwen3_5MoeForConditionalGeneration,
        layer_types=[LIN, FULL, LIN, FULL],
        moe_layers=[0, 1, 2, 3],
        experts="fused",
        storage="bfloat16",
        drop_layer_types_for_interval=2,
    ),
    "qwen3_next_per_expert": dict(
        config_fn=qwen3_next_config,
        model_cls=Qwen3NextForCausalLM,
        layer_types=[LIN, LIN, LIN, FULL],
        moe_layers=[0, 2, 3],
        experts="per_expert",
        storage="float32",
    ),
    "qwen3_moe": dict(
        config_fn=qwen3_moe_config,
        model_cls=Qwen3MoeForCausalLM,
        layer_types=[FULL, FULL, FULL, FULL],
        moe_layers=[1, 3],
        experts="per_expert",
        storage="float32",
        # transformers 5.24 writes the attribute-mapped name `num_local_experts`; the official
        # Qwen3-MoE checkpoints (and transformers < 5) spell it `num_experts`
        rename_config_keys={"num_local_experts": "num_experts"},
    ),
    "qwen3_5_text": dict(
        config_fn=qwen3_5_text_config,
        model_cls=Qwen3_5ForCausalLM,
        layer_types=[LIN, FULL, LIN, LIN],
        moe_layers=[],
        experts="none",
        storage="float32",
    ),
}


# --------------------------------------------------------------------------- helpers


def text_model(model):
    """The decoder stack: model.model.language_model for the ConditionalGeneration classes."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


def text_config(model):
    return getattr(model.config, "text_config", model.config)


def build_model(spec):
    cfg = spec["config_fn"]()
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(WEIGHT_SEED)
    model = spec["model_cls"](cfg).float().eval()
    return model


def check_implementations(model):
    """eager attention + eager experts everywhere, pure-torch GDN (no fla / causal_conv1d)."""
    tcfg = text_config(model)
    assert model.config._attn_implementation == "eager"
    assert tcfg._attn_implementation == "eager", tcfg._attn_implementation
    for name, mod in model.named_modules():
        cfg = getattr(mod, "config", None)
        if type(mod).__name__.endswith("Experts"):
            assert cfg._experts_implementation == "eager", (name, cfg._experts_implementation)
        if type(mod).__name__.endswith("Attention") and cfg is not None:
            assert cfg._attn_implementation == "eager", (name, cfg._attn_implementation)
    # the kernel-or-torch dispatchers of the GDN (use_kernel_func_from_hub_with_fallback) must have
    # resolved to their pure-torch implementation
    mod = sys.modules[type(text_model(model)).__module__]
    n = 0
    for fn_name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        fn = getattr(mod, fn_name, None)
        if fn is None:
            continue
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
        assert cells.get("is_new_implementation") is False, (fn_name, cells.get("implementation"))
        n += 1
    return n


# --------------------------------------------------------------------------- randomisation

ZERO_CENTRED_NORMS = ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm")
PLAIN_NORMS = ("Qwen3MoeRMSNorm",)
GATED_NORMS = ("Qwen3_5RMSNormGated", "Qwen3_5MoeRMSNormGated", "Qwen3NextRMSNormGated")


def randomise(model, gen, router_gen):
    """Overwrite every parameter with a random value (see the *_STD constants); returns counts per
    category. Routers use router_gen, so their seed can change without touching anything else."""
    counts = {}
    done = set()

    def put(param, value, category):
        assert param.shape == value.shape, (category, param.shape, value.shape)
        param.copy_(value)
        counts[category] = counts.get(category, 0) + 1
        done.add(id(param))

    with torch.no_grad():
        for mname, mod in model.named_modules():
            cls = type(mod).__name__
            vision = ".visual." in f".{mname}."
            for pname, p in mod.named_parameters(recurse=False):
                full = f"{mname}.{pname}"
                if vision:
                    if isinstance(mod, torch.nn.LayerNorm) and pname == "weight":
                        put(p, randn(p.shape, gen, 0.1, 1.0), "vision LayerNorm weight: 1 + 0.1*randn")
                    elif pname == "bias":
                        put(p, randn(p.shape, gen, 0.1), "vision bias: 0.1*randn")
                    else:
                        put(p, randn(p.shape, gen, VISION_STD), f"vision weight: {VISION_STD}*randn")
                elif cls in ZERO_CENTRED_NORMS:
                    assert torch.all(p == 0), f"{full}: zero-centred norm not initialised to 0"
                    put(p, randn(p.shape, gen, NORM_STD),
                        f"zero-centred RMSNorm weight (x*(1+w)): {NORM_STD}*randn")
                elif cls in PLAIN_NORMS:
                    assert torch.all(p == 1), f"{full}: plain norm not initialised to 1"
                    put(p, randn(p.shape, gen, NORM_STD, 1.0), f"plain RMSNorm weight (x*w): 1 + {NORM_STD}*randn")
                elif cls in GATED_NORMS:
                    put(p, randn(p.shape, gen, NORM_STD, 1.0),
                        f"GDN gated RMSNorm weight (plain x*w): 1 + {NORM_STD}*randn")
                elif cls.endswith("GatedDeltaNet") and pname == "A_log":
                    a = A_RANGE[0] + (A_RANGE[1] - A_RANGE[0]) * torch.rand(p.shape, generator=gen)
                    put(p, a.log(), f"A_log: log(uniform{A_RANGE})")
                elif cls.endswith("GatedDeltaNet") and pname == "dt_bias":
                    put(p, randn(p.shape, gen), "dt_bias: randn")
                elif isinstance(mod, torch.nn.Conv1d):
                    assert mod.bias is None
                    put(p, randn(p.shape, gen, CONV_STD), f"GDN conv1d weight: {CONV_STD}*randn")
                elif cls.endswith("TopKRouter"):
                    put(p, randn(p.shape, router_gen, ROUTER_STD), f"router weight: {ROUTER_STD}*randn")
                elif cls.endswith("Experts"):
                    put(p, randn(p.shape, gen, LINEAR_STD), f"expert gate_up_proj/down_proj: {LINEAR_STD}*randn")
                elif isinstance(mod, torch.nn.Embedding):
                    put(p, randn(p.shape, gen, EMBED_STD), f"embed_tokens: {EMBED_STD}*randn")
                elif isinstance(mod, torch.nn.Linear) and mname.endswith("shared_expert_gate"):
                    put(p, randn(p.shape, gen, SHARED_GATE_STD), f"shared_expert_gate: {SHARED_GATE_STD}*randn")
                elif isinstance(mod, torch.nn.Linear) and pname == "weight":
                    put(p, randn(p.shape, gen, LINEAR_STD), f"Linear weight (incl. lm_head): {LINEAR_STD}*randn")
                else:
                    raise AssertionError(f"no randomisation rule for {full} ({cls})")
    missing = [n for n, p in model.named_parameters() if id(p) not in done]
    assert not missing, f"not randomised: {missing}"
    return counts


def randomise_routers(model, router_gen):
    with torch.no_grad():
        for mod in model.modules():
            if type(mod).__name__.endswith("TopKRouter"):
                mod.weight.copy_(randn(mod.weight.shape, router_gen, ROUTER_STD))


def round_to_bf16(model):
    """Round every parameter except A_log / linear_attn.norm.weight to bfloat16 (kept as float32
    tensors, so the float32 reference corresponds exactly to the stored bfloat16 values)."""
    kept = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if KEEP_F32.search(name):
                kept.append(name)
            else:
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return kept


# --------------------------------------------------------------------------- checkpoint layout

EXPERT_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
EXPERT_SPLIT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def split_experts(state):
    """Fused module tensors -> per-expert Linear weights. Qwen*Experts.forward does
    `gate, up = linear(x, gate_up_proj[e]).chunk(2, -1)`: rows [0, I) of gate_up_proj[e] are the
    gate projection, rows [I, 2I) the up projection; down_proj[e] is already [H, I]."""
    out = {}
    for name, t in state.items():
        m = EXPERT_FUSED.match(name)
        if not m:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
    return out


def fuse_experts(tensors):
    """Inverse of split_experts (written independently of transformers' conversion mapping)."""
    out, groups = {}, {}
    for name, t in tensors.items():
        m = EXPERT_SPLIT.match(name)
        if m:
            prefix, e, kind = m.groups()
            groups.setdefault(prefix, {}).setdefault(kind, {})[int(e)] = t
        else:
            out[name] = t
    for prefix, kinds in groups.items():
        n = len(kinds["down_proj"])
        assert all(sorted(v) == list(range(n)) for v in kinds.values()), prefix
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([kinds["gate_proj"][e], kinds["up_proj"][e]], dim=0) for e in range(n)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([kinds["down_proj"][e] for e in range(n)])
    return out


def file_tensors(model, spec):
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    assert set(state) == {n for n, _ in model.named_parameters()}, "unexpected buffers in state_dict"
    if spec["experts"] == "per_expert":
        state = split_experts(state)
    else:
        assert spec["experts"] in ("fused", "none")
    if spec["storage"] == "bfloat16":
        state = {k: (v if KEEP_F32.search(k) else v.to(torch.bfloat16)) for k, v in state.items()}
    extra = spec.get("extra_tensors", {})
    g = torch.Generator().manual_seed(WEIGHT_SEED + 7)
    for name, shape in extra.items():
        assert name not in state
        state[name] = randn(shape, g, 0.1)
    return state




def check_expert_split(model):
    """Per-expert Linear weights from split_experts reproduce Qwen*Experts.forward for each expert."""
    g = torch.Generator().manual_seed(99)
    n_checked = 0
    for name, mod in model.named_modules():
        if not type(mod).__name__.endswith("Experts"):
            continue
        split = split_experts({f"{name}.gate_up_proj": mod.gate_up_proj.data, f"{name}.down_proj": mod.down_proj.data})
        x = torch.randn(5, mod.gate_up_proj.shape[-1], generator=g)
        for e in range(mod.num_experts):
            idx = torch.full((5, 1), e, dtype=torch.long)
            w = torch.ones(5, 1)
            got = mod(x, idx, w)
            gp = split[f"{name}.{e}.gate_proj.weight"]
            up = split[f"{name}.{e}.up_proj.weight"]
            dn = split[f"{name}.{e}.down_proj.weight"]
            want = F.linear(F.silu(F.linear(x, gp)) * F.linear(x, up), dn)
            assert torch.allclose(got, want, atol=1e-6, rtol=0), (name, e, (got - want).abs().max())
            n_checked += 1
    return n_checked


# --------------------------------------------------------------------------- reference


@torch.no_grad()
def run_reference(model, ids, top_k, check_positions=True):
    """hidden_states of one sequence, checked against forward hooks; also the router gaps and the
    pre-norm output of the last decoder layer (final_prenorm, from the same forward pass)."""
    base = text_model(model)
    n_layers = text_config(model).num_hidden_layers
    cap = {"router": []}

    def keep(key):
        def hook(_mod, _inp, out):
            cap[key] = layer_output(out)
        return hook

    def keep_router(_mod, _inp, out):
        cap["router"].append((out[0].detach().clone(), out[2].detach().clone()))

    hooks = [base.embed_tokens.register_forward_hook(keep("embed")), base.norm.register_forward_hook(keep("norm"))]
    hooks += [layer.register_forward_hook(keep(f"layer{i}")) for i, layer in enumerate(base.layers)]
    hooks += [m.register_forward_hook(keep_router) for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    try:
        out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    hs = torch.stack(out.hidden_states)[:, 0].contiguous()
    T = ids.shape[0]
    assert hs.dtype == torch.float32 and hs.shape == (n_layers + 1, T, H), hs.shape
    assert torch.isfinite(hs).all(), "non-finite hidden states"
    assert torch.equal(hs[0], cap["embed"][0]), "index 0 is not the embedding output"
    for i in range(1, n_layers):
        assert torch.equal(hs[i], cap[f"layer{i - 1}"][0]), f"index {i} is not decoder layer {i - 1}'s output"
    assert torch.equal(hs[n_layers], cap["norm"][0]), "index L is not the final-norm output"
    assert not torch.allclose(hs[n_layers], cap[f"layer{n_layers - 1}"][0]), "index L equals the raw last layer"
    # final_prenorm: the hook on the last decoder layer (base.layers[-1]); the model's final norm
    # applied to it must give index L
    assert len(base.layers) == n_layers
    prenorm = cap[f"layer{n_layers - 1}"][0].contiguous()
    assert prenorm.dtype == torch.float32 and prenorm.shape == (T, H), (prenorm.dtype, prenorm.shape)
    check_final_prenorm(base.norm, prenorm, hs[n_layers])

    gaps = []
    for logits, idx in cap["router"]:
        probs = torch.softmax(logits.float(), dim=-1)
        top = torch.sort(probs, dim=-1, descending=True)
        assert torch.equal(torch.sort(top.indices[:, :top_k], -1).values, torch.sort(idx, -1).values)
        gaps.append((top.values[:, top_k - 1] - top.values[:, top_k]).min().item())

    if not check_positions:
        return hs, gaps, prenorm
    # text-only positions: explicit 1-D arange positions give the identical result
    out2 = model(input_ids=ids[None], position_ids=torch.arange(T)[None], output_hidden_states=True, use_cache=False)
    assert torch.equal(torch.stack(out2.hidden_states)[:, 0], hs), "default positions != arange"
    return hs, gaps, prenorm


def compute_references(model, seqs, top_k, check_positions=True, prenorms=None):
    """References of all sequences and the smallest router gap; stops early (refs=None) as soon as
    a gap <= MIN_ROUTER_GAP is seen when check_positions is False (router seed search). The
    final_prenorm tensors are appended to `prenorms` when a list is given."""
    refs, min_gap = [], math.inf
    for ids in seqs:
        hs, gaps, prenorm = run_reference(model, ids, top_k, check_positions)
        refs.append(hs)
        if prenorms is not None:
            prenorms.append(prenorm)
        if gaps:
            min_gap = min(min_gap, min(gaps))
        if not check_positions and min_gap <= MIN_ROUTER_GAP:
            return None, min_gap
    return refs, min_gap


@torch.no_grad()
def f32_drift(model, seqs, refs):
    """Worst relative error of the f32 references against the same model run in float64."""
    worst = 0.0
    model.double()
    try:
        for ids, ref in zip(seqs, refs):
            with torch.no_grad():
                hs = model(ids[None], output_hidden_states=True, use_cache=False).hidden_states
            for i, h in enumerate(hs):
                exact = h[0]
                worst = max(worst, ((ref[i].double() - exact).norm() / exact.norm().clamp_min(1e-30)).item())
    finally:
        model.float()
    return worst


def hidden_states_of(model, seqs):
    return [torch.stack(model(input_ids=ids[None], output_hidden_states=True, use_cache=False).hidden_states)[:, 0]
            for ids in seqs]


@torch.no_grad()
def check_vision_tower(model):
    """The tiny vision tower is real: one 8x8 image (grid 1x2x2 patches) -> 1 merged token of size H."""
    vc = model.config.vision_config
    grid = torch.tensor([[1, 2, 2]])
    n_patch = int(grid.prod())
    pix = torch.randn(n_patch, vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2,
                      generator=torch.Generator().manual_seed(5))
    feats = model.model.get_image_features(pix, grid)
    pooled = torch.cat(list(feats.pooler_output), dim=0)
    assert pooled.shape == (n_patch // vc.spatial_merge_size ** 2, H), pooled.shape
    assert torch.isfinite(pooled).all()
    return list(pooled.shape)


# --------------------------------------------------------------------------- variants


def compare_with_save_pretrained(saved, ours, spec):
    """What transformers' save_pretrained wrote vs. the file this script writes."""
    ours_cmp = {k: v.float() for k, v in ours.items() if k not in spec.get("extra_tensors", {})}
    saved_layout = "per_expert" if any(EXPERT_SPLIT.match(k) for k in saved) else (
        "fused" if any(EXPERT_FUSED.match(k) for k in saved) else "none")
    if saved_layout == "per_expert" and spec["experts"] == "fused":
        ours_cmp = split_experts(ours_cmp)
    assert set(saved) == set(ours_cmp), sorted(set(saved) ^ set(ours_cmp))[:10]
    for k, v in saved.items():
        assert torch.equal(v.float(), ours_cmp[k]), k
    return saved_layout


def make_variant(name, spec, out_dir, tok_dir, seqs):
    model = build_model(spec)
    n_torch_fns = check_implementations(model)
    tcfg = text_config(model)
    layer_types = list(getattr(tcfg, "layer_types", None) or [FULL] * tcfg.num_hidden_layers)
    assert layer_types == spec["layer_types"], layer_types
    top_k = getattr(tcfg, "num_experts_per_tok", 0)
    moe_layers = [i for i, layer in enumerate(text_model(model).layers) if hasattr(layer.mlp, "gate")]
    assert moe_layers == spec["moe_layers"], moe_layers

    counts = randomise(model, torch.Generator().manual_seed(WEIGHT_SEED), torch.Generator().manual_seed(ROUTER_SEED))
    kept_f32 = round_to_bf16(model) if spec["storage"] == "bfloat16" else []
    router_seed = None
    rejected = []
    if moe_layers:
        for attempt in range(MAX_ROUTER_ATTEMPTS):
            router_seed = ROUTER_SEED + attempt
            randomise_routers(model, torch.Generator().manual_seed(router_seed))
            if spec["storage"] == "bfloat16":
                kept_f32 = round_to_bf16(model)
            refs, min_gap = compute_references(model, seqs, top_k, check_positions=False)
            if refs is not None and f32_drift(model, seqs, refs) <= MAX_F32_DRIFT:
                break
            rejected.append(router_seed)
        else:
            raise AssertionError(f"{name}: no router seed gives a top-k gap > {MIN_ROUTER_GAP} and an f32 drift "
                                 f"<= {MAX_F32_DRIFT}")
        print(f"  {name}: router seed {router_seed} ({len(rejected)} seeds rejected for a gap <= {MIN_ROUTER_GAP} "
              f"or an f32 drift > {MAX_F32_DRIFT})")
    prenorms = []
    refs, min_gap = compute_references(model, seqs, top_k, prenorms=prenorms)
    assert len(prenorms) == len(refs) == len(seqs)
    if moe_layers:
        assert min_gap > MIN_ROUTER_GAP, min_gap
    drift = f32_drift(model, seqs, refs)
    print(f"  {name}: transformers f32 vs f64, worst relative error over all indices {drift:.2e}")
    max_drift = spec.get("max_f32_drift", MAX_F32_DRIFT)
    assert drift <= max_drift, f"{name}: f32 references drift {drift:.2e} from f64 (> {max_drift})"
    n_expert_checks = check_expert_split(model) if moe_layers else 0
    vision_out = check_vision_tower(model) if hasattr(model.model, "visual") else None
    if vision_out is not None:  # the vision check must not leave state behind
        assert torch.equal(hidden_states_of(model, seqs[:3])[2], refs[2])

    vdir = os.path.join(out_dir, name)
    fresh_dir(vdir)
    model.save_pretrained(vdir)
    saved = read_file(os.path.join(vdir, "model.safetensors"))
    tensors = file_tensors(model, spec)
    saved_layout = compare_with_save_pretrained(saved, tensors, spec)
    if spec["storage"] == "bfloat16":
        for k, v in tensors.items():
            if KEEP_F32.search(k):  # full-precision values, not bf16-representable
                assert v.dtype == torch.float32 and not torch.equal(v, v.to(torch.bfloat16).float()), k
            else:
                assert v.dtype == torch.bfloat16, k
    save_tensors(tensors, os.path.join(vdir, "model.safetensors"), metadata={"format": "pt"},
                 mode=0o644)  # save_file creates 0600
    copy_files(tok_dir, vdir, TOKENIZER_FILES)

    # ---- config.json edits
    cfg_path = os.path.join(vdir, "config.json")
    cfg_json = read_json(cfg_path)
    edits = []
    for old, new in spec.get("rename_config_keys", {}).items():
        cfg_json[new] = cfg_json.pop(old)
        edits.append(f"renamed {old!r} -> {new!r}")
    if "drop_layer_types_for_interval" in spec:
        tc = cfg_json["text_config"]
        del tc["layer_types"]
        tc["full_attention_interval"] = spec["drop_layer_types_for_interval"]
        edits.append("text_config.layer_types removed, text_config.full_attention_interval added")
    if spec["storage"] == "bfloat16":
        cfg_json["dtype"] = "bfloat16"
        edits.append("dtype set to bfloat16")
    write_json(cfg_json, cfg_path, sort_keys=True)

    # ---- the written folder, read back by transformers, reproduces the reference exactly
    cfg2 = AutoConfig.from_pretrained(vdir)
    tcfg2 = getattr(cfg2, "text_config", cfg2)
    assert list(getattr(tcfg2, "layer_types", None) or [FULL] * L) == spec["layer_types"]
    if moe_layers:
        assert tcfg2.num_experts == MOE["num_experts"]
    loaded, info = spec["model_cls"].from_pretrained(
        vdir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True,
    )
    loaded.eval()
    assert not info["missing_keys"], info["missing_keys"]
    unexpected = sorted(info["unexpected_keys"])
    assert all(k.startswith("mtp.") for k in unexpected), unexpected
    # from_pretrained leaves parameters in memory-mapped storage at the (8-byte aligned) file
    # offsets; CPU float kernels give slightly different roundings for such operands, so the
    # comparison is made on freshly allocated copies (what the reference model used)
    mmap_diff = max((a - b).abs().max().item() for a, b in zip(hidden_states_of(loaded, seqs), refs))
    n_misaligned = sum(1 for p in loaded.parameters() if p.data_ptr() % 64)
    with torch.no_grad():
        for p in loaded.parameters():
            p.data = p.data.clone()
    for a, b in zip(hidden_states_of(loaded, seqs), refs):
        assert torch.equal(a, b), "from_pretrained(folder) differs from the reference"
    # ... and so does our own loader (per-expert -> fused written here, mtp.* dropped)
    written = read_file(os.path.join(vdir, "model.safetensors"))
    own = fuse_experts({k: v.float() for k, v in written.items() if not k.startswith("mtp.")})
    cfg2._attn_implementation = "eager"
    cfg2._experts_implementation = "eager"
    fresh = spec["model_cls"](cfg2).float().eval()
    check_implementations(fresh)
    fresh.load_state_dict(own, strict=True)
    for a, b in zip(hidden_states_of(fresh, seqs), refs):
        assert torch.equal(a, b), "own inverse mapping differs from the reference"
    del loaded, fresh

    # transformers' own bf16 error on seq2 (the yardstick for the engine's half-precision test):
    # the folder loaded as users load it, from_pretrained(dtype=bfloat16)
    half = spec["model_cls"].from_pretrained(
        vdir, dtype=torch.bfloat16, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    check_implementations(half)
    with torch.no_grad():
        half_hs = hidden_states_of(half, seqs[2:3])[0].float().detach()
    bf16_err = [((half_hs[i] - refs[2][i]).norm() / refs[2][i].norm()).item() for i in range(half_hs.shape[0])]
    print(f"  {name}: transformers bf16 vs f32 on seq2, per index: " + " ".join(f"{e:.1e}" for e in bf16_err))
    del half

    ref_tensors = reference_tensors(seqs, refs, prenorms)
    ref_tensors["seq2.hidden_states_bf16"] = half_hs.contiguous()
    save_tensors(ref_tensors, os.path.join(vdir, "reference.safetensors"), mode=0o644)

    allh = torch.cat(refs, dim=1)  # [L+1, sum T, H]
    norms = allh.norm(dim=-1)
    norm_mean = [round(x, 4) for x in norms.mean(dim=1).tolist()]
    norm_max = [round(x, 4) for x in norms.max(dim=1).values.tolist()]
    norm_min = [round(x, 4) for x in norms.min(dim=1).values.tolist()]
    assert all(0.3 < m < 30 for m in norm_mean) and max(norm_max) < 100, (norm_mean, norm_max)

    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in tensors.values()})
    prefix = "model.language_model." if hasattr(model.model, "language_model") else "model."
    assert any(k.startswith(prefix + "layers.0.") for k in tensors)
    ignored = sorted(k for k in tensors if not k.startswith(("model.", "lm_head.")))
    ignored_prefixes = ["mtp."] if spec.get("extra_tensors") else []
    if hasattr(model.model, "visual"):
        ignored_prefixes.append("model.visual.")

    if spec["experts"] == "fused":
        expert_layout = ("fused, exactly as transformers' module/state_dict holds them: "
                         f"{prefix}layers.N.mlp.experts.gate_up_proj [E, 2I, H] (per expert rows [0, I) = gate_proj, "
                         f"[I, 2I) = up_proj) and {prefix}layers.N.mlp.experts.down_proj [E, H, I]; no '.weight' suffix")
    elif spec["experts"] == "per_expert":
        expert_layout = (f"per expert: {prefix}layers.N.mlp.experts.{{e}}.gate_proj.weight [I, H], .up_proj.weight [I, H], "
                         ".down_proj.weight [H, I] (transformers fuses them at load: gate_up_proj[e] = cat(gate, up), "
                         "down_proj[e] = down)")
    else:
        expert_layout = "none (dense MLP)"

    if spec["storage"] == "bfloat16":
        storage = {"default": "bfloat16", "float32": sorted(kept_f32),
                   "note": "every other parameter was rounded to bfloat16 before the float32 reference was computed, "
                           "so the reference is exact for the stored values; A_log and linear_attn.norm.weight "
                           "keep full-precision float32 random values"}
    else:
        storage = {"default": "float32"}

    notes = [
        "hidden_states = torch.stack(model(input_ids[None], output_hidden_states=True, use_cache=False)"
        ".hidden_states)[:, 0], each sequence run alone (batch 1, no padding, no attention_mask).",
        "index 0 is the embedding output, index l (1..L-1) the output of decoder layer l-1, index L the "
        "final-norm output (all checked with torch.equal against forward hooks).",
        "seq{i}.final_prenorm [T, H] = output of the last decoder layer before the final norm, captured with "
        "a forward hook on the last decoder layer (model.model.layers[-1], model.model.language_model.layers[-1] "
        "for the ConditionalGeneration classes) in the same forward pass; checked that the model's final norm "
        "applied to it equals index L to float32 tolerance.",
        f"float32 compute, attn_implementation=eager, experts_implementation=eager, pure-torch Gated DeltaNet "
        f"(chunked, chunk 64; fla/causal_conv1d absent); torch.set_num_threads({torch.get_num_threads()}).",
        "positions: none passed, transformers uses arange(T) (for Qwen3.5 text-only inputs the same arange for "
        "the text row and the 3 M-RoPE rows, i.e. plain 1-D partial RoPE); checked identical to passing "
        "position_ids=arange(T)[None].",
        f"input ids: torch.randint(0, {VOCAB}) with torch.Generator().manual_seed({SEQ_SEED}), lengths in order.",
        "verified: the written folder loaded with from_pretrained(dtype=float32), and the written "
        "model.safetensors loaded through this script's own per-expert->fused mapping, reproduce the reference "
        "bit-exactly (parameters copied to fresh 64-byte aligned memory first: run directly on the memory-mapped "
        f"file tensors, {n_misaligned} of them not 64-byte aligned, transformers itself differs from the reference "
        f"by up to {mmap_diff:.2e} (from_pretrained_unaligned_max_abs_diff), because CPU float kernels round "
        "differently for unaligned operands).",
    ]
    if moe_layers:
        notes.append(
            f"MoE routing: softmax over router logits in float32, top-{top_k}, top-k weights renormalised "
            "(norm_topk_prob; Qwen3.5-MoE always renormalises); for every token of every sequence and every MoE "
            f"layer p_k - p_(k+1) >= {min_gap:.3e} > {MIN_ROUTER_GAP}."
        )
    if saved_layout != spec["experts"] and spec["experts"] != "none":
        notes.append(f"transformers' save_pretrained would have written the experts {saved_layout}; this file "
                     f"stores them {spec['experts']} (same values).")

    ref = {
        **versions(),
        "model_class": type(model).__name__,
        "architectures": cfg_json["architectures"],
        "model_type": cfg_json["model_type"],
        "text_model_type": tcfg.model_type,
        "lengths": SEQ_LENGTHS,
        "num_hidden_layers": tcfg.num_hidden_layers,
        "hidden_size": tcfg.hidden_size,
        "layer_types": layer_types,
        "layer_types_in_config_json": "layer_types" in cfg_json.get("text_config", cfg_json),
        "moe_layers": moe_layers,
        "num_experts": getattr(tcfg, "num_experts", None),
        "num_experts_per_tok": top_k or None,
        "min_router_topk_gap": (min_gap if moe_layers else None),
        "f32_vs_f64_worst_relative_error": drift,
        "transformers_bf16_vs_f32_seq2_per_index": bf16_err,
        "from_pretrained_unaligned_max_abs_diff": mmap_diff,
        "router_seed": router_seed,
        "router_seeds_rejected": len(rejected),
        "last_index_is_post_norm": True,
        "text_weight_prefix": prefix,
        "ignored_tensor_prefixes": ignored_prefixes,
        "ignored_tensors": [k for k in ignored if k.startswith("mtp.")],
        "storage_dtype": storage,
        "file_dtypes": dtypes,
        "expert_layout": expert_layout,
        "save_pretrained_expert_layout": saved_layout,
        "config_json_edits": edits,
        "rope_parameters": tcfg.rope_parameters,
        "vision_check_output_shape": vision_out,
        "randomised": {
            "seeds": {"weights": WEIGHT_SEED, "routers": router_seed, "extra_tensors": (WEIGHT_SEED + 7) if spec.get("extra_tensors") else None},
            "counts": counts,
            "expert_split_checks": n_expert_checks,
            "pure_torch_gdn_dispatchers_checked": n_torch_fns,
        },
        "hidden_state_norms": {"mean": norm_mean, "min": norm_min, "max": norm_max,
                               "note": "L2 norm over H per token, statistics over all tokens of all sequences, per index"},
        "notes": " ".join(notes),
    }
    dump_json(ref, os.path.join(vdir, "reference.json"))

    print(f"{name}: {type(model).__name__} layer_types={[t[:3] for t in layer_types]} moe={moe_layers} "
          f"experts={spec['experts']} (save_pretrained: {saved_layout}) dtypes={dtypes} "
          f"size={dir_size(vdir) / 1e3:.0f} kB")
    if moe_layers:
        print(f"  router seed {router_seed}: min top-{top_k} gap {min_gap:.3e}")
    print(f"  |h| mean per index {norm_mean}  max {norm_max}")
    for k, v in counts.items():
        print(f"    {v:3d} x {k}")
    return ref


def main():
    args = fixture_args(__doc__.split("\n")[0], DEFAULT_OUT)
    setup_torch()
    tok_dir = os.path.join(args.out, TOKENIZER_SOURCE)
    if not os.path.isdir(tok_dir):  # e.g. --out elsewhere: take the committed tokenizer
        tok_dir = os.path.join(DEFAULT_OUT, TOKENIZER_SOURCE)
    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    os.makedirs(args.out, exist_ok=True)

    seqs = random_sequences(VOCAB, SEQ_LENGTHS, SEQ_SEED)
    total = 0
    for name, spec in selected(VARIANTS, args.only):
        make_variant(name, spec, args.out, tok_dir, seqs)
        total += dir_size(os.path.join(args.out, name))
    print(f"total size of the variants written: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
