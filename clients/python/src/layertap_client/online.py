"""Online training: hidden states streamed from layertap servers a few steps ahead of the
trainer, with no disk in between.

>>> from layertap_client.online import OnlineSource
>>> src = OnlineSource("chats.jsonl", ["http://gpu0:8080", "http://gpu1:8080"],
...                    layers=[2, 15, 27, -1], dtype="bfloat16", shuffle=True, seed=0)
>>> for epoch in range(3):
...     src.set_epoch(epoch)
...     for sample in src:          # {"id", "hidden_states" [T, 4, H], "input_ids", "loss_mask"}
...         ...

:class:`OnlineSource` is the torch-free core and a plain iterator; with torch,
:class:`OnlineIterableDataset` (``torch.utils.data.IterableDataset``) wraps it for a
``DataLoader``. Samples are the dicts :class:`layertap_client.dataset.BulkIterableDataset`
yields for a ``layertap bulk`` folder, so a trainer can switch between offline and online.

What it guarantees:

- **Order.** The samples of an epoch are a permutation drawn from ``(seed, epoch)`` (or the
  input's order without ``shuffle``), the same on every rank; rank ``r`` of ``W`` takes every
  ``W``-th sample of it from ``r``, and a rank's DataLoader workers take its share in chunks of
  ``batch_size`` in turn, so the DataLoader hands them out in the rank's order. Every sample is
  asked for once per epoch across the whole job, and samples come out in that order whatever
  order the answers arrive in (a reorder buffer, bounded by bytes): two runs give the same
  samples, bit for bit, in the same order.
- **No silent drop.** A request that fails (no connection, a timeout, a 5xx, a 408, a 429, an
  answer that fails its checksums) is sent again, to another server where there is one; the
  server is left alone for a backoff (or its ``Retry-After``), and one that answers 503
  ``selfcheck_failed`` is never asked again. A sample whose requests failed ``retries + 1``
  times, or that the server refuses (a 4xx: the sample's own fault), raises
  :class:`SampleError` naming it when its turn comes, after every sample before it was handed
  out; with ``on_error="replace"`` it is replaced by the next sample of the epoch's order
  instead (deterministically, so runs still agree), and counted in :meth:`OnlineSource.stats`.
  A batch is never short.
- **Resume.** :meth:`OnlineSource.state_dict` holds ``(seed, epoch, position)``; after a crash
  :meth:`OnlineSource.load_state_dict` asks only for the samples not yet handed out, on any
  number of ranks.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import email.utils
import http.client
import io
import json
import math
import os
import socket
import threading
import time
import urllib.parse
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Deque, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import xxhash
import zstandard

from . import _safetensors
from ._common import (
    ChecksumMismatch,
    LayertapError,
    ZSTD_MAGIC,
    error_from_response,
    normalize_dtype,
    normalize_input,
    normalize_layers,
    normalize_logprobs,
    listed_checksums,
    verify_digests,
)

__all__ = [
    "OnlineSource",
    "OnlineIterableDataset",
    "SampleError",
    "Samples",
    "open_samples",
    "share",
]

#: 4xx answers that say nothing about the sample: the server or the client's setup is wrong
#: (a key, a URL, an encoding), so every sample would fail alike; they raise at once.
SETUP_STATUSES = (401, 403, 404, 405, 406, 415)

#: 4xx answers worth sending again: the body did not arrive in time (408), the queue is full (429).
RETRY_4XX = (408, 429)

STATE_VERSION = 1


class SampleError(LayertapError):
    """A sample that could not be had: the server refused it (a 4xx), its row cannot be a
    request, or every attempt failed. The message names it (``sample 'ID' (row N): ...``);
    ``sample_id`` and ``row`` (its index in the input) too; ``status`` and ``type`` are the
    last answer's (``None`` and ``"failed"`` when no server answered).

    It takes its message first, so that a DataLoader re-raising it from a worker (by type,
    with one argument) keeps it a ``SampleError``.
    """

    def __init__(
        self,
        message: str,
        sample_id: Optional[str] = None,
        row: Optional[int] = None,
        status: Optional[int] = None,
        type: str = "failed",
    ):
        super().__init__(status, type, message)
        self.sample_id = sample_id
        self.row = row

    @classmethod
    def of(cls, sample_id: str, row: int, message: str, status: Optional[int] = None, type: str = "failed") -> "SampleError":
        return cls(f"sample {sample_id!r} (row {row}): {message}", sample_id, row, status, type)

    def __reduce__(self) -> Any:
        return (SampleError, (self.message, self.sample_id, self.row, self.status, self.type))


class _BadRow(Exception):
    """A row that cannot be a request (as ``layertap bulk`` lists in its failures)."""

    def __init__(self, sample_id: str, message: str):
        super().__init__(message)
        self.sample_id = sample_id
        self.message = message


# -- the input, read as `layertap bulk` reads it ------------------------------------------------------

_KINDS = ("text", "messages", "input_ids")

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system", "tool": "tool"}


def _sharegpt_role(speaker: str) -> str:
    role = _SHAREGPT_ROLES.get(speaker.lower())
    if role is None:
        raise ValueError(f"its from is {json.dumps(speaker)}, not one of {', '.join(_SHAREGPT_ROLES)}")
    return role


def _json_type(v: Any, missing: bool = False) -> str:
    if missing:
        return "missing"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, (list, tuple)):
        return "a list"
    return "an object"


def _sharegpt_to_chat(msgs: Any) -> Any:
    """ShareGPT's ``{from, value}`` messages as ``{role, content}`` (others left as they are)."""
    if not isinstance(msgs, list):
        return msgs
    out = []
    for i, m in enumerate(msgs):
        if isinstance(m, Mapping) and "role" not in m and "from" in m:
            m = dict(m)
            speaker = m.pop("from")
            try:
                if not isinstance(speaker, str):
                    raise ValueError(f"its from is {_json_type(speaker)}, not a string")
                role = _sharegpt_role(speaker)
                if "value" not in m or not isinstance(m["value"], str):
                    raise ValueError(f"its value is {_json_type(m.get('value'), 'value' not in m)}, not a string")
            except ValueError as e:
                raise ValueError(f"message {i}: {e}") from None
            m["content"] = m.pop("value")
            m["role"] = role
        out.append(m)
    return out


def _id_text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, separators=(",", ":"), ensure_ascii=False)


def _plain(x: Any) -> Any:
    """numpy / torch / pyarrow values to plain Python (lists, ints, strs)."""
    if hasattr(x, "as_py"):
        return x.as_py()
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes, list, tuple)):
        return x.tolist()
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


class _Columns:
    """Which keys (JSONL) or columns (Parquet, datasets) hold the input and the id, as
    ``layertap bulk``'s ``--text-column``, ``--messages-column``, ``--ids-column`` and ``--id-column``."""

    def __init__(self, text_column: Optional[str], messages_column: Optional[str], ids_column: Optional[str], id_column: str):
        self.renames = [(k, c) for k, c in (("text", text_column), ("messages", messages_column), ("input_ids", ids_column)) if c is not None]
        self.id_column = id_column

    def one(self, what: str) -> Tuple[str, str]:
        if len(self.renames) != 1:
            raise ValueError(
                f"{what} needs exactly one of text_column, messages_column or ids_column (the column holding "
                f"the input), {len(self.renames)} given"
            )
        return self.renames[0]

    def from_object(self, obj: Any, fallback: str) -> Tuple[str, Dict[str, Any]]:
        """A JSONL line's object (or a dict sample) as ``(id, input)``: the id taken out, the
        renamed keys renamed, ShareGPT messages read as chats; the rest is the request's input."""
        if not isinstance(obj, Mapping):
            raise _BadRow(fallback, "not a JSON object")
        obj = dict(obj)
        v = obj.pop(self.id_column, None)
        sid = fallback if v is None else _id_text(_plain(v))
        for kind, column in self.renames:
            if column != kind:
                if column not in obj:
                    raise _BadRow(sid, f"no key {json.dumps(column)}")
                obj[kind] = obj.pop(column)
        obj = {k: _plain(v) for k, v in obj.items()}
        if "messages" in obj:
            try:
                obj["messages"] = _sharegpt_to_chat(obj["messages"])
            except ValueError as e:
                raise _BadRow(sid, str(e)) from None
        return sid, obj

    def from_column(self, kind: str, column: str, value: Any, sid: str) -> Dict[str, Any]:
        """A Parquet (or datasets) cell as the request's input of ``kind``, checked as bulk checks it."""
        value = _plain(value)
        bad = lambda msg: _BadRow(sid, f"column {json.dumps(column)}: {msg}")  # noqa: E731
        if value is None:
            raise bad("the value is null")
        if kind == "text":
            if not isinstance(value, str):
                raise bad(f"the text is {_json_type(value)}, not a string")
            return {"text": value}
        if not isinstance(value, list):
            what = "the input_ids are" if kind == "input_ids" else "the messages are"
            want = "a list of integers" if kind == "input_ids" else "a list of {role, content}"
            raise bad(f"{what} {_json_type(value)}, not {want}")
        if not value:
            raise bad(f"the {'input_ids' if kind == 'input_ids' else 'messages'} list is empty")
        if kind == "input_ids":
            for i, t in enumerate(value):
                if not isinstance(t, int) or isinstance(t, bool):
                    raise bad(f"token id {i} is {_json_type(t)}, not an integer")
                if not 0 <= t <= 0xFFFFFFFF:
                    raise bad(f"token id {i} is {t}, not a token id")
            return {"input_ids": value}
        msgs = []
        for i, m in enumerate(value):
            if not isinstance(m, Mapping):
                raise bad(f"message {i} is {_json_type(m)}, not a {{role, content}} or {{from, value}} struct")
            sharegpt = m.get("role") is None and "role" not in m and "from" in m
            keys = (("from", "role"), ("value", "content")) if sharegpt else (("role", "role"), ("content", "content"))
            out = {}
            for key, name in keys:
                if key not in m:
                    raise bad(f"message {i}: it has no {key}")
                if not isinstance(m[key], str):
                    raise bad(f"message {i}: its {key} is {_json_type(m[key])}, not a string")
                if key == "from":
                    try:
                        out[name] = _sharegpt_role(m[key])
                    except ValueError as e:
                        raise bad(f"message {i}: {e}") from None
                else:
                    out[name] = m[key]
            msgs.append(out)
        return {"messages": msgs}


