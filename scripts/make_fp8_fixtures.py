#!/usr/bin/env python3
"""Generate tiny random-weight checkpoints in the layout of Qwen's block-wise FP8 releases, plus
reference hidden states, used by the Rust test-suite (tests/fp8.rs): Qwen3 (scales in bf16, with
one projection kept in bf16, and in f32), Llama (f16 scales), Qwen3-MoE (per-expert FP8
experts, bf16 router), Qwen3.5 text (Gated DeltaNet in_proj_qkv / in_proj_z / out_proj in FP8),
Qwen3.5-MoE text (the same, with per-expert FP8 experts and an FP8 shared expert) and Qwen3-Next
(its fused in_proj_qkvz in FP8, grouped per key head, in_proj_ba in bf16). The hybrids need the
pure-torch path, as scripts/make_hybrid_fixtures.py does.

The releases' scheme (config.json `quantization_config`: quant_method "fp8", fmt "e4m3",
activation_scheme "dynamic", weight_block_size [128, 128]):
  * a quantised projection stores `*.weight` as float8_e4m3fn [N, K] and `*.weight_scale_inv`
    [ceil(N/128), ceil(K/128)], a dequantisation multiplier (weight ~ fp8 * scale_inv per 128 x 128
    block), in bf16, f16 or f32 depending on the release (one variant here per dtype);
  * embeddings, norms, lm_head and the projections listed in `modules_to_not_convert` stay bf16;
  * W8A8 dynamic: each quantised projection's input is quantised per token in groups of 128
    along K, s = max(amax, 1e-10) / 448, x_q = e4m3(clamp(x / s, -448, 448)) (torch's cast:
    round to nearest, ties to even), and the product is computed on x_q * s and the dequantised
    weight in float32.

Output layout (default: tests/fixtures/fp8 relative to the repository root):

    <out>/activation_quant.safetensors    input [R, K] f32, output [R, K] f32: the activation
                                          quantise-dequantise above, computed by torch, on rows
                                          built to hit ties, subnormals, zeros and the clamp
    <out>/<variant>/config.json, model.safetensors, tokenizer files (those of tiny/qwen3_qknorm)
    <out>/<variant>/reference.safetensors  as in tests/fixtures/tiny (scripts/make_fixtures.py):
                                          seq{i}.input_ids, seq{i}.hidden_states [L+1, T, H],
                                          seq{i}.final_prenorm [T, H]
    <out>/<variant>/reference.json

The reference is transformers in float32 (eager attention) on the dequantised weights and the
bf16-rounded other parameters, each quantised projection's forward replaced by
F.linear(qdq(x), W_dequantised). An activation within a hair of an e4m3 rounding boundary rounds
one way or the other under the last-bit differences between two correct float32 implementations
(a different order of sums), a step of 1/16 of its value. Two things keep that from deciding a
test: the layers add a few per cent to a residual stream of std 1 (EMBED_SCALE, initializer_range
0.02), so one such rounding moves the states by ~1e-5 rather than ~1e-3 (skipping the activation
quantisation altogether moves them by ~2e-3); and the weight seed of each variant is the first
from WEIGHT_SEED on for which no activation of magnitude 8 or more (an e4m3 step of 1 or more)
lies closer to a rounding boundary than 3 times the rms difference between float32 and float64
over its group of 128 (`close_calls`), and, in the MoE variants, no token's k-th and (k+1)-th
router probabilities lie closer than MIN_ROUTER_GAP (a near tie would choose another expert under
the same last-bit differences). reference.json records the seed.

Pinned package versions: scripts/requirements-fixtures.txt. As for make_fixtures.py, the committed
files were generated with torch's AVX2 CPU kernels (ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine).
Usage: python scripts/make_fp8_fixtures.py [--out tests/fixtures/fp8] [--only VARIANT ...]
"""

import contextlib
import os

