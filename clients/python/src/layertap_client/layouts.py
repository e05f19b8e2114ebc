"""One sample's answer in each drafter trainer's layout: one function per layout.

The offline converter (:mod:`layertap_client.convert`) and the online drop-ins
(:mod:`layertap_client.trainers`) build their tensors with these same functions, so
the files on disk and the batches streamed to a trainer cannot drift apart.

Each function takes one sample as the client decodes it, a mapping holding
``hidden_states`` ``[T, n_layers, H]`` (the layers in the order asked),
``input_ids`` ``[T]`` and ``loss_mask`` ``[T]`` (a :class:`layertap_client.Result`
works too, and so do the dicts of :mod:`layertap_client.dataset`), and returns a new
dict of tensors. The arrays may be numpy arrays or torch tensors; the result is of
the same kind and the hidden states keep their dtype. Token ids and masks become
int64. An fp8 sample kept as fp8 (``dequantize=False``, with its
``hidden_states_scale`` ``[T, n_layers]``) is dequantised to float32 first, except
by :func:`speculators`, which keeps the fp8 values beside their scales as
hs-connectors' fp8 reader takes them.

Layouts (``T`` tokens, ``H`` hidden size, ``n`` layers asked):

=============================  =====================================================
function                       keys
=============================  =====================================================
:func:`speculators`            ``hidden_states`` ``[T, n, H]`` (the last layer is the
                               verifier's pre-norm state: ask for ``final_prenorm``
                               last), ``token_ids`` ``[T]``; fp8 adds
                               ``hidden_states_scales`` ``[T, n, 1]``. What
                               ``layertap bulk --layout speculators`` writes and
                               hs-connectors' ``get_cached`` / ``get_generated``
                               return.
:func:`specforge_eagle3_file`  ``input_ids`` ``[T]``, ``loss_mask`` ``[T]``,
                               ``hidden_state`` ``[1, T, H]`` (the last layer, index
                               L: the final state after the norm),
                               ``aux_hidden_state`` ``[1, T, (n-1)·H]``: SpecForge's
                               offline EAGLE-3 file (``convert specforge-eagle3``).
:func:`specforge_dflash_file`  ``input_ids`` ``[T]``, ``loss_mask`` ``[T]``,
                               ``hidden_states`` ``[T, n·H]``: SpecForge's offline
                               DFlash file (``convert specforge-dflash``).
:func:`specforge_eagle3`       ``hidden_state`` ``[1, T, (n-1)·H]`` (the auxiliary
                               layers), ``target`` ``[1, T, H]`` (the last layer,
                               index L), ``input_ids``, ``loss_mask`` and
                               ``attention_mask`` ``[1, T]``: the features of
                               SpecForge's online EAGLE-3 loop (what its normaliser
                               makes of an offline file, but with the loss mask as
                               given).
:func:`specforge_dflash`       ``hidden_states`` ``[1, T, n·H]``, ``input_ids`` and
                               ``loss_mask`` ``[1, T]``: SpecForge's online DFlash
                               features.
=============================  =====================================================

:func:`specforge_features` is the general form of the last two, for any SpecForge
capture layout (which feature takes the auxiliary layers, which the final state,
which masks pass through).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from . import _safetensors

__all__ = [
    "LayoutError",
    "FILE_LAYOUTS",
    "check_layers",
    "dequantized",
    "speculators",
    "specforge_eagle3_file",
    "specforge_dflash_file",
    "specforge_eagle3",
    "specforge_dflash",
    "specforge_features",
]


class LayoutError(ValueError):
    """A sample (or a set of layers) that the layout asked for cannot take."""


# -- arrays of either kind ------------------------------------------------------------------------


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".", 1)[0] == "torch"


def _get(sample: Any, name: str) -> Any:
    if isinstance(sample, Mapping):
        return sample.get(name)
    return getattr(sample, name, None)


def _need(sample: Any, name: str) -> Any:
    x = _get(sample, name)
    if x is None:
        raise LayoutError(f"the sample has no {name}")
    return x


def _int64(x: Any) -> Any:
    if _is_torch(x):
        import torch

        return x.to(torch.int64)
    return np.asarray(x).astype(np.int64)


def _ones_int64(like: Any) -> Any:
    if _is_torch(like):
        import torch

        return torch.ones(tuple(like.shape), dtype=torch.int64, device=like.device)
    return np.ones(like.shape, dtype=np.int64)


def _float32(x: Any) -> Any:
    if _is_torch(x):
        import torch

        return x.to(torch.float32)
    if x.dtype == np.uint8:  # raw fp8 bits (numpy without ml_dtypes)
        return _safetensors.f8_e4m3_bits_to_float32(x)
    return x.astype(np.float32)


def dequantized(sample: Any) -> Any:
    """The sample's hidden states, dequantised to float32 where it holds fp8 values and their
    ``hidden_states_scale`` (``state * scale``, per token and layer); as they are otherwise."""
    hs = _need(sample, "hidden_states")
    scale = _get(sample, "hidden_states_scale")
    if scale is None:
        return hs
    return _float32(hs) * _float32(scale)[..., None]


def _states(sample: Any) -> Tuple[Any, Any, Any, int, int, int]:
    """``(hidden_states [T, n, H], input_ids int64 [T], loss_mask int64 [T], T, n, H)``."""
    hs = dequantized(sample)
    ids = _int64(_need(sample, "input_ids"))
    mask = _int64(_need(sample, "loss_mask"))
    if len(hs.shape) != 3 or hs.shape[0] != ids.shape[0] or tuple(mask.shape) != tuple(ids.shape):
        raise LayoutError(
            f"hidden_states {tuple(hs.shape)}, input_ids {tuple(ids.shape)} and loss_mask "
            f"{tuple(mask.shape)} do not agree (want [T, n_layers, H], [T], [T])"
        )
    t, n, h = (int(d) for d in hs.shape)
    return hs, ids, mask, t, n, h


# -- layer sets ----------------------------------------------------------------------------------


def check_layers(layout: str, layers: Sequence[Any], num_layers: int, what: str = "the folder") -> None:
    """Refuses the layer sets ``layout`` cannot take, saying what to ask for instead.

    EAGLE-3 for SpecForge (``specforge-eagle3``, the file and the online features alike)
    needs at least one auxiliary layer and, last, index L: the final state after the norm
    (SpecForge's target head has no norm of its own)."""
    if layout in ("specforge-eagle3", "specforge_eagle3", "specforge_eagle3_file"):
        if len(layers) < 2:
            raise LayoutError(
                f"{what} holds layers {list(layers)}: specforge-eagle3 needs the auxiliary layers and, last, "
                f"index L = {num_layers} (e.g. --layers 2,{num_layers // 2},{num_layers - 3},-1)"
            )
        if layers[-1] != num_layers:
            raise LayoutError(
                f"{what} ends with layer {layers[-1]!r}: SpecForge's EAGLE-3 target is the final state after the "
                f"norm, index L = {num_layers} (its target head has no norm); end --layers with -1"
            )


def _check_sample_layers(layout: str, sample: Any) -> None:
    layers = _get(sample, "layers")
    num_layers = _get(sample, "num_layers")
    if num_layers is None:
        metadata = _get(sample, "metadata")
        if isinstance(metadata, Mapping) and "num_layers" in metadata:
            num_layers = int(metadata["num_layers"])
    if layers is not None and num_layers is not None:
        check_layers(layout, list(layers), int(num_layers), "the sample")


# -- the layouts ---------------------------------------------------------------------------------


def speculators(sample: Any) -> Dict[str, Any]:
    """speculators' per-sample dict: ``{"hidden_states": [T, n, H], "token_ids": [T]}``, plus
    ``hidden_states_scales`` ``[T, n, 1]`` (float32) for an fp8 sample kept as fp8.

    speculators' dataset takes every slot but the last as the auxiliary layers and the last
    as the verifier's last decoder layer before its final norm (it applies the norm itself):
    ask for ``[*aux_layer_ids, "final_prenorm"]``."""
    hs = _need(sample, "hidden_states")
    ids = _int64(_need(sample, "input_ids"))
    if len(hs.shape) != 3 or hs.shape[0] != ids.shape[0]:
        raise LayoutError(f"hidden_states {tuple(hs.shape)} and input_ids {tuple(ids.shape)} do not agree")
    out = {"hidden_states": hs, "token_ids": ids}
    scale = _get(sample, "hidden_states_scale")
    if scale is not None:
        out["hidden_states_scales"] = _float32(scale)[..., None]
    return out


def specforge_eagle3_file(sample: Any) -> Dict[str, Any]:
    """SpecForge's offline EAGLE-3 file: ``input_ids`` ``[T]``, ``loss_mask`` ``[T]`` (int64),
    ``hidden_state`` ``[1, T, H]`` (the last layer, which must be index L) and
    ``aux_hidden_state`` ``[1, T, (n-1)·H]`` (the others, in the order asked)."""
    _check_sample_layers("specforge-eagle3", sample)
    hs, ids, mask, t, n, h = _states(sample)
    if n < 2:
        raise LayoutError(f"specforge-eagle3 needs at least 2 layers (auxiliary ones and index L), the sample has {n}")
    return {
        "input_ids": ids,
        "loss_mask": mask,
        "hidden_state": hs[:, n - 1, :].reshape(1, t, h),
        "aux_hidden_state": hs[:, : n - 1, :].reshape(1, t, (n - 1) * h),
    }


def specforge_dflash_file(sample: Any) -> Dict[str, Any]:
    """SpecForge's offline DFlash file: ``input_ids`` ``[T]``, ``loss_mask`` ``[T]`` (int64) and
    ``hidden_states`` ``[T, n·H]`` (every layer, in the order asked)."""
    hs, ids, mask, t, n, h = _states(sample)
    return {"input_ids": ids, "loss_mask": mask, "hidden_states": hs.reshape(t, n * h)}


def specforge_features(
    sample: Any,
    aux_feature: Optional[str],
    last_hidden_feature: Optional[str],
    passthrough: Sequence[Tuple[str, str]] = (("input_ids", "input_ids"), ("loss_mask", "loss_mask")),
    attention_mask_feature: Optional[str] = None,
) -> Dict[str, Any]:
    """One sample's features for SpecForge's online loop, for any of its capture layouts.

    With ``last_hidden_feature`` the last layer of the sample (index L, post-norm) becomes that
    feature ``[1, T, H]`` and the others, concatenated, ``aux_feature`` ``[1, T, k·H]``; without
    it every layer goes to ``aux_feature``. ``passthrough`` pairs ``(feature, key)``: the
    sample's ``key`` (``input_ids``, ``loss_mask``, ...) as int64 ``[1, T]``.
    ``attention_mask_feature`` adds ones ``[1, T]`` (int64), as SpecForge's server capture does
    for unpadded prompts."""
    hs, ids, mask, t, n, h = _states(sample)
    out: Dict[str, Any] = {}
    for feature, key in passthrough:
        value = {"input_ids": ids, "loss_mask": mask}.get(key)
        if value is None:
            value = _int64(_need(sample, key))
        if value.shape[0] != t:
            raise LayoutError(f"{key} has {value.shape[0]} rows, hidden_states {t}")
        out[feature] = value.reshape(1, t, *value.shape[1:])
    aux = n
    if last_hidden_feature is not None:
        if n < 1:
            raise LayoutError("the sample holds no layer for the final state")
        aux = n - 1
        out[last_hidden_feature] = hs[:, n - 1, :].reshape(1, t, h)
    if aux_feature is not None:
        out[aux_feature] = hs[:, :aux, :].reshape(1, t, aux * h)
    if attention_mask_feature is not None:
        out[attention_mask_feature] = _ones_int64(ids).reshape(1, t)
    return out


def specforge_eagle3(sample: Any) -> Dict[str, Any]:
    """SpecForge's online EAGLE-3 features: ``hidden_state`` ``[1, T, (n-1)·H]`` (the auxiliary
    layers), ``target`` ``[1, T, H]`` (the last layer, index L), ``input_ids``, ``loss_mask``
    and ``attention_mask`` ``[1, T]`` int64."""
    _check_sample_layers("specforge-eagle3", sample)
    return specforge_features(sample, "hidden_state", "target", attention_mask_feature="attention_mask")


def specforge_dflash(sample: Any) -> Dict[str, Any]:
    """SpecForge's online DFlash features: ``hidden_states`` ``[1, T, n·H]`` (every layer, in the
    order asked), ``input_ids`` and ``loss_mask`` ``[1, T]`` int64."""
    return specforge_features(sample, "hidden_states", None)


#: The converter's formats (``python -m layertap_client.convert FORMAT``) and their layouts.
FILE_LAYOUTS: Dict[str, Callable[[Any], Dict[str, Any]]] = {
    "specforge-eagle3": specforge_eagle3_file,
    "specforge-dflash": specforge_dflash_file,
}