class Samples:
    """The samples of an input, by index: ``len(s)``, ``s.get(i) -> (id, input)``.

    ``input`` is the request's input (``{"text"}``, ``{"messages"}`` or ``{"input_ids"}``);
    a row that cannot be one raises :class:`SampleError` naming it. Made by :func:`open_samples`.
    """

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def row(self, i: int) -> Tuple[str, Dict[str, Any]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def get(self, i: int) -> Tuple[str, Dict[str, Any]]:
        try:
            return self.row(i)
        except _BadRow as e:
            raise SampleError.of(e.sample_id, i, e.message, type="bad_row") from None


class _JsonlSamples(Samples):
    """A JSONL file, indexed once (each non-empty line's offset), read line by line as asked."""

    def __init__(self, path: Path, columns: _Columns):
        self.path = Path(path)
        self.columns = columns
        offsets, lengths, numbers = [], [], []
        with open(self.path, "rb") as f:
            at = 0
            for n, line in enumerate(f, start=1):
                if line.strip():
                    offsets.append(at)
                    lengths.append(len(line))
                    numbers.append(n)
                at += len(line)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.numbers = np.asarray(numbers, dtype=np.int64)
        self._file: Optional[Any] = None
        self._pid = -1
        self._lock = threading.Lock()

    def __getstate__(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d["_file"], d["_pid"], d["_lock"] = None, -1, None
        return d

    def __setstate__(self, d: Dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.offsets)

    def _line(self, i: int) -> bytes:
        with self._lock:
            if self._file is None or self._pid != os.getpid():  # a DataLoader worker opens its own
                self._file = open(self.path, "rb")
                self._pid = os.getpid()
            self._file.seek(int(self.offsets[i]))
            return self._file.read(int(self.lengths[i]))

    def row(self, i: int) -> Tuple[str, Dict[str, Any]]:
        n = int(self.numbers[i])
        fallback = f"line-{n}"
        try:
            obj = json.loads(self._line(i))
        except ValueError as e:
            raise _BadRow(fallback, f"line {n}: not JSON: {e}") from None
        try:
            return self.columns.from_object(obj, fallback)
        except _BadRow as e:
            raise _BadRow(e.sample_id, f"line {n}: {e.message}") from None


class _ColumnSamples(Samples):
    """Columns held in memory (a Parquet file through pyarrow, or a ``datasets.Dataset``):
    one column of inputs, and the ids from ``id_column`` where there is one (else the row number)."""

    def __init__(self, values: Any, ids: Any, kind: str, column: str, columns: _Columns):
        self.values = values
        self.ids = ids
        self.kind = kind
        self.column = column
        self.columns = columns

    def __len__(self) -> int:
        return len(self.values)

    def row(self, i: int) -> Tuple[str, Dict[str, Any]]:
        sid = str(i)
        if self.ids is not None:
            v = _plain(self.ids[i])
            if v is None:
                raise _BadRow(sid, f"column {json.dumps(self.columns.id_column)}: the id is null")
            if not isinstance(v, (str, int)) or isinstance(v, bool):
                raise _BadRow(
                    sid, f"column {json.dumps(self.columns.id_column)}: an id is a string or an integer, not {_json_type(v)}"
                )
            sid = str(v)
        return sid, self.columns.from_column(self.kind, self.column, self.values[i], sid)


class _ListSamples(Samples):
    """A Python sequence: dicts as JSONL lines (id from ``id_column``, else the index), or bare
    inputs (a str, a list of token ids, a list of messages) with the index as their id."""

    def __init__(self, items: Sequence[Any], columns: _Columns):
        self.items = items
        self.columns = columns

    def __len__(self) -> int:
        return len(self.items)

    def row(self, i: int) -> Tuple[str, Dict[str, Any]]:
        x = self.items[i]
        if isinstance(x, Mapping):
            return self.columns.from_object(x, str(i))
        try:
            return str(i), normalize_input(i, x)
        except (TypeError, ValueError) as e:
            raise _BadRow(str(i), str(e)) from None


def open_samples(
    samples: Any,
    text_column: Optional[str] = None,
    messages_column: Optional[str] = None,
    ids_column: Optional[str] = None,
    id_column: str = "id",
) -> Samples:
    """The samples of ``samples``, read as ``layertap bulk`` reads its ``--input``:

    - a path ending in ``.parquet``: one of ``text_column``, ``messages_column`` (lists of
      ``{role, content}``, or ShareGPT's ``{from, value}``) or ``ids_column`` names the column
      of inputs, ``id_column`` (default ``id``, strings or integers) the ids; without such a
      column a row's id is its number from 0. Needs pyarrow; the two columns are held in memory;
    - any other path: JSONL, each line ``{"input_ids"}``, ``{"text"}`` or ``{"messages"}``
      (ShareGPT's ``{from, value}`` messages read as ``{role, content}``), with an optional
      ``"id"`` (a line without one is ``line-N``, N from 1); the column options rename keys as
      bulk's do. The file is indexed once and read line by line as samples are asked for;
    - a Hugging Face ``datasets.Dataset``: as a Parquet file (the column option may be left
      out when the dataset has exactly one of the columns ``text``, ``messages``, ``input_ids``);
    - a sequence: dicts as JSONL lines (id from ``id_column``, else the index as a string), or
      bare inputs: a str, a list of token ids, a list of ``{role, content}`` messages;
    - a :class:`Samples` as it is.

    A row that cannot be a request (a null, a value of the wrong type, an empty list, a line
    that is not JSON, an unknown ShareGPT speaker) raises :class:`SampleError` naming it when it
    is asked for, never at opening.
    """
    columns = _Columns(text_column, messages_column, ids_column, id_column)
    if isinstance(samples, Samples):
        return samples
    if isinstance(samples, (str, os.PathLike)):
        path = Path(samples)
        if path.suffix.lower() == ".parquet":
            kind, column = columns.one("a Parquet input")
            try:
                import pyarrow.parquet as pq
            except ImportError as e:
                raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
            names = pq.read_schema(path).names
            if column not in names:
                raise ValueError(f"{path} has no column {json.dumps(column)} (its columns: {', '.join(names)})")
            wanted = [column] + ([id_column] if id_column in names and id_column != column else [])
            table = pq.read_table(path, columns=wanted)
            ids = table.column(id_column) if id_column in names else None
            return _ColumnSamples(table.column(column), ids, kind, column, columns)
        return _JsonlSamples(path, columns)
    names = getattr(samples, "column_names", None)
    if isinstance(names, list) and hasattr(samples, "__getitem__"):  # datasets.Dataset
        if columns.renames:
            kind, column = columns.one("a datasets.Dataset")
        else:
            present = [k for k in _KINDS if k in names]
            if len(present) != 1:
                raise ValueError(
                    f"the dataset's columns are {', '.join(names)}: name the input column with text_column, "
                    "messages_column or ids_column"
                )
            kind = column = present[0]
        if column not in names:
            raise ValueError(f"the dataset has no column {json.dumps(column)} (its columns: {', '.join(names)})")
        ids = samples[id_column] if id_column in names else None
        return _ColumnSamples(samples[column], ids, kind, column, columns)
    if isinstance(samples, (str, bytes, Mapping)) or not hasattr(samples, "__len__") or not hasattr(samples, "__getitem__"):
        raise TypeError(
            f"samples has type {type(samples).__name__}: give a path (JSONL or .parquet), a datasets.Dataset "
            "or a sequence of samples"
        )
    return _ListSamples(samples, columns)


# -- order and shares ---------------------------------------------------------------------------------


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The order of an epoch: a permutation drawn from ``(seed, epoch)`` (the one
    :func:`layertap_client.dataset.shard_indices` draws), or ``0..n-1`` without ``shuffle``."""
    return np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)


def share(
    n: int,
    offset: int = 0,
    rank: int = 0,
    world_size: int = 1,
    worker: int = 0,
    num_workers: int = 1,
    batch_size: int = 1,
) -> List[int]:
    """The positions (in the epoch's order) one DataLoader worker of one rank asks for, in order.

    The order's positions from ``offset`` on (those not yet handed out) are dealt to the ranks
    in turn (rank ``r`` takes ``offset + r``, ``offset + r + world_size``, ...); a rank's
    sequence is cut into chunks of ``batch_size`` and chunk ``j`` goes to worker
    ``j % num_workers``, which is the order a DataLoader hands the workers' batches out in.
    Together the pairs take every position once.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if num_workers < 1 or not 0 <= worker < num_workers:
        raise ValueError(f"worker {worker} is not in [0, num_workers={num_workers})")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    mine = list(range(offset + rank, n, world_size))
    return [p for j in range(worker * batch_size, len(mine), num_workers * batch_size) for p in mine[j : j + batch_size]]


def _distributed() -> Tuple[int, int]:
    """(rank, world_size) from torch.distributed when it is initialised, else (0, 1)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    return 0, 1


def _worker_info() -> Tuple[int, int]:
    """(worker, num_workers) of the DataLoader worker this runs in, else (0, 1)."""
    try:
        from torch.utils.data import get_worker_info
    except ImportError:
        return 0, 1
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


# -- decoding answers into per-sample arrays --------------------------------------------------------

_TORCH = {
    "F32": lambda t: t.float32,
    "F16": lambda t: t.float16,
    "BF16": lambda t: t.bfloat16,
    "F8_E4M3": lambda t: t.float8_e4m3fn,
    "I64": lambda t: t.int64,
    "U8": lambda t: t.uint8,
}
_NP = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F8_E4M3": np.dtype("u1"), "I64": np.dtype("<i8"), "U8": np.dtype("u1")}

#: Per-sample tensors of an answer, in the order a sample dict holds them.
_PER_ROW = ("hidden_states", "input_ids", "loss_mask", "positions", "hidden_states_scale", "topk_ids", "topk_logprobs", "target_logprobs")


class _Short(Exception):
    """The body ended before the bytes its header announced."""


class _Reader:
    """The bytes of an answer, read into buffers of the caller's choosing: straight from a file
    object (an HTTP response, a buffer), or through a zstd decompressor reading from it."""

    def __init__(self, source: Any, zstd: Optional["zstandard.ZstdDecompressor"] = None):
        self.source = source
        self.stream = zstd.stream_reader(source, read_size=1 << 20) if zstd is not None else None
        self.read_bytes = 0  # decoded bytes read

    def fill(self, dst: Any) -> None:
        """Fills ``dst`` (a writable buffer) or raises _Short."""
        mv = memoryview(dst).cast("B")
        got, size = 0, len(mv)
        r = self.stream if self.stream is not None else self.source
        while got < size:
            k = r.readinto(mv[got:])
            if not k:
                raise _Short(f"the answer ended {size - got} bytes early")
            got += k
        self.read_bytes += size

    def finish(self) -> None:
        """Checks that nothing follows the answer's last byte."""
        if self.stream is not None:
            if self.stream.read(1):
                raise _Short("the answer holds more bytes than its header announces")
        if self.source.read(1):
            raise _Short("the body holds more after the answer" if self.stream is not None else "the answer holds more bytes than its header announces")


class _PinnedArena:
    """Pinned host memory for the samples on their way to a GPU. Allocating pinned memory
    (cudaHostAlloc) is slow, and it waits behind the process's own GPU work: allocated per
    sample it stalled the decoding threads for most of a pass whenever the consumer kept the
    GPU busy. So it is allocated here in a few large slabs, kept for the source's life (the first
    from a background thread when a pass starts, the others when the buffers in use fill those
    there are), and cut into the samples' buffers first-fit; a buffer goes back when the copy from
    it is done. A sample larger than a slab gets a buffer of its own, kept for reuse by size.
    With ``pinned=False`` the slabs are plain pageable memory (``pin_memory=False``)."""

    ALIGN = 4096

    def __init__(self, torch: Any, slab_bytes: int, pinned: bool = True):
        self.torch = torch
        self.slab_bytes = slab_bytes
        self.pinned = pinned  # False: plain pageable memory (the copies then go through the driver's staging)
        self.slabs: List[Any] = []
        self.free: List[List[Tuple[int, int]]] = []  # per slab: (offset, size), sorted, coalesced
        self.large: Dict[int, List[Any]] = collections.defaultdict(list)
        self.lock = threading.Lock()
        self.grow_lock = threading.Lock()
        self.pending: Deque[Tuple[Any, Tuple[int, int, int, Any]]] = collections.deque()  # (copy's event, token)
        self.buffers = 0  # pinned allocations made (slabs and large buffers)
        self.bytes = 0
        self.seconds = 0.0  # time they took
        self._warming: Optional[threading.Thread] = None

    def _pinned(self, nbytes: int) -> Any:
        t0 = time.monotonic()
        t = self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=self.pinned)
        with self.lock:
            self.buffers += 1
            self.bytes += nbytes
            self.seconds += time.monotonic() - t0
        return t

    def _grow(self) -> None:
        slab = self._pinned(self.slab_bytes)
        with self.lock:
            self.slabs.append(slab)
            self.free.append([(0, self.slab_bytes)])

    def warm(self, target: int) -> None:
        """Allocates slabs up to ``target`` bytes in the background (once at a time)."""
        if self._warming is not None and self._warming.is_alive():
            return

        def run() -> None:
            try:
                while True:
                    with self.grow_lock:
                        if len(self.slabs) * self.slab_bytes >= target:
                            return
                        self._grow()
            except Exception:  # noqa: BLE001 - out of pinned memory: the buffers come when asked for
                return

        self._warming = threading.Thread(target=run, name="layertap-pinned", daemon=True)
        self._warming.start()

    def after(self, event: Any, token: Tuple[int, int, int, Any]) -> None:
        """Gives the buffer of ``token`` back once ``event`` (the copy from it) has happened."""
        with self.lock:
            self.pending.append((event, token))

    def take(self, nbytes: int) -> Tuple[Any, Tuple[int, int, int, Any]]:
        """A pinned uint8 tensor of ``nbytes`` and the token that gives it back."""
        while True:  # the buffers whose copies are done come back first
            with self.lock:
                done = self.pending.popleft() if self.pending and self.pending[0][0].query() else None
            if done is None:
                break
            self.give(done[1])
        size = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        if size > self.slab_bytes:
            size = 1 << (size - 1).bit_length()
            with self.lock:
                free = self.large[size]
                t = free.pop() if free else None
            if t is None:
                t = self._pinned(size)
            return t[:nbytes], (-1, 0, size, t)
        while True:
            with self.lock:
                for i, spans in enumerate(self.free):
                    for j, (off, n) in enumerate(spans):
                        if n >= size:
                            if n == size:
                                del spans[j]
                            else:
                                spans[j] = (off + size, n - size)
                            return self.slabs[i][off : off + nbytes], (i, off, size, None)
                have = len(self.slabs)
            with self.grow_lock:  # one thread grows the arena; the others look again after it
                if len(self.slabs) == have:
                    self._grow()

    def give(self, token: Tuple[int, int, int, Any]) -> None:
        i, off, size, large = token
        with self.lock:
            if i < 0:
                self.large[size].append(large)
                return
            spans = self.free[i]
            k = bisect.bisect_left(spans, (off, 0))
            spans.insert(k, (off, size))
            if k + 1 < len(spans) and spans[k][0] + spans[k][1] == spans[k + 1][0]:
                spans[k] = (off, size + spans[k + 1][1])
                del spans[k + 1]
            if k > 0 and spans[k - 1][0] + spans[k - 1][1] == spans[k][0]:
                spans[k - 1] = (spans[k - 1][0], spans[k - 1][1] + spans[k][1])
                del spans[k]


class _Decoder:
    """Turns an answer into one sample dict per input, as it streams in.

    The answer's small tensors come first (``cu_seqlens`` among them: each input's rows), its
    hidden states last (older servers: first, then they go through one temporary buffer);
    each input's rows are read (decompressed) straight into the sample's own buffer and hashed
    there, so a sample holds only its own memory and no answer is ever held whole. The
    checksums are compared once the last byte is in; nothing is handed out before. With
    ``device`` (torch, CUDA) the samples' buffers are pinned host buffers cut from ``arena``
    and copied to the device without blocking, on a stream of the decoding thread; the consumer
    waits for that copy (an event) when it takes the sample, and the pinned buffer goes back to
    the arena once the copy is done.
    """

    def __init__(self, as_torch: bool, dequantize: bool, device: Any, arena: Optional[_PinnedArena] = None):
        self.as_torch = as_torch
        self.dequantize = dequantize
        self.device = None
        self.arena = arena
        self._tls = threading.local()
        self._torch: Any = None
        if as_torch or device is not None:
            import torch

            self._torch = torch
        if device is not None:
            dev = self._torch.device(device)
            if dev.type == "cuda":
                self.device = dev
                if arena is None:
                    raise ValueError("a pinned arena is needed to copy to a GPU")
            elif dev.type != "cpu":
                raise ValueError(f"device={device!r}: only CUDA devices (or the CPU) are supported")

    def reader(self, source: Any, zstd: bool) -> _Reader:
        """A reader of ``source`` (a file object), through this thread's zstd decompressor when ``zstd``."""
        dctx = None
        if zstd:
            dctx = getattr(self._tls, "dctx", None)
            if dctx is None:
                dctx = self._tls.dctx = zstandard.ZstdDecompressor()
        return _Reader(source, dctx)

    # host buffers: plain numpy; torch shared memory in a DataLoader worker (the loader then
    # hands the sample to the main process without copying it); pinned, from the arena, when the
    # samples go to a GPU. A torch buffer is held[0]: the sample's tensors are views of it (an
    # arena buffer's token is held[1]).
    def _alloc(self, nbytes: int, held: List[Any]) -> np.ndarray:
        torch = self._torch
        if self.device is None:
            if self.as_torch and self._in_worker():
                try:
                    t = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes), 0, (nbytes,))
                except (AttributeError, RuntimeError, TypeError):  # a torch without it: shared by a copy
                    t = torch.empty(nbytes, dtype=torch.uint8).share_memory_()
                held.append(t)
                return t.numpy()
            return np.empty(nbytes, dtype=np.uint8)
        assert self.arena is not None
        t, token = self.arena.take(nbytes)
        held.append(t)
        held.append(token)
        return t.numpy()

    def decode(self, body: bytes, n_inputs: int, status: int = 200) -> List[Tuple[Dict[str, Any], int, int]]:
        """:meth:`read` of an answer held whole (zstd or not, by its first bytes)."""
        return self.read(self.reader(io.BytesIO(body), body[:4] == ZSTD_MAGIC), n_inputs, status)

    def read(self, body: _Reader, n_inputs: int, status: int = 200) -> List[Tuple[Dict[str, Any], int, int]]:
        """``[(sample without its id, bytes it holds, tokens its input has at least)]`` for an
        answer of ``n_inputs`` inputs read from ``body``; raises LayertapError (``bad_answer``,
        ``checksum_mismatch``), ZstdError, or _Short for a damaged or cut one (and OSError, a
        timeout among them, from the connection). Pinned buffers of an answer that fails go
        back to the arena (this thread was their only writer)."""
        held: List[List[Any]] = []
        try:
            return self._read(body, n_inputs, status, held)
        except BaseException:
            if self.arena is not None:
                for h in held:
                    if len(h) > 1 and h[1] is not None:
                        self.arena.give(h[1])
            raise

    def _read(self, body: _Reader, n_inputs: int, status: int, held: List[List[Any]]) -> List[Tuple[Dict[str, Any], int, int]]:

        def bad(msg: str) -> LayertapError:
            return LayertapError(status, "bad_answer", msg)

        head = bytearray(8)
        body.fill(head)
        n = int.from_bytes(head, "little")
        if n > _safetensors._MAX_HEADER:
            raise bad(f"the answer is not a safetensors file: a header of {n} bytes")
        raw_head = bytearray(n)
        body.fill(raw_head)
        try:
            entries, metadata, _total = _safetensors.layout(raw_head)
        except _safetensors.SafetensorsError as e:
            raise bad(f"the answer is not a safetensors file: {e}") from None
        sums = listed_checksums(metadata, status)
        if sums is None:
            raise ChecksumMismatch("the answer has no checksums in its metadata", status)
        for k in ("hidden_states", "input_ids", "cu_seqlens", "loss_mask"):
            if k not in entries:
                raise bad(f"the answer has no {k!r} tensor")
        rows = entries["input_ids"][1][0] if len(entries["input_ids"][1]) == 1 else -1
        dt, shape = entries["cu_seqlens"][:2]
        if dt != "I64" or shape != (n_inputs + 1,):
            raise bad(f"cu_seqlens is {dt} {list(shape)} for {n_inputs} inputs")
        for name in _PER_ROW:
            if name in entries and (not entries[name][1] or entries[name][1][0] != rows):
                raise bad(f"{name} has shape {list(entries[name][1])} for {rows} rows")
        hs_dtype, hs_shape = entries["hidden_states"][:2]
        if hs_dtype == "F8_E4M3":
            if "hidden_states_scale" not in entries:
                raise bad("F8_E4M3 hidden_states without 'hidden_states_scale'")
            if entries["hidden_states_scale"][0] != "F32" or entries["hidden_states_scale"][1] != hs_shape[:2]:
                raise bad(f"hidden_states_scale is {entries['hidden_states_scale'][:2]} for hidden_states {list(hs_shape)}")

        names = [name for name in _PER_ROW if name in entries]
        row_bytes = {}
        for name in names:
            b = _NP[entries[name][0]].itemsize
            for d in entries[name][1][1:]:
                b *= d
            row_bytes[name] = b
        cu: Optional[List[int]] = None
        slots: Optional[List[Dict[str, np.ndarray]]] = None  # each input's buffer, cut per tensor
        early: Dict[str, bytearray] = {}  # per-row tensors read before cu_seqlens was known
        digests: Dict[str, str] = {}

        def allocate() -> List[Dict[str, np.ndarray]]:
            assert cu is not None
            out = []
            for i in range(n_inputs):
                s, e = cu[i], cu[i + 1]
                starts, at = [], 0
                for name in names:  # one buffer per sample: every tensor of it, each aligned to 64 bytes
                    starts.append(at)
                    at += ((e - s) * row_bytes[name] + 63) // 64 * 64
                h: List[Any] = []
                buf = self._alloc(max(at, 1), h)
                held.append(h)
                out.append({name: buf[st : st + (e - s) * row_bytes[name]] for name, st in zip(names, starts)})
            return out

        for name in sorted(entries, key=lambda k: entries[k][2]):
            dtype, shape, begin, end = entries[name]
            if name in row_bytes and slots is not None:
                hasher = xxhash.xxh64()
                for slot in slots:
                    dst = slot[name]
                    body.fill(dst)
                    hasher.update(dst)
                digests[name] = hasher.hexdigest()
                continue
            buf = bytearray(end - begin)
            body.fill(buf)
            digests[name] = xxhash.xxh64(buf).hexdigest()
            if name == "cu_seqlens":
                cu = np.frombuffer(buf, dtype="<i8").tolist()
                if cu[0] != 0 or cu[-1] != rows or any(b < a for a, b in zip(cu, cu[1:])):
                    raise bad(f"cu_seqlens {cu} does not split {rows} rows into the {n_inputs} inputs asked for")
                slots = allocate()
            elif name in row_bytes:
                early[name] = buf
        body.finish()
        verify_digests(digests, metadata, status)
        assert cu is not None and slots is not None
        for name, buf in early.items():  # an answer written with its states first
            for i, slot in enumerate(slots):
                slot[name][:] = np.frombuffer(buf, dtype=np.uint8, count=len(slot[name]), offset=cu[i] * row_bytes[name])

        out = []
        for i, slot in enumerate(slots):
            s, e = cu[i], cu[i + 1]
            arrays: Dict[str, Tuple[str, np.ndarray]] = {}
            for name in names:
                dtype, shape = entries[name][:2]
                arrays[name] = (dtype, slot[name].view(_NP[dtype]).reshape((e - s,) + tuple(shape[1:])))
            if "positions" in arrays:
                seen = int(arrays["positions"][1][-1]) + 1 if e > s else 0
            else:
                seen = e - s
            sample, nbytes = self._finish(arrays, held[i])
            out.append((sample, nbytes, seen))
        return out

    def _in_worker(self) -> bool:
        flag = getattr(self, "_worker_flag", None)
        if flag is None:
            from torch.utils.data import get_worker_info

            flag = self._worker_flag = get_worker_info() is not None
        return flag

    def _tensor(self, dtype: str, arr: np.ndarray, held: List[Any]) -> Any:
        """``arr`` as a torch tensor of the safetensors dtype: a view of the sample's torch buffer
        where it has one (so that it stays pinned or shared), else of the numpy array."""
        torch = self._torch
        tdtype = _TORCH[dtype](torch)
        if held and isinstance(held[0], torch.Tensor):
            base = held[0]
            at = arr.ctypes.data - base.data_ptr()
            return base[at : at + arr.nbytes].view(tdtype).view(arr.shape)
        return torch.from_numpy(arr).view(tdtype)

    def _finish(self, arrays: Dict[str, Tuple[str, np.ndarray]], held: List[Any]) -> Tuple[Dict[str, Any], int]:
        hs_dtype = arrays["hidden_states"][0]
        fp8 = hs_dtype == "F8_E4M3"
        torch = self._torch
        if self.device is not None:
            stream = getattr(self._tls, "stream", None)
            if stream is None:
                stream = self._tls.stream = torch.cuda.Stream(self.device)
            out: Dict[str, Any] = {}
            with torch.cuda.stream(stream):
                for name, (dtype, arr) in arrays.items():
                    out[name] = self._tensor(dtype, arr, held).to(self.device, non_blocking=True)
                if fp8 and self.dequantize:
                    out["hidden_states"] = out["hidden_states"].float() * out.pop("hidden_states_scale")[..., None]
                event = torch.cuda.Event()
                event.record(stream)
            assert self.arena is not None
            self.arena.after(event, held[1])
            held[1] = None  # the arena's again once the copy is done
            out["_event"] = event
            return out, sum(int(t.nbytes) for k, t in out.items() if k != "_event")
        out = {}
        for name, (dtype, arr) in arrays.items():
            if self.as_torch:
                out[name] = self._tensor(dtype, arr, held)
            elif dtype in ("BF16", "F8_E4M3") and not (fp8 and self.dequantize and name == "hidden_states"):
                out[name] = _safetensors.to_numpy(dtype, arr)
            else:
                out[name] = arr
        if fp8 and self.dequantize:
            scale = out.pop("hidden_states_scale")
            if self.as_torch:
                out["hidden_states"] = out["hidden_states"].to(torch.float32) * scale[..., None]
            else:
                values = _safetensors.f8_e4m3_bits_to_float32(arrays["hidden_states"][1])
                values *= scale[..., None]
                out["hidden_states"] = values
        return out, sum(int(v.nbytes) for v in out.values())


