#!/usr/bin/env python3
"""Generate a 256-wide random checkpoint in the layout of Qwen's block-wise FP8 releases with
references from transformers in float64 and in float32 on 130-token sequences, used by the Rust
test-suite (tests/fp8_long.rs) to test the W8A8 arithmetic against float64 where no single float32
run can stand for it.

Why float64: W8A8's activation quantisation is discontinuous. An activation x / s within float32
noise of an e4m3 rounding boundary (the midpoint of two e4m3 values) rounds one way or the other
under the last-bit differences between two correct float32 implementations, a step of 1/16 of its
value; that token's states move, and through attention every later token's, whose activations
then round differently in turn. scripts/make_fp8_fixtures.py keeps its short sequences off those
boundaries (its weight seeds are chosen so); on longer sequences they cannot be avoided: the first
layer's inputs are bf16 embeddings times bf16 norm weights, whose ratios to their group's largest
land exactly on e4m3 midpoints now and then, where even float64 only picks a side by its own last
bit. So the engine is held to float64 as transformers-f32 is: its distance from the float64 run,
and the token of its first rounding flip (the first token whose states move from the float64
run's by more than FLIP), measured the same way.

The checkpoint (variants below) is made by scripts/make_fp8_fixtures.py's build(): every parameter
random (transformers' initialisation, initializer_range 0.02, RMSNorm weights multiplied by
(1 + 0.1 * randn)), the projections quantised block-wise as the releases are, every other parameter
rounded to bf16 as stored. Unlike the short fixtures, the embeddings keep transformers' std of 0.02
(embed_scale 1): the layers make up most of the residual stream, so a flip shows nearly undamped
(1e-2 and more), the worst case for a user comparing runs; the weight seed is not searched.

Both passes run transformers' own model with each quantised projection's forward replaced by
F.linear(qdq(x), W_dequantised) (scripts/make_fp8_fixtures.py's qdq_activation):
  * float32: eager attention, as the short fixtures' references;
  * float64: the same model widened (model.double(), rotary inverse frequencies computed again in
    float64) under scripts/make_logprob_references.py's Float64Everywhere, which turns every float32
    that transformers asks for (RMSNorm's x.to(torch.float32), attention's softmax dtype, the rotary
    angles) into float64. The activation quantisation runs in float64 as well: s = max(amax, 1e-10) /
    448, x / s and its rounding to e4m3 (round_e4m3, ties to even, on the float64 value itself; the
    script checks it gives torch's cast on every activation of the float32 pass). Every op's floating
    output is checked to be float64 (reference.json: ops_not_float64, empty).

Output layout (default: tests/fixtures/fp8_long relative to the repository root):

    <out>/<variant>/config.json, model.safetensors, tokenizer files (those of tiny/qwen3_qknorm)
    <out>/<variant>/reference.safetensors
        seq{i}.input_ids      int64   [T]
        seq{i}.hidden_states  float32 [L+1, T, H]  the float64 run's states, rounded to float32
                                                  (index 0 the embeddings, index L after the final
                                                  norm)
        seq{i}.f32_distance   float32 [L+1, T]     transformers-f32's distance from the float64 run,
                                                  per index and token: |h32 - h64| / |h64| (L2 over
                                                  the hidden size; 0 where both rows are zero)
        seq{i}.boundary_gap   float32 [L, T]       per decoder layer and token, the smallest distance
                                                  of any quantised activation x / s of the float64
                                                  run to an e4m3 rounding boundary (units of x / s)
    <out>/<variant>/reference.json                the versions, the recipe, and transformers-f32's
                                                  figures: distance from float64 per index (each
                                                  sequence and all together), first flip per
                                                  sequence

Pinned package versions: scripts/requirements-fixtures.txt. As for the other fixture scripts, the
committed files were generated with torch's AVX2 CPU kernels (ATEN_CPU_CAPABILITY=avx2).
Usage: ATEN_CPU_CAPABILITY=avx2 python scripts/make_fp8_long_fixtures.py [--out tests/fixtures/fp8_long]
       [--only VARIANT ...]
"""

import os

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import make_fp8_fixtures as fp8
from fixture_common import (
    FIXTURES_DIR,
    copy_files,
    dir_size,
    dump_json,
    fixture_args,
    fresh_dir,
    random_sequences,
    read_json,
    save_tensors,
    selected,
    setup_torch,
    versions,
    write_json,
)
from make_logprob_references import Float64Everywhere, to_float64

