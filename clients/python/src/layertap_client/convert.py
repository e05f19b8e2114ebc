"""Convert a ``layertap bulk`` folder into the offline files of a drafter trainer.

Usage::

    python -m layertap_client.convert specforge-eagle3 hs/ specforge-hs/
    python -m layertap_client.convert specforge-dflash hs/ specforge-hs/

Formats (SpecForge's offline readers list every ``*.ckpt`` under the folder,
sorted, and ``torch.load`` each):

``specforge-eagle3``
    ``input_ids`` [T] int64, ``loss_mask`` [T] int64, ``aux_hidden_state``
    [1, T, (n-1)·H] (every layer asked but the last, concatenated in the
    order asked) and ``hidden_state`` [1, T, H] (the last layer asked, which
    must be index L: the final state **after** the norm, as SpecForge's
    target head has no norm of its own). Ask ``layertap bulk`` for
    ``--layers 2,L/2,L-3,-1``.
``specforge-dflash``
    ``input_ids`` [T] int64, ``loss_mask`` [T] int64 and ``hidden_states``
    [T, n·H] (every layer asked, concatenated in the order asked). For a
    draft whose ``target_layer_ids`` are ``[t, …]`` ask for ``t + 1``.

The source folder must be the plain layout (the default of ``layertap bulk``)
holding every token (no ``--tokens`` selection). Each file is checked
against the manifest's xxh64 and its tensors against their checksums before
it is converted. The hidden states keep their dtype (``--dtype`` casts them;
fp8 files are dequantised with their scales, then stored as bfloat16 unless
``--dtype`` says otherwise).

One sample is read, converted and written at a time (memory: one sample).
Each output goes to ``OUT/<the bulk file's path>.ckpt`` through a temporary
name and a rename, and ``OUT/convert-manifest.jsonl`` records it, so running
the same command again after a crash or Ctrl-C resumes: finished samples are
skipped, the rest are done. Samples that cannot be converted are listed in
``OUT/convert-failures.jsonl`` and the exit status is 1, and so are manifest
lines that record no id or no file, or a file outside the bulk folder (``..``,
an absolute path, a link leading out of it), which are never read.

torch is not needed: the files are written in ``torch.save``'s own format
(see :mod:`layertap_client._torchsave`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _safetensors, _torchsave, layouts
from ._common import ChecksumMismatch, LayertapError, verify_checksums
from .dataset import LOAD_ERRORS, BulkFolder

FORMATS = ("specforge-eagle3", "specforge-dflash")
DTYPES = ("auto", "bfloat16", "float16", "float32")
MANIFEST = "convert-manifest.jsonl"
FAILURES = "convert-failures.jsonl"
SETTINGS = "convert.json"

_STORAGE = {"bfloat16": "BFloat16Storage", "float16": "HalfStorage", "float32": "FloatStorage"}
_SOURCE_DTYPE = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": "fp8"}


class ConvertError(ValueError):
    """A sample (or the whole folder) cannot be converted to the format asked."""


def _float32(dtype: str, arr: np.ndarray, scale: Optional[np.ndarray]) -> np.ndarray:
    """The hidden states as float32, exactly (fp8 times its per-row, per-layer scale)."""
    if dtype == "F32":
        return arr
    if dtype == "F16":
        return arr.astype(np.float32)
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    if dtype == "F8_E4M3":
        out = _safetensors.f8_e4m3_bits_to_float32(arr)
        out *= scale[..., None]
        return out
    raise ConvertError(f"hidden_states are {dtype}, which this converter does not read")


def _bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounding to nearest even (as torch's ``.to(torch.bfloat16)``)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def _cast(dtype: str, arr: np.ndarray, scale: Optional[np.ndarray], want: str) -> Tuple[str, np.ndarray]:
    """``(storage class, array)`` of the hidden states in the output dtype ``want``
    (``auto``: the source's, bfloat16 for fp8); the bytes as they are when the
    dtype does not change."""
    source = _SOURCE_DTYPE.get(dtype)
    if source is None:
        raise ConvertError(f"hidden_states are {dtype}, which this converter does not read")
    if want == "auto":
        want = "bfloat16" if source == "fp8" else source
    if want == source:
        return _STORAGE[want], arr
    f32 = _float32(dtype, arr, scale)
    if want == "float32":
        return "FloatStorage", f32
    if want == "float16":
        return "HalfStorage", f32.astype(np.float16)
    return "BFloat16Storage", _bfloat16_bits(f32)


def _labels(metadata: Dict[str, str], what: str) -> Tuple[List[Any], int]:
    try:
        layers = json.loads(metadata["layers"])
        num_layers = int(metadata["num_layers"])
    except (KeyError, ValueError, TypeError) as e:
        raise ConvertError(f"{what}: no layers / num_layers in its metadata ({e}): is it a layertap bulk file?") from None
    if not isinstance(layers, list) or not layers:
        raise ConvertError(f"{what}: its layers metadata is {metadata.get('layers')!r}")
    return layers, num_layers


def check_layers(fmt: str, layers: Sequence[Any], num_layers: int, what: str = "the folder") -> None:
    """Refuses layer sets the format cannot take, saying what to ask for instead
    (:func:`layertap_client.layouts.check_layers`)."""
    try:
        layouts.check_layers(fmt, layers, num_layers, what)
    except layouts.LayoutError as e:
        raise ConvertError(str(e)) from None


@dataclass
class Converted:
    """One output file: its tensors' names and shapes, and the layers it came from."""

    tensors: Dict[str, Tuple[str, np.ndarray]]
    layers: List[Any]
    num_layers: int
    tokens: int


def convert_sample(fmt: str, data: bytes, what: str, dtype: str = "auto") -> Converted:
    """Converts one bulk file's bytes (already checked against the manifest) into ``fmt``."""
    tensors, metadata, stored = _safetensors.parse_raw(data)
    if not verify_checksums(stored, metadata, status=None, what=what):
        raise ChecksumMismatch(f"{what}: no checksums in its metadata")
    layers, num_layers = _labels(metadata, what)
    if "positions" in tensors:
        raise ConvertError(
            f"{what} holds a token selection ({metadata.get('tokens')}): the trainers read every token; "
            "extract without --tokens"
        )
    if "token_ids" in tensors and "loss_mask" not in tensors:
        raise ConvertError(
            f"{what} is a file of --layout speculators, which holds no loss_mask: convert a folder of the "
            "plain layout (layertap bulk without --layout)"
        )
    for name in ("hidden_states", "input_ids", "loss_mask"):
        if name not in tensors:
            raise ConvertError(f"{what} has no {name}")
    check_layers(fmt, layers, num_layers, what)
    hs_dtype, hs = tensors["hidden_states"]
    ids = tensors["input_ids"][1].astype(np.int64)
    mask = tensors["loss_mask"][1].astype(np.int64)
    if hs.ndim != 3 or hs.shape[0] != ids.shape[0] or hs.shape[1] != len(layers) or mask.shape != ids.shape:
        raise ConvertError(
            f"{what}: hidden_states {tuple(hs.shape)}, input_ids {tuple(ids.shape)}, loss_mask {tuple(mask.shape)} "
            f"and {len(layers)} layers do not agree"
        )
    scale = tensors["hidden_states_scale"][1] if hs_dtype == "F8_E4M3" and "hidden_states_scale" in tensors else None
    if hs_dtype == "F8_E4M3" and scale is None:
        raise ConvertError(f"{what}: fp8 hidden_states without hidden_states_scale")
    storage, states = _cast(hs_dtype, hs, scale, dtype)
    layout = layouts.FILE_LAYOUTS.get(fmt)
    if layout is None:
        raise ConvertError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    # the trainer's layout, the one the online drop-ins use (ids and masks int64, states as cast)
    try:
        arrays = layout({"hidden_states": states, "input_ids": ids, "loss_mask": mask})
    except layouts.LayoutError as e:
        raise ConvertError(f"{what}: {e}") from None
    out: Dict[str, Tuple[str, np.ndarray]] = {
        name: ("LongStorage" if a.dtype == np.int64 else storage, a) for name, a in arrays.items()
    }
    return Converted(out, layers, num_layers, int(states.shape[0]))


def _read_jsonl(path: Path) -> List[Dict[str, Any]]:
    """The JSON objects of a JSONL file, skipping lines torn by a crash."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_bytes().split(b"\n"):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


class _Progress:
    """One status line on stderr: redrawn twice a second on a terminal, every 10 s otherwise."""

    def __init__(self, total: int, quiet: bool):
        self.total, self.quiet = total, quiet
        self.tty = sys.stderr.isatty()
        self.start = self.last = time.monotonic()
        self.done = self.tokens = 0

    def step(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        now = time.monotonic()
        if not self.quiet and now - self.last >= (0.5 if self.tty else 10.0):
            self.last = now
            self.draw(now)

    def draw(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        line = (
            f"converted {self.done}/{self.total} samples, {self.tokens / elapsed:,.0f} tokens/s, "
            f"ETA {eta:,.0f} s"
        )
        sys.stderr.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if not self.quiet and self.tty and self.done:
            self.draw(time.monotonic())
            sys.stderr.write("\n")


@dataclass
class Summary:
    converted: int = 0
    skipped: int = 0
    failed: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        return (
            f"converted {self.converted} samples ({self.tokens:,} tokens, {self.bytes:,} bytes) in "
            f"{self.seconds:.1f} s; {self.skipped} already done, {self.failed} failed"
        )


def convert_folder(
    fmt: str,
    source: "os.PathLike[str] | str",
    out: "os.PathLike[str] | str",
    dtype: str = "auto",
    quiet: bool = True,
) -> Summary:
    """Converts every sample of the bulk folder ``source`` into ``out`` (resuming; see the module doc)."""
    if fmt not in FORMATS:
        raise ConvertError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    if dtype not in DTYPES:
        raise ConvertError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    folder = BulkFolder(source, verify=True, strict=False)
    out = Path(out)
    if out.resolve() == folder.root.resolve():
        raise ConvertError("the output folder must not be the bulk folder")
    out.mkdir(parents=True, exist_ok=True)
    settings = {"format": fmt, "dtype": dtype}
    settings_path = out / SETTINGS
    if settings_path.is_file():
        try:
            before = json.loads(settings_path.read_text())
        except ValueError:
            before = None
        if not isinstance(before, dict) or any(before.get(k) != v for k, v in settings.items()):
            raise ConvertError(
                f"{out} holds a conversion made with {before}, not {settings}: convert into another folder"
            )
    else:
        tmp = settings_path.with_name(settings_path.name + ".tmp")
        tmp.write_text(json.dumps(settings) + "\n")
        os.replace(tmp, settings_path)

    done = {e["id"]: e for e in _read_jsonl(out / MANIFEST) if isinstance(e.get("id"), str)}
    summary = Summary()
    started = time.monotonic()
    todo = []
    for i, entry in enumerate(folder.entries):
        prev = done.get(entry["id"])
        target = out / (str(Path(entry["file"]).with_suffix("")) + ".ckpt")
        if (
            prev is not None
            and prev.get("source_xxh64") == entry.get("xxh64")
            and prev.get("file") == target.relative_to(out).as_posix()
            and target.is_file()
            and target.stat().st_size == prev.get("bytes")
        ):
            summary.skipped += 1
        else:
            todo.append((i, target))
    if todo:  # the folder's layers are checked on its first file before anything is written
        first = folder.path(todo[0][0])
        try:
            _, metadata, _ = _safetensors.header(folder.read(todo[0][0]))
        except LOAD_ERRORS:
            pass  # that file fails on its own below
        else:
            check_layers(fmt, *_labels(metadata, str(first)), what=str(first))
    (out / FAILURES).unlink(missing_ok=True)  # it lists this run's failures only
    failures = None
    # Manifest lines that cannot be used (no id, no file, a file outside the folder) are failures.
    for problem in folder.problems:
        summary.failed += 1
        if failures is None:
            failures = open(out / FAILURES, "ab")
        line = {"id": problem["id"], "file": problem["file"], "error": problem["error"]}
        failures.write((json.dumps(line) + "\n").encode())
        failures.flush()
        if not quiet:
            sys.stderr.write(f"{problem['error']}\n")
    progress = _Progress(len(todo), quiet)
    with open(out / MANIFEST, "ab") as manifest:
        if manifest.tell() > 0:  # a line torn by a crash stays a line of its own
            with open(out / MANIFEST, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    manifest.write(b"\n")
        for i, target in todo:
            entry = folder.entries[i]
            path = folder.path(i)
            what = str(path)
            try:
                conv = convert_sample(fmt, folder.read(i), what, dtype)
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(target.name + ".tmp")
                _torchsave.save(tmp, conv.tensors)
                size = tmp.stat().st_size
                os.replace(tmp, target)
            except (ConvertError, *LOAD_ERRORS) as e:
                summary.failed += 1
                if failures is None:
                    failures = open(out / FAILURES, "ab")
                msg = str(e) if isinstance(e, (ConvertError, LayertapError)) else f"{what}: {e}"
                failures.write((json.dumps({"id": entry["id"], "file": entry["file"], "error": msg}) + "\n").encode())
                failures.flush()
                if not quiet:
                    sys.stderr.write(f"\n{entry['id']}: {msg}\n")
                progress.step(0)
                continue
            line = {
                "id": entry["id"],
                "file": target.relative_to(out).as_posix(),
                "tokens": conv.tokens,
                "bytes": size,
                "source": entry["file"],
                "source_xxh64": entry.get("xxh64"),
            }
            manifest.write((json.dumps(line) + "\n").encode())
            manifest.flush()
            summary.converted += 1
            summary.tokens += conv.tokens
            summary.bytes += size
            progress.step(conv.tokens)
    if failures is not None:
        failures.close()
    progress.close()
    summary.seconds = time.monotonic() - started
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m layertap_client.convert",
        description="Convert a `layertap bulk` folder (plain layout, every token) into a drafter trainer's "
        "offline files, resumably; see the module's documentation for each format's keys.",
    )
    p.add_argument("format", choices=FORMATS)
    p.add_argument("bulk_dir", help="the folder `layertap bulk --out` wrote")
    p.add_argument("out_dir", help="where the trainer's files go (the trainer's hidden-states path)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="dtype of the written hidden states (auto: as extracted; fp8 becomes bfloat16)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress line")
    args = p.parse_args(argv)
    try:
        summary = convert_folder(args.format, args.bulk_dir, args.out_dir, args.dtype, quiet=args.quiet)
    except (ConvertError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary.line())
    if summary.failed:
        print(f"the failed samples are listed in {Path(args.out_dir) / FAILURES}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