# -- servers -----------------------------------------------------------------------------------------


@dataclass
class _Server:
    url: str
    outstanding: int = 0  # tokens (estimated) in flight
    down_until: float = 0.0
    failures_in_row: int = 0
    out: Optional[str] = None  # why it is out for good
    requests: int = 0
    samples: int = 0
    tokens: int = 0  # rows answered
    failures: int = 0
    throttled: int = 0
    bytes: int = 0
    last_error: str = ""


def _retry_after(value: Optional[str]) -> Optional[float]:
    """A Retry-After header in seconds (a number or an HTTP date), at most a minute."""
    if not value:
        return None
    try:
        secs = float(value.strip())
    except ValueError:
        try:
            secs = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError):
            return None
    if not math.isfinite(secs):
        return None
    return min(max(secs, 0.0), 60.0)


class _Connections:
    """Keep-alive HTTP connections of the fetching threads: one per (thread, server), made on
    first use. A connection's socket waits ``timeout`` seconds per operation (connect: at most
    10), so a server that hangs costs a request at most that, and :meth:`shut` ends every
    operation under way at once (a pass that closes)."""

    def __init__(self, timeout: float, headers: Dict[str, str]):
        self.timeout = timeout
        self.headers = headers
        self._tls = threading.local()
        self._all: set = set()
        self._lock = threading.Lock()
        self.closed = False

    def get(self, url: str) -> Tuple[http.client.HTTPConnection, str, bool]:
        """(connection, path prefix, whether it is new)."""
        conns = getattr(self._tls, "conns", None)
        if conns is None:
            conns = self._tls.conns = {}
        if url in conns:
            return conns[url] + (False,)
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise LayertapError(None, "bad_url", f"{url!r} is not an http:// or https:// URL")
        cls = _HTTPS if u.scheme == "https" else _HTTP
        c = cls(u.hostname, u.port, timeout=min(self.timeout, 10.0))
        c.read_timeout = self.timeout
        with self._lock:
            if self.closed:
                raise ConnectionAbortedError("the pass is closing")
            self._all.add(c)
        conns[url] = (c, u.path.rstrip("/"))
        return conns[url] + (True,)

    def drop(self, url: str) -> None:
        conns = getattr(self._tls, "conns", {})
        c = conns.pop(url, None)
        if c is not None:
            with self._lock:
                self._all.discard(c[0])
            c[0].close()

    def shut(self) -> None:
        with self._lock:
            self.closed = True
            conns = list(self._all)
        for c in conns:
            sock = c.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _Timeouts:
    """Connect within min(timeout, 10) seconds, then ``read_timeout`` per socket operation."""

    read_timeout: float

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self.sock.settimeout(self.read_timeout)  # type: ignore[attr-defined]