import torch
import torch.nn.functional as F
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from fixture_common import (
    FIXTURES_DIR,
    TINY_DIR,
    check_final_prenorm,
    copy_files,
    dir_size,
    dump_json,
    fixture_args,
    forward_with_last_layer,
    fresh_dir,
    randn,
    random_sequences,
    read_json,
    reference_tensors,
    save_tensors,
    selected,
    setup_torch,
    versions,
    write_json,
)

DEFAULT_OUT = os.path.join(FIXTURES_DIR, "fp8")
TOKENIZER_FROM = os.path.join(TINY_DIR, "qwen3_qknorm")
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]

BLOCK = 128
FP8_MAX = 448.0
SEQ_LENGTHS = [1, 7, 33]
SEQ_SEED = 1234
WEIGHT_SEED = 0
SEED_TRIES = 400
# A variant's weight seed is kept when no activation x / s of magnitude CHECKED_FROM or more (an
# e4m3 step of 1 or more) lies closer to a rounding boundary than MARGIN times the rms difference
# between float32 and float64 over its group (make_variant).
MARGIN = 3.0
CHECKED_FROM = 8.0
# ... and, where there are experts, when every token's k-th router probability exceeds its
# (k+1)-th by at least this much.
MIN_ROUTER_GAP = 1e-4

# Embeddings of std 1 under projections of std 0.02 (initializer_range): each layer adds a few per
# cent to the residual stream, as in trained models, so one activation rounded the other way by
# a last-bit difference moves the states by ~1e-5, not ~1e-3 (see make_variant).
EMBED_SCALE = 50.0

# The Gated DeltaNet's in_proj_qkv, in_proj_z and out_proj (Qwen3-Next: in_proj_qkvz) are
# quantised in the releases; its in_proj_a / in_proj_b (Qwen3-Next: in_proj_ba), conv1d, A_log,
# dt_bias and norm stay bf16 (A_log and the norm f32). The MoE releases quantise every expert and
# the shared expert (gate_proj, up_proj, down_proj); the router (mlp.gate) and
# mlp.shared_expert_gate stay bf16.
QUANTISED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv", "in_proj_z",
             "in_proj_qkvz", "out_proj")

COMMON = dict(
    num_hidden_layers=2,
    hidden_size=128,
    intermediate_size=384,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    bos_token_id=None,
    eos_token_id=2,
    pad_token_id=0,
)

# The Qwen3.5 text decoder of the hybrid variants: layer 0 linear attention (one key head, two
# value heads of 128), layer 1 full attention, partial interleaved multimodal rotary.
QWEN3_5_TEXT = dict(
    tie_word_embeddings=False,
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                         mrope_section=[8, 4, 4], mrope_interleaved=True),
)

