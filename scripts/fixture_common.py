"""What the fixture scripts (scripts/make_*.py) share: the repository's paths, the command line of
the model fixtures, JSON and safetensors writing, seeded random inputs and values, token ids, and
the reference forward pass's capture of the last decoder layer's output (final_prenorm).

The scripts run as `python scripts/<name>.py` and import this module by its sibling path. torch
and transformers are imported where they are used, so a script that needs neither
(make_parquet_fixture.py, pyarrow alone) imports it too.
"""

import argparse
import json
import os
import re
import shutil

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES_DIR = os.path.join(REPO_ROOT, "tests", "fixtures")
TINY_DIR = os.path.join(FIXTURES_DIR, "tiny")


# --------------------------------------------------------------------------- command line


def fixture_args(description, default_out):
    """--out FOLDER and --only VARIANT ... of the model-fixture scripts."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=default_out, help="output folder (default: tests/fixtures/tiny)")
    ap.add_argument("--only", nargs="*", help="only these variants")
    return ap.parse_args()


def selected(variants, only):
    """(name, spec) of `variants` in order, those named in `only` when it is given."""
    return [(name, spec) for name, spec in variants.items() if not only or name in only]


def setup_torch():
    """At most two CPU threads (the references' roundings depend on the split), versions printed."""
    import torch
    import transformers

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")


def versions():
    """The "transformers" and "torch" entries that head every reference.json."""
    import torch
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__}


# --------------------------------------------------------------------------- files


def dump_json(obj, path):
    """Pretty JSON, but with lists of numbers kept on one line."""
    text = json.dumps(obj, indent=2, ensure_ascii=False)
    text = re.sub(
        r"\[\n\s*(-?[0-9.e+-]+(?:,\n\s*-?[0-9.e+-]+)*)\n\s*\]",
        lambda m: "[" + ", ".join(s.strip() for s in m.group(1).split(",")) + "]",
        text,
    )
    with open(path, "w") as f:
        f.write(text)
        f.write("\n")


def write_json(obj, path, **kwargs):
    """json.dump with indent 2 (kwargs: sort_keys, ensure_ascii), then a newline."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, **kwargs)
        f.write("\n")


def read_json(path):
    with open(path) as f:
        return json.load(f)


def fresh_dir(path):
    """Remove `path` if it exists (save_pretrained then writes a clean folder)."""
    if os.path.exists(path):
        shutil.rmtree(path)


def copy_files(src_dir, dst_dir, names=None):
    """Copy `names` (default: every file) of src_dir into dst_dir."""
    for f in os.listdir(src_dir) if names is None else names:
        shutil.copy(os.path.join(src_dir, f), os.path.join(dst_dir, f))


def dir_size(path):
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def save_tensors(tensors, path, metadata=None, mode=None):
    """safetensors file of `tensors`; `mode` (e.g. 0o644) set afterwards when given."""
    from safetensors.torch import save_file

    if metadata is None:
        save_file(tensors, path)
    else:
        save_file(tensors, path, metadata=metadata)
    if mode is not None:
        os.chmod(path, mode)


def read_file(path):
    """Every tensor of a safetensors file, by name (torch)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def drift_per_index(refs, exact):
    """Per hidden-state index, the worst relative error (L2 over a sequence's tokens) of the
    float32 states `refs` against the float64 ones `exact` (each `[indices, T, H]`)."""
    worst = [0.0] * refs[0].shape[0]
    for ref, ex in zip(refs, exact):
        for i in range(len(worst)):
            worst[i] = max(worst[i], ((ref[i].double() - ex[i]).norm() / ex[i].norm().clamp_min(1e-30)).item())
    return worst


