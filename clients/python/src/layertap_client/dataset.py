"""Datasets over a ``layertap bulk`` output folder.

:class:`BulkFolder` is the torch-free core: it reads the manifest(s), loads a
sample's file (verifying its checksums), and splits the samples across
DataLoader workers and distributed ranks, optionally shuffled. The torch
datasets are thin wrappers over it and need torch (``pip install
'layertap-client[torch]'``):

- :class:`BulkIterableDataset`, a ``torch.utils.data.IterableDataset`` that
  shards across workers (``get_worker_info``) and ranks (``rank``,
  ``world_size``) by itself;
- :class:`BulkDataset`, a map-style ``torch.utils.data.Dataset`` (shard it
  with a ``DistributedSampler``).

Each sample is a dict: ``id`` (str), ``hidden_states`` ``[T, n_layers, H]``,
``input_ids`` ``[T]`` int64, ``loss_mask`` ``[T]`` uint8, and ``positions``
``[T]`` int64 when the file has it (a ``--tokens`` selection). fp8 files are
dequantised to float32 unless ``dequantize=False`` (then the fp8 values come
with ``hidden_states_scale`` ``[T, n_layers]``). Files of ``--layout
speculators`` hold no loss mask: their samples have ``input_ids`` (from
``token_ids``) and no ``loss_mask``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np
import xxhash

from . import _safetensors
from ._common import ChecksumMismatch, LayertapError, decode

__all__ = [
    "BulkFolder",
    "BulkFolderError",
    "BulkIterableDataset",
    "BulkDataset",
    "manifest_paths",
    "shard_indices",
]

PathLike = Union[str, "os.PathLike[str]"]

_SHARDED = re.compile(r"manifest-(\d+)-of-(\d+)\.jsonl")


class BulkFolderError(ValueError):
    """A bulk folder's manifest that cannot be used as it stands: a line without an id or a
    file, or a file outside the folder (``..``, an absolute path, a link leading out of it)."""


#: What a file that cannot be used raises: missing or unreadable (OSError), not
#: safetensors (SafetensorsError), checksums that do not match (LayertapError), a link
#: leading out of the folder (BulkFolderError).
LOAD_ERRORS = (OSError, _safetensors.SafetensorsError, LayertapError, BulkFolderError)


def outside_reason(file: str) -> Optional[str]:
    """Why a manifest's ``file`` does not name a path inside the folder (None when it does): it
    must be relative, without ``..``, a drive or a backslash. Links are checked when the file is
    read."""
    if not file:
        return "is empty"
    if "\\" in file or "\0" in file:
        return "holds a backslash or a NUL"
    p = PurePosixPath(file)
    if p.is_absolute() or PureWindowsPath(file).drive:
        return "is absolute"
    if ".." in p.parts:
        return "goes up out of the folder (..)"
    if not [part for part in p.parts if part not in ("", ".")]:
        return "names no file"
    return None


def manifest_paths(root: PathLike) -> List[Path]:
    """The manifests of a bulk folder: ``manifest.jsonl`` and every
    ``manifest-I-of-N.jsonl`` (one per ``--shard I/N`` worker), in shard order."""
    root = Path(root)
    found = []
    plain = root / "manifest.jsonl"
    if plain.is_file():
        found.append((-1, -1, plain))
    for p in root.iterdir() if root.is_dir() else []:
        m = _SHARDED.fullmatch(p.name)
        if m and p.is_file():
            found.append((int(m.group(2)), int(m.group(1)), p))
    return [p for _, _, p in sorted(found)]


def _natural_key(s: str) -> List[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def shard_indices(
    n: int,
    rank: int = 0,
    world_size: int = 1,
    worker: int = 0,
    num_workers: int = 1,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
) -> List[int]:
    """The indices (of ``n`` samples) one DataLoader worker of one rank reads.

    Every (rank, worker) pair computes the same order (shuffled with
    ``seed`` and ``epoch`` alike everywhere); rank ``r`` owns every
    ``world_size``-th index of it from ``r`` (so ranks' shares differ by at
    most one sample), and its workers split that share the same way.
    Together they read each sample exactly once.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if num_workers < 1 or not 0 <= worker < num_workers:
        raise ValueError(f"worker {worker} is not in [0, num_workers={num_workers})")
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    return [int(i) for i in order[rank::world_size][worker::num_workers]]


