"""The torch dataset of :mod:`layertap_client.online` (imported only when asked for: needs torch)."""

from __future__ import annotations

from typing import Any, Dict, Iterator, Mapping, Optional

import torch  # noqa: F401  (fails here, not later, without torch)
from torch.utils.data import IterableDataset, get_worker_info

from .online import OnlineSource


class OnlineIterableDataset(IterableDataset):
    """:class:`~layertap_client.online.OnlineSource` as a ``torch.utils.data.IterableDataset``:
    the same arguments (samples come as torch tensors), the same samples as
    :class:`layertap_client.dataset.BulkIterableDataset` yields for a bulk folder.

    Under a ``DataLoader`` with workers, each worker fetches its own chunks of the rank's share
    (``get_worker_info``); give the dataset the DataLoader's ``batch_size`` (``1`` for
    ``batch_size=None``) so that the workers' batches come out in the rank's order, which is
    what makes ``state_dict(consumed=...)`` exact. Each worker runs its own fetching thread and
    requests: ``max_requests`` and ``max_buffered_bytes`` hold per worker. The fetching,
    decompression and checks already run off the consumer's thread, so ``num_workers=0`` is
    the usual choice, and the only one with ``device=`` (CUDA in worker processes is not
    supported: use the DataLoader's ``pin_memory`` there).
    """

    def __init__(self, samples: Any, servers: Any, layers: Any, **kwargs: Any):
        super().__init__()
        kwargs["as_torch"] = True
        self.source = OnlineSource(samples, servers, layers, **kwargs)

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        if get_worker_info() is not None and self.source.device is not None:
            raise RuntimeError(
                "device= copies to the GPU from the main process: use num_workers=0, or drop device= and let "
                "the DataLoader pin memory (pin_memory=True)"
            )
        return iter(self.source)

    def __len__(self) -> int:
        """Samples of this rank (all its workers together) left in the epoch."""
        return len(self.source)

    def set_epoch(self, epoch: int) -> None:
        """See :meth:`OnlineSource.set_epoch`."""
        self.source.set_epoch(epoch)

    def state_dict(self, consumed: Optional[int] = None) -> Dict[str, Any]:
        """See :meth:`OnlineSource.state_dict`; with DataLoader workers pass ``consumed``, the
        samples the trainer has taken on this rank in this epoch (steps × batch size)."""
        return self.source.state_dict(consumed)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """See :meth:`OnlineSource.load_state_dict`."""
        self.source.load_state_dict(state)

    def stats(self) -> Dict[str, Any]:
        """See :meth:`OnlineSource.stats` (of the pass run in this process)."""
        return self.source.stats()

    def close(self) -> None:
        self.source.close()


__all__ = ["OnlineIterableDataset"]