VARIANTS = {
    # Qwen3 (q/k norm), scales in bf16, one projection kept in bf16 and listed as such.
    "qwen3_bf16_scales": dict(
        config_cls=Qwen3Config,
        model_cls=Qwen3ForCausalLM,
        kwargs=dict(tie_word_embeddings=False),
        scale_dtype=torch.bfloat16,
        keep_bf16=["model.layers.1.mlp.down_proj"],
        modules_to_not_convert=["lm_head", "model.layers.1.mlp.down_proj"],
    ),
    # Qwen3, scales in f32, no modules_to_not_convert (as Qwen3-8B-FP8's config).
    "qwen3_f32_scales": dict(
        config_cls=Qwen3Config,
        model_cls=Qwen3ForCausalLM,
        kwargs=dict(tie_word_embeddings=False),
        scale_dtype=torch.float32,
        keep_bf16=[],
        modules_to_not_convert=None,
    ),
    # Llama (grouped-query attention, tied embeddings), scales in f16.
    "llama_f16_scales": dict(
        config_cls=LlamaConfig,
        model_cls=LlamaForCausalLM,
        kwargs=dict(tie_word_embeddings=True, rope_theta=500000.0),
        scale_dtype=torch.float16,
        keep_bf16=[],
        modules_to_not_convert=["lm_head"],
    ),
    # Qwen3-MoE: layer 0 dense, layer 1 four experts (top 2), each expert's projections
    # quantised and written one module per expert (experts.{e}.{gate,up,down}_proj) as the FP8
    # releases do; the router (mlp.gate) stays bf16 and is listed by suffix.
    "qwen3_moe_bf16_scales": dict(
        config_cls=Qwen3MoeConfig,
        model_cls=Qwen3MoeForCausalLM,
        kwargs=dict(
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=256,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
        ),
        scale_dtype=torch.bfloat16,
        keep_bf16=[],
        modules_to_not_convert=["lm_head", "mlp.gate"],
    ),
    # Qwen3.5 text (Gated DeltaNet + gated attention, zero-centred norms, partial rotary), layer 0
    # linear attention, layer 1 full attention; every parameter randomised as
    # scripts/make_hybrid_fixtures.py does (norms, gates, conv), then rescaled as above.
    "qwen3_5_f32_scales": dict(
        config_cls=Qwen3_5TextConfig,
        model_cls=Qwen3_5ForCausalLM,
        kwargs=dict(QWEN3_5_TEXT),
        hybrid=True,
        scale_dtype=torch.float32,
        keep_bf16=[],
        modules_to_not_convert=["lm_head", "linear_attn.in_proj_a", "linear_attn.in_proj_b"],
    ),
    # Qwen3.5-MoE text (the layout of Qwen3.6-35B-A3B-FP8's decoder): as qwen3_5_f32_scales, with
    # four experts (top 2) and a gated shared expert in both layers; the experts are quantised and
    # written one module per expert (mlp.experts.{e}.{gate,up,down}_proj), the shared expert's
    # projections quantised, the router and shared_expert_gate kept bf16.
    "qwen3_5_moe_f32_scales": dict(
        config_cls=Qwen3_5MoeTextConfig,
        model_cls=Qwen3_5MoeForCausalLM,
        drop_common=["intermediate_size"],  # no dense MLP: every layer has experts
        kwargs=dict(
            QWEN3_5_TEXT,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
        ),
        hybrid=True,
        scale_dtype=torch.float32,
        keep_bf16=[],
        modules_to_not_convert=["lm_head", "linear_attn.in_proj_a", "linear_attn.in_proj_b", "mlp.gate",
                                "mlp.shared_expert_gate"],
    ),
    # Qwen3-Next (the layout of Qwen3-Next-80B-A3B-FP8): the Gated DeltaNet's fused in_proj_qkvz
    # quantised as stored, its rows grouped per key head (two key heads of two value heads each,
    # head dims 128: every part of a group is whole 128-row blocks, as in the release), in_proj_ba
    # kept bf16; experts in both layers as in qwen3_5_moe_f32_scales; scales in bf16.
    "qwen3_next_bf16_scales": dict(
        config_cls=Qwen3NextConfig,
        model_cls=Qwen3NextForCausalLM,
        kwargs=dict(
            tie_word_embeddings=False,
            layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        ),
        hybrid=True,
        scale_dtype=torch.bfloat16,
        keep_bf16=[],
        modules_to_not_convert=["lm_head", "linear_attn.in_proj_ba", "mlp.gate", "mlp.shared_expert_gate"],
    ),
}


# --------------------------------------------------------------------------- the arithmetic


def round_e4m3(v):
    """v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, in v's own dtype: the step
    in [2^e, 2^(e+1)) is 2^(e-3), and 2^-9 below 2^-6 (the subnormals); dividing by a power of two
    is exact, and so is torch.round (ties to even) to a whole number of steps. On float32 values
    it is torch's cast to float8_e4m3fn (scripts/make_fp8_long_fixtures.py checks it on every
    activation of its float32 passes); on float64 values it rounds the float64 value itself,
    where the cast would round it to float32 first."""
    _, e = torch.frexp(v)
    step = torch.ldexp(torch.ones_like(v), (e - 1).clamp(min=-6) - 3)
    return torch.round(v / step) * step


