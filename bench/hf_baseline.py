#!/usr/bin/env python3
"""CPU baseline: Hugging Face transformers + forward hooks, the way users extract hidden
states of chosen layers today.

f32 weights (transformers dequantises the GGUF, or loads a Hugging Face folder given with --model),
base model only (`model.model`, no lm_head), SDPA attention, `torch.inference_mode()`,
`use_cache=False`. Forward hooks capture the outputs
the requested `hidden_states` indices stand for:

    0          output of model.model.embed_tokens
    1 .. L-1   output of model.model.layers[i-1]
    L          output of model.model.norm (final normed output)

Sequences are sorted by length and grouped greedily into right-padded batches of at most
--max-batch-tokens tokens (counting padding; a longer sequence gets a batch of its own), with an
attention mask. After each forward the unpadded rows of every requested layer are copied out
(one [n_layers, T, H] f32 tensor per sequence), so the extraction work is really done.

One untimed warm-up batch (the first of the schedule), then the whole workload is timed end to
end with time.perf_counter (batch assembly, forward, copy-out; not model loading or reading the
workload). Throughput counts real (unpadded) tokens. The last stdout line is one JSON object.

Hybrid models (Gated DeltaNet `linear_attention` layers, e.g. Qwen3.5 / Qwen3-Next from a --model
folder) run transformers' pure-torch path: the script refuses to run when `fla` or `causal_conv1d` is
importable (transformers would silently switch to their kernels), checks that the GDN dispatchers
resolved to the torch functions, and records that (and transformers' fallback warnings) in the JSON
line. Right padding is exact for the GDN too: transformers zeroes the padded positions, which all
come after the real tokens of the causal conv and delta rule (--check verifies it).

--check OUT.safetensors saves `s{k}.hidden_states` [n_layers, T, H] f32 (and `s{k}.input_ids`)
of the first 2 sequences of the workload file, and prints the largest difference against an
unbatched `output_hidden_states=True` forward of the same model (each without padding), naming the
padded batch the sequence ran in.

Usage: python bench/hf_baseline.py [--workload bench/workload_cpu.json]
           [--gguf .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf | --model HF_FOLDER] [--threads 2]
           [--max-batch-tokens 4096] [--check OUT.safetensors]
"""