class BulkFolder:
    """The samples of a ``layertap bulk`` output folder, loaded as numpy (or torch) arrays.

    ``verify`` checks each file against the manifest's whole-file xxh64 and
    each tensor against its checksum in the file's metadata when it is loaded;
    a mismatch raises :class:`~layertap_client.ChecksumMismatch` (a
    :class:`LayertapError` with ``type="checksum_mismatch"``) naming the
    file. ``dequantize`` turns fp8 files into float32; ``bf16`` is as in :func:`layertap_client._safetensors.to_numpy` (``"auto"``: numpy
    bf16 with ml_dtypes, else float32; ``"float32"``: always widened).

    The samples are ordered by file path (shard folder, then name, numbers
    compared as numbers), the same on every machine whatever order the bulk
    run finished them in. A line of the manifest that is not JSON (a line torn
    by a crash) is ignored, as ``layertap bulk`` itself does; an id recorded
    twice counts once (its last line).

    Only files inside the folder are read. A manifest line that records no id,
    or is an id's last line and records no file or a file outside the folder
    (``..``, an absolute path), raises :class:`BulkFolderError` listing them;
    with ``strict=False`` they are left out and listed in :attr:`problems`
    instead (``layertap bulk --verify`` drops such lines, and the next bulk run
    extracts their samples again). A file that is a link leading out of the
    folder raises :class:`BulkFolderError` when it is read.
    """

    def __init__(
        self,
        root: PathLike,
        verify: bool = True,
        dequantize: bool = True,
        bf16: str = "auto",
        strict: bool = True,
    ):
        self.root = Path(root)
        self.verify = verify
        self.dequantize = dequantize
        self.bf16 = bf16
        self.manifests = manifest_paths(self.root)
        if not self.manifests:
            raise FileNotFoundError(
                f"{self.root} has no manifest.jsonl nor manifest-I-of-N.jsonl: is it a `layertap bulk --out` folder?"
            )
        self._real_root = self.root.resolve()
        #: Manifest lines left out: ``{"manifest", "line" (from 1), "id", "file", "error"}``.
        self.problems: List[Dict[str, Any]] = []
        # id -> its last line: (entry, None) when usable, (None, problem) when not
        by_id: Dict[str, Any] = {}
        for path in self.manifests:
            for n, line in enumerate(path.read_bytes().split(b"\n"), 1):
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                fields = entry if isinstance(entry, dict) else {}
                id_, file = fields.get("id"), fields.get("file")
                if not isinstance(entry, dict):
                    why = "is not a JSON object"
                elif not isinstance(id_, str):
                    why = "records no id"
                elif not isinstance(file, str):
                    why = f"records no file for {id_!r}"
                else:
                    reason = outside_reason(file)
                    if reason is not None:
                        why = f"records the file {file!r}, which {reason}; only files inside the folder are read"
                    else:
                        why = None
                if why is None:
                    by_id[id_] = (entry, None)
                    continue
                problem = {
                    "manifest": path.name,
                    "line": n,
                    "id": id_ if isinstance(id_, str) else None,
                    "file": file if isinstance(file, str) else None,
                    "error": f"{path.name} line {n} {why}",
                }
                if isinstance(id_, str):
                    by_id[id_] = (None, problem)
                else:
                    self.problems.append(problem)
        self.problems.extend(p for _, p in by_id.values() if p is not None)
        self.problems.sort(key=lambda p: (p["manifest"], p["line"]))
        if strict and self.problems:
            shown = "; ".join(p["error"] for p in self.problems[:5])
            more = f" (and {len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
            raise BulkFolderError(
                f"{self.root}: {len(self.problems)} manifest line(s) cannot be used: {shown}{more}. "
                "`layertap bulk --verify` drops them and the next bulk run extracts those samples again"
            )
        usable = [e for e, _ in by_id.values() if e is not None]
        self.entries: List[Dict[str, Any]] = sorted(usable, key=lambda e: (_natural_key(e["file"]), e["id"]))

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def ids(self) -> List[str]:
        return [e["id"] for e in self.entries]

    @property
    def tokens(self) -> int:
        """Rows over all samples, as the manifest records them."""
        return sum(int(e.get("tokens", 0)) for e in self.entries)

    def path(self, i: int) -> Path:
        return self.root / self.entries[i]["file"]

    def read(self, i: int) -> bytes:
        """Sample ``i``'s file as stored, checked against the manifest's whole-file xxh64 when
        ``verify`` is on (its tensors' checksums are checked when it is decoded). A file that is
        a link leading out of the folder raises :class:`BulkFolderError`."""
        entry = self.entries[i]
        path = self.root / entry["file"]
        real = path.resolve()
        if real != self._real_root and self._real_root not in real.parents:
            raise BulkFolderError(
                f"{path}: the manifest's file {entry['file']!r} leads out of the folder (to {real}); only files "
                "inside the folder are read"
            )
        data = path.read_bytes()
        if self.verify and isinstance(entry.get("xxh64"), str):
            got = xxhash.xxh64(data).hexdigest()
            if got != entry["xxh64"]:
                raise ChecksumMismatch(f"{path}: the file hashes to {got}, the manifest recorded {entry['xxh64']}")
        return data

    def load(self, i: int, as_torch: bool = False) -> Dict[str, Any]:
        """Sample ``i``: a dict of arrays (torch tensors with ``as_torch``) and its ``id``."""
        entry = self.entries[i]
        path = self.root / entry["file"]
        data = self.read(i)
        t, metadata, _ = decode(
            data,
            as_torch=as_torch,
            bf16=self.bf16,
            dequantize=self.dequantize,
            verify=self.verify,
            status=None,
            what=str(path),
        )
        if self.verify and "checksum_algorithm" not in metadata:
            raise ChecksumMismatch(f"{path}: no checksums in its metadata (verify=False reads it)")
        if "hidden_states" not in t:
            raise _safetensors.SafetensorsError(f"{path}: no hidden_states tensor")
        sample: Dict[str, Any] = {"id": entry["id"], "hidden_states": t["hidden_states"]}
        if "input_ids" in t:
            sample["input_ids"] = t["input_ids"]
        elif "token_ids" in t:  # --layout speculators
            sample["input_ids"] = t["token_ids"]
        else:
            raise _safetensors.SafetensorsError(f"{path}: neither input_ids nor token_ids")
        for k in ("loss_mask", "positions", "hidden_states_scale"):
            if k in t:
                sample[k] = t[k]
        rows = sample["hidden_states"].shape[0]
        for k, v in sample.items():
            if k not in ("id", "hidden_states") and v.shape[0] != rows:
                raise _safetensors.SafetensorsError(f"{path}: {k} has {v.shape[0]} rows, hidden_states {rows}")
        return sample

    def indices(
        self,
        rank: int = 0,
        world_size: int = 1,
        worker: int = 0,
        num_workers: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
    ) -> List[int]:
        """:func:`shard_indices` over this folder's samples."""
        return shard_indices(len(self), rank, world_size, worker, num_workers, shuffle, seed, epoch)

    def iter(
        self,
        indices: Optional[Sequence[int]] = None,
        skip_errors: bool = False,
        as_torch: bool = False,
    ) -> Iterator[Dict[str, Any]]:
        """Loads the samples at ``indices`` (all, in order, by default).

        A file that cannot be used (missing, malformed, failing its checksums)
        raises; with ``skip_errors=True`` it is reported with a warning and
        left out, and its index is appended to :attr:`skipped`.
        """
        for i in range(len(self)) if indices is None else indices:
            try:
                yield self.load(i, as_torch=as_torch)
            except LOAD_ERRORS as e:
                if not skip_errors:
                    raise
                self.skipped.append(i)
                warnings.warn(f"skipping sample {self.entries[i]['id']!r}: {e}", RuntimeWarning, stacklevel=2)

    @property
    def skipped(self) -> List[int]:
        """Indices :meth:`iter` left out (in this process)."""
        if "_skipped" not in self.__dict__:
            self._skipped: List[int] = []
        return self._skipped

    def __repr__(self) -> str:
        return f"BulkFolder({str(self.root)!r}, {len(self)} samples, {len(self.manifests)} manifest(s))"


def __getattr__(name: str) -> Any:  # the torch datasets import torch only when asked for
    if name in ("BulkIterableDataset", "BulkDataset"):
        try:
            from . import _torch_dataset
        except ImportError as e:
            raise ImportError(
                f"layertap_client.dataset.{name} needs torch: pip install 'layertap-client[torch]' "
                f"(or the torch build you need); BulkFolder works without it ({e})"
            ) from e
        return getattr(_torch_dataset, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