def logprob_tensors(seqs, logits, logits64, k):
    """seq{i}.logprob_ids / .logprobs (the top `k` of each row's log-softmax) and
    .target_logprobs (the next token's; NaN on the last row), with transformers-f32's largest
    distance from the float64 log-probabilities and the smallest gap between the k-th and the
    next log-probability (a tie there would make the top k ambiguous)."""
    import math

    import torch

    tensors, f32_err, min_gap = {}, 0.0, math.inf
    for i, (ids, lg, lg64) in enumerate(zip(seqs, logits, logits64)):
        lp, lp64 = torch.log_softmax(lg, -1), torch.log_softmax(lg64, -1)
        top = torch.sort(lp, -1, descending=True)
        min_gap = min(min_gap, (top.values[:, k - 1] - top.values[:, k]).min().item())
        tensors[f"seq{i}.logprob_ids"] = top.indices[:, :k].contiguous()
        tensors[f"seq{i}.logprobs"] = top.values[:, :k].contiguous()
        target = torch.full((ids.shape[0],), float("nan"))
        target[:-1] = lp[torch.arange(ids.shape[0] - 1), ids[1:]]
        tensors[f"seq{i}.target_logprobs"] = target
        f32_err = max(f32_err, (lp.double() - lp64).abs().max().item())
    return tensors, f32_err, min_gap


def reference_tensors(seqs, hidden_states, prenorms):
    """seq{i}.input_ids, seq{i}.hidden_states, seq{i}.final_prenorm, sequence after sequence."""
    tensors = {}
    for i, (ids, hs, prenorm) in enumerate(zip(seqs, hidden_states, prenorms)):
        tensors[f"seq{i}.input_ids"] = ids.contiguous()
        tensors[f"seq{i}.hidden_states"] = hs
        tensors[f"seq{i}.final_prenorm"] = prenorm
    return tensors


# --------------------------------------------------------------------------- random values, ids


def random_sequences(vocab, lengths, seed):
    """torch.randint(0, vocab) ids of each length in turn, from torch.Generator().manual_seed(seed)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (t,), generator=g, dtype=torch.int64) for t in lengths]


def randn(shape, gen, std=1.0, mean=0.0):
    """mean + std * (float32 normal draws of `gen`)."""
    import torch

    return mean + std * torch.randn(shape, generator=gen, dtype=torch.float32)


def token_ids(tok, text, **kwargs):
    """tok(text, **kwargs)["input_ids"] as a list of ints."""
    return [int(i) for i in tok(text, **kwargs)["input_ids"]]


def as_id_list(x):
    """apply_chat_template(tokenize=True) may return a list, a dict or a BatchEncoding."""
    import torch

    if hasattr(x, "keys") and "input_ids" in x.keys():
        x = x["input_ids"]
    if torch.is_tensor(x):
        x = x.tolist()
    if len(x) > 0 and isinstance(x[0], (list, tuple)):
        assert len(x) == 1
        x = x[0]
    return [int(i) for i in x]


# --------------------------------------------------------------------------- reference pass


def layer_output(out):
    """A decoder layer's hidden-state output (first item of a tuple), detached and copied: what a
    forward hook keeps."""
    return (out[0] if isinstance(out, (tuple, list)) else out).detach().clone()


def forward_with_last_layer(base, ids):
    """base(input_ids=ids[None], output_hidden_states=True) with a forward hook on the last decoder
    layer, base.layers[-1]; returns the output and that layer's output [1, T, H] (before the final
    norm), both of the same forward pass. Call under torch.no_grad()."""
    captured = {}

    def hook(_mod, _inp, out):
        captured["last"] = layer_output(out)

    h = base.layers[-1].register_forward_hook(hook)
    try:
        out = base(input_ids=ids[None], output_hidden_states=True)
    finally:
        h.remove()
    return out, captured["last"]


def check_final_prenorm(norm, prenorm, final, atol=1e-6):
    """The final norm applied to final_prenorm [T, H] gives the last hidden-state index [T, H]."""
    import torch

    assert torch.allclose(norm(prenorm[None])[0], final, rtol=1e-5, atol=atol), \
        "final_prenorm: final norm of the hooked tensor != hidden_states[L]"