DEFAULT_OUT = os.path.join(FIXTURES_DIR, "fp8_long")
SEQ_LENGTHS = [130] * 6
SEQ_SEED = 4321
WEIGHT_SEED = 0
# A token's states have flipped when they lie further than this from the float64 run's at some
# index (relative L2): the float32 runs stay within ~1e-6 of it until an activation rounds to
# another e4m3 value, which moves them by 1e-3 and more on this checkpoint.
FLIP = 1e-4

VARIANTS = {
    # Qwen3 (q/k norm), hidden 256 (two groups of 128 per input row), MLP 512, two layers, tied
    # embeddings, scales in f32 (as Qwen3-8B-FP8's), every projection quantised.
    "qwen3_256": dict(
        config_cls=Qwen3Config,
        model_cls=Qwen3ForCausalLM,
        drop_common=["hidden_size", "intermediate_size"],
        kwargs=dict(hidden_size=256, intermediate_size=512, tie_word_embeddings=True),
        scale_dtype=torch.float32,
        keep_bf16=[],
        modules_to_not_convert=None,
        embed_scale=1.0,
    ),
}


def row_distance(a, b):
    """|a - b| / |b| per row (last dimension), float64; 0 where both rows are zero (the padding
    id's embedding)."""
    a, b = a.double(), b.double()
    num, den = (a - b).norm(dim=-1), b.norm(dim=-1)
    assert bool(((den > 0) | (num == 0)).all()), "a zero float64 row where the float32 one is not"
    return torch.where(den > 0, num / den.clamp(min=1e-300), torch.zeros_like(num))


def first_flip(distance):
    """The first token whose distance [L+1, T] exceeds FLIP at some index, T when none does."""
    over = (distance > FLIP).any(dim=0).nonzero().flatten()
    return int(over[0]) if len(over) else distance.shape[1]


