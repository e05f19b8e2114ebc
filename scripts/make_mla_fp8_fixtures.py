#!/usr/bin/env python3
"""Generate a tiny random-weight DeepSeek-V3 checkpoint in the layout of DeepSeek-V3's block-wise FP8
release, with reference hidden states and log-probabilities, used by tests/mla.rs.

The release's scheme (config.json `quantization_config`: quant_method "fp8", fmt "e4m3",
activation_scheme "dynamic", weight_block_size [128, 128]):
  * every linear of attention (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj), of the
    dense MLPs, of every expert (one module per expert: mlp.experts.{e}.{gate,up,down}_proj) and
    of the shared experts stores `*.weight` as float8_e4m3fn [N, K] and `*.weight_scale_inv`
    [ceil(N/128), ceil(K/128)] in float32 (a dequantisation multiplier per 128 x 128 block);
  * the embeddings, the norms, lm_head and the router (mlp.gate.weight) stay bf16, the router's
    e_score_correction_bias float32;
  * the multi-token-prediction layer after the decoder (model.layers.{L}) is stored the same way.
The release's kv_a_proj_with_mqa has 576 rows (kv_lora_rank 512 + qk_rope_head_dim 64): its last
row block is ragged (64 rows). So are this fixture's kv_a_proj_with_mqa (128 + 16 = 144 rows) and
q_b_proj (4 heads x 48 = 192 rows); every input width is a multiple of 128 (hidden 128, q_lora_rank
128, kv_lora_rank 128, 4 heads x v 32, intermediate 256, moe_intermediate 128), as the activations
are quantised in groups of 128 along it.

The arithmetic (that of scripts/make_fp8_fixtures.py, whose quantisers this script imports): the
weights dequantised per block, w = e4m3 * scale_inv[row // 128, col // 128] in float32, as
transformers' fine-grained FP8 integration dequantises them on a CPU (Fp8Dequantize._dequantize_one:
the script checks its bits on every projection whose rows are whole blocks; on a ragged one it
takes rows / scale rows for the block height, so it refuses the release's kv_a_proj_with_mqa, 576
rows over 5 scale rows, and reads this fixture's 144 rows as 2 blocks of 72: the reference keeps
the 128-row blocks of weight_block_size, as FP8Linear's kernels read them); each quantised
projection's input quantised per token in groups of 128 (W8A8
dynamic: s = max(amax, 1e-10) / 448, x_q = e4m3(clamp(x / s, -448, 448))), as the release's
FP8Linear computes; the experts through transformers' own loop with every F.linear input
quantised. The reference is transformers' DeepseekV3ForCausalLM in float32 (eager attention and
experts) on those weights with the projections' forwards so patched, each sequence alone; the
float64 run (model.double(), RMSNorms and the quantisers in float64, the routers in float32 as
transformers computes them) gives transformers-f32's own distance.

The weight seed is the first from WEIGHT_SEED on for which every token's routing choice (groups
and experts) has a margin of at least MIN_GAP, the groups change some token's experts, no
quantised activation of magnitude 8 or more lies closer to an e4m3 rounding boundary than 3 times
the rms difference between the float32 and float64 runs over its group
(make_fp8_fixtures.close_calls), and transformers-f32 stays within MAX_F32_DRIFT of float64.

Output layout (default: tests/fixtures/mla relative to the repository root):

    <out>/deepseek_v3_fp8/config.json            DeepseekV3Config (hidden 128, 2 layers: a dense MLP
                          of 256, then 8 experts of 128, top 3, 4 groups of 2 of which 2 kept, one
                          shared expert; 4 heads, q_lora_rank 128, kv_lora_rank 128, qk_nope 32,
                          qk_rope 16, v 32; interleaved rope, YaRN as deepseek_v3 of
                          make_mla_fixtures.py; one multi-token-prediction layer) with the
                          release's quantization_config
    <out>/deepseek_v3_fp8/model.safetensors      the release's layout above
    <out>/deepseek_v3_fp8/tokenizer files        those of tests/fixtures/tiny/qwen3_qknorm
    <out>/deepseek_v3_fp8/reference.safetensors  as make_mla_fixtures.py's (hidden_states,
                          hidden_states_f64, final_prenorm, log-probabilities)
    <out>/deepseek_v3_fp8/reference.json

As for make_fp8_fixtures.py, the committed files were generated with torch's AVX2 CPU kernels
(ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine: the same weight seed, references a few float32
ulps apart from the AVX-512 kernels').
Usage: ATEN_CPU_CAPABILITY=avx2 python scripts/make_mla_fp8_fixtures.py [--out tests/fixtures/mla]
"""

