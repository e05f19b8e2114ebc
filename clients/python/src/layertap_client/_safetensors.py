"""Reading the safetensors files layertap writes (answers, and the files of ``layertap bulk``).

The ``safetensors`` package parses and validates every file (header, offsets,
tensors tiling the data section): :func:`parse_torch` is
``safetensors.torch.load``, and :func:`parse_raw` takes each tensor's bytes
from ``safetensors.deserialize``. What that package cannot do is kept here,
for the dtypes the server writes only (:data:`DTYPES`):

- numpy arrays of ``BF16`` without ``ml_dtypes`` (numpy has no bfloat16: the
  values are widened to float32, exactly), and of ``F8_E4M3`` without
  ``ml_dtypes`` or torch (widened through a 256-entry table, exactly);
- the ``__metadata__`` and each tensor's stored bytes (for the checksums,
  without a copy): the package has no API for either on a buffer in memory.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Dict, Tuple, Union

import numpy as np
import safetensors

try:  # optional: real bfloat16 / float8_e4m3fn dtypes for numpy
    import ml_dtypes as _ml_dtypes  # type: ignore
except Exception:  # pragma: no cover - depends on the environment
    _ml_dtypes = None

Buffer = Union[bytes, bytearray, memoryview]

#: safetensors dtype -> numpy dtype holding the same bytes (little-endian), for
#: the dtypes layertap writes: hidden states (F32, BF16, F16, F8_E4M3), fp8
#: scales (F32), token ids, cu_seqlens and positions (I64), loss masks (U8).
DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # raw bits
    "F8_E4M3": np.dtype("u1"),  # raw bits
    "I64": np.dtype("<i8"),
    "U8": np.dtype("u1"),
}

# Sanity bound on the JSON header (the safetensors package uses 100 MB).
_MAX_HEADER = 100_000_000


class SafetensorsError(ValueError):
    """The bytes are not a well-formed safetensors file (or hold a dtype layertap does not write)."""


def _e4m3fn_table() -> np.ndarray:
    """float32 value of each of the 256 float8_e4m3fn bit patterns.

    e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits. Exponent 0
    holds the subnormals ``m / 8 * 2**-6``; ``S.1111.111`` (0x7F, 0xFF) is NaN;
    there is no infinity, so ``S.1111.110`` = 448 is the largest value.
    """
    table = np.empty(256, dtype=np.float32)
    for bits in range(256):
        sign = -1.0 if bits & 0x80 else 1.0
        exponent = (bits >> 3) & 0xF
        mantissa = bits & 0x7
        if exponent == 0xF and mantissa == 0x7:
            table[bits] = np.nan
        elif exponent == 0:
            table[bits] = sign * (mantissa / 8.0) * 2.0**-6
        else:
            table[bits] = sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    table.setflags(write=False)
    return table


#: float32 value of every float8_e4m3fn bit pattern (index = the byte).
F8_E4M3_TO_FLOAT32 = _e4m3fn_table()


def f8_e4m3_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact widening of raw float8_e4m3fn bits (uint8) to float32."""
    return F8_E4M3_TO_FLOAT32[np.asarray(bits, dtype=np.uint8)]


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact widening of raw bfloat16 bits (uint16) to float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def has_numpy_bfloat16() -> bool:
    """True when ``ml_dtypes`` is installed, so numpy output can stay bfloat16."""
    return _ml_dtypes is not None


def _validate(data: Buffer) -> list:
    """``safetensors.deserialize``: the package's checks, and each tensor's bytes (a copy)."""
    try:
        return safetensors.deserialize(bytes(data) if isinstance(data, memoryview) else data)
    except safetensors.SafetensorError as e:
        raise SafetensorsError(str(e)) from None


