"""SpecForge fed by layertap, in its online modes.

**SpecForge 0.2 (its main branch since 2026-07).** The online producer's ``RolloutWorker``
leases prompt tasks and asks its feature source for their features
(``generate_features(tasks, *, capture)``), checks them against the run's
``CaptureConfig`` and puts them in the feature store the trainer reads.
:class:`LayertapFeatureSource` is such a source: it asks layertap for the capture layers of
the ``CaptureConfig`` (SpecForge's ``aux_hidden_state_layer_ids`` count decoder layers from
0: layer ``t`` is layertap's index ``t + 1``) and, where the algorithm's layout has a final
state (EAGLE-3's ``target``), index ``L``: the final state after the norm, as SpecForge's
SGLang capture returns it. The features are :func:`layertap_client.layouts.specforge_features`
of the answer with the algorithm's server layout; token ids and loss mask come from the task.

**SpecForge's scripts before 2026-07** (``scripts/train_eagle3.py``, ``train_dflash.py``)
call a target model each step: ``generate_eagle3_data(input_ids, attention_mask, loss_mask)``
and ``generate_dflash_data(...)``. :class:`LayertapEagle3TargetModel` and
:class:`LayertapDFlashTargetModel` implement them over layertap; the EAGLE-3 target (the
next token's logits) comes from the final state through the target's output head, loaded
on the trainer (:meth:`LayertapEagle3TargetModel.from_pretrained`). Their :meth:`prefetch`
wraps the trainer's DataLoader and asks for the next batches while the current one trains.

Importing this module needs torch; SpecForge itself is imported only where its classes are
used (the output dataclasses, its algorithm registry, its ``TargetHead``).
"""

from __future__ import annotations

import collections
import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .. import layouts
from .._common import Result, normalize_dtype
from ._servers import Servers

__all__ = [
    "LayertapFeatureSource",
    "LayertapEagle3TargetModel",
    "LayertapDFlashTargetModel",
    "Eagle3TargetOutput",
    "DFlashTargetOutput",
    "server_layout",
]

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _as_layertap_layers(layer_ids: Sequence[int]) -> List[int]:
    """SpecForge's capture layer ids (decoder layers from 0, as SGLang captures their outputs)
    as layertap's ``hidden_states`` indices: ``t + 1``."""
    return [int(t) + 1 for t in layer_ids]


# -- SpecForge 0.2: the online rollout's feature source ------------------------------------------


@dataclass(frozen=True)
class _Layout:
    aux_feature: Optional[str]
    last_hidden_feature: Optional[str]
    passthrough: Tuple[Tuple[str, str, Tuple[int, ...]], ...]
    attention_mask_feature: Optional[str]


def _layout(layout: Any) -> _Layout:
    """SpecForge's ``ServerCaptureLayout`` / ``ServerCaptureSchema`` (or anything with their
    four attributes) as a plain record."""
    passthrough = []
    for entry in layout.passthrough:
        trailing = tuple(int(d) for d in entry[2]) if len(entry) > 2 else ()
        passthrough.append((str(entry[0]), str(entry[1]), trailing))
    return _Layout(
        layout.aux_feature, layout.last_hidden_feature, tuple(passthrough), getattr(layout, "attention_mask_feature", None)
    )


def server_layout(algorithm: str = "eagle3", modality: str = "text") -> Any:
    """SpecForge's own server-capture layout of ``algorithm`` (its feature names), from its
    built-in algorithm registry."""
    from specforge.algorithms.builtin import builtin_algorithm_registry

    return builtin_algorithm_registry().resolve(algorithm).providers.server_streaming_for(modality).layout


