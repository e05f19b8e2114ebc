"""Pieces shared by the sync and async clients: request building, answer decoding, retry timing."""

from __future__ import annotations

import email.utils
import io
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np
import zstandard

from . import _safetensors

# What one input may look like (see normalize_inputs).
InputLike = Union[str, Sequence[int], Sequence[Mapping[str, Any]], Mapping[str, Any], Any]

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

RETRY_STATUSES = (429, 503)

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
}


class LayertapError(Exception):
    """An error answer from the server (or a failure to reach it).

    ``status`` is the HTTP status (``None`` when the server could not be
    reached), ``type`` the server's error kind (``invalid_request``,
    ``unauthorized``, ``overloaded``, ...; ``connection_error`` when
    unreachable), ``message`` its explanation.
    """

    def __init__(self, status: Optional[int], type: str, message: str):
        super().__init__(f"{status} {type}: {message}" if status is not None else f"{type}: {message}")
        self.status = status
        self.type = type
        self.message = message


@dataclass
class Result:
    """The hidden states of one input.

    ``hidden_states`` is ``[T, len(layers), hidden]``; ``input_ids`` ``[T]``
    int64; ``loss_mask`` ``[T]`` uint8 (1 on assistant tokens of a chat).
    ``layers`` are the resolved ``hidden_states`` indices, in the order of the
    second axis; ``metadata`` is the answer's safetensors metadata (model,
    layers, dtype, convention, num_layers, architecture).
    """

    hidden_states: Any
    input_ids: Any
    loss_mask: Any
    layers: List[int]
    metadata: Dict[str, str] = field(default_factory=dict)
    request_id: Optional[str] = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def normalize_dtype(dtype: Optional[str]) -> Optional[str]:
    if dtype is None:
        return None
    name = str(dtype).lower()
    if name.startswith("torch."):
        name = name[len("torch.") :]
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use 'float32', 'bfloat16' or 'float16'")
    return _DTYPES[name]


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _to_list(x: Any) -> Any:
    """numpy arrays / torch tensors to plain lists; everything else as is."""
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes, list, tuple)):
        return x.tolist()
    return x


def normalize_input(i: int, x: Any) -> Dict[str, Any]:
    """One input in API form: ``{"input_ids"|"text"|"messages": ...}``.

    Accepts the API's dict form, a ``str`` (text), a sequence of ints / a 1-D
    integer array or tensor (input_ids), or a list of ``{"role", "content"}``
    dicts (messages).
    """
    if isinstance(x, str):
        return {"text": x}
    if isinstance(x, Mapping):
        keys = [k for k in ("input_ids", "text", "messages") if k in x]
        if len(keys) != 1:
            hint = " (a single chat message? wrap the conversation in a list)" if "role" in x else ""
            raise ValueError(f"inputs[{i}] must have exactly one of input_ids, text or messages{hint}")
        out = dict(x)
        if "input_ids" in out:
            out["input_ids"] = [int(t) for t in _to_list(out["input_ids"])]
        return out
    x = _to_list(x)
    if isinstance(x, (list, tuple)):
        if len(x) == 0:
            raise ValueError(f"inputs[{i}] is empty")
        if all(_is_int(t) for t in x):
            return {"input_ids": [int(t) for t in x]}
        if all(isinstance(m, Mapping) and "role" in m and "content" in m for m in x):
            return {"messages": [dict(m) for m in x]}
    raise TypeError(
        f"inputs[{i}] has type {type(x).__name__}: give a str, a list of token ids, "
        "a list of {'role', 'content'} messages, or a dict with input_ids/text/messages"
    )


def normalize_inputs(inputs: Any) -> List[Dict[str, Any]]:
    """The list of inputs in API form. A lone str or dict counts as one input."""
    if isinstance(inputs, (str, Mapping)):
        inputs = [inputs]
    inputs = _to_list(inputs)
    if not isinstance(inputs, (list, tuple)):
        raise TypeError("inputs must be a list of inputs")
    if len(inputs) == 0:
        raise ValueError("inputs is empty: give at least one input")
    if all(_is_int(t) for t in inputs):
        raise TypeError("inputs is a flat list of token ids; wrap it in a list for one sequence: [[1, 2, 3]]")
    return [normalize_input(i, x) for i, x in enumerate(inputs)]


def normalize_layers(layers: Any) -> List[int]:
    if _is_int(layers):
        return [int(layers)]
    layers = _to_list(layers)
    if not isinstance(layers, (list, tuple)) or not all(_is_int(t) for t in layers):
        raise TypeError("layers must be a list of ints (hidden_states indices)")
    return [int(t) for t in layers]