def qdq_activation(x):
    """x [..., K] (K a multiple of 128), float32 (or float64: then in float64 throughout, the
    rounding by round_e4m3): quantised per row in groups of 128 and dequantised. Returns
    (x_q * s, x / s clamped), the second to compare roundings."""
    shape = x.shape
    g = x.reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    amax = g.abs().amax(dim=-1, keepdim=True)
    s = amax.clamp(min=1e-10) / FP8_MAX
    v = (g / s).clamp(-FP8_MAX, FP8_MAX)
    q = round_e4m3(v) if v.dtype == torch.float64 else v.to(torch.float8_e4m3fn).to(torch.float32)
    return (q * s).reshape(shape), v.reshape(shape)


def quantise_weight(w, scale_dtype):
    """w [N, K] float32 -> (fp8 [N, K], scale_inv [N/128, K/128] in scale_dtype, dequantised f32):
    per block scale = amax / 448 rounded to scale_dtype, w_q = e4m3(clamp(w / scale))."""
    n, k = w.shape
    assert n % BLOCK == 0 and k % BLOCK == 0, (n, k)
    blocks = w.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).to(scale_dtype)
    s = scale.to(torch.float32)[:, None, :, None]
    q = (blocks / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    deq = (q.to(torch.float32) * s).reshape(n, k)
    return q.reshape(n, k).contiguous(), scale.contiguous(), deq


def e4m3_boundaries():
    """The rounding boundaries of e4m3 on [0, 448]: midpoints of consecutive finite values."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    values = torch.unique(values[torch.isfinite(values)].abs())
    return (values[1:] + values[:-1]) / 2


def close_calls(v32, v64):
    """How many activations (of one quantiser call: x / s clamped, float32 and float64 runs) of
    magnitude at least CHECKED_FROM lie closer to an e4m3 rounding boundary than MARGIN times the
    rms difference between the two runs over their group of 128."""
    bounds = e4m3_boundaries()
    a = v32.double().reshape(-1, BLOCK)
    diff = (a - v64.double().reshape(-1, BLOCK)).pow(2).mean(dim=-1, keepdim=True).sqrt()
    x = a.abs()
    i = torch.searchsorted(bounds, x.contiguous()).clamp(1, len(bounds) - 1)
    dist = torch.minimum((x - bounds[i - 1]).abs(), (x - bounds[i]).abs())
    return int(((x >= CHECKED_FROM) & (dist < MARGIN * diff)).sum())


# --------------------------------------------------------------------------- the checkpoint


def perturb_norms(model, gen):
    """Norm weights multiplied by (1 + 0.1 * randn), as scripts/make_fixtures.py does."""
    n = 0
    with torch.no_grad():
        for _name, mod in model.named_modules():
            if "RMSNorm" in type(mod).__name__:
                mod.weight.mul_(randn(mod.weight.shape, gen, 0.1, 1.0))
                n += 1
    return n


def build(spec, seed):
    """The float32 model on the dequantised weights with its projections patched, and the
    checkpoint's tensors. Returns (model, tensors, quantised module names, each quantiser call's clamped x / s, norms
    perturbed)."""
    torch.manual_seed(seed)
    common = {k: v for k, v in COMMON.items() if k not in spec.get("drop_common", [])}
    cfg = spec["config_cls"](**common, **spec["kwargs"], attn_implementation="eager")
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = spec["model_cls"](cfg).float().eval()
    if spec.get("hybrid"):
        import make_hybrid_fixtures as hybrid  # refuses to run where fla / causal_conv1d import

        assert hybrid.check_implementations(model) > 0
        gen = torch.Generator().manual_seed(seed + 1)
        counts = hybrid.randomise(model, gen, gen)
        n_norm = sum(n for k, n in counts.items() if "norm" in k.lower())
        with torch.no_grad():
            for name, mod in model.named_modules():
                if isinstance(mod, torch.nn.Linear) and name.split(".")[-1] in QUANTISED:
                    mod.weight.mul_(0.02 / hybrid.LINEAR_STD)
                elif isinstance(getattr(mod, "gate_up_proj", None), torch.nn.Parameter):
                    mod.gate_up_proj.mul_(0.02 / hybrid.LINEAR_STD)
                    mod.down_proj.mul_(0.02 / hybrid.LINEAR_STD)
            model.get_input_embeddings().weight.mul_(1.0 / hybrid.EMBED_STD)
    else:
        n_norm = perturb_norms(model, torch.Generator().manual_seed(seed + 1))
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(spec.get("embed_scale", EMBED_SCALE))
    captured = []
    tensors = {}
    quantised = []
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(getattr(mod, "gate_up_proj", None), torch.nn.Parameter):
                quantise_experts(name, mod, spec, tensors, captured)
                quantised.append(name)
                continue
            if not isinstance(mod, torch.nn.Linear) or name == "lm_head":
                continue
            if name.split(".")[-1] not in QUANTISED or name in spec["keep_bf16"]:
                continue
            assert mod.bias is None
            q, scale, deq = quantise_weight(mod.weight.float(), spec["scale_dtype"])
            mod.weight.copy_(deq)
            tensors[f"{name}.weight"] = q
            tensors[f"{name}.weight_scale_inv"] = scale
            quantised.append(name)

            def forward(x, mod=mod):
                xq, v = qdq_activation(x)
                captured.append(v)
                return F.linear(xq, mod.weight)

            mod.forward = forward
        # Everything else as the release stores it: bf16.
        for name, p in model.named_parameters():
            module = name.rsplit(".", 1)[0]
            if module in quantised:
                continue
            if name.endswith((".A_log", ".linear_attn.norm.weight")):
                tensors[name] = p.detach().to(torch.float32).contiguous()
                continue
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
            if name.startswith("lm_head.") and cfg.tie_word_embeddings:
                continue
            tensors[name] = p.detach().to(torch.bfloat16).contiguous()
    return model, tensors, quantised, captured, n_norm


def quantise_experts(name, mod, spec, tensors, captured):
    """A Qwen*Experts module (gate_up_proj [E, 2I, H], down_proj [E, H, I]): each expert's gate,
    up and down projections quantised on their own and written one module per expert; forward
    runs transformers' own expert loop with every F.linear input quantised (gate and up share
    their input, quantised once: the same values as twice)."""
    inter = mod.gate_up_proj.shape[1] // 2
    gate_up, down = [], []
    for e in range(mod.gate_up_proj.shape[0]):
        parts = {"gate_proj": mod.gate_up_proj[e, :inter], "up_proj": mod.gate_up_proj[e, inter:],
                 "down_proj": mod.down_proj[e]}
        deq = {}
        for proj, w in parts.items():
            q, scale, deq[proj] = quantise_weight(w.float(), spec["scale_dtype"])
            tensors[f"{name}.{e}.{proj}.weight"] = q
            tensors[f"{name}.{e}.{proj}.weight_scale_inv"] = scale
        gate_up.append(torch.cat([deq["gate_proj"], deq["up_proj"]]))
        down.append(deq["down_proj"])
    mod.gate_up_proj.copy_(torch.stack(gate_up))
    mod.down_proj.copy_(torch.stack(down))
    loop = mod.forward

    def forward(*args, loop=loop):
        linear = torch.nn.functional.linear

        def quantised_linear(x, weight, bias=None):
            xq, v = qdq_activation(x)
            captured.append(v)
            return linear(xq, weight, bias)

        torch.nn.functional.linear = quantised_linear
        try:
            return loop(*args)
        finally:
            torch.nn.functional.linear = linear

    mod.forward = forward


@contextlib.contextmanager
def router_gaps(model):
    """Collects, while the block runs, each router call's smallest gap between a token's k-th and
    (k+1)-th softmax probabilities (none where the model has no experts)."""
    gaps = []

    def hook(mod, _inp, out):
        probs = torch.softmax(out[0].float(), dim=-1).sort(dim=-1, descending=True).values
        gaps.append(float((probs[:, mod.top_k - 1] - probs[:, mod.top_k]).min()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    try:
        yield gaps
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def run_reference(model, ids):
    base = model.model
    L = model.config.num_hidden_layers
    out, last = forward_with_last_layer(base, ids)
    hs = torch.stack(out.hidden_states)[:, 0].contiguous().float()
    assert hs.shape[0] == L + 1, hs.shape
    prenorm = last[0].contiguous().float()
    check_final_prenorm(base.norm, prenorm, hs[L])
    return hs, prenorm


@torch.no_grad()
def float64_activations(spec, seed, seqs):
    """Each quantiser call's x / s when the same model runs in float64."""
    model, _, _, captured, _ = build(spec, seed)
    model.double()
    for ids in seqs:
        model.model(input_ids=ids[None])
    return captured