class LayertapFeatureSource:
    """A SpecForge ``FeatureSource`` (``specforge.inference.rollout_worker``) over layertap.

    ``servers``: one URL or several (a list, or comma-separated); each call's tasks go out in
    requests of about ``request_tokens`` tokens, ``max_requests`` at a time, each to the
    server with the fewest requests in flight, and a failed request to another (see
    :class:`layertap_client.trainers.Servers`). ``layout``: the algorithm's server-capture
    layout (``server_layout("eagle3")``, ``"dflash"``, ...); by default it is read from
    SpecForge's registry for ``algorithm``. ``dtype``: of the states (``bfloat16``, as
    SpecForge's capture returns them, ``float16`` or ``float32``; ``fp8`` is dequantised to
    ``bfloat16``).

    Each feature dict also carries ``__aux_layer_ids__``: the capture layers layertap's answer
    says it holds, which the worker checks against the ``CaptureConfig``.
    """

    def __init__(
        self,
        servers: Union[str, Sequence[str]],
        *,
        algorithm: str = "eagle3",
        layout: Any = None,
        modality: str = "text",
        dtype: str = "bfloat16",
        api_key: Optional[str] = None,
        timeout: float = 600.0,
        retries: int = 8,
        request_tokens: int = 8192,
        max_requests: int = 4,
    ):
        self.servers = Servers(servers, api_key=api_key, timeout=timeout, retries=retries)
        self.algorithm = algorithm
        self.layout = _layout(layout if layout is not None else server_layout(algorithm, modality))
        self.dtype = normalize_dtype(dtype)
        self.request_tokens = int(request_tokens)
        self.max_requests = int(max_requests)
        self._healthy = True
        self._last_error = ""

    def layers(self, capture: Any) -> List[int]:
        """What to ask layertap for under ``capture``: its capture layers, then index L (-1)
        where the layout has a final state."""
        layers = _as_layertap_layers(capture.aux_hidden_state_layer_ids)
        if self.layout.last_hidden_feature is not None:
            if getattr(capture, "target_repr", "hidden_state") not in (None, "hidden_state"):
                raise ValueError(
                    f"target_repr={capture.target_repr!r}: layertap sends the final hidden state "
                    "(target_repr='hidden_state'); the trainer applies the output head"
                )
            layers.append(-1)
        return layers

    def generate_features(self, tasks: List[Any], *, capture: Any) -> List[Dict[str, Any]]:
        """One feature dict per task, in the tasks' order."""
        layers = self.layers(capture)
        inputs = [{"input_ids": [int(t) for t in task.payload["input_ids"]]} for task in tasks]
        try:
            results = self.servers.hidden_states_split(
                inputs, layers, request_tokens=self.request_tokens, max_requests=self.max_requests,
                dtype=self.dtype, as_torch=True,
            )
        except Exception as e:
            self._healthy, self._last_error = False, str(e)
            raise
        self._healthy = True
        n_aux = len(capture.aux_hidden_state_layer_ids)
        out = []
        for task, r in zip(tasks, results):
            sample: Dict[str, Any] = {"hidden_states": r.hidden_states, "input_ids": r.input_ids}
            if r.hidden_states.dtype == torch.float32 and self.dtype == "float8_e4m3fn":
                sample["hidden_states"] = r.hidden_states.to(torch.bfloat16)
            n = len(task.payload["input_ids"])
            for _, key, _ in self.layout.passthrough:
                if key == "input_ids":
                    continue
                if key not in task.payload:
                    raise ValueError(f"task {task.task_id}: required capture payload {key!r} is missing")
                value = torch.as_tensor(task.payload[key], dtype=torch.int64)
                if value.shape[0] != n:
                    raise ValueError(f"task {task.task_id}: payload {key!r} length {value.shape[0]} != input_ids length {n}")
                sample[key] = value
            if "loss_mask" not in sample:
                sample["loss_mask"] = r.loss_mask
            feats = layouts.specforge_features(
                sample,
                self.layout.aux_feature,
                self.layout.last_hidden_feature,
                passthrough=[(f, k) for f, k, _ in self.layout.passthrough],
                attention_mask_feature=self.layout.attention_mask_feature,
            )
            for feature, _, trailing in self.layout.passthrough:
                if trailing:
                    feats[feature] = feats[feature].reshape(1, n, *trailing)
            feats["__aux_layer_ids__"] = tuple(int(x) - 1 for x in r.layers[:n_aux])
            out.append(feats)
        return out

    def health(self) -> Dict[str, Any]:
        return {
            "healthy": self._healthy,
            "backend": "layertap",
            "servers": list(self.servers.urls),
            "strategy": self.algorithm,
            "last_error": self._last_error,
        }


# -- SpecForge before 2026-07: the target model the training scripts call ------------------------