def header(
    data: Buffer, validated: bool = False
) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, str], Dict[str, memoryview]]:
    """The header of a file: ``({name: entry}, metadata, {name: stored bytes})``, each entry
    ``{"dtype", "shape", "data_offsets"}`` as the file has it.

    The file is first checked by the safetensors package unless ``validated``
    says it has been already. The stored bytes are views of ``data`` (no
    copy), what the checksums are computed over.
    """
    if not validated:
        _validate(data)
    spans, metadata, body = _parse(data)
    entries = {name: {"dtype": d, "shape": list(shape), "data_offsets": [b, e]} for name, (d, shape, b, e) in spans.items()}
    return entries, metadata, {name: body[b:e] for name, (_, _, b, e) in spans.items()}


def layout(head: Buffer) -> Tuple[Dict[str, Tuple[str, Tuple[int, ...], int, int]], Dict[str, str], int]:
    """The JSON header of a file (the bytes after its 8-byte length) as
    ``({name: (dtype, shape, begin, end)}, metadata, data section length)``.

    Checks what the safetensors package checks that a header alone can show: a dtype layertap
    writes (:data:`DTYPES`), a shape of non-negative ints whose size is the tensor's byte
    length, and offsets that tile the data section with no gap or overlap. For a reader that
    streams the data section (:mod:`layertap_client.online`).
    """
    try:
        entries = json.loads(bytes(head).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise SafetensorsError(f"the header is not valid JSON: {e}") from None
    if not isinstance(entries, dict):
        raise SafetensorsError("the header is not a JSON object")
    metadata = entries.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise SafetensorsError("__metadata__ must map strings to strings")
    out: Dict[str, Tuple[str, Tuple[int, ...], int, int]] = {}
    spans = []
    for name, e in entries.items():
        try:
            begin, end = e["data_offsets"]
            dtype = e["dtype"]
            shape = e["shape"]
        except (TypeError, KeyError, ValueError):
            raise SafetensorsError(f"tensor {name!r}: malformed entry {e!r}") from None
        if dtype not in DTYPES:
            raise SafetensorsError(
                f"tensor {name!r}: dtype {dtype!r} is not one layertap writes ({', '.join(DTYPES)}); "
                "read such files with the safetensors package"
            )
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise SafetensorsError(f"tensor {name!r}: malformed shape {shape!r}")
        if not (isinstance(begin, int) and isinstance(end, int) and not isinstance(begin, bool) and 0 <= begin <= end):
            raise SafetensorsError(f"tensor {name!r}: malformed offsets [{begin!r}, {end!r}]")
        size = DTYPES[dtype].itemsize
        for d in shape:
            size *= d
        if size != end - begin:
            raise SafetensorsError(f"tensor {name!r}: shape {shape} of {dtype} is {size} bytes, its offsets hold {end - begin}")
        spans.append((begin, end, name))
        out[name] = (dtype, tuple(shape), begin, end)
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise SafetensorsError(f"tensor {name!r} starts at byte {begin} of the data section, not at {at}")
        at = end
    return out, metadata, at


def views(data: Buffer) -> Tuple[Dict[str, Tuple[str, Tuple[int, ...], memoryview]], Dict[str, str]]:
    """Every tensor of a file as ``{name: (dtype, shape, stored bytes)}`` and the metadata, with
    no copy: the bytes are views of ``data``.

    This checks what the safetensors package checks (:func:`layout`, and a data section of
    exactly the length the offsets tile), without the copy of every tensor that
    ``safetensors.deserialize`` makes.
    """
    entries, metadata, body = _parse(data)
    return {name: (d, shape, body[b:e]) for name, (d, shape, b, e) in entries.items()}, metadata


def _parse(data: Buffer) -> Tuple[Dict[str, Tuple[str, Tuple[int, ...], int, int]], Dict[str, str], memoryview]:
    """:func:`layout` of a whole file, and its data section (a view), which must be exactly as
    long as the offsets tile."""
    buf = memoryview(data).cast("B")
    if len(buf) < 8:
        raise SafetensorsError(f"{len(buf)} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > _MAX_HEADER or 8 + n > len(buf):
        raise SafetensorsError(f"header length {n} does not fit in a {len(buf)}-byte file")
    entries, metadata, total = layout(buf[8 : 8 + n])
    body = buf[8 + n :]
    if total != len(body):
        raise SafetensorsError(f"the tensors end at byte {total} of a {len(body)}-byte data section")
    return entries, metadata, body


def parse_raw(
    data: Buffer,
) -> Tuple[Dict[str, Tuple[str, np.ndarray]], Dict[str, str], Dict[str, memoryview]]:
    """Parses a safetensors buffer into numpy.

    Returns ``({name: (dtype_name, array)}, metadata, {name: stored bytes})``.
    The arrays are writable and hold types numpy lacks as their raw bits
    (``BF16`` as ``uint16``, ``F8_E4M3`` as ``uint8``); :func:`to_numpy` turns
    them into usable arrays. The stored bytes view ``data``.
    """
    flat = _validate(data)
    _, metadata, stored = header(data, validated=True)
    tensors: Dict[str, Tuple[str, np.ndarray]] = {}
    for name, t in flat:
        dtype = t["dtype"]
        if dtype not in DTYPES:  # header() has refused it already; kept for clarity
            raise SafetensorsError(f"tensor {name!r}: unsupported dtype {dtype!r}")
        arr = np.frombuffer(t["data"], dtype=DTYPES[dtype]).reshape(t["shape"])
        if not arr.flags.writeable:  # older safetensors hand out bytes
            arr = arr.copy()
        tensors[name] = (dtype, arr)
    return tensors, metadata, stored


def parse(data: Buffer) -> Tuple[Dict[str, Tuple[str, np.ndarray]], Dict[str, str]]:
    """:func:`parse_raw` without the stored bytes."""
    tensors, metadata, _ = parse_raw(data)
    return tensors, metadata


def parse_torch(data: Buffer) -> Tuple[Dict[str, Tuple[str, Any]], Dict[str, str], Dict[str, memoryview]]:
    """:func:`parse_raw` with torch tensors, read by ``safetensors.torch.load`` (bf16 and fp8 keep their dtype)."""
    try:
        import safetensors.torch as st_torch
    except ImportError as e:  # torch missing
        raise ImportError("torch output needs torch installed") from e
    try:
        loaded = st_torch.load(bytes(data) if isinstance(data, memoryview) else data)
    except safetensors.SafetensorError as e:
        raise SafetensorsError(str(e)) from None
    entries, metadata, stored = header(data, validated=True)
    return {k: (entries[k]["dtype"], v) for k, v in loaded.items()}, metadata, stored


def to_numpy(dtype_name: str, arr: np.ndarray, bf16: str = "auto") -> np.ndarray:
    """Turns a parsed tensor into a numpy array with a real dtype.

    ``BF16`` becomes ``ml_dtypes.bfloat16`` and ``F8_E4M3``
    ``ml_dtypes.float8_e4m3fn`` when that package is installed
    (``bf16="auto"``), otherwise float32 (exact: every value of either type is
    a float32 value). ``bf16="float32"`` always widens.
    """
    if dtype_name == "BF16":
        if bf16 == "auto" and _ml_dtypes is not None:
            return arr.view(_ml_dtypes.bfloat16)
        return bf16_bits_to_float32(arr)
    if dtype_name == "F8_E4M3":
        if bf16 == "auto" and _ml_dtypes is not None:
            return arr.view(_ml_dtypes.float8_e4m3fn)
        return f8_e4m3_bits_to_float32(arr)
    return arr


def load(data: Buffer, bf16: str = "auto") -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Parses a safetensors buffer into ``({name: numpy array}, metadata)``; bf16 and fp8 follow :func:`to_numpy`."""
    tensors, metadata = parse(data)
    return {k: to_numpy(d, a, bf16=bf16) for k, (d, a) in tensors.items()}, metadata


def load_file(path: str, bf16: str = "auto") -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """:func:`load` for a file on disk."""
    with open(path, "rb") as f:
        return load(f.read(), bf16=bf16)
