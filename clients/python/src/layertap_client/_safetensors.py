"""A strict safetensors reader built on numpy alone.

Format: an unsigned little-endian 64-bit header length ``N``, ``N`` bytes of
UTF-8 JSON (``{name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}``), then the data section; offsets are relative to
the start of the data section and the tensors must tile it exactly.

:func:`parse` returns each tensor's safetensors dtype name and a numpy array
that views the buffer. Types that numpy lacks are returned as their raw bits
(``BF16`` as ``uint16``, ``F8_*`` as ``uint8``); :func:`to_numpy` and
:func:`to_torch` turn those into usable arrays / tensors. :func:`parse_raw`
also returns each tensor's bytes exactly as stored (for checksums).
"""

from __future__ import annotations

import json
import struct
from typing import Any, Dict, Tuple, Union

import numpy as np

try:  # optional: a real bfloat16 dtype for numpy
    import ml_dtypes as _ml_dtypes  # type: ignore
except Exception:  # pragma: no cover - depends on the environment
    _ml_dtypes = None

__all__ = [
    "SafetensorsError",
    "parse",
    "parse_raw",
    "load",
    "load_file",
    "to_numpy",
    "to_torch",
    "has_numpy_bfloat16",
    "F8_E4M3_TO_FLOAT32",
    "f8_e4m3_bits_to_float32",
]

# safetensors dtype -> numpy dtype holding the same bytes (little-endian).
_STORAGE = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # raw bits
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype("u1"),  # raw bits
    "F8_E5M2": np.dtype("u1"),  # raw bits
}

# Sanity bound on the JSON header (the reference implementation uses 100 MB).
_MAX_HEADER = 100_000_000


class SafetensorsError(ValueError):
    """The bytes are not a well-formed safetensors file."""


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


def has_numpy_bfloat16() -> bool:
    """True when ``ml_dtypes`` is installed, so numpy output can stay bfloat16."""
    return _ml_dtypes is not None


def parse(data: Union[bytes, bytearray, memoryview]) -> Tuple[Dict[str, Tuple[str, np.ndarray]], Dict[str, str]]:
    """Parses a safetensors buffer.

    Returns ``({name: (dtype_name, array)}, metadata)``. The arrays view
    ``data`` (no copy); pass a ``bytearray`` to get writable arrays.
    """
    tensors, metadata, _ = parse_raw(data)
    return tensors, metadata


def parse_raw(
    data: Union[bytes, bytearray, memoryview],
) -> Tuple[Dict[str, Tuple[str, np.ndarray]], Dict[str, str], Dict[str, memoryview]]:
    """:func:`parse`, plus ``{name: memoryview}`` of each tensor's bytes as stored in the file."""
    buf = memoryview(data).cast("B")
    if len(buf) < 8:
        raise SafetensorsError(f"{len(buf)} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > _MAX_HEADER or 8 + n > len(buf):
        raise SafetensorsError(f"header length {n} does not fit in a {len(buf)}-byte file")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise SafetensorsError(f"the header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("the header is not a JSON object")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SafetensorsError("__metadata__ must map strings to strings")

    body = buf[8 + n :]
    spans = []
    tensors: Dict[str, Tuple[str, np.ndarray]] = {}
    raw: Dict[str, memoryview] = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            raise SafetensorsError(f"tensor {name!r}: entry is not an object")
        dtype_name = info.get("dtype")
        shape = info.get("shape")
        offsets = info.get("data_offsets")
        if dtype_name not in _STORAGE:
            raise SafetensorsError(f"tensor {name!r}: unsupported dtype {dtype_name!r}")
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            raise SafetensorsError(f"tensor {name!r}: bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
            raise SafetensorsError(f"tensor {name!r}: bad data_offsets {offsets!r}")
        begin, end = offsets
        storage = _STORAGE[dtype_name]
        count = 1
        for d in shape:
            count *= d
        if end < begin or end > len(body):
            raise SafetensorsError(f"tensor {name!r}: data_offsets {offsets} outside the {len(body)}-byte data")
        if end - begin != count * storage.itemsize:
            raise SafetensorsError(
                f"tensor {name!r}: {end - begin} bytes for shape {shape} of {dtype_name} "
                f"(expected {count * storage.itemsize})"
            )
        arr = np.frombuffer(body, dtype=storage, count=count, offset=begin).reshape(shape)
        if not arr.flags.aligned:
            arr = arr.copy()
        tensors[name] = (dtype_name, arr)
        raw[name] = body[begin:end]
        spans.append((begin, end, name))

    # The tensors must cover the data section exactly: no holes, no overlaps.
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            raise SafetensorsError(f"tensor {name!r} starts at {begin}, expected {pos} (hole or overlap)")
        pos = end
    if pos != len(body):
        raise SafetensorsError(f"{len(body) - pos} trailing bytes after the last tensor")
    return tensors, metadata, raw


def _is_uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact widening of raw bfloat16 bits (uint16) to float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_numpy(dtype_name: str, arr: np.ndarray, bf16: str = "auto") -> np.ndarray:
    """Turns a parsed tensor into a numpy array with a real dtype.

    ``BF16`` becomes ``ml_dtypes.bfloat16`` and ``F8_E4M3``
    ``ml_dtypes.float8_e4m3fn`` when that package is installed
    (``bf16="auto"``), otherwise float32 (exact: every value of either type is
    a float32 value). ``bf16="float32"`` always widens. ``F8_E5M2`` needs
    ``ml_dtypes``.
    """
    if dtype_name == "BF16":
        if bf16 == "auto" and _ml_dtypes is not None:
            return arr.view(_ml_dtypes.bfloat16)
        return bf16_bits_to_float32(arr)
    if dtype_name == "F8_E4M3":
        if bf16 == "auto" and _ml_dtypes is not None:
            return arr.view(_ml_dtypes.float8_e4m3fn)
        return f8_e4m3_bits_to_float32(arr)
    if dtype_name == "F8_E5M2":
        if _ml_dtypes is None:
            raise SafetensorsError(f"{dtype_name} needs the ml_dtypes package")
        return arr.view(_ml_dtypes.float8_e5m2)
    return arr


def to_torch(dtype_name: str, arr: np.ndarray) -> Any:
    """Turns a parsed tensor into a torch tensor sharing its memory (bf16 stays bf16)."""
    import torch

    if not arr.dtype.isnative:  # big-endian host: safetensors bytes are little-endian
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if dtype_name == "BF16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    if dtype_name == "F8_E4M3":
        return torch.from_numpy(arr.view(np.int8)).view(torch.float8_e4m3fn)
    if dtype_name == "F8_E5M2":
        return torch.from_numpy(arr.view(np.int8)).view(torch.float8_e5m2)
    return torch.from_numpy(arr)


def load(data: Union[bytes, bytearray, memoryview], bf16: str = "auto") -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Parses a safetensors buffer into ``({name: numpy array}, metadata)``.

    bfloat16 tensors follow :func:`to_numpy`'s rule.
    """
    tensors, metadata = parse(data)
    return {k: to_numpy(d, a, bf16=bf16) for k, (d, a) in tensors.items()}, metadata


def load_file(path: str, bf16: str = "auto") -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """:func:`load` for a file on disk."""
    with open(path, "rb") as f:
        return load(bytearray(f.read()), bf16=bf16)