def make_variant(name, spec, out_dir):
    seqs = random_sequences(COMMON["vocab_size"], SEQ_LENGTHS, SEQ_SEED)
    for seed in range(WEIGHT_SEED, WEIGHT_SEED + SEED_TRIES):
        model, tensors, quantised, captured, n_norm = build(spec, seed)
        with router_gaps(model) as gaps:
            results = [run_reference(model, ids) for ids in seqs]
        if gaps and min(gaps) < MIN_ROUTER_GAP:
            continue
        wide = float64_activations(spec, seed, seqs)
        assert len(wide) == len(captured)
        if sum(close_calls(v, w) for v, w in zip(captured, wide)) == 0:
            break
    else:
        raise SystemExit(f"{name}: no weight seed in {SEED_TRIES} tries keeps the activations off the e4m3 "
                         "rounding boundaries (and the routers off ties)")
    cfg = model.config
    # Every projection is listed in modules_to_not_convert or quantised, never both.
    listed = spec["modules_to_not_convert"] or []
    assert not set(listed) & set(quantised)

    vdir = os.path.join(out_dir, name)
    fresh_dir(vdir)
    os.makedirs(vdir)
    cfg.save_pretrained(vdir)
    config = read_json(os.path.join(vdir, "config.json"))
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "bfloat16"
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": spec["modules_to_not_convert"],
    }
    write_json(config, os.path.join(vdir, "config.json"), sort_keys=True)
    save_tensors(dict(sorted(tensors.items())), os.path.join(vdir, "model.safetensors"), metadata={"format": "pt"})
    copy_files(TOKENIZER_FROM, vdir, TOKENIZER_FILES)

    hidden = [h for h, _ in results]
    prenorms = [p for _, p in results]
    save_tensors(reference_tensors(seqs, hidden, prenorms), os.path.join(vdir, "reference.safetensors"))
    L = cfg.num_hidden_layers
    if spec.get("hybrid"):
        randomised = ("every parameter randomised by scripts/make_hybrid_fixtures.py's randomise() (generator seeded "
                      "weight_seed + 1; pure-torch Gated DeltaNet), then the quantised projections"
                      f"{' (the experts too)' if gaps else ''} rescaled to std 0.02 and the embeddings to std 1; "
                      "A_log and linear_attn.norm.weight stored in float32")
    else:
        randomised = ("initializer_range 0.02; RMSNorm weights multiplied by (1 + 0.1*randn) (generator seeded "
                      f"weight_seed + 1), embeddings by {EMBED_SCALE}")
    ref = {
        **versions(),
        "model_class": type(model).__name__,
        "lengths": SEQ_LENGTHS,
        "num_hidden_layers": L,
        "hidden_size": cfg.hidden_size,
        "last_index_is_post_norm": True,
        "num_rmsnorm_perturbed": n_norm,
        "weight_seed": seed,
        "scale_dtype": str(spec["scale_dtype"]).replace("torch.", ""),
        "quantised_projections": sum(k.endswith(".weight_scale_inv") for k in tensors),
        "kept_bf16": spec["keep_bf16"],
        "activations_quantised": sum(v.numel() for v in captured),
        "activation_margin": f"|x / s| >= {CHECKED_FROM}: {MARGIN} x rms(float32 - float64) per group",
        **({"min_router_gap": min(gaps)} if gaps else {}),
        "notes": (
            "hidden_states = torch.stack(model.model(input_ids[None], output_hidden_states=True).hidden_states)[:, 0]; "
            "index 0 is the embedding output, index l (1..L) the output of decoder layer l, index L after the final "
            "norm; final_prenorm = the last decoder layer's output before the final norm (forward hook, same pass). "
            f"float32, eager attention, torch.manual_seed(weight_seed), {randomised}. Projections quantised block-wise (128 x 128): scale_inv = "
            "(amax / 448) in scale_dtype, w_q = e4m3(clamp(w / scale_inv, -448, 448)); the reference runs on "
            "w_q * scale_inv in float32, every other parameter rounded to bf16 (as stored), and each quantised "
            "projection's input quantised per token in groups of 128 (s = max(amax, 1e-10) / 448, "
            "x_q = e4m3(clamp(x / s, -448, 448)), input x_q * s). weight_seed is the first from "
            f"{WEIGHT_SEED} for which no quantised activation x / s with |x / s| >= {CHECKED_FROM} lies closer to an "
            f"e4m3 rounding boundary than {MARGIN} times the rms difference of x / s between this float32 run and a "
            "float64 run over its group of 128"
            + (f" and no token's k-th router probability exceeds its (k+1)-th by less than {MIN_ROUTER_GAP}"
               if gaps else "")
            + ". input ids: torch.randint(0, vocab_size) with "
            f"torch.Generator().manual_seed({SEQ_SEED}), lengths in order."
        ),
    }
    dump_json(ref, os.path.join(vdir, "reference.json"))
    print(f"{name}: seed {seed}, {sum(k.endswith('.weight_scale_inv') for k in tensors)} quantised projections, "
          f"{dir_size(vdir) / 1e3:.0f} kB")


