"""Pieces shared by the sync and async clients: request building, answer decoding, retry timing."""

from __future__ import annotations

import email.utils
import io
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import xxhash
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
    "float8_e4m3fn": "float8_e4m3fn",
    "fp8": "float8_e4m3fn",
    "f8_e4m3": "float8_e4m3fn",
}

#: The layer label of the last decoder layer's output before the final norm.
FINAL_PRENORM = "final_prenorm"

#: Checksum algorithms the client can verify.
CHECKSUM_ALGORITHMS = ("xxh64",)


class LayertapError(Exception):
    """An error answer from the server (or a failure to reach it).

    ``status`` is the HTTP status (``None`` when the server could not be
    reached), ``type`` the server's error kind (``invalid_request``,
    ``unauthorized``, ``overloaded``, ...; ``connection_error`` when
    unreachable; ``checksum_mismatch`` when an answer's bytes do not match
    the checksums in its metadata), ``message`` its explanation.
    """

    def __init__(self, status: Optional[int], type: str, message: str):
        super().__init__(f"{status} {type}: {message}" if status is not None else f"{type}: {message}")
        self.status = status
        self.type = type
        self.message = message

    def __reduce__(self) -> Any:  # picklable (e.g. across processes)
        return (LayertapError, (self.status, self.type, self.message))


class ChecksumMismatch(LayertapError):
    """Bytes that do not match their checksums: a :class:`LayertapError`
    with ``type="checksum_mismatch"``.

    It takes its message alone, so that wrappers re-raising it by type with
    one argument (as torch's DataLoader does for its workers' errors) keep
    it a ``ChecksumMismatch``.
    """

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(status, "checksum_mismatch", message)

    def __reduce__(self) -> Any:
        return (ChecksumMismatch, (self.message, self.status))