def hidden_states_body(
    inputs: Any, layers: Any, dtype: Optional[str], split_special_tokens: bool = False
) -> Dict[str, Any]:
    body: Dict[str, Any] = {"inputs": normalize_inputs(inputs), "layers": normalize_layers(layers)}
    d = normalize_dtype(dtype)
    if d is not None:
        body["dtype"] = d
    if split_special_tokens:
        body["split_special_tokens"] = True
    return body


def tokenize_body(inputs: Any, split_special_tokens: bool = False) -> Dict[str, Any]:
    body: Dict[str, Any] = {"inputs": normalize_inputs(inputs)}
    if split_special_tokens:
        body["split_special_tokens"] = True
    return body


def decompress(data: bytes) -> bytes:
    """The body as safetensors bytes: zstd frames are detected by their magic
    number and decompressed; anything else (already decoded by the HTTP
    library, or sent plain) is returned as is. A safetensors file cannot start
    with the zstd magic (that would be a header over 4 GB)."""
    if data[:4] != ZSTD_MAGIC:
        return data
    dctx = zstandard.ZstdDecompressor()
    # stream_reader copes with frames that do not record their content size,
    # and with several concatenated frames.
    with dctx.stream_reader(io.BytesIO(data), read_across_frames=True) as r:
        return r.read()


def error_from_response(status: int, body: bytes) -> LayertapError:
    try:
        j = json.loads(body.decode("utf-8"))
        if isinstance(j, dict) and "error" in j:
            return LayertapError(status, str(j.get("type", "error")), str(j["error"]))
    except (UnicodeDecodeError, ValueError):
        pass
    text = body[:1000].decode("utf-8", "replace").strip()
    return LayertapError(status, "http_error", text or f"HTTP {status}")


def parse_hidden_states(
    body: bytes, as_torch: bool = False, request_id: Optional[str] = None, bf16: str = "auto"
) -> List[Result]:
    """Splits a /v1/hidden-states answer (possibly zstd-compressed) into one Result per input."""
    raw = decompress(body)
    # A bytearray makes the arrays writable (and torch.from_numpy warning-free).
    tensors, metadata = _safetensors.parse(bytearray(raw))
    for k in ("hidden_states", "input_ids", "cu_seqlens", "loss_mask"):
        if k not in tensors:
            raise LayertapError(200, "bad_answer", f"the answer has no {k!r} tensor")
    hs_dtype, hs = tensors["hidden_states"]
    _, ids = tensors["input_ids"]
    _, cu = tensors["cu_seqlens"]
    _, mask = tensors["loss_mask"]
    if hs.ndim != 3 or ids.ndim != 1 or hs.shape[0] != ids.shape[0] or mask.shape != ids.shape:
        raise LayertapError(200, "bad_answer", f"inconsistent shapes {hs.shape}, {ids.shape}, {mask.shape}")
    if cu.ndim != 1 or cu.shape[0] < 1 or cu[0] != 0 or cu[-1] != ids.shape[0] or np.any(np.diff(cu) < 0):
        raise LayertapError(200, "bad_answer", f"bad cu_seqlens {cu.tolist()}")
    try:
        layers = [int(x) for x in json.loads(metadata.get("layers", "[]"))]
    except (ValueError, TypeError):
        layers = []

    if as_torch:
        try:
            import torch  # noqa: F401
        except ImportError as e:
            raise ImportError("as_torch=True needs torch installed") from e
        hs_t = _safetensors.to_torch(hs_dtype, hs)
        ids_t = _safetensors.to_torch("I64", ids)
        mask_t = _safetensors.to_torch("U8", mask)
    else:
        hs_t = _safetensors.to_numpy(hs_dtype, hs, bf16=bf16)
        ids_t, mask_t = ids, mask

    out = []
    bounds = [int(c) for c in cu]
    for s, e in zip(bounds[:-1], bounds[1:]):
        out.append(
            Result(
                hidden_states=hs_t[s:e],
                input_ids=ids_t[s:e],
                loss_mask=mask_t[s:e],
                layers=list(layers),
                metadata=dict(metadata),
                request_id=request_id,
            )
        )
    return out


def retry_delay(attempt: int, retry_after: Optional[str], backoff: float, max_backoff: float) -> float:
    """Seconds to wait before retry number ``attempt`` (0-based).

    A ``Retry-After`` header (seconds or an HTTP date) is honoured as the
    minimum wait, capped at ``max_backoff``; otherwise exponential backoff
    with jitter.
    """
    if retry_after:
        secs: Optional[float] = None
        try:
            secs = float(retry_after.strip())
        except ValueError:
            try:
                dt = email.utils.parsedate_to_datetime(retry_after)
                secs = dt.timestamp() - time.time()
            except (TypeError, ValueError, IndexError):
                secs = None
        if secs is not None:
            secs = min(max(secs, 0.0), max_backoff)
            return secs + random.uniform(0, 0.1 * max(secs, 0.1))
    base = min(max_backoff, backoff * (2**attempt))
    return base * random.uniform(0.5, 1.0)
