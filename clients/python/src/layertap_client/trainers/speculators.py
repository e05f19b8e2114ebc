"""speculators' trainer fed by layertap: a hs-connectors backend named ``layertap``.

speculators' ``ArrowDataset`` asks its ``HiddenStatesTransfer`` for each sample with
``get_cached(file_idx)`` (``file_idx``: the row of the prepared dataset) and, only when that
returns ``None``, generates the states through a vLLM server. :class:`LayertapTransfer`
answers ``get_cached`` itself: it reads the row's ``input_ids`` from the prepared dataset and
asks layertap for their hidden states, so the trainer needs no vLLM server and no
hidden-states folder, and every sample is fetched when the DataLoader needs it (its workers
and ``prefetch_factor`` keep requests in flight ahead of the step). A request that fails is
sent to another server and, when every attempt fails, raises: a sample is never skipped.

Run the trainer through this module, which registers the backend before speculators builds
its command line (the choices of ``--hidden-states-backend`` and the backends' flags are
read when speculators' config module is imported)::

    torchrun --nproc_per_node=8 -m layertap_client.trainers.speculators \\
        --verifier-name-or-path Qwen/Qwen3-8B --data-path data/ --speculator-type eagle3 \\
        --hidden-states-backend layertap --layertap-server http://gpu0:8080,http://gpu1:8080

``--layertap-layers`` defaults to speculators' ``--target-layer-ids`` (else its default
``[2, L/2, L-3]``, L from the server) followed by ``final_prenorm``, the verifier's last
decoder layer before its final norm, which speculators applies itself. In your own script,
``import layertap_client.trainers.speculators`` before importing ``speculators.train``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from hs_connectors.transfer import HiddenStatesBackend, HiddenStatesTransfer

from .. import layouts
from .._common import FINAL_PRENORM, normalize_dtype, normalize_layers
from ._servers import Servers

__all__ = ["BACKEND", "LayertapBackend", "LayertapTransfer", "default_layers", "main", "register"]

#: The name the backend is registered under (``--hidden-states-backend layertap``).
BACKEND = "layertap"

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def default_layers(num_layers: int, target_layer_ids: Optional[Sequence[int]] = None) -> List[Union[int, str]]:
    """The layers speculators' EAGLE-3 reads: its target layer ids (default ``[2, L/2, L-3]``,
    as speculators resolves them; they are ``hidden_states`` indices already) and, last,
    ``final_prenorm``."""
    ids = list(target_layer_ids) if target_layer_ids else [2, num_layers // 2, num_layers - 3]
    return [*ids, FINAL_PRENORM]


class LayertapTransfer(HiddenStatesTransfer):
    """A ``HiddenStatesTransfer`` whose ``get_cached(file_idx)`` asks layertap for the hidden
    states of row ``file_idx`` of the prepared dataset at ``data_path``.

    ``servers``: one URL or several (a list, or comma-separated). ``layers``: what to ask for,
    the last being ``final_prenorm`` (default: :func:`default_layers` with
    ``target_layer_ids``). ``dtype``: of the answer (``bfloat16``, ``float16``, ``float32``, or
    ``fp8``, which is dequantised to ``dequantize_dtype`` as hs-connectors' fp8 backend does).
    Returns ``{"hidden_states": [T, n, H], "token_ids": [T]}`` (:func:`layouts.speculators`).
    """

    def __init__(
        self,
        servers: Union[str, Sequence[str]],
        data_path: Union[str, "os.PathLike[str]"],
        layers: Any = None,
        dtype: str = "bfloat16",
        target_layer_ids: Optional[Sequence[int]] = None,
        api_key: Optional[str] = None,
        timeout: float = 600.0,
        retries: int = 8,
        dequantize_dtype: torch.dtype = torch.bfloat16,
    ):
        self.servers = Servers(servers, api_key=api_key, timeout=timeout, retries=retries)
        self.data_path = str(data_path)
        self.layers = normalize_layers(layers) if layers is not None else None
        self.target_layer_ids = list(target_layer_ids) if target_layer_ids else None
        self.dtype = normalize_dtype(dtype)
        self.dequantize_dtype = dequantize_dtype
        self._rows: Any = None

    def __getstate__(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d["_rows"] = None  # each DataLoader worker opens the dataset itself
        return d

    def setup(self) -> None:
        """Opens the prepared dataset and settles the layers (also done on first use)."""
        if self._rows is None:
            from datasets import load_from_disk

            self._rows = load_from_disk(self.data_path).with_format(None).select_columns(["input_ids"])
        if self.layers is None:
            self.layers = default_layers(int(self.servers.info()["num_layers"]), self.target_layer_ids)

    def fetch(self, input_ids: Sequence[int]) -> Dict[str, torch.Tensor]:
        """The speculators sample of one sequence of token ids, from layertap."""
        self.setup()
        [r] = self.servers.hidden_states([list(input_ids)], self.layers, dtype=self.dtype, as_torch=True)
        sample = layouts.speculators(r)
        if self.dtype == "float8_e4m3fn":
            sample["hidden_states"] = sample["hidden_states"].to(self.dequantize_dtype)
        return sample

    def get_cached(self, file_idx: int) -> Optional[Dict[str, torch.Tensor]]:
        self.setup()
        return self.fetch(self._rows[int(file_idx)]["input_ids"])

    def get_generated(self, hs_transfer_params: Dict[str, Any]) -> Optional[Dict[str, torch.Tensor]]:
        # get_cached never returns None, so speculators never generates through vLLM; a
        # request carrying token ids (as vLLM's transfer parameters may) is answered anyway.
        ids = hs_transfer_params.get("token_ids") or hs_transfer_params.get("input_ids")
        if ids is None:
            raise RuntimeError(
                "the layertap backend answers get_cached() itself and needs no vLLM server: "
                f"it got vLLM transfer parameters without token ids ({sorted(hs_transfer_params)})"
            )
        return self.fetch(ids)

    def delete(self, handle: str) -> None:
        """Nothing to clean up: nothing was written."""


def _add(parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    dest = flag.lstrip("-").replace("-", "_")
    if not any(a.dest == dest for a in parser._actions):  # noqa: SLF001 - as hs-connectors does
        parser.add_argument(flag, **kwargs)


class LayertapBackend(HiddenStatesBackend):
    """The ``layertap`` hidden-states backend: :class:`LayertapTransfer` from the train flags
    ``--layertap-server`` (or ``$LAYERTAP_SERVER``), ``--layertap-layers``,
    ``--layertap-dtype``, ``--layertap-api-key`` (or ``$LAYERTAP_API_KEY``) and
    ``--layertap-timeout``."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        _add(parser, "--layertap-server", type=str, default=None,
             help="layertap server URL(s), comma-separated (default: $LAYERTAP_SERVER)")
        _add(parser, "--layertap-layers", type=str, default=None,
             help="layers to ask layertap for, comma-separated, the last final_prenorm "
             "(default: the target layer ids, then final_prenorm)")
        _add(parser, "--layertap-dtype", type=str, default="bfloat16",
             choices=["bfloat16", "float16", "float32", "fp8"], help="dtype of layertap's answers (default bfloat16)")
        _add(parser, "--layertap-api-key", type=str, default=None, help="layertap API key (default: $LAYERTAP_API_KEY)")
        _add(parser, "--layertap-timeout", type=float, default=600.0, help="seconds per layertap request")

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        """No vLLM server to launch: layertap serves the hidden states."""

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> LayertapTransfer:
        servers = getattr(args, "layertap_server", None) or os.environ.get("LAYERTAP_SERVER")
        if not servers:
            raise ValueError("the layertap backend needs --layertap-server URL[,URL...] (or $LAYERTAP_SERVER)")
        layers = getattr(args, "layertap_layers", None)
        if isinstance(layers, str):
            layers = [int(x) if x.strip().lstrip("-").isdigit() else x.strip() for x in layers.split(",") if x.strip()]
        hs_dtype = getattr(args, "hidden_states_dtype", None)
        return LayertapTransfer(
            servers,
            data_path,
            layers=layers,
            dtype=getattr(args, "layertap_dtype", None) or "bfloat16",
            target_layer_ids=getattr(args, "target_layer_ids", None),
            api_key=getattr(args, "layertap_api_key", None) or os.environ.get("LAYERTAP_API_KEY"),
            timeout=float(getattr(args, "layertap_timeout", None) or 600.0),
            dequantize_dtype=_TORCH_DTYPES.get(str(hs_dtype).replace("torch.", ""), torch.bfloat16),
        )

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> Dict[str, Any]:
        raise RuntimeError("the layertap backend needs no vLLM server: layertap serves the hidden states")


def register() -> None:
    """Registers the backend as ``layertap`` (once; importing this module does it)."""
    if HiddenStatesBackend.registry.get(BACKEND) is not LayertapBackend:
        if BACKEND in HiddenStatesBackend.registry:
            raise ValueError(f"another hidden-states backend is registered as {BACKEND!r}")
        HiddenStatesBackend.register(BACKEND)(LayertapBackend)
    if "speculators.train.config.resolution" in sys.modules:
        resolution = sys.modules["speculators.train.config.resolution"]
        if BACKEND not in getattr(resolution, "_BACKEND_ACTIONS", {BACKEND: None}):
            import warnings

            warnings.warn(
                "speculators' train config was imported before the layertap backend was registered: "
                "its --layertap-* flags are missing (the backend reads $LAYERTAP_SERVER instead). "
                "Import layertap_client.trainers.speculators first.",
                RuntimeWarning,
                stacklevel=2,
            )


register()


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``speculators train`` with the layertap backend registered: the same flags."""
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    train(TrainConfig.resolve(list(argv) if argv is not None else None))


if __name__ == "__main__":
    main()