@dataclass
class Result:
    """The hidden states of one input.

    ``hidden_states`` is ``[T, len(layers), hidden]``; ``input_ids`` ``[T]``
    int64; ``loss_mask`` ``[T]`` uint8 (1 on assistant tokens of a chat).
    ``T`` is the number of rows returned: every token, or those selected with
    ``tokens=`` (possibly 0). ``layers`` are the resolved ``hidden_states``
    indices, in the order of the second axis (ints, and the string
    ``"final_prenorm"``); ``metadata`` is the answer's safetensors metadata
    (model, layers, dtype, convention, num_layers, architecture, tokens,
    checksums, ...).

    ``positions`` ``[T]`` int64 is each row's position in its input, when the
    server sent it (a ``tokens`` selection other than ``"all"``), else
    ``None``. ``hidden_states_scale`` ``[T, len(layers)]`` float32 is the
    per-row, per-layer scale of an fp8 answer returned with
    ``dequantize=False`` (``hidden_states * scale[..., None]`` restores the
    state), else ``None``. ``nonfinite`` maps layer labels (``"17"``,
    ``"final_prenorm"``) to the number of rows of the whole answer holding a
    NaN or infinity in that layer (``{}`` when none).

    With ``logprobs=``: ``topk_ids`` ``[T, k]`` int64 and ``topk_logprobs``
    ``[T, k]`` float32, the teacher's top-k next-token ids of each row and
    their log-probabilities (descending, ties by ascending id), and with
    ``target`` ``target_logprobs`` ``[T]`` float32, the log-probability of
    each row's actual next input token (NaN on the input's last token).
    Otherwise ``None``.
    """

    hidden_states: Any
    input_ids: Any
    loss_mask: Any
    layers: List[Union[int, str]]
    metadata: Dict[str, str] = field(default_factory=dict)
    request_id: Optional[str] = None
    positions: Any = None
    hidden_states_scale: Any = None
    nonfinite: Dict[str, int] = field(default_factory=dict)
    topk_ids: Any = None
    topk_logprobs: Any = None
    target_logprobs: Any = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def normalize_dtype(dtype: Any) -> Optional[str]:
    """The API name of ``dtype``: a name or alias (``"bf16"``, ``"fp8"``, ...),
    a torch dtype (``torch.float8_e4m3fn``), or a numpy / ml_dtypes dtype."""
    if dtype is None:
        return None
    if isinstance(dtype, type):  # np.float32, ml_dtypes.float8_e4m3fn, ...
        name = dtype.__name__
    else:
        name = str(dtype)
    name = name.lower()
    if name.startswith("torch."):
        name = name[len("torch.") :]
    if name not in _DTYPES:
        raise ValueError(
            f"unknown dtype {dtype!r}; use 'float32', 'bfloat16', 'float16' or 'float8_e4m3fn' (alias 'fp8')"
        )
    return _DTYPES[name]


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _flag(name: str, value: Any) -> bool:
    """A boolean option as given: ``True`` or ``False`` (numpy's bools too); anything else, a
    string such as ``"false"`` or a number included, is a TypeError naming the option, never
    judged by its truthiness."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} has type {type(value).__name__}: give True or False")


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


def normalize_layers(layers: Any) -> List[Union[int, str]]:
    """The ``layers`` list of the API: ints (``hidden_states`` indices) and
    layer labels such as ``"final_prenorm"`` (strings are sent as they are:
    the server knows which labels exist)."""
    if _is_int(layers) or isinstance(layers, str):
        layers = [layers]
    layers = _to_list(layers)
    if not isinstance(layers, (list, tuple)):
        raise TypeError('layers must be a list of ints (hidden_states indices) and/or "final_prenorm"')
    out: List[Union[int, str]] = []
    for t in layers:
        if _is_int(t):
            out.append(int(t))
        elif isinstance(t, str):
            out.append(t)
        else:
            raise TypeError(f'layers: {t!r} is neither an int (hidden_states index) nor a label like "final_prenorm"')
    return out


def normalize_tokens(tokens: Any) -> Any:
    """The ``tokens`` selection in API form, checked for its shape only (the
    server checks the values): ``"all"``, ``"assistant"``, ``{"last": k}``, or
    one list of ``[start, end)`` pairs per input."""
    if isinstance(tokens, str):
        if tokens not in ("all", "assistant"):
            raise ValueError(f'tokens={tokens!r}: use "all", "assistant", {{"last": k}} or per-input ranges')
        return tokens
    if isinstance(tokens, Mapping):
        if set(tokens) != {"last"} or not _is_int(tokens["last"]):
            raise ValueError(f'tokens={tokens!r}: a dict selection is {{"last": k}} with an int k')
        return {"last": int(tokens["last"])}
    tokens = _to_list(tokens)
    if not isinstance(tokens, (list, tuple)):
        raise TypeError(f"tokens has type {type(tokens).__name__}: give a str, {{'last': k}} or per-input ranges")
    out = []
    for i, ranges in enumerate(tokens):
        ranges = _to_list(ranges)
        if not isinstance(ranges, (list, tuple)):
            raise TypeError(f"tokens[{i}] must be a list of [start, end) pairs")
        pairs = []
        for pair in ranges:
            pair = _to_list(pair)
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(_is_int(x) for x in pair)):
                raise TypeError(f"tokens[{i}]: {pair!r} is not a [start, end) pair of ints")
            pairs.append([int(pair[0]), int(pair[1])])
        out.append(pairs)
    return out


def normalize_logprobs(logprobs: Any) -> Optional[Dict[str, Any]]:
    """``logprobs=`` in API form: an int k (``{"top_k": k}``) or a dict
    ``{"top_k": k, "target": bool}``; ``None`` for none."""
    if logprobs is None:
        return None
    if _is_int(logprobs):
        return {"top_k": int(logprobs)}
    if isinstance(logprobs, Mapping):
        unknown = set(logprobs) - {"top_k", "target"}
        if unknown or not _is_int(logprobs.get("top_k")):
            raise ValueError(f'logprobs={logprobs!r}: give an int k or {{"top_k": k, "target": bool}}')
        out: Dict[str, Any] = {"top_k": int(logprobs["top_k"])}
        if _flag('logprobs["target"]', logprobs.get("target", False)):
            out["target"] = True
        return out
    raise TypeError(f'logprobs has type {type(logprobs).__name__}: give an int k or {{"top_k": k, "target": bool}}')


def hidden_states_body(
    inputs: Any,
    layers: Any,
    dtype: Any,
    split_special_tokens: bool = False,
    tokens: Any = None,
    allow_nonfinite: bool = False,
    logprobs: Any = None,
) -> Dict[str, Any]:
    body: Dict[str, Any] = {"inputs": normalize_inputs(inputs), "layers": normalize_layers(layers)}
    d = normalize_dtype(dtype)
    if d is not None:
        body["dtype"] = d
    if _flag("split_special_tokens", split_special_tokens):
        body["split_special_tokens"] = True
    if tokens is not None:
        body["tokens"] = normalize_tokens(tokens)
    if _flag("allow_nonfinite", allow_nonfinite):
        body["allow_nonfinite"] = True
    lp = normalize_logprobs(logprobs)
    if lp is not None:
        body["logprobs"] = lp
    return body


def tokenize_body(inputs: Any, split_special_tokens: bool = False) -> Dict[str, Any]:
    body: Dict[str, Any] = {"inputs": normalize_inputs(inputs)}
    if _flag("split_special_tokens", split_special_tokens):
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
    # layertap's frames record the file's size: then one call decompresses into
    # an output allocated once (about a fifth faster on large answers).
    try:
        if zstandard.frame_content_size(data) >= 0:
            return dctx.decompress(data, allow_extra_data=False)
    except (TypeError, zstandard.ZstdError):
        pass  # an older zstandard, or more than one frame: read them as a stream
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


def verify_checksums(
    raw: Mapping[str, Any], metadata: Mapping[str, str], status: Optional[int] = None, what: str = "the answer"
) -> bool:
    """Checks every tensor's stored bytes against the metadata's checksums.

    ``raw`` maps each tensor name to its bytes as stored (see
    :func:`layertap_client._safetensors.parse_raw`). Without
    ``checksum_algorithm`` and ``checksums`` in the metadata there is nothing
    to check and the answer is ``False``; otherwise ``True`` once every tensor
    matched. A mismatch, a tensor without a checksum, a checksum naming a
    tensor that is not there, or an algorithm other than xxh64 raises
    :class:`LayertapError` (``type="checksum_mismatch"``, ``status`` as given).
    """
    if listed_checksums(metadata, status, what) is None:
        return False
    return verify_digests({name: xxhash.xxh64(b).hexdigest() for name, b in raw.items()}, metadata, status, what)


def listed_checksums(metadata: Mapping[str, str], status: Optional[int] = None, what: str = "the answer") -> Optional[Dict[str, str]]:
    """The metadata's checksums (``{tensor: xxh64 hex}``), ``None`` when it has none; raises
    :class:`LayertapError` (``checksum_mismatch``) when they are malformed or of another algorithm."""
    algorithm = metadata.get("checksum_algorithm")
    listed = metadata.get("checksums")
    if algorithm is None and listed is None:
        return None

    def fail(message: str) -> LayertapError:
        return ChecksumMismatch(f"{what}: {message}", status)

    if algorithm not in CHECKSUM_ALGORITHMS:
        raise fail(f"unknown checksum_algorithm {algorithm!r} (this client verifies {', '.join(CHECKSUM_ALGORITHMS)})")
    if listed is None:
        raise fail(f"checksum_algorithm is {algorithm!r} but the metadata has no checksums")
    try:
        sums = json.loads(listed)
    except ValueError as e:
        raise fail(f"the checksums metadata is not JSON: {e}") from None
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise fail(f"the checksums metadata is not an object of strings: {listed[:200]!r}")
    return sums


def verify_digests(
    digests: Mapping[str, str], metadata: Mapping[str, str], status: Optional[int] = None, what: str = "the answer"
) -> bool:
    """:func:`verify_checksums` for digests already computed (``{tensor: xxh64 hex}``, e.g.
    while the bytes streamed past): ``False`` when the metadata has no checksums, ``True``
    when every tensor matched; raises as :func:`verify_checksums` does."""
    sums = listed_checksums(metadata, status, what)
    if sums is None:
        return False
    algorithm = metadata.get("checksum_algorithm")

    def fail(message: str) -> LayertapError:
        return ChecksumMismatch(f"{what}: {message}", status)

    for name in sorted(digests):
        if name not in sums:
            raise fail(f"tensor {name!r} has no entry in checksums")
        got = digests[name]
        if got != sums[name]:
            raise fail(f"tensor {name!r}: checksums says {sums[name]}, its bytes hash to {got} ({algorithm})")
    extra = sorted(set(sums) - set(digests))
    if extra:
        raise fail(f"checksums names tensors that are not in it: {extra}")
    return True


def verify_file(path: Any, require: bool = True) -> Dict[str, str]:
    """Verifies a safetensors file written by ``layertap bulk`` (or a saved
    answer) against the checksums in its metadata; returns the metadata.

    Raises :class:`LayertapError` (``type="checksum_mismatch"``,
    ``status=None``) on any mismatch, a tensor without a checksum, or an
    unknown algorithm; with ``require=True`` (the default) also when the file
    has no checksums at all. A malformed file raises ``SafetensorsError``.
    """
    with open(path, "rb") as f:
        data = decompress(f.read())
    _, metadata, raw = _safetensors.header(data)
    if not verify_checksums(raw, metadata, status=None, what=str(path)) and require:
        raise ChecksumMismatch(f"{path}: no checksum_algorithm/checksums in the metadata")
    return metadata


def _parse_layers(text: str) -> List[Union[int, str]]:
    out: List[Union[int, str]] = []
    for x in json.loads(text):
        if isinstance(x, str):
            out.append(x)
        else:
            out.append(int(x))
    return out


def decode(
    raw: Any,
    as_torch: bool = False,
    bf16: str = "auto",
    dequantize: bool = True,
    verify: bool = True,
    status: Optional[int] = 200,
    what: str = "the answer",
) -> Tuple[Dict[str, Any], Dict[str, str], str]:
    """Reads a safetensors file layertap wrote (an answer, or a file of
    ``layertap bulk``): ``({name: array or tensor}, metadata, hidden_states dtype)``.

    Torch tensors come from ``safetensors.torch.load``; numpy arrays from
    ``safetensors.deserialize``, bf16 and fp8 turned into numpy arrays as
    :func:`layertap_client._safetensors.to_numpy` says. With ``verify`` the
    tensors' checksums (when the metadata has them) are checked first. An fp8
    ``hidden_states`` becomes float32 times its scale with ``dequantize=True``
    (``hidden_states_scale`` is then dropped); otherwise it stays fp8
    (``ml_dtypes.float8_e4m3fn``, uint8 bits without ml_dtypes;
    ``torch.float8_e4m3fn``) beside its scale.
    """
    if as_torch:
        tensors, metadata, stored = _safetensors.parse_torch(raw)
    else:
        tensors, metadata, stored = _safetensors.parse_raw(raw)
    if verify:
        verify_checksums(stored, metadata, status=status, what=what)
    hs_dtype = tensors["hidden_states"][0] if "hidden_states" in tensors else ""
    out: Dict[str, Any] = {}
    for name, (dtype, arr) in tensors.items():
        if name == "hidden_states" and dtype == "F8_E4M3":
            if "hidden_states_scale" not in tensors:
                raise LayertapError(status, "bad_answer", f"{what}: F8_E4M3 hidden_states without 'hidden_states_scale'")
            scale_dtype, scale = tensors["hidden_states_scale"]
            if scale_dtype != "F32" or tuple(scale.shape) != tuple(arr.shape[:2]):
                raise LayertapError(
                    status,
                    "bad_answer",
                    f"{what}: hidden_states_scale is {scale_dtype} {tuple(scale.shape)}, "
                    f"expected F32 {tuple(arr.shape[:2])}",
                )
            if dequantize and as_torch:
                out[name] = arr.to(scale.dtype) * scale[..., None]
            elif dequantize:
                values = _safetensors.f8_e4m3_bits_to_float32(arr)
                values *= scale[..., None]
                out[name] = values
            elif as_torch or _safetensors._ml_dtypes is not None:
                out[name] = _safetensors.to_numpy(dtype, arr) if not as_torch else arr
            else:
                out[name] = arr  # the raw bits, uint8
        elif as_torch:
            out[name] = arr
        else:
            out[name] = _safetensors.to_numpy(dtype, arr, bf16=bf16)
    if hs_dtype == "F8_E4M3" and dequantize:
        out.pop("hidden_states_scale", None)
    return out, metadata, hs_dtype


def parse_hidden_states(
    body: bytes,
    as_torch: bool = False,
    request_id: Optional[str] = None,
    bf16: str = "auto",
    dequantize: bool = True,
    status: Optional[int] = 200,
) -> List[Result]:
    """Splits a /v1/hidden-states answer (possibly zstd-compressed) into one Result per input.

    The tensors' checksums (when the metadata has them) are verified first.
    An fp8 answer becomes float32 times its scale with ``dequantize=True``;
    with ``dequantize=False`` it stays fp8 (``ml_dtypes.float8_e4m3fn``, or
    its uint8 bits without ml_dtypes; ``torch.float8_e4m3fn``) and each
    Result carries its ``hidden_states_scale``.
    """
    raw = decompress(body)

    def bad(message: str) -> LayertapError:
        return LayertapError(status, "bad_answer", message)

    if as_torch:
        try:
            import torch  # noqa: F401
        except ImportError as e:
            raise ImportError("as_torch=True needs torch installed") from e
    t, metadata, _ = decode(raw, as_torch=as_torch, bf16=bf16, dequantize=dequantize, status=status)
    for k in ("hidden_states", "input_ids", "cu_seqlens", "loss_mask"):
        if k not in t:
            raise bad(f"the answer has no {k!r} tensor")
    hs, ids, cu, mask = t["hidden_states"], t["input_ids"], t["cu_seqlens"], t["loss_mask"]
    if hs.ndim != 3 or ids.ndim != 1 or hs.shape[0] != ids.shape[0] or tuple(mask.shape) != tuple(ids.shape):
        raise bad(f"inconsistent shapes {tuple(hs.shape)}, {tuple(ids.shape)}, {tuple(mask.shape)}")
    bounds = [int(c) for c in cu.tolist()] if cu.ndim == 1 else []
    if not bounds or bounds[0] != 0 or bounds[-1] != ids.shape[0] or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise bad(f"bad cu_seqlens {cu.tolist()}")
    positions = t.get("positions")
    if positions is not None and tuple(positions.shape) != tuple(ids.shape):
        raise bad(f"positions has shape {tuple(positions.shape)}, input_ids {tuple(ids.shape)}")
    scale = t.get("hidden_states_scale")
    topk_ids, topk_lp, target = t.get("topk_ids"), t.get("topk_logprobs"), t.get("target_logprobs")
    for name, arr, rank in (("topk_ids", topk_ids, 2), ("topk_logprobs", topk_lp, 2), ("target_logprobs", target, 1)):
        if arr is not None and (arr.ndim != rank or arr.shape[0] != ids.shape[0]):
            raise bad(f"{name} has shape {tuple(arr.shape)} for {ids.shape[0]} rows")
    try:
        layers = _parse_layers(metadata.get("layers", "[]"))
    except (ValueError, TypeError):
        layers = []
    try:
        nonfinite = {str(k): int(v) for k, v in json.loads(metadata.get("nonfinite", "{}")).items()}
    except (ValueError, TypeError, AttributeError):
        raise bad(f"the nonfinite metadata is not an object of counts: {metadata.get('nonfinite')!r}") from None

    out = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        out.append(
            Result(
                hidden_states=hs[s:e],
                input_ids=ids[s:e],
                loss_mask=mask[s:e],
                layers=list(layers),
                metadata=dict(metadata),
                request_id=request_id,
                positions=positions[s:e] if positions is not None else None,
                hidden_states_scale=scale[s:e] if scale is not None else None,
                nonfinite=dict(nonfinite),
                topk_ids=topk_ids[s:e] if topk_ids is not None else None,
                topk_logprobs=topk_lp[s:e] if topk_lp is not None else None,
                target_logprobs=target[s:e] if target is not None else None,
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
