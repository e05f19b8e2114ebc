#!/usr/bin/env python3
"""The baseline users run today, on the GPU: Hugging Face transformers, bf16, SDPA attention, the
base model without lm_head and without the layers past the deepest requested one (--no-truncate
keeps them), forward hooks on the requested layers, sequences sorted by length in right-padded
batches of at most --max-batch-tokens (padding counted), results copied asynchronously to
page-locked host buffers allocated once and reused, each batch's copy waited for by its own
event. An untimed warm-up pass over every batch (--warmup first: the first batch only), then the
whole workload timed end to end. For the Gated DeltaNet
hybrids, transformers uses fla's kernels when fla imports (the JSON line says whether it did);
MoE models take --experts-implementation.

--from-config: the model of DIR's config.json with transformers' own random initialisation, drawn in
bf16 on the GPU (for the shapes bench/gpu/synthetic_manifest.py describes, whose checkpoints are
not written; speed does not depend on the weights' values).

Usage: python3 bench/gpu/hf_baseline.py --model-dir DIR --workload bench/out/gpu/workload_gpu.json
           [--max-batch-tokens 16384] [--from-config]
"""

import argparse
import importlib.util
import json
import os
import time

import sys

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM


def load_workload(path):
    meta = json.load(open(path))
    seqs = [json.loads(l)["input_ids"] for l in open(os.path.join(os.path.dirname(path), meta["file"])) if l.strip()]
    return meta["layers"], seqs


def delta_rule_implementation(base):
    """The module of the chunked gated delta rule transformers resolved at import for this model
    (hybrids; None for other models): fla's when it imports, else transformers' torch reference.
    transformers wraps its reference function and keeps the resolved implementation in the
    wrapper's closure."""
    import importlib

    mod = importlib.import_module(type(base).__module__)
    fn = getattr(mod, "torch_chunk_gated_delta_rule", None)
    if fn is None:
        return None
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        v = cell.cell_contents
        if callable(v) and getattr(v, "__module__", None):
            found.append(v.__module__)
    fla = [m for m in found if m.split(".")[0] == "fla"]
    return fla[0] if fla else (found[0] if found else fn.__module__)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--max-batch-tokens", type=int, default=16384)
    ap.add_argument("--no-truncate", action="store_true", help="run every layer, as output_hidden_states would")
    ap.add_argument("--warmup", choices=["first", "all"], default="all",
                    help="untimed warm-up: the first batch, or every batch once (Triton kernels, such as fla's, "
                         "compile and autotune per shape on first use)")
    ap.add_argument("--experts-implementation", default=None,
                    help="MoE models: transformers' experts kernel (grouped_mm, batched_mm, eager)")
    ap.add_argument("--from-config", action="store_true",
                    help="random weights of DIR's config.json, drawn on the GPU, instead of its checkpoint")
    a = ap.parse_args()
    layers, seqs = load_workload(a.workload)
    extra = {"experts_implementation": a.experts_implementation} if a.experts_implementation else {}
    load_t0 = time.perf_counter()
    if a.from_config:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
        from random_checkpoint import random_model

        cfg = AutoConfig.from_pretrained(a.model_dir)
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config  # the FP8 layout's config: transformers runs the bf16 model
        model = random_model(cfg, cfg.architectures[0], device="cuda", dtype=torch.bfloat16, from_config=True,
                             attn_implementation="sdpa", **extra)
    else:
        # Loaded straight onto the GPU: a full-depth 27B model held once more in host memory would
        # not fit beside its files in /dev/shm.
        model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                     device_map="cuda", **extra)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - load_t0
    base = model.model.eval()
    del model.lm_head
    n = base.config.num_hidden_layers
    deepest = max(layers)
    if not a.no_truncate and deepest < n:
        # Layers past the deepest hook cannot change what is captured: drop them.
        base.layers = base.layers[:deepest]
        base.config.num_hidden_layers = deepest
        if hasattr(base.config, "layer_types") and base.config.layer_types:
            base.config.layer_types = base.config.layer_types[:deepest]
    captured = {}

    def hook(idx):
        def f(_m, _a, out):
            captured[idx] = out[0] if isinstance(out, (tuple, list)) else out
        return f

    for idx in sorted(set(layers)):
        mod = base.embed_tokens if idx == 0 else base.norm if idx == n else base.layers[idx - 1]
        mod.register_forward_hook(hook(idx))

    order = sorted(range(len(seqs)), key=lambda k: len(seqs[k]))
    batches, cur = [], []
    for k in order:
        if cur and (len(cur) + 1) * len(seqs[k]) > a.max_batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(k)
    batches.append(cur)

    # Page-locked host buffers, allocated once and reused (pinning hundreds of MB per batch costs
    # more than the copy), one per batch in flight; each batch's copy is waited for by its own
    # event, so the GPU keeps working on the next batches meanwhile.
    in_flight = 3
    largest = max(len(b) * max(len(seqs[k]) for k in b) for b in batches) * len(layers) * base.config.hidden_size
    pool = [torch.empty(largest, dtype=torch.bfloat16, pin_memory=True) for _ in range(in_flight + 1)]

    def run(batch, slot):
        lens = [len(seqs[k]) for k in batch]
        t = max(lens)
        ids = torch.zeros((len(batch), t), dtype=torch.int64)
        mask = torch.zeros((len(batch), t), dtype=torch.int64)
        for b, k in enumerate(batch):
            ids[b, : lens[b]] = torch.tensor(seqs[k])
            mask[b, : lens[b]] = 1
        captured.clear()
        base(input_ids=ids.cuda(non_blocking=True), attention_mask=mask.cuda(non_blocking=True), use_cache=False)
        stacked = torch.stack([captured[i] for i in layers], dim=2)  # [B, T, L, H]
        host = pool[slot][: stacked.numel()].view(stacked.shape)
        host.copy_(stacked, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, lens, done

    with torch.inference_mode():
        warm = time.perf_counter()
        for n_b, b in enumerate(batches if a.warmup == "all" else batches[:1]):
            run(b, n_b % len(pool))
            torch.cuda.synchronize()
        warmup_s = time.perf_counter() - warm
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        pending, out_bytes = [], 0
        t0 = time.perf_counter()
        for n_b, b in enumerate(batches):
            pending.append(run(b, n_b % len(pool)))
            if len(pending) > in_flight - 1:
                host, lens, done = pending.pop(0)
                done.synchronize()
                out_bytes += sum(host[i, :l].numel() * 2 for i, l in enumerate(lens))
        for host, lens, done in pending:
            done.synchronize()
            out_bytes += sum(host[i, :l].numel() * 2 for i, l in enumerate(lens))
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
    tokens = sum(len(s) for s in seqs)
    rule = delta_rule_implementation(base)
    print(json.dumps({
        "contender": "hf-transformers-hooks", "tokens": tokens, "seconds": round(secs, 3),
        "tokens_per_s": round(tokens / secs, 1), "max_batch_tokens": a.max_batch_tokens, "batches": len(batches),
        "padded_tokens": sum(len(b) * len(seqs[b[-1]]) for b in batches), "output_bytes": out_bytes,
        "layers_run": len(base.layers), "warmup": a.warmup, "warmup_seconds": round(warmup_s, 3),
        "load_seconds": round(load_s, 3), "weights": "random, drawn on the GPU" if a.from_config else a.model_dir,
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(), "torch": torch.__version__,
        "transformers": transformers.__version__, "experts_implementation": a.experts_implementation,
        "fla": importlib.util.find_spec("fla") is not None, "chunk_gated_delta_rule": rule,
    }))


if __name__ == "__main__":
    main()