class _HTTP(_Timeouts, http.client.HTTPConnection):
    pass


class _HTTPS(_Timeouts, http.client.HTTPSConnection):
    pass


# -- one pass over a share ---------------------------------------------------------------------------


@dataclass
class _Item:
    pos: int  # position in this share (0 = the first sample this pass hands out)
    gpos: int  # position in the epoch's order
    index: int  # row of the input
    sid: str = ""
    input: Optional[Dict[str, Any]] = None
    est: int = 0  # tokens (estimated)
    attempts: int = 0
    replaced: int = 0  # replacements drawn for this position so far
    alone: bool = False  # sent in a request of its own (after a 4xx on a shared one)
    errors: List[str] = field(default_factory=list)
    failed_on: set = field(default_factory=set)  # servers its requests failed on
    bad: Optional["SampleError"] = None  # its row cannot be a request


def _push(queue: List[_Item], it: _Item) -> None:
    """Puts a sample back among those to send again, in position order."""
    k = len(queue)
    while k > 0 and queue[k - 1].pos > it.pos:
        k -= 1
    queue.insert(k, it)


@dataclass
class _Failed:
    error: BaseException


class _Pass:
    """One pass over a share: a background thread runs an asyncio loop that keeps requests in
    flight and hands finished samples to a bounded reorder buffer, read in order by ``next``.

    The loop holds the routing, retry and backoff state in one thread; each request runs on a
    fetching thread of its own (one per request in flight) that sends it over a kept-alive
    connection and reads the answer as it streams in, decompressed straight into the samples'
    buffers and hashed there (the socket, zstd, xxh64 and the copies release the GIL, so the
    threads work in parallel and the consumer's thread only takes finished samples). A request
    that hangs ends at its timeout (every socket operation has it), and closing the pass shuts
    the sockets of the requests under way.
    """

    def __init__(self, src: "OnlineSource", order: np.ndarray, positions: List[int]):
        self.src = src
        self.order = order
        self.n = len(order)
        self.items = positions  # epoch positions, in this share's order
        self.lock = threading.Condition()
        self.ready: Dict[int, Any] = {}
        self.next_pos = 0
        self.buffered = 0
        self.reserved = 0
        self.peak = 0
        self.in_flight = 0
        self.fatal: Optional[BaseException] = None
        self.closing = False
        self.waited = 0.0
        self.delivered = 0
        self.tokens = 0
        self.retries = 0
        self.failures = 0
        self.replacements: List[Dict[str, Any]] = []
        self.started = time.monotonic()
        self.servers = [_Server(u) for u in src.servers]
        self.decoder = _Decoder(src.as_torch, src.dequantize, src.device, src._arena())
        self.bar = None
        if src.progress:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=len(positions), unit="sample", desc="layertap", dynamic_ncols=True)
            except ImportError:
                self.bar = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.wake: Optional[asyncio.Event] = None
        self.thread = threading.Thread(target=self._main, name="layertap-online", daemon=True)
        self.thread.start()

    # -- the consumer's side
    def next(self) -> Dict[str, Any]:
        with self.lock:
            if self.next_pos >= len(self.items):
                raise StopIteration
            t0 = time.monotonic()
            while self.next_pos not in self.ready and self.fatal is None:
                self.lock.wait(0.5)
            self.waited += time.monotonic() - t0
            if self.next_pos not in self.ready:
                raise self.fatal  # type: ignore[misc]
            entry, nbytes = self.ready.pop(self.next_pos)
            self.buffered -= nbytes
            self.next_pos += 1
        self._poke()
        if isinstance(entry, _Failed):
            raise entry.error
        event = entry.pop("_event", None)
        if event is not None:
            import torch

            stream = torch.cuda.current_stream(self.decoder.device)
            stream.wait_event(event)
            for v in entry.values():
                if isinstance(v, torch.Tensor):
                    v.record_stream(stream)
        with self.lock:
            self.delivered += 1
            self.tokens += int(entry["input_ids"].shape[0])
        if self.bar is not None:
            self.bar.update(1)
            if self.delivered % 16 == 0 or self.delivered == len(self.items):
                self.bar.set_postfix(tokens=self.tokens, waited=f"{self.waited:.1f}s", refresh=False)
        return entry

    def _poke(self) -> None:
        loop, wake = self.loop, self.wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop has ended
                pass

    def close(self) -> None:
        with self.lock:
            self.closing = True
        self._poke()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=30)
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def stats(self) -> Dict[str, Any]:
        arena = self.decoder.arena
        pinned = arena is not None and arena.pinned
        with self.lock:
            elapsed = max(time.monotonic() - self.started, 1e-9)
            return {
                "samples": self.delivered,
                "tokens": self.tokens,
                "waited_s": self.waited,
                "buffered_bytes": self.buffered,
                "buffered_samples": len(self.ready),
                "reserved_bytes": self.reserved,
                "peak_bytes": self.peak,
                "in_flight": self.in_flight,
                "retries": self.retries,
                "failures": self.failures,
                "replacements": len(self.replacements),
                "replaced": list(self.replacements),
                "pinned_buffers": arena.buffers if pinned else 0,
                "pinned_bytes": arena.bytes if pinned else 0,
                "pinning_s": arena.seconds if pinned else 0.0,
                "host_buffer_bytes": arena.bytes if arena is not None else 0,
                "servers": {
                    s.url: {
                        "state": "out" if s.out else ("down" if s.down_until > time.monotonic() else "up"),
                        "requests": s.requests,
                        "samples": s.samples,
                        "tokens": s.tokens,
                        "tokens_per_s": s.tokens / elapsed,
                        "bytes": s.bytes,
                        "failures": s.failures,
                        "throttled": s.throttled,
                        "last_error": s.last_error or s.out or "",
                    }
                    for s in self.servers
                },
            }

    # -- the loop's side
    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        try:
            loop.run_until_complete(self._run())
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._set_fatal(e if isinstance(e, Exception) else RuntimeError(f"the fetching thread stopped: {e!r}"))
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    def _set_fatal(self, e: BaseException) -> None:
        with self.lock:
            if self.fatal is None:
                self.fatal = e
            self.lock.notify_all()

    def _item(self, pos: int, gpos: int, replaced: int = 0) -> _Item:
        index = int(self.order[gpos % self.n])
        it = _Item(pos=pos, gpos=gpos, index=index, replaced=replaced)
        try:
            it.sid, it.input = self.src.samples.get(index)
            it.est = self.src._estimate(it.input)
        except SampleError as e:
            it.sid = e.sample_id or str(index)
            it.input = None
            it.bad = e
        return it

    async def _run(self) -> None:
        src = self.src
        self.wake = asyncio.Event()
        # one thread per request in flight: it sends the request, reads the answer straight into
        # the samples' buffers (the socket, zstd, xxh64 and the copies release the GIL) and
        # checks it; this loop only routes, retries and counts
        executor = ThreadPoolExecutor(max_workers=src.max_requests, thread_name_prefix="layertap-fetch")
        headers = {"accept-encoding": src.encoding, "content-type": "application/json"}
        if src.api_key:
            headers["authorization"] = f"Bearer {src.api_key}"
        conns = _Connections(src.timeout, headers)
        queue: List[_Item] = []  # to send again, by position; they go first
        cursor = 0  # next position of the share not yet taken into a request
        tasks: Dict[asyncio.Task, Tuple[_Server, List[_Item], int]] = {}
        turn = 0
        try:
            while True:
                self.wake.clear()  # before looking: a poke from now on ends the wait below
                with self.lock:
                    if self.closing:
                        return
                    if self.fatal is not None:
                        return
                    done_all = cursor >= len(self.items) and not queue and not tasks
                if done_all:
                    return
                # launch what the bounds allow
                while len(tasks) < src.max_requests and (queue or cursor < len(self.items)):
                    now = time.monotonic()
                    up = [s for s in self.servers if s.out is None and s.down_until <= now]
                    if not [s for s in self.servers if s.out is None]:
                        reasons = "; ".join(f"{s.url}: {s.out}" for s in self.servers)
                        raise LayertapError(503, "no_server", f"every server is out for good: {reasons}")
                    if not up:
                        break
                    batch, cursor = self._take(queue, cursor)
                    if not batch:
                        break
                    est_bytes = sum(self.src._est_bytes(it) for it in batch)
                    with self.lock:
                        head = batch[0].pos <= self.next_pos  # the sample the consumer waits for next
                        if self.buffered + self.reserved + est_bytes > src.max_buffered_bytes and not head:
                            for it in batch:  # no room: back, to go first when there is
                                _push(queue, it)
                            break
                        self.reserved += est_bytes
                        self.in_flight += 1
                    # the up server with the fewest tokens outstanding (ties in turn), among those
                    # the batch's samples have not failed on where there is one: a failing server
                    # looks idle, and would draw the same samples again and again
                    turn += 1
                    avoid = set().union(*(it.failed_on for it in batch))
                    pool = [s for s in up if s.url not in avoid] or up
                    server = min(pool, key=lambda s: (s.outstanding, (self.servers.index(s) - turn) % len(self.servers)))
                    tokens = sum(it.est for it in batch)
                    server.outstanding += tokens
                    task = asyncio.ensure_future(self._request(conns, executor, server, batch))
                    tasks[task] = (server, batch, est_bytes)
                waits = [s.down_until for s in self.servers if s.out is None and s.down_until > time.monotonic()]
                timeout = max(min(waits) - time.monotonic(), 0.01) if waits and (queue or cursor < len(self.items)) else None
                waker = asyncio.ensure_future(self.wake.wait())
                done, _ = await asyncio.wait([*tasks, waker], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                waker.cancel()
                for task in done:
                    if task is waker:
                        continue
                    server, batch, est_bytes = tasks.pop(task)
                    server.outstanding -= sum(it.est for it in batch)
                    with self.lock:
                        self.reserved -= est_bytes
                        self.in_flight -= 1
                    self._settle(task.result(), server, batch, queue)
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            conns.shut()
            executor.shutdown(wait=False)

    def _take(self, queue: List[_Item], cursor: int) -> Tuple[List[_Item], int]:
        """The next request's samples, in the share's order: those to send again first (their
        positions are all before the cursor), then new ones, up to the token budget and the
        server's input limit (the first always, whatever its size)."""
        src = self.src
        batch: List[_Item] = []
        tokens = 0
        while True:
            if queue:
                it = queue.pop(0)
            elif cursor < len(self.items):
                it = self._item(cursor, self.items[cursor])
                cursor += 1
                if it.bad is not None:  # a row that cannot be a request
                    self._fail(it, it.bad, queue)
                    continue
            else:
                break
            if batch and (it.alone or batch[0].alone or tokens + it.est > src._budget or len(batch) >= src._max_inputs):
                _push(queue, it)
                break
            batch.append(it)
            tokens += it.est
            if it.alone:
                break
        return batch, cursor

    async def _request(self, conns: _Connections, executor: ThreadPoolExecutor, server: _Server, batch: List[_Item]) -> Tuple[str, Any]:
        """One request: ``("ok", [(sample, nbytes, rows seen)])``, or ``(kind, (message, status,
        type, retry_after))`` with kind ``down`` (connection, timeout, 5xx, bad answer), ``busy``
        (429), ``out`` (selfcheck_failed), ``setup`` (a 4xx that is no sample's fault) or
        ``refused`` (a 4xx)."""
        body = dict(self.src._body)
        body["inputs"] = [_with_template_kwargs(it.input, self.src.chat_template_kwargs) for it in batch]
        payload = json.dumps(body).encode()
        server.requests += 1
        loop = asyncio.get_running_loop()
        kind, value, nbytes = await loop.run_in_executor(executor, self._fetch, conns, server.url, payload, len(batch))
        server.bytes += nbytes
        return kind, value

    def _fetch(self, conns: _Connections, url: str, payload: bytes, n_inputs: int) -> Tuple[str, Any, int]:
        """:meth:`_request`'s work, on a fetching thread; also the bytes as sent."""
        src = self.src
        for attempt in (0, 1):
            try:
                c, prefix, new = conns.get(url)
            except LayertapError as e:
                return "setup", (e.message, None, e.type, None), 0
            except ConnectionAbortedError as e:
                return "down", (str(e), None, "closed", None), 0
            try:
                c.request("POST", prefix + "/v1/hidden-states", body=payload, headers=conns.headers)
                r = c.getresponse()
            except socket.timeout as e:
                conns.drop(url)
                return "down", (f"no answer within {src.timeout} s ({type(e).__name__})", None, "timeout", None), 0
            except (OSError, http.client.HTTPException) as e:
                conns.drop(url)
                # a kept-alive connection the server had closed meanwhile: once more on a new one
                # (the request has no effect on the server, so sending it twice is harmless)
                stale = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, http.client.CannotSendRequest)
                if not new and attempt == 0 and isinstance(e, stale):
                    continue
                return "down", (f"{type(e).__name__}: {e}", None, "connection_error", None), 0
            break
        status = r.status
        if status != 200:
            try:
                data = r.read(1 << 20)  # an error is small; the rest of a larger body is dropped with the connection
            except (OSError, http.client.HTTPException):
                data = b""
            if r.will_close or not r.isclosed():
                conns.drop(url)
            err = error_from_response(status, _maybe_unzstd(data))
            wait = _retry_after(r.getheader("retry-after"))
            msg = f"HTTP {status} {err.type}: {err.message}"
            if status == 503 and err.type == "selfcheck_failed":
                return "out", (msg, status, err.type, None), len(data)
            if status >= 500 or status == 408:
                return "down", (msg, status, err.type, wait), len(data)
            if status == 429:
                return "busy", (msg, status, err.type, wait if wait is not None else 1.0), len(data)
            if status in SETUP_STATUSES:
                return "setup", (msg, status, err.type, None), len(data)
            return "refused", (msg, status, err.type, None), len(data)
        encoding = (r.getheader("content-encoding") or "identity").strip().lower()
        if encoding not in ("zstd", "identity"):
            conns.drop(url)
            return "setup", (f"the answer came as {encoding!r}, which this client does not read", status, "bad_answer", None), 0
        reader = self.decoder.reader(r, encoding == "zstd")
        try:
            decoded = self.decoder.read(reader, n_inputs, status)
        except socket.timeout as e:
            conns.drop(url)
            return "down", (f"the answer stopped for {src.timeout} s ({type(e).__name__})", status, "timeout", None), 0
        except (LayertapError, zstandard.ZstdError, ValueError, _Short, http.client.IncompleteRead) as e:
            conns.drop(url)
            kind = getattr(e, "type", "bad_answer")
            return "down", (f"the answer was damaged: {e}", status, kind, None), 0
        except (OSError, http.client.HTTPException) as e:
            conns.drop(url)
            return "down", (f"the answer was cut: {type(e).__name__}: {e}", status, "connection_error", None), 0
        if r.will_close:
            conns.drop(url)
        length = r.getheader("content-length")
        return "ok", decoded, int(length) if length and length.isdigit() else reader.read_bytes

    def _settle(self, result: Tuple[str, Any], server: _Server, batch: List[_Item], queue: List[_Item]) -> None:
        kind, value = result
        src = self.src
        if kind == "ok":
            server.failures_in_row = 0
            server.samples += len(batch)
            rows = 0
            with self.lock:
                for it, (sample, nbytes, _) in zip(batch, value):
                    if it.pos in self.ready or it.pos < self.next_pos:
                        continue  # already settled (never handed out twice)
                    sample = {"id": it.sid, **sample}
                    rows += int(sample["input_ids"].shape[0])
                    self.ready[it.pos] = (sample, nbytes)
                    self.buffered += nbytes
                self.peak = max(self.peak, self.buffered + self.reserved)
                self.lock.notify_all()
            server.tokens += rows
            for it, (_, _, seen) in zip(batch, value):
                src._learn(it.input, seen)
            return
        message, status, etype, wait = value
        server.last_error = message
        now = time.monotonic()
        if kind == "setup":
            raise LayertapError(status, etype, f"{server.url} refused the request for a reason no sample causes: {message}")
        if kind == "refused":
            if len(batch) > 1:
                # whose fault? each sample is asked again on its own
                for it in batch:
                    it.alone = True
                    _push(queue, it)
                return
            it = batch[0]
            self._fail(it, SampleError.of(it.sid, it.index, f"{server.url} refused it: {message}", status, etype), queue)
            return
        if kind == "out":
            server.out = f"out for good: {message}"
            server.failures += 1
        elif kind == "busy":
            server.throttled += 1
            server.down_until = max(server.down_until, now + wait)
        else:
            server.failures += 1
            backoff = min(src.backoff * (2 ** min(server.failures_in_row, 16)), src.max_backoff)
            server.failures_in_row += 1
            server.down_until = max(server.down_until, now + max(backoff, wait or 0.0))
        with self.lock:
            self.retries += len(batch)
        for it in batch:
            it.attempts += 1
            it.failed_on.add(server.url)
            it.errors.append(f"{server.url}: {message}")
            if it.attempts > src.retries:
                tried = "; ".join(it.errors[-4:])
                self._fail(it, SampleError.of(it.sid, it.index, f"failed {it.attempts} times (last: {tried})", status, etype), queue)
            else:
                _push(queue, it)

    def _fail(self, it: _Item, error: SampleError, queue: List[_Item]) -> None:
        """A sample failed for good: its error waits at its position, or (on_error="replace")
        the next sample of the epoch's order takes its place."""
        src = self.src
        with self.lock:
            self.failures += 1
        if src.on_error == "replace" and it.replaced < src.max_replacements and self.n > 1:
            k = it.replaced + 1
            new = self._item(it.pos, it.gpos + k, replaced=k)
            new.gpos = it.gpos  # the next one, if it fails too, is counted from the same place
            with self.lock:
                self.replacements.append(
                    {"position": it.pos, "id": it.sid, "row": it.index, "replaced_by": new.sid, "error": error.message}
                )
            if new.bad is not None:
                self._fail(new, new.bad, queue)
            else:
                _push(queue, new)
            return
        if src.on_error == "replace":
            error = SampleError(f"{error.message}; and the {it.replaced} samples after it in the order failed too", it.sid, it.index, error.status, error.type)
        with self.lock:
            if it.pos not in self.ready and it.pos >= self.next_pos:
                self.ready[it.pos] = (_Failed(error), 0)
            self.lock.notify_all()