import os

import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

import make_fp8_fixtures as fp8
import make_mla_fixtures as mla  # refuses to run where fla / causal_conv1d import
from fixture_common import (
    copy_files,
    dir_size,
    drift_per_index,
    dump_json,
    fixture_args,
    fresh_dir,
    logprob_tensors,
    randn,
    random_sequences,
    read_file,
    read_json,
    reference_tensors,
    save_tensors,
    setup_torch,
    versions,
    write_json,
)

NAME = "deepseek_v3_fp8"
BLOCK = fp8.BLOCK
H, L, VOCAB, HEADS = 128, 2, 512, 4
# 33: past YaRN's 32 original positions. Fewer and shorter sequences than make_mla_fixtures.py's,
# and two layers: the fewer activations quantised, the likelier a weight seed keeps them all off
# the e4m3 rounding boundaries.
SEQ_LENGTHS = [1, 7, 33]
SEQ_SEED = mla.SEQ_SEED
WEIGHT_SEED = 0
SEED_TRIES = 400
MIN_GAP = mla.MIN_GAP
MAX_F32_DRIFT = 3e-6
LOGPROB_K = 5
SCALE_DTYPE = torch.float32  # the release's weight_scale_inv

EMBED_STD, LINEAR_STD, EXPERT_STD = 1.0, 0.02, 0.02
NORM_STD = 0.1  # 1 + NORM_STD * randn
ROUTER_STD, CORRECTION_STD = 0.3, 0.05

CONFIG = dict(
    hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB,
    n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=128, intermediate_size=256,
    q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1,
    first_k_dense_replace=1, rope_interleave=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
    max_position_embeddings=128, bos_token_id=None, eos_token_id=2, pad_token_id=0,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                         beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8),
)
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": [BLOCK, BLOCK]}

# run_reference checks the states' shape against make_mla_fixtures' own dimensions.
mla.H, mla.L = H, L