import argparse
import importlib.util
import json
import logging
import os
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
DEFAULT_WORKLOAD = os.path.join(HERE, "workload_cpu.json")
DEFAULT_GGUF = os.path.join(REPO_ROOT, ".cache", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
N_CHECK = 2
# GDN kernel-or-torch dispatchers of transformers' hybrid modelling files
GDN_FUNCS = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")


class _Collect(logging.Handler):
    """Keeps the messages transformers logs (its fallback warnings are logged once, at first use)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def gdn_path(base):
    """For a model with linear-attention layers: the implementation its GDN functions resolved to.
    Refuses a run where fla / causal_conv1d would be used (the baseline is transformers' torch path)."""
    layer_types = list(getattr(base.config, "layer_types", None) or [])
    if "linear_attention" not in layer_types:
        return None
    found = [p for p in ("fla", "causal_conv1d") if importlib.util.find_spec(p) is not None]
    assert not found, f"{found} importable: transformers would use their kernels, not its torch path"
    assert not getattr(base, "use_kernels", False), "hub kernels requested"
    mod = sys.modules[type(base).__module__]
    resolved = {}
    for name in GDN_FUNCS:
        fn = getattr(mod, name, None)
        assert fn is not None, f"{mod.__name__} has no {name}"
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
        impl = cells.get("implementation")
        assert cells.get("is_new_implementation") is False, (name, impl)
        resolved[name] = f"{impl.__module__}.{impl.__qualname__}"
    return {"path": "torch", "functions": resolved, "layer_types": layer_types}


def load_workload(sidecar_path):
    with open(sidecar_path) as f:
        meta = json.load(f)
    assert meta.get("dtype", "float32") == "float32", meta
    path = os.path.join(os.path.dirname(os.path.abspath(sidecar_path)), meta["file"])
    seqs = []
    with open(path) as f:
        for line in f:
            if line.strip():
                obj = json.loads(line)
                seqs.append((obj["id"], obj["input_ids"]))
    return meta["layers"], seqs


def make_batches(seqs, max_batch_tokens):
    """Sort by length, then group greedily: len(batch) * longest <= max_batch_tokens."""
    order = sorted(range(len(seqs)), key=lambda k: len(seqs[k][1]))
    batches, cur = [], []
    for k in order:
        n = len(seqs[k][1])  # ascending, so n is the longest of cur + [k]
        if cur and (len(cur) + 1) * n > max_batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(k)
    if cur:
        batches.append(cur)
    return batches


def install_hooks(base, layers):
    n_layers = base.config.num_hidden_layers
    captured = {}

    def hook_for(idx):
        def hook(_module, _args, output):
            captured[idx] = output[0] if isinstance(output, (tuple, list)) else output

        return hook

    for idx in sorted(set(layers)):
        if idx == 0:
            module = base.embed_tokens
        elif 1 <= idx < n_layers:
            module = base.layers[idx - 1]
        elif idx == n_layers:
            module = base.norm
        else:
            raise SystemExit(f"layer index {idx} out of range 0..{n_layers}")
        module.register_forward_hook(hook_for(idx))
    return captured


def run_batch(base, captured, layers, seqs, batch):
    lens = [len(seqs[k][1]) for k in batch]
    t_max = max(lens)
    ids = torch.zeros((len(batch), t_max), dtype=torch.int64)
    mask = torch.zeros((len(batch), t_max), dtype=torch.int64)
    for b, k in enumerate(batch):
        ids[b, : lens[b]] = torch.tensor(seqs[k][1], dtype=torch.int64)
        mask[b, : lens[b]] = 1
    captured.clear()
    base(input_ids=ids, attention_mask=mask, use_cache=False)
    out = {}
    for b, k in enumerate(batch):
        out[k] = torch.stack([captured[i][b, : lens[b]] for i in layers]).clone()
    captured.clear()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=DEFAULT_WORKLOAD, help="workload sidecar JSON")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--gguf", help=f"GGUF model file (default: {DEFAULT_GGUF})")
    src.add_argument("--model", metavar="DIR", help="Hugging Face model folder (config.json + safetensors)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch-tokens", type=int, default=4096)
    ap.add_argument("--check", metavar="OUT.safetensors", help="save states of the first 2 sequences")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    layers, seqs = load_workload(args.workload)

    collect = _Collect()
    transformers.utils.logging.get_logger().addHandler(collect)
    attn = "sdpa"
    if args.model:
        try:
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=attn)
        except ValueError as e:  # transformers refuses sdpa for this architecture: eager, said in the line
            print(f"sdpa refused ({e}); using eager attention", file=sys.stderr)
            attn = "eager"
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=attn)
    else:
        gguf_dir, gguf_name = os.path.split(os.path.abspath(args.gguf or DEFAULT_GGUF))
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=gguf_name, dtype=torch.float32, attn_implementation="sdpa"
        )
    model.eval()
    base = model.model
    assert base.config._attn_implementation == attn, base.config._attn_implementation
    gdn = gdn_path(base)
    captured = install_hooks(base, layers)

    batches = make_batches(seqs, args.max_batch_tokens)
    real_tokens = sum(len(ids) for _, ids in seqs)
    padded_tokens = sum(len(b) * len(seqs[b[-1]][1]) for b in batches)

    with torch.inference_mode():
        run_batch(base, captured, layers, seqs, batches[0])  # warm-up, untimed
        fallback = [m for m in collect.messages if "falling back" in m]
        if gdn is not None:
            assert fallback, "no torch-fallback warning from transformers for a linear-attention model"

        results = {}
        t0 = time.perf_counter()
        for batch in batches:
            results.update(run_batch(base, captured, layers, seqs, batch))
        seconds = time.perf_counter() - t0

    assert len(results) == len(seqs)

    if args.check:
        from safetensors.torch import save_file

        tensors = {}
        with torch.inference_mode():
            for k in range(min(N_CHECK, len(seqs))):
                name, ids = seqs[k]
                ids_t = torch.tensor(ids, dtype=torch.int64)
                tensors[f"{name}.input_ids"] = ids_t
                tensors[f"{name}.hidden_states"] = results[k].contiguous()
                ref = base(input_ids=ids_t[None], output_hidden_states=True, use_cache=False).hidden_states
                ref = torch.stack([ref[i][0] for i in layers])
                diff = (ref - results[k]).abs().max().item()
                batch = next(b for b in batches if k in b)
                print(
                    f"check {name}: T={len(ids)} (batch of {len(batch)} padded to {len(seqs[batch[-1]][1])}) "
                    f"max|hooks(batched) - output_hidden_states| = {diff:.3g}"
                )
        save_file(tensors, args.check, metadata={"layers": json.dumps(layers)})

    line = {
        "contender": "hf-transformers-hooks",
        "tokens": real_tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(real_tokens / seconds, 1),
        "threads": args.threads,
        "max_batch_tokens": args.max_batch_tokens,
        "batches": len(batches),
        "padded_tokens": padded_tokens,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if args.model:  # the GGUF line keeps its fields
        line["model"] = args.model
        line["attn_implementation"] = base.config._attn_implementation
        if gdn is not None:
            line["gdn_path"] = gdn["path"]
            line["gdn_functions"] = gdn["functions"]
            line["linear_attention_layers"] = gdn["layer_types"].count("linear_attention")
            line["full_attention_layers"] = gdn["layer_types"].count("full_attention")
            line["transformers_fallback_warnings"] = fallback
    print(json.dumps(line))


if __name__ == "__main__":
    main()