def _maybe_unzstd(data: bytes) -> bytes:
    if data[:4] != ZSTD_MAGIC:
        return data
    try:
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 20)
    except zstandard.ZstdError:
        return data


# -- the source -------------------------------------------------------------------------------------


_RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token")


def _check_template_kwargs(kwargs: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """``chat_template_kwargs`` as the server takes them: a JSON object without the names it sets."""
    if kwargs is None:
        return None
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"chat_template_kwargs must be a mapping, not {type(kwargs).__name__}")
    out = dict(kwargs)
    for k in out:
        if not isinstance(k, str):
            raise TypeError(f"chat_template_kwargs: the key {k!r} is not a string")
        if k in _RESERVED_TEMPLATE_VARIABLES:
            raise ValueError(f"chat_template_kwargs sets {k!r}, which the server sets itself")
    json.dumps(out)  # raises on what JSON cannot carry
    return out


def _with_template_kwargs(inp: Dict[str, Any], kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """A chat input with ``kwargs`` under its own ``chat_template_kwargs`` (its own win, key by key),
    as ``layertap bulk --chat-template-kwargs`` does; other inputs as they are."""
    if not kwargs or "messages" not in inp:
        return inp
    merged = dict(kwargs)
    merged.update(inp.get("chat_template_kwargs") or {})
    return {**inp, "chat_template_kwargs": merged}


class OnlineSource:
    """Samples with their hidden states, fetched from layertap servers as the consumer goes.

    ``samples``: what :func:`open_samples` takes (a JSONL or Parquet path, a
    ``datasets.Dataset``, a list of samples, with ``text_column``, ``messages_column``,
    ``ids_column`` and ``id_column`` as ``layertap bulk``'s flags). ``servers``: one URL or a
    list. The request options are :meth:`layertap_client.Client.hidden_states`'s: ``layers``,
    ``dtype`` (fp8 too), ``tokens`` (``"all"``, ``"assistant"``, ``{"last": k}`` or
    ``"last:k"``), ``logprobs`` (an int k or ``{"top_k": k, "target": True}``),
    ``split_special_tokens``, ``allow_nonfinite``; and ``dequantize`` (fp8 comes as float32
    unless False) and ``as_torch`` (torch tensors rather than numpy arrays).

    Iterating gives this rank's (and worker's) share of the current epoch in order, each sample
    a dict: ``id``, ``hidden_states`` ``[T, n_layers, H]``, ``input_ids`` ``[T]`` int64,
    ``loss_mask`` ``[T]`` uint8, and as asked ``positions`` (a ``tokens`` selection),
    ``hidden_states_scale`` (fp8 with ``dequantize=False``), ``topk_ids``, ``topk_logprobs``,
    ``target_logprobs`` (``logprobs``).

    Sharing: ``rank``/``world_size`` (default: torch.distributed when initialised, else 0/1),
    ``worker``/``num_workers`` (default: the DataLoader worker this runs in, else 0/1) and
    ``batch_size`` (the DataLoader's, so that its workers' batches come out in the rank's
    order; 1 by default). ``shuffle``, ``seed`` and :meth:`set_epoch` set the order.

    Flow: ``request_tokens`` (tokens per request, several samples each; fewer where the
    server's ``max_request_tokens`` is smaller, or where ``max_requests`` answers of that many
    tokens would not fit ``max_buffered_bytes`` together), ``max_requests`` in flight, ``max_buffered_bytes`` of
    answers fetched and not yet handed out (counting what the requests in flight will bring,
    estimated: exact for token ids, from the length for text and chats). ``encoding``: the
    answers as ``"zstd"`` (the default: a fifth fewer bytes on the wire for bf16 states) or
    ``"identity"`` (no decompression: less client CPU where the network is fast). Each request
    in flight has a thread that reads its answer straight into the samples' buffers, so no
    answer is held whole. ``device="cuda:N"`` (torch) copies every sample to
    the GPU from reused pinned buffers without blocking (in the main process only: under
    DataLoader workers use the DataLoader's ``pin_memory`` instead); ``pin_memory=False`` keeps
    those host buffers pageable (nothing to pin when a pass starts; each copy then goes through
    the CUDA driver's staging buffer and holds its decoding thread until it is staged).

    Failures: ``retries`` (attempts of a sample beyond its first), ``timeout`` (seconds per
    request), ``backoff``/``max_backoff`` (how long a failed server is left alone: doubling from
    the first to the last), ``on_error`` (``"raise"``, or ``"replace"`` with at most
    ``max_replacements`` replacements per position). ``progress=True`` shows a tqdm bar where
    tqdm is installed.

    ``chat_template_kwargs``: template variables for every chat (``{"reasoning_effort": "high"}``
    for gpt-oss, ``{"enable_thinking": False}`` for Qwen3), under a sample's own
    ``chat_template_kwargs``, which win key by key (as ``layertap bulk --chat-template-kwargs``).
    """

    def __init__(
        self,
        samples: Any,
        servers: Union[str, Sequence[str]],
        layers: Any,
        dtype: Any = "bfloat16",
        tokens: Any = None,
        logprobs: Any = None,
        split_special_tokens: bool = False,
        allow_nonfinite: bool = False,
        dequantize: bool = True,
        as_torch: bool = False,
        *,
        text_column: Optional[str] = None,
        messages_column: Optional[str] = None,
        ids_column: Optional[str] = None,
        id_column: str = "id",
        shuffle: bool = False,
        seed: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        worker: Optional[int] = None,
        num_workers: Optional[int] = None,
        batch_size: int = 1,
        request_tokens: int = 8192,
        max_requests: int = 32,
        max_buffered_bytes: int = 2 << 30,
        encoding: str = "zstd",
        device: Any = None,
        pin_memory: bool = True,
        retries: int = 8,
        timeout: float = 600.0,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        on_error: str = "raise",
        max_replacements: int = 16,
        api_key: Optional[str] = None,
        progress: bool = False,
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
    ):
        self.samples = open_samples(samples, text_column, messages_column, ids_column, id_column)
        self.chat_template_kwargs = _check_template_kwargs(chat_template_kwargs)
        if isinstance(servers, str):
            servers = [s for s in servers.split(",") if s.strip()]
        self.servers = [s.strip().rstrip("/") for s in servers]
        if not self.servers:
            raise ValueError("give at least one server URL")
        for url in self.servers:
            u = urllib.parse.urlsplit(url)
            if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
                raise ValueError(f"{url!r} is not a server URL (http:// or https://, a host, an optional port and path)")
        if len(set(self.servers)) != len(self.servers):
            raise ValueError(f"a server is named twice: {self.servers}")
        self.layers = normalize_layers(layers)
        self.dtype = normalize_dtype(dtype)
        self.tokens = _normalize_selection(tokens)
        self.logprobs = normalize_logprobs(logprobs)
        self.split_special_tokens = bool(split_special_tokens)
        self.allow_nonfinite = bool(allow_nonfinite)
        self.dequantize = dequantize
        self.as_torch = as_torch or device is not None
        if on_error not in ("raise", "replace"):
            raise ValueError(f'on_error={on_error!r}: use "raise" or "replace"')
        self.on_error = on_error
        self.max_replacements = int(max_replacements)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        if (rank is None) != (world_size is None):
            raise ValueError("give both rank and world_size, or neither (then torch.distributed's, when initialised)")
        if rank is None:
            rank, world_size = _distributed()
        assert world_size is not None
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.rank, self.world_size = int(rank), int(world_size)
        if (worker is None) != (num_workers is None):
            raise ValueError("give both worker and num_workers, or neither (then the DataLoader worker's)")
        self._worker = (int(worker), int(num_workers)) if worker is not None and num_workers is not None else None
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        self.batch_size = int(batch_size)
        for name, v in (("request_tokens", request_tokens), ("max_requests", max_requests)):
            if v < 1:
                raise ValueError(f"{name} must be at least 1, not {v}")
        if max_buffered_bytes < 1:
            raise ValueError(f"max_buffered_bytes must be positive, not {max_buffered_bytes}")
        self.request_tokens = int(request_tokens)
        self.max_requests = int(max_requests)
        self.max_buffered_bytes = int(max_buffered_bytes)
        if encoding not in ("zstd", "identity"):
            raise ValueError(f'encoding={encoding!r}: use "zstd" or "identity"')
        self.encoding = encoding
        self.device = device
        self.pin_memory = bool(pin_memory)
        self._pinned: Optional[_PinnedArena] = None
        self._warm_bytes: Optional[int] = None  # host memory made ready when a pass starts (None: one slab)
        if device is not None:
            import torch

            if torch.device(device).type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device={device!r}, but torch sees no CUDA device")
        self.retries = int(retries)
        self.timeout = float(timeout)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.api_key = api_key
        self.progress = progress
        self.offset = 0  # positions of the epoch's order handed out (by every rank together)
        self._pass: Optional[_Pass] = None
        self._pass_offset = 0
        self._consumed = 0
        self._closed_stats: Dict[str, Any] = {}
        self._info: Optional[Dict[str, Any]] = None
        self._chars_per_token = 3.0  # learnt from answers; starts low, so estimates err large
        self._seen_chars = 0
        self._seen_tokens = 0
        body: Dict[str, Any] = {"layers": self.layers}
        if self.dtype is not None:
            body["dtype"] = self.dtype
        if self.tokens is not None:
            body["tokens"] = self.tokens
        if self.split_special_tokens:
            body["split_special_tokens"] = True
        if self.allow_nonfinite:
            body["allow_nonfinite"] = True
        if self.logprobs is not None:
            body["logprobs"] = self.logprobs
        self._body = body

    # -- sizes
    def __len__(self) -> int:
        """Samples this rank (all its workers together) hands out in what is left of the epoch."""
        return len(share(len(self.samples), self.offset, self.rank, self.world_size))

    def info(self) -> Dict[str, Any]:
        """``GET /v1/info`` of the first server that answers it (the hidden size and the limits
        size the requests). When none does, raises :class:`LayertapError` (``type="no_server"``,
        ``status`` the last answer's) giving each server's reason."""
        if self._info is None:
            import requests

            errors, status = [], None
            headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            for url in self.servers:
                try:
                    r = requests.get(url + "/v1/info", timeout=min(self.timeout, 30), headers=headers)
                except requests.RequestException as e:
                    errors.append(f"{url}: {e}")
                    continue
                if r.status_code == 200:
                    self._info = r.json()
                    break
                err = error_from_response(r.status_code, r.content)
                status = r.status_code
                errors.append(f"{url}: HTTP {r.status_code} {err.type}: {err.message}")
            else:
                raise LayertapError(status, "no_server", "no server answered /v1/info: " + "; ".join(errors))
        return self._info

    def _prepare(self) -> None:
        info = self.info()
        self._hidden = int(info.get("hidden_size", 0))
        self._budget = max(1, min(self.request_tokens, int(info.get("max_request_tokens", self.request_tokens))))
        self._max_inputs = max(1, int(info.get("max_inputs", 1024)))
        item = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}.get(self.dtype or info.get("dtype", "float32"), 4)
        per_layer = self._hidden * (4 if (item == 1 and self.dequantize) else item) + (4 if item == 1 else 0)
        self._row_bytes = len(self.layers) * per_layer + 8 + 1 + 8
        if self.logprobs is not None:
            self._row_bytes += 12 * int(self.logprobs["top_k"]) + (4 if self.logprobs.get("target") else 0)
        # every request in flight must fit the buffer bound at once, else the bound, not
        # max_requests, sets how many are in flight (and one large answer waits for the last)
        self._budget = max(1, min(self._budget, self.max_buffered_bytes // (self.max_requests * self._row_bytes)))

    def _estimate(self, x: Dict[str, Any]) -> int:
        """Tokens of an input: exact for token ids, from its length for text and chats."""
        if "input_ids" in x and isinstance(x["input_ids"], list):
            return max(1, len(x["input_ids"]))
        return max(1, int(self._chars(x) / self._chars_per_token) + 1)

    @staticmethod
    def _chars(x: Dict[str, Any]) -> int:
        if isinstance(x.get("text"), str):
            return len(x["text"].encode("utf-8"))
        if isinstance(x.get("messages"), list):
            return sum(len(str(m.get("content", "")).encode("utf-8")) + 24 for m in x["messages"] if isinstance(m, Mapping))
        return 0

    def _est_bytes(self, it: _Item) -> int:
        rows = it.est
        if isinstance(self.tokens, dict):
            rows = min(rows, int(self.tokens["last"]))
        return rows * self._row_bytes + 256

    def _learn(self, x: Optional[Dict[str, Any]], n: int) -> None:
        """Learns characters per token from answers (``n``: tokens the input has at least)."""
        if not x or "input_ids" in x or n <= 0:
            return
        self._seen_chars += self._chars(x)
        self._seen_tokens += n
        if self._seen_tokens >= 64:
            # a little under the mean, so estimates err large rather than small
            self._chars_per_token = max(0.5, 0.8 * self._seen_chars / self._seen_tokens)

    # -- epochs and state
    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration hands out (call it before each epoch, as with
        DistributedSampler). Moving to another epoch starts it from its beginning; the epoch a
        loaded state is in keeps its position."""
        if int(epoch) != self.epoch:
            self.close()
            self.epoch = int(epoch)
            self.offset = 0
            self._pass_offset = 0
            self._consumed = 0

    def state_dict(self, consumed: Optional[int] = None) -> Dict[str, Any]:
        """Where the job is: ``{"seed", "epoch", "position", ...}``; ``position`` counts the
        epoch's samples handed out by every rank together (the order's first ``position``).

        ``consumed``: the samples this rank's trainer has taken since the epoch started (or
        since the state was loaded); by default what this source handed out itself, which
        needs it iterated in this process. Under DataLoader workers pass the count: the
        DataLoader hands samples out in the rank's order (given the dataset's ``batch_size``),
        so the count says which. Ranks that step together (DDP) have taken the same count, so
        their states agree, and any one of them resumes the job.
        """
        n = len(self.samples)
        if consumed is None:
            if self._worker is not None and self._worker[1] > 1:
                raise ValueError("this source is one of several workers: pass consumed= (the samples the rank has taken)")
            consumed = self._consumed
        start = self._pass_offset
        mine = len(share(n, start, self.rank, self.world_size))
        if not 0 <= consumed <= mine:
            raise ValueError(f"consumed={consumed}: this rank's share from position {start} holds {mine} samples")
        # a rank whose share is done has seen the epoch through (ranks' shares differ by one at most)
        position = n if consumed == mine else start + consumed * self.world_size
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": int(position),
            "shuffle": self.shuffle,
            "num_samples": n,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues where ``state`` (from :meth:`state_dict`) left off: the same seed, epoch
        and order, and only the samples after ``position``. The world size may differ (the
        remaining samples are dealt to the ranks there are now); a state of another input
        (another number of samples), another order or an unknown version is refused."""
        if not isinstance(state, Mapping):
            raise TypeError("load_state_dict takes the dict state_dict() returned")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"state version {state.get('version')!r}: this client reads version {STATE_VERSION}")
        n = len(self.samples)
        if int(state["num_samples"]) != n:
            raise ValueError(
                f"the state is of an input of {state['num_samples']} samples, this one has {n}: resume on the same input"
            )
        if bool(state["shuffle"]) != self.shuffle:
            raise ValueError(f"the state was made with shuffle={state['shuffle']}, this source has shuffle={self.shuffle}")
        position = int(state["position"])
        if not 0 <= position <= n:
            raise ValueError(f"position {position} is not in [0, {n}]")
        self.close()
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.offset = position
        self._consumed = 0
        self._pass_offset = position

    # -- iterating
    def __iter__(self) -> Iterator[Dict[str, Any]]:
        self.close()
        n = len(self.samples)
        if self.offset >= n and n > 0:
            warnings.warn(
                f"epoch {self.epoch} has been handed out already: call set_epoch() with the next epoch",
                RuntimeWarning,
                stacklevel=2,
            )
        worker, num_workers = self._worker if self._worker is not None else _worker_info()
        positions = share(n, self.offset, self.rank, self.world_size, worker, num_workers, self.batch_size)
        self._pass_offset = self.offset
        self._consumed = 0
        if not positions:
            return iter(())
        self._prepare()
        order = epoch_order(n, self.shuffle, self.seed, self.epoch)
        p = _Pass(self, order, positions)
        self._pass = p
        return self._iterate(p, n)

    def _iterate(self, p: _Pass, n: int) -> Iterator[Dict[str, Any]]:
        try:
            while True:
                try:
                    sample = p.next()
                except StopIteration:
                    break
                self._consumed += 1
                yield sample
            # every sample of this share handed out: the epoch is done for this rank
            if self._pass is p:
                self.offset = n
        finally:
            if self._pass is p:
                self.close()

    def close(self) -> None:
        """Stops the requests in flight and the fetching thread (iterating again starts anew)."""
        p, self._pass = self._pass, None
        if p is not None:
            p.close()
            self._closed_stats = p.stats()

    def stats(self) -> Dict[str, Any]:
        """What the current (or last) pass did: ``samples`` and ``tokens`` handed out,
        ``waited_s`` (time the consumer waited for a sample), ``buffered_bytes`` (fetched, not
        handed out), ``reserved_bytes`` (what the requests in flight are expected to bring),
        ``peak_bytes``, ``in_flight`` requests, ``retries`` (samples sent again), ``failures``
        (samples that failed for good), ``replacements`` and ``replaced`` (which, by what, why),
        ``pinned_buffers``, ``pinned_bytes`` and ``pinning_s`` (with ``device``: the pinned host
        memory allocated, kept and reused for the source's life, and the time its allocation
        took; zero with ``pin_memory=False``), ``host_buffer_bytes`` (with ``device``: those
        buffers' bytes, pinned or not), and per server: ``state`` (up, down for a backoff, out for good), ``requests``,
        ``samples``, ``tokens`` (rows answered), ``tokens_per_s`` (since the pass started),
        ``bytes`` (as sent), ``failures``, ``throttled`` (429s), ``last_error``."""
        if self._pass is not None:
            return self._pass.stats()
        return dict(self._closed_stats)

    def __enter__(self) -> "OnlineSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _arena(self) -> Optional[_PinnedArena]:
        """The pinned memory of the copies to ``device`` (CUDA), kept for the source's life: one
        slab made ready in the background when the first pass starts, more slabs as the copies
        need them (up to what they hold at once: the samples being decoded and the copies in
        flight; the buffered samples wait on the GPU, so on the 8B benchmark 1 GiB of a 2 GiB
        bound). Pinning the whole bound up front took twice the pinned memory and, in one run
        each on an H100, gave 91.2 % of bench_http against 93.2 %."""
        if self.device is None:
            return None
        import torch

        if torch.device(self.device).type != "cuda":
            return None
        if self._pinned is None:
            slab = min(256 << 20, max(32 << 20, self.max_buffered_bytes // 8))
            self._pinned = _PinnedArena(torch, -(-slab // _PinnedArena.ALIGN) * _PinnedArena.ALIGN, self.pin_memory)
        self._pinned.warm(self._pinned.slab_bytes if self._warm_bytes is None else self._warm_bytes)
        return self._pinned

    def __getstate__(self) -> Dict[str, Any]:  # to DataLoader workers: no thread, no pass
        d = dict(self.__dict__)
        d["_pass"] = None
        d["_pinned"] = None
        return d


def _normalize_selection(tokens: Any) -> Any:
    """``tokens`` as bulk's ``--tokens`` takes it: None or ``"all"``, ``"assistant"``,
    ``{"last": k}`` or ``"last:k"`` (one selection for every sample)."""
    if tokens is None or tokens == "all":
        return None
    if tokens == "assistant":
        return "assistant"
    if isinstance(tokens, str) and tokens.startswith("last:"):
        try:
            k = int(tokens[5:])
        except ValueError:
            raise ValueError(f"tokens={tokens!r}: last:K needs a whole number K") from None
        tokens = {"last": k}
    if isinstance(tokens, Mapping) and set(tokens) == {"last"} and isinstance(tokens["last"], int) and tokens["last"] >= 1:
        return {"last": int(tokens["last"])}
    raise ValueError(f'tokens={tokens!r}: use "all", "assistant", {{"last": k}} or "last:k" (k >= 1)')


def __getattr__(name: str) -> Any:  # the torch dataset imports torch only when asked for
    if name == "OnlineIterableDataset":
        try:
            from . import _torch_online
        except ImportError as e:
            raise ImportError(
                f"layertap_client.online.{name} needs torch: pip install 'layertap-client[torch]' "
                f"(or the torch build you need); OnlineSource works without it ({e})"
            ) from e
        return _torch_online.OnlineIterableDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