@dataclass
class Eagle3TargetOutput:
    """The fields of SpecForge's ``Eagle3TargetOutput`` (used where SpecForge's own class cannot
    be imported)."""

    hidden_states: torch.Tensor
    target: torch.Tensor
    loss_mask: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    last_hidden_states: Optional[torch.Tensor] = None


@dataclass
class DFlashTargetOutput:
    """The fields of SpecForge's ``DFlashTargetOutput``."""

    hidden_states: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor


@functools.lru_cache(maxsize=None)
def _output_class(module: str, name: str, fallback: type) -> type:
    try:
        mod = __import__(module, fromlist=[name])
        return getattr(mod, name)
    except Exception:  # noqa: BLE001 - not installed, or its optional backends missing
        return fallback


def _shift_left(x: torch.Tensor) -> torch.Tensor:
    """SpecForge's ``padding(x, left=False)``: every position takes the next one's value, the
    last becomes zero."""
    return torch.cat((x[:, 1:], torch.zeros_like(x[:, -1:])), dim=1)


def _batch_key(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Tuple[bytes, bytes, Tuple[int, ...]]:
    ids = input_ids.detach().to("cpu", torch.int64).contiguous()
    mask = attention_mask.detach().to("cpu", torch.int64).contiguous()
    return ids.numpy().tobytes(), mask.numpy().tobytes(), tuple(ids.shape)


_OWN_ARGS = ("dtype", "api_key", "timeout", "retries", "request_tokens", "max_requests")


def _own(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The keyword arguments of :class:`_TargetModel`; the SpecForge backends' others
    (``trust_remote_code``, SGLang's settings, ...) mean nothing here and are dropped."""
    return {k: v for k, v in kwargs.items() if k in _OWN_ARGS}


class _TargetModel:
    """What the EAGLE-3 and DFlash target models share: the servers, the requests of a batch,
    and the prefetching of the batches to come."""

    def __init__(
        self,
        servers: Union[str, Sequence[str]],
        dtype: str = "bfloat16",
        api_key: Optional[str] = None,
        timeout: float = 600.0,
        retries: int = 8,
        request_tokens: int = 8192,
        max_requests: int = 4,
    ):
        self.servers = Servers(servers, api_key=api_key, timeout=timeout, retries=retries)
        self.dtype = normalize_dtype(dtype)
        self.request_tokens = int(request_tokens)
        self.max_requests = int(max_requests)
        self._pending: Deque[Tuple[Tuple[bytes, bytes, Tuple[int, ...]], "Future[List[Result]]"]] = collections.deque()
        self._pending_lock = threading.Lock()
        self.prefetch_hits = 0
        self.prefetch_misses = 0

    @property
    def num_layers(self) -> int:
        return int(self.servers.info()["num_layers"])

    def _layers(self) -> List[Union[int, str]]:  # pragma: no cover - per subclass
        raise NotImplementedError

    def _request(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: List[Union[int, str]]) -> List[Result]:
        ids = input_ids.detach().to("cpu", torch.int64)
        mask = attention_mask.detach().to("cpu").bool() if attention_mask is not None else torch.ones_like(ids, dtype=torch.bool)
        rows = [{"input_ids": ids[b][mask[b]].tolist()} for b in range(ids.shape[0])]
        return self.servers.hidden_states_split(
            rows, layers, request_tokens=self.request_tokens, max_requests=self.max_requests,
            dtype=self.dtype, as_torch=True,
        )

    def _answers(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> List[Result]:
        """The answers for this batch: prefetched where :meth:`prefetch` asked for it already."""
        key = _batch_key(input_ids, attention_mask)
        with self._pending_lock:
            while self._pending:
                k, future = self._pending.popleft()
                if k == key:
                    self.prefetch_hits += 1
                    return future.result()
                future.cancel()  # a batch the trainer skipped
        self.prefetch_misses += 1
        return self._request(input_ids, attention_mask, self._layers())

    def prefetch(self, batches: Iterable[Mapping], depth: int = 2) -> Iterator[Any]:
        """Yields ``batches`` (the trainer's DataLoader) as they are, having asked layertap for
        the states of the next ``depth`` batches (each a dict with ``input_ids`` and
        ``attention_mask``); the generate call for a batch then takes its prefetched answer.

        ``for data in target_model.prefetch(train_dataloader): ...`` in place of
        ``for data in train_dataloader``."""
        if depth < 1:
            yield from batches
            return
        layers = self._layers()
        pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="layertap-prefetch")
        window: Deque[Any] = collections.deque()
        it = iter(batches)
        try:
            for batch in it:
                ids, mask = batch["input_ids"], batch.get("attention_mask")
                if mask is None:
                    mask = torch.ones_like(ids)
                future = pool.submit(self._request, ids, mask, layers)
                with self._pending_lock:
                    self._pending.append((_batch_key(ids, mask), future))
                window.append(batch)
                if len(window) > depth:
                    yield window.popleft()
            while window:
                yield window.popleft()
        finally:
            with self._pending_lock:
                for _, f in self._pending:
                    f.cancel()
                self._pending.clear()
            pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _scatter(
        answers: List[Result], take: Callable[[Result], torch.Tensor], like: torch.Tensor, mask: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """``[B, L, W]`` of each row's ``take(answer)`` ``[T, W]`` at its unmasked positions,
        zeros at the padding."""
        width = take(answers[0]).shape[-1]
        out = torch.zeros((*like.shape[:2], width), dtype=dtype)
        cpu_mask = mask.detach().to("cpu").bool()
        for b, r in enumerate(answers):
            out[b][cpu_mask[b]] = take(r).to(dtype)
        return out.to(like.device, non_blocking=True)


class LayertapEagle3TargetModel(_TargetModel):
    """SpecForge's ``Eagle3TargetModel`` interface (its scripts before 2026-07) over layertap.

    :meth:`generate_eagle3_data` returns what SpecForge's HF and SGLang target models return
    for the same batch: ``hidden_states`` ``[B, L, 3H]`` (the three auxiliary layers: SpecForge's
    layer ``t``, counted from 0, is layertap's index ``t + 1``), ``target`` ``[B, L, V]`` (the
    next position's logits: the final state after the norm, index L, through ``lm_head``,
    shifted left with a zero last position), ``input_ids`` shifted the same way,
    ``loss_mask`` ``[B, L, 1]`` and ``attention_mask`` as given; also ``last_hidden_states``
    ``[B, L, H]`` (the final state, not shifted). Padded positions (``attention_mask`` 0) are
    not sent and hold zeros.

    ``lm_head``: the target's output head, a module or function from ``[..., H]`` to
    ``[..., V]`` (SpecForge's ``TargetHead``, or ``torch.nn.Linear`` holding
    ``lm_head.weight``); :meth:`from_pretrained` loads it from the target's checkpoint.
    Without it ``target`` is the final state itself (``[B, L, H]``, shifted).
    """

    def __init__(self, servers: Union[str, Sequence[str]], lm_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 **kwargs: Any):
        super().__init__(servers, **kwargs)
        self.lm_head = lm_head
        self.aux_hidden_states_layers: Optional[List[int]] = None

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str,
        torch_dtype: Optional[torch.dtype] = None,
        device: Optional[str] = None,
        cache_dir: Optional[str] = None,
        *,
        servers: Union[str, Sequence[str]],
        lm_head_key: str = "lm_head.weight",
        **kwargs: Any,
    ) -> "LayertapEagle3TargetModel":
        """The target model over ``servers``, with the output head of the checkpoint at
        ``pretrained_model_name_or_path`` (SpecForge's ``TargetHead``: ``lm_head_key`` from its
        safetensors index; give ``model.embed_tokens.weight`` for a model with tied
        embeddings), on ``device`` in ``torch_dtype``. Keyword arguments other than this
        class's own (``dtype``, ``api_key``, ``timeout``, ``retries``, ``request_tokens``,
        ``max_requests``) are ignored, so the call of SpecForge's factory fits as it is."""
        from specforge.modeling.target.target_head import TargetHead

        head = TargetHead.from_pretrained(pretrained_model_name_or_path, lm_head_key=lm_head_key, cache_dir=cache_dir)
        head = head.to(device=device or head.fc.weight.device, dtype=torch_dtype or head.fc.weight.dtype)
        return cls(servers, lm_head=head, **_own(kwargs))

    def set_aux_hidden_states_layers(self, aux_hidden_states_layers: Optional[List[int]] = None) -> None:
        """SpecForge's default for none: ``[1, L/2 - 1, L - 4]`` (decoder layers from 0)."""
        if aux_hidden_states_layers is None:
            n = self.num_layers
            aux_hidden_states_layers = [1, n // 2 - 1, n - 4]
        self.aux_hidden_states_layers = list(aux_hidden_states_layers)
        assert len(self.aux_hidden_states_layers) == 3, "aux_hidden_states_layers is expected to be 3 layers for EAGLE3"

    def _layers(self) -> List[Union[int, str]]:
        if self.aux_hidden_states_layers is None:
            self.set_aux_hidden_states_layers()
        assert self.aux_hidden_states_layers is not None
        return [*_as_layertap_layers(self.aux_hidden_states_layers), -1]

    @torch.no_grad()
    def generate_eagle3_data(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor, **kwargs: Any
    ) -> Any:
        answers = self._answers(input_ids, attention_mask)
        dtype = _TORCH_DTYPES.get(self.dtype or "", torch.bfloat16)
        features = [layouts.specforge_eagle3(r) for r in answers]
        by_answer = dict(zip(map(id, answers), features))
        aux = self._scatter(answers, lambda r: by_answer[id(r)]["hidden_state"][0], input_ids, attention_mask, dtype)
        last = self._scatter(answers, lambda r: by_answer[id(r)]["target"][0], input_ids, attention_mask, dtype)
        if self.lm_head is not None:
            weight = getattr(getattr(self.lm_head, "fc", self.lm_head), "weight", None)
            target = self.lm_head(last.to(weight.dtype) if weight is not None else last)
        else:
            target = last
        out = _output_class("specforge.modeling.target.eagle3_target_model", "Eagle3TargetOutput", Eagle3TargetOutput)
        return out(
            hidden_states=aux,
            target=_shift_left(target),
            loss_mask=loss_mask[..., None],
            input_ids=_shift_left(input_ids),
            attention_mask=attention_mask,
            last_hidden_states=last,
        )


class LayertapDFlashTargetModel(_TargetModel):
    """SpecForge's ``DFlashTargetModel`` interface (its scripts before 2026-07) over layertap.

    :meth:`generate_dflash_data` returns ``hidden_states`` ``[B, L, k·H]``: the capture layers
    set by :meth:`set_capture_layers` (the draft's ``target_layer_ids``, decoder layers from 0:
    layertap's index ``t + 1``), concatenated in that order; ``input_ids``, ``attention_mask``
    and ``loss_mask`` as given. Without capture layers, the final state (index L), as
    SpecForge's HF backend returns ``hidden_states[-1]``.
    """

    def __init__(self, servers: Union[str, Sequence[str]], **kwargs: Any):
        super().__init__(servers, **kwargs)
        self.capture_layer_ids: Optional[List[int]] = None

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: Optional[str] = None,
        torch_dtype: Optional[torch.dtype] = None,
        device: Optional[str] = None,
        cache_dir: Optional[str] = None,
        *,
        servers: Union[str, Sequence[str]],
        **kwargs: Any,
    ) -> "LayertapDFlashTargetModel":
        """The target model over ``servers`` (no weights are needed on the trainer); keyword
        arguments other than this class's own are ignored, as for the EAGLE-3 model."""
        kwargs = _own(kwargs)
        if torch_dtype is not None and "dtype" not in kwargs:
            kwargs["dtype"] = str(torch_dtype).replace("torch.", "")
        return cls(servers, **kwargs)

    def set_capture_layers(self, layer_ids: List[int]) -> None:
        self.capture_layer_ids = list(layer_ids)

    def _layers(self) -> List[Union[int, str]]:
        return _as_layertap_layers(self.capture_layer_ids) if self.capture_layer_ids is not None else [-1]

    @torch.no_grad()
    def generate_dflash_data(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> Any:
        answers = self._answers(input_ids, attention_mask)
        dtype = _TORCH_DTYPES.get(self.dtype or "", torch.bfloat16)
        hidden = self._scatter(answers, lambda r: layouts.specforge_dflash(r)["hidden_states"][0], input_ids,
                               attention_mask, dtype)
        out = _output_class("specforge.modeling.target.dflash_target_model", "DFlashTargetOutput", DFlashTargetOutput)
        return out(hidden_states=hidden, input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask)
