"""Writing ``torch.save`` files without torch.

:func:`save` writes a flat ``{name: tensor}`` dict in torch's zip
serialisation (the format of ``torch.save`` since torch 1.6, read by
``torch.load`` with or without ``mmap=True`` and ``weights_only=True``):

- ``<stem>/data.pkl``: a protocol-2 pickle of the dict, each tensor rebuilt by
  ``torch._utils._rebuild_tensor_v2`` from a persistent storage id
  ``("storage", torch.<Type>Storage, key, "cpu", numel)``, contiguous strides,
  offset 0, no grad;
- ``<stem>/data/<key>``: each storage's bytes, little-endian, starting on a
  64-byte boundary of the file (so ``mmap=True`` maps them aligned);
- ``<stem>/byteorder`` (``little``) and ``<stem>/version`` (``3``).

Entries are stored uncompressed, as torch writes them. The arrays handed in are
numpy arrays holding the tensor's bytes: ``uint16`` bits for bfloat16.
"""

from __future__ import annotations

import os
import struct
import zipfile
from typing import Dict, Mapping, Tuple

import numpy as np

#: torch storage class name -> numpy dtype of its bytes.
STORAGES: Dict[str, np.dtype] = {
    "BFloat16Storage": np.dtype("<u2"),
    "HalfStorage": np.dtype("<f2"),
    "FloatStorage": np.dtype("<f4"),
    "LongStorage": np.dtype("<i8"),
    "ByteStorage": np.dtype("u1"),
}

_ALIGN = 64


def _unicode(s: str) -> bytes:
    b = s.encode("utf-8")
    return b"X" + struct.pack("<I", len(b)) + b


def _int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if -(2**31) <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _tuple(items: Tuple[int, ...]) -> bytes:
    if not items:
        return b")"
    return b"(" + b"".join(_int(i) for i in items) + b"t"


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def pickle_dict(entries: Mapping[str, Tuple[str, Tuple[int, ...], int]]) -> bytes:
    """The ``data.pkl`` of a dict whose values are tensors.

    ``entries`` maps each name to ``(storage class, shape, numel)``; the
    storage keys are ``"0"``, ``"1"``, … in the mapping's order.
    """
    out = [b"\x80\x02", b"}"]
    if entries:
        out.append(b"(")
        for key, (name, (storage, shape, numel)) in enumerate(entries.items()):
            strides = []
            step = 1
            for d in reversed(shape):
                strides.append(step)
                step *= d
            out += [
                _unicode(name),
                _global("torch._utils", "_rebuild_tensor_v2"),
                b"(",
                b"(",
                _unicode("storage"),
                _global("torch", storage),
                _unicode(str(key)),
                _unicode("cpu"),
                _int(numel),
                b"t",
                b"Q",  # BINPERSID
                _int(0),
                _tuple(tuple(shape)),
                _tuple(tuple(reversed(strides))),
                b"\x89",  # False: requires_grad
                _global("collections", "OrderedDict"),
                b")",
                b"R",
                b"t",
                b"R",
            ]
        out.append(b"u")  # SETITEMS
    out.append(b".")
    return b"".join(out)


def _write_aligned(zf: zipfile.ZipFile, fp, name: str, data: bytes) -> None:
    """Adds a stored entry whose data begins on a 64-byte boundary of the file."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.create_system = 3
    start = fp.tell() + 30 + len(name.encode("utf-8"))
    pad = (-start) % _ALIGN
    if pad:
        if pad < 4:  # an extra field needs its 4-byte header
            pad += _ALIGN
        info.extra = b"FB" + struct.pack("<H", pad - 4) + b"Z" * (pad - 4)
    zf.writestr(info, data)


def save(path: "os.PathLike[str] | str", tensors: Mapping[str, Tuple[str, np.ndarray]]) -> None:
    """Writes ``{name: (storage class, array)}`` as ``torch.save`` would.

    ``storage class`` is a key of :data:`STORAGES` and the array's dtype must be
    its dtype (bfloat16 as ``uint16`` bits). The file is written to ``path``
    directly; write to a temporary name and rename for atomicity.
    """
    entries = {}
    blobs = []
    for name, (storage, arr) in tensors.items():
        want = STORAGES.get(storage)
        if want is None:
            raise ValueError(f"{name}: unknown storage {storage!r} (known: {', '.join(STORAGES)})")
        if arr.dtype != want:
            raise ValueError(f"{name}: a {storage} holds {want}, got {arr.dtype}")
        arr = np.ascontiguousarray(arr)
        entries[name] = (storage, tuple(int(d) for d in arr.shape), int(arr.size))
        blobs.append(arr)
    stem = os.path.basename(os.fspath(path)).split(".")[0] or "archive"
    with open(path, "wb") as fp:
        with zipfile.ZipFile(fp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            _write_aligned(zf, fp, f"{stem}/data.pkl", pickle_dict(entries))
            _write_aligned(zf, fp, f"{stem}/byteorder", b"little")
            for key, arr in enumerate(blobs):
                _write_aligned(zf, fp, f"{stem}/data/{key}", arr.tobytes())
            _write_aligned(zf, fp, f"{stem}/version", b"3\n")