def boundary_gaps(calls, per_layer, t):
    """[L, T]: per decoder layer and token, the smallest distance of the quantiser calls' x / s
    (each [1, T, K], per_layer calls a layer, in order) to an e4m3 rounding boundary."""
    bounds = fp8.e4m3_boundaries()
    gaps = []
    for layer in range(len(calls) // per_layer):
        gap = torch.full((t,), float("inf"), dtype=torch.float64)
        for v in calls[layer * per_layer:(layer + 1) * per_layer]:
            x = v.reshape(t, -1).double().abs().contiguous()
            i = torch.searchsorted(bounds, x).clamp(1, len(bounds) - 1)
            d = torch.minimum((x - bounds[i - 1]).abs(), (x - bounds[i]).abs())
            gap = torch.minimum(gap, d.min(dim=-1).values)
        gaps.append(gap)
    return torch.stack(gaps)


@torch.no_grad()
def make_variant(name, spec, out_dir):
    seqs = random_sequences(fp8.COMMON["vocab_size"], SEQ_LENGTHS, SEQ_SEED)
    model, tensors, quantised, captured, n_norm = fp8.build(spec, WEIGHT_SEED)
    cfg = model.config
    L = cfg.num_hidden_layers
    per_layer = len(quantised) // L

    # float32, as the short fixtures' references.
    hs32 = []
    for ids in seqs:
        start = len(captured)
        out = model.model(input_ids=ids[None], output_hidden_states=True)
        hs32.append(torch.stack(out.hidden_states)[:, 0].contiguous())
        calls = captured[start:]
        assert len(calls) == per_layer * L and all(v.dtype == torch.float32 for v in calls)
        # round_e4m3 is torch's cast on float32 values (the float64 pass relies on it).
        for v in calls:
            assert torch.equal(fp8.round_e4m3(v), v.to(torch.float8_e4m3fn).to(torch.float32))
    checked = sum(v.numel() for v in captured)

    # float64 end to end, the activation quantisation included.
    model64, experts = to_float64(model)
    mode = Float64Everywhere()
    hs64, gaps = [], []
    for ids in seqs:
        start = len(captured)
        with mode:
            out = model64.model(input_ids=ids[None], output_hidden_states=True)
        h = torch.stack(out.hidden_states)[:, 0]
        assert h.dtype == torch.float64
        hs64.append(h)
        calls = captured[start:]
        assert len(calls) == per_layer * L and all(v.dtype == torch.float64 for v in calls)
        gaps.append(boundary_gaps(calls, per_layer, len(ids)))
    assert not mode.not_float64, mode.not_float64

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
        "weight_block_size": [fp8.BLOCK, fp8.BLOCK],
        "modules_to_not_convert": spec["modules_to_not_convert"],
    }
    write_json(config, os.path.join(vdir, "config.json"), sort_keys=True)
    save_tensors(dict(sorted(tensors.items())), os.path.join(vdir, "model.safetensors"), metadata={"format": "pt"})
    copy_files(fp8.TOKENIZER_FROM, vdir, fp8.TOKENIZER_FILES)

    ref, per_seq, flips = {}, [], []
    num = torch.zeros(L + 1, dtype=torch.float64)
    den = torch.zeros(L + 1, dtype=torch.float64)
    for i, (ids, h32, h64, gap) in enumerate(zip(seqs, hs32, hs64, gaps)):
        dist = row_distance(h32, h64)
        ref[f"seq{i}.input_ids"] = ids.contiguous()
        ref[f"seq{i}.hidden_states"] = h64.float().contiguous()
        ref[f"seq{i}.f32_distance"] = dist.float().contiguous()
        ref[f"seq{i}.boundary_gap"] = gap.float().contiguous()
        diff = (h32.double() - h64).pow(2).sum(dim=(1, 2))
        whole = h64.pow(2).sum(dim=(1, 2))
        num, den = num + diff, den + whole
        per_seq.append([float(f"{x:.3g}") for x in (diff / whole).sqrt().tolist()])
        flips.append(first_flip(dist))
    save_tensors(ref, os.path.join(vdir, "reference.safetensors"))
    together = [float(f"{x:.3g}") for x in (num / den).sqrt().tolist()]
    facts = {
        **versions(),
        "model_class": type(model).__name__,
        "lengths": SEQ_LENGTHS,
        "num_hidden_layers": L,
        "hidden_size": cfg.hidden_size,
        "last_index_is_post_norm": True,
        "num_rmsnorm_perturbed": n_norm,
        "weight_seed": WEIGHT_SEED,
        "embed_scale": spec["embed_scale"],
        "scale_dtype": str(spec["scale_dtype"]).replace("torch.", ""),
        "quantised_projections": sum(k.endswith(".weight_scale_inv") for k in tensors),
        "activations_checked_round_e4m3": checked,
        "ops_not_float64": sorted(mode.not_float64),
        "experts_implementation": experts,
        "flip_threshold": FLIP,
        "f32_distance_per_index": together,
        "f32_distance_per_index_per_sequence": per_seq,
        "f32_first_flip": flips,
        "notes": (
            "hidden_states: the float64 run (model.double(), rotary inverse frequencies in float64, under a torch "
            "function mode turning every float32 asked for into float64), rounded to float32; index 0 the embeddings, "
            "index L after the final norm. Each quantised projection: input quantised per token in groups of 128 "
            "(s = max(amax, 1e-10) / 448, x_q = e4m3(clamp(x / s, -448, 448)), ties to even), times the dequantised "
            "weight (w_q * scale_inv). f32_distance: transformers in float32 (eager attention, the same model and "
            "quantiser in float32) against the float64 run, |h32 - h64| / |h64| per index and token. "
            "f32_distance_per_index: sqrt(sum |h32 - h64|^2 / sum |h64|^2) over all the sequences' tokens, per index. "
            f"f32_first_flip: per sequence, the first token whose f32_distance exceeds {FLIP} at some index. "
            "boundary_gap: per decoder layer and token, the smallest |x / s - m| over that token's quantised "
            "activations (every projection of the layer) and the e4m3 rounding boundaries m, in the float64 run. "
            "input ids: torch.randint(0, vocab_size) with "
            f"torch.Generator().manual_seed({SEQ_SEED}), lengths in order. "
            f"Weights: scripts/make_fp8_fixtures.py's build(), torch.manual_seed({WEIGHT_SEED}), embeddings scaled by "
            f"{spec['embed_scale']} (transformers' initialisation)."
        ),
    }
    dump_json(facts, os.path.join(vdir, "reference.json"))
    print(f"{name}: transformers-f32 from float64 per index {together}, first flips {flips}, "
          f"{dir_size(vdir) / 1e3:.0f} kB")


def main():
    args = fixture_args(__doc__.split("\n")[0], DEFAULT_OUT)
    setup_torch()
    os.makedirs(args.out, exist_ok=True)
    for name, spec in selected(VARIANTS, args.only):
        make_variant(name, spec, args.out)
    print(f"total size of {os.path.relpath(args.out)}: {dir_size(args.out) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