# --------------------------------------------------------------------------- the quantiser's own test


def activation_quant_cases(out_dir):
    """Rows of 256 (two groups of 128) that hit the corners of the activation quantiser: exact
    ties (amax 448, so s = 1 and x / s = x), subnormals and their ties, zeros, negative values,
    an all-zero group, a group whose largest value divides to just above 448, and random rows."""
    g = torch.Generator().manual_seed(7)
    rows = []
    ties = torch.tensor([
        448.0, 1.0625, 1.1875, -1.0625, -1.1875, 0.0, -0.0, 2.0 ** -10, 3 * 2.0 ** -10, -(2.0 ** -10),
        5 * 2.0 ** -10, 2.0 ** -9, 2.0 ** -6, 0.015625 + 2.0 ** -10, 17.0, 18.0, 19.0, 21.0, 23.0, 25.0,
        240.0, 232.0, 248.0, 272.0, 288.0, 304.0, 416.0, 432.0, 440.0, -432.0, 0.5 + 2.0 ** -5, 0.5 + 3 * 2.0 ** -5,
        1e-30, -1e-30,
    ])
    group = torch.zeros(BLOCK)
    group[: len(ties)] = ties
    rows.append(torch.cat([group, torch.zeros(BLOCK)]))
    # 448 * (1 + a little): x / s may round to just above 448 before the clamp.
    for amax in [1000.0, 3.0e-3, 0.7, 123456.0, 1e-12]:
        r = randn((2 * BLOCK,), g)
        r = r / r.abs().max() * amax
        rows.append(r)
    for _ in range(4):
        rows.append(randn((2 * BLOCK,), g, std=float(torch.rand(1, generator=g)) * 10))
    x = torch.stack(rows).float()
    y, _ = qdq_activation(x)
    save_tensors({"input": x.contiguous(), "output": y.contiguous()}, os.path.join(out_dir, "activation_quant.safetensors"))
    print(f"activation_quant: {x.shape[0]} rows of {x.shape[1]}")


def main():
    args = fixture_args(__doc__.split("\n")[0], DEFAULT_OUT)
    setup_torch()
    os.makedirs(args.out, exist_ok=True)
    if not args.only or "activation_quant" in args.only:
        activation_quant_cases(args.out)
    for name, spec in selected(VARIANTS, args.only):
        make_variant(name, spec, args.out)
    print(f"total size of {os.path.relpath(args.out)}: {dir_size(args.out) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