def quantise_weight(w):
    """w [N, K] float32 (K a multiple of 128, N any) -> (fp8 [N, K], scale_inv [ceil(N/128), K/128],
    dequantised f32): make_fp8_fixtures.quantise_weight on the rows padded with zeros to whole
    blocks (a zero changes no block's amax), the padding dropped."""
    n, k = w.shape
    rows = -(-n // BLOCK) * BLOCK
    padded = torch.cat([w, w.new_zeros(rows - n, k)]) if rows > n else w
    q, scale, deq = fp8.quantise_weight(padded, SCALE_DTYPE)
    return q[:n].contiguous(), scale, deq[:n].contiguous()


def dequantise(q, scale):
    """The block grid's reading: row r, column c times scale_inv[r // 128, c // 128], in float32."""
    s = scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * s


def build(seed):
    """The float32 model with its FP8 projections dequantised and their forwards patched, the
    checkpoint's tensors, the quantised modules, each quantiser call's clamped x / s (filled as the
    model runs) and what was randomised."""
    cfg = DeepseekV3Config(**CONFIG)
    cfg.num_nextn_predict_layers = 1
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    counts = {}
    with torch.no_grad():
        for mname, mod in model.named_modules():
            cls = type(mod).__name__
            for pname, p in mod.named_parameters(recurse=False):
                if cls.endswith("RMSNorm"):
                    v, what = randn(p.shape, gen, NORM_STD, 1.0), f"RMSNorm weight: 1 + {NORM_STD}*randn"
                elif cls.endswith("TopkRouter"):
                    v, what = randn(p.shape, gen, ROUTER_STD), f"router weight: {ROUTER_STD}*randn"
                elif cls.endswith("Experts"):
                    v, what = randn(p.shape, gen, EXPERT_STD), f"experts {pname}: {EXPERT_STD}*randn"
                elif isinstance(mod, torch.nn.Embedding):
                    v, what = randn(p.shape, gen, EMBED_STD), f"embed_tokens: {EMBED_STD}*randn"
                elif isinstance(mod, torch.nn.Linear) and pname == "weight":
                    v, what = randn(p.shape, gen, LINEAR_STD), f"Linear weight: {LINEAR_STD}*randn"
                else:
                    raise AssertionError(f"no randomisation rule for {mname}.{pname} ({cls})")
                p.copy_(v)
                counts[what] = counts.get(what, 0) + 1
        for r in mla.routing_of(model):
            r.e_score_correction_bias.copy_(randn(r.e_score_correction_bias.shape, gen, CORRECTION_STD))

    captured, tensors, quantised = [], {}, []
    spec = {"scale_dtype": SCALE_DTYPE}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(getattr(mod, "gate_up_proj", None), torch.nn.Parameter):
                fp8.quantise_experts(name, mod, spec, tensors, captured)
                quantised.append(name)
                continue
            if not isinstance(mod, torch.nn.Linear) or name == "lm_head":
                continue
            assert mod.bias is None
            q, scale, deq = quantise_weight(mod.weight.float())
            mod.weight.copy_(deq)
            tensors[f"{name}.weight"] = q
            tensors[f"{name}.weight_scale_inv"] = scale
            quantised.append(name)

            def forward(x, mod=mod):
                xq, v = fp8.qdq_activation(x)
                captured.append(v)
                return F.linear(xq, mod.weight)

            mod.forward = forward
        # Everything else as the release stores it: bf16, the correction bias float32.
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            module = name.rsplit(".", 1)[0]
            if module in quantised or name.endswith("inv_freq") or "rotary_emb" in name:
                continue
            if name.endswith("e_score_correction_bias"):
                tensors[name] = t.detach().float().contiguous()
                continue
            t.copy_(t.to(torch.bfloat16).to(torch.float32))
            tensors[name] = t.detach().to(torch.bfloat16).contiguous()
    return model, tensors, quantised, captured, counts


def mtp_tensors(tensors):
    """One multi-token-prediction layer as the release stores it after the decoder (layers.{L}: a
    decoder layer, its projections in FP8, plus enorm, hnorm, eh_proj and its own norm), random."""
    gen = torch.Generator().manual_seed(7)
    out = {}
    prefix = f"model.layers.{L - 1}."
    for k, v in tensors.items():
        if not k.startswith(prefix) or k.endswith(".weight_scale_inv"):
            continue
        name = f"model.layers.{L}." + k[len(prefix):]
        if v.dtype == torch.float8_e4m3fn:
            q, scale, _ = quantise_weight(randn(v.shape, gen, 0.05))
            out[name], out[name + "_scale_inv"] = q, scale
        else:
            out[name] = randn(v.shape, gen, 0.1).to(v.dtype)
    for n, shape in [("enorm.weight", (H,)), ("hnorm.weight", (H,)), ("eh_proj.weight", (H, 2 * H)),
                     ("shared_head.norm.weight", (H,))]:
        out[f"model.layers.{L}.{n}"] = randn(shape, gen, 0.1).to(torch.bfloat16)
    return out


def check_dequantisation(model, tensors):
    """Every FP8 projection of the file dequantised gives the model's weight bit for bit, and where
    its rows are whole blocks, transformers' own CPU dequantisation gives the same bits. Returns
    how many projections transformers' dequantisation was checked on, and what it makes of the
    ragged ones (by module): it derives the block height from the weight's rows and the scale's,
    so it refuses a ragged weight whose rows the scale rows do not divide (the release's
    kv_a_proj_with_mqa: 576 rows, 5 scale rows) and reads one they divide with blocks of
    rows / scale rows (this fixture's 144 rows as 2 blocks of 72), not the 128 of the block grid."""
    params = dict(model.named_parameters())
    op = Fp8Dequantize(None)
    checked, ragged = 0, {}
    for name, q in tensors.items():
        if q.dtype != torch.float8_e4m3fn:
            continue
        scale = tensors[name + "_scale_inv"]
        deq = dequantise(q, scale)
        if name in params:
            want = params[name]
        else:  # experts.{e}.{proj}.weight: a slice of the fused tensors
            experts, e, proj, _ = name.rsplit(".", 3)
            i = CONFIG["moe_intermediate_size"]
            fused = params[f"{experts}.gate_up_proj" if proj != "down_proj" else f"{experts}.down_proj"][int(e)]
            want = {"gate_proj": fused[:i], "up_proj": fused[i:], "down_proj": fused}[proj]
        assert torch.equal(deq, want), f"{name}: the file dequantised is not the model's weight"
        if q.shape[0] % BLOCK == 0:
            assert torch.equal(op._dequantize_one(q, scale, output_dtype=torch.float32), deq), name
            checked += 1
            continue
        kind = name.rsplit(".", 2)[-2]
        try:
            theirs = op._dequantize_one(q, scale, output_dtype=torch.float32)
            assert not torch.equal(theirs, deq), name
            outcome = (f"{q.shape[0]} rows read as {scale.shape[0]} blocks of {q.shape[0] // scale.shape[0]} rows "
                       f"(not {BLOCK}): another weight")
        except ValueError:
            outcome = "refused"
        assert ragged.setdefault(kind, outcome) == outcome, (name, outcome)
    return checked, ragged


def main():
    args = fixture_args(__doc__.split("\n")[0], mla.DEFAULT_OUT)
    setup_torch()
    seqs = random_sequences(VOCAB, SEQ_LENGTHS, SEQ_SEED)
    rejected = {"routing": 0, "close calls": 0, "drift": 0}
    for seed in range(WEIGHT_SEED, WEIGHT_SEED + SEED_TRIES):
        model, tensors, quantised, captured, counts = build(seed)
        refs, prenorms, logits, gap, changed = mla.references(model, seqs)
        if gap < MIN_GAP or changed == 0:
            rejected["routing"] += 1
            continue
        narrow = list(captured)
        captured.clear()
        exact, logits64 = mla.float64_run(model, seqs)
        wide = list(captured)
        captured.clear()
        # A quantiser call of another shape: an activation rounded apart moved a token to another expert.
        same = len(wide) == len(narrow) and all(v.shape == w.shape for v, w in zip(narrow, wide))
        close = sum(fp8.close_calls(v, w) for v, w in zip(narrow, wide)) if same else -1
        drift = drift_per_index(refs, exact)
        if close:
            rejected["close calls"] += 1
            continue
        if max(drift) > MAX_F32_DRIFT:
            rejected["drift"] += 1
            continue
        break
    else:
        raise SystemExit(f"no weight seed in {SEED_TRIES} tries: {rejected}")
    print(f"{NAME}: weight seed {seed} (rejected: {rejected}), min margin {gap:.2e}, tokens whose experts the "
          f"groups change {changed}, f32 vs f64 per index " + " ".join(f"{d:.1e}" for d in drift))
    checked, ragged = check_dequantisation(model, tensors)
    assert sorted(ragged) == ["kv_a_proj_with_mqa", "q_b_proj"], ragged

    vdir = os.path.join(args.out, NAME)
    fresh_dir(vdir)
    os.makedirs(vdir)
    model.config.save_pretrained(vdir)
    cfg_path = os.path.join(vdir, "config.json")
    config = read_json(cfg_path)
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    config["dtype"] = "bfloat16"
    config["quantization_config"] = QUANTIZATION_CONFIG
    write_json(config, cfg_path, sort_keys=True)
    tensors.update(mtp_tensors(tensors))
    save_tensors(dict(sorted(tensors.items())), os.path.join(vdir, "model.safetensors"), metadata={"format": "pt"},
                 mode=0o644)
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
               for a, b in ((tensors[k], v) for k, v in read_file(os.path.join(vdir, "model.safetensors")).items()))
    copy_files(mla.TOKENIZER_DIR, vdir, mla.TOKENIZER_FILES)

    ref_tensors = reference_tensors(seqs, refs, prenorms)
    for i, ex in enumerate(exact):
        ref_tensors[f"seq{i}.hidden_states_f64"] = ex.contiguous()
    lp_tensors, lp_f32_err, lp_gap = logprob_tensors(seqs, logits, logits64, LOGPROB_K)
    ref_tensors.update(lp_tensors)
    save_tensors(ref_tensors, os.path.join(vdir, "reference.safetensors"), mode=0o644)
    fp8_names = [k for k, v in tensors.items() if v.dtype == torch.float8_e4m3fn]
    ref = {
        **versions(),
        "model_class": "DeepseekV3ForCausalLM",
        "lengths": SEQ_LENGTHS,
        "num_hidden_layers": L,
        "hidden_size": H,
        "logprobs_top_k": LOGPROB_K,
        "logprobs_f32_vs_f64_max_abs": lp_f32_err,
        "logprobs_min_gap_at_k": lp_gap,
        "weight_seed": seed,
        "weight_seeds_rejected": rejected,
        "min_routing_margin": gap,
        "expert_choices_changed_by_groups": changed,
        "f32_vs_f64_relative_error_per_index": drift,
        "randomised": counts,
        "scale_dtype": str(SCALE_DTYPE).replace("torch.", ""),
        "quantised_projections": len(fp8_names),
        "quantised_projections_of_the_decoder": sum(not k.startswith(f"model.layers.{L}.") for k in fp8_names),
        "ragged_projections": sorted(ragged),
        "dequantisation_checked_against_transformers": checked,
        "transformers_cpu_dequantisation_of_ragged_projections": ragged,
        "activations_quantised": sum(v.numel() for v in narrow),
        "activation_margin": f"|x / s| >= {fp8.CHECKED_FROM}: {fp8.MARGIN} x rms(float32 - float64) per group",
        "notes": "hidden_states = torch.stack(model(ids[None], output_hidden_states=True, use_cache=False)"
                 ".hidden_states)[:, 0], each sequence alone, float32, eager attention and experts; index L is "
                 "after the final norm; final_prenorm from a hook on the last decoder layer; hidden_states_f64 "
                 "from model.double() with RMSNorm and the quantisers in float64 (routers in float32, as "
                 "transformers computes them). Every FP8 projection runs on its weight dequantised per 128 x 128 "
                 "block (e4m3 * scale_inv in float32: transformers' Fp8Dequantize gives the same bits where the "
                 "rows are whole blocks; see transformers_cpu_dequantisation_of_ragged_projections for the others) "
                 "with its input quantised per token in groups "
                 "of 128 (s = max(amax, 1e-10) / 448, x_q = e4m3(clamp(x / s, -448, 448)), input x_q * s).",
    }
    dump_json(ref, os.path.join(vdir, "reference.json"))
    print(f"{NAME}: {len(fp8_names)} FP8 projections (ragged: {ragged}), "
          f"{checked} checked against transformers' dequantisation, size {dir_size(vdir) / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
