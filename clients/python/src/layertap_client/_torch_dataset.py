"""The torch datasets of :mod:`layertap_client.dataset` (imported only when asked for: needs torch)."""

from __future__ import annotations

import warnings
from typing import Any, Dict, Iterator, Optional

import torch  # noqa: F401  (fails here, not later, without torch)
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from .dataset import LOAD_ERRORS, BulkFolder, PathLike


def _folder(root: Any, verify: bool, dequantize: bool) -> BulkFolder:
    if isinstance(root, BulkFolder):
        return root
    return BulkFolder(root, verify=verify, dequantize=dequantize)


class BulkIterableDataset(IterableDataset):
    """The samples of a ``layertap bulk`` folder as torch tensors, each exactly once per epoch.

    Splits the samples across DataLoader workers (``get_worker_info``) and,
    given ``rank`` and ``world_size`` (e.g. ``torch.distributed.get_rank()``
    and ``get_world_size()``), across ranks: every (rank, worker) pair reads
    a disjoint share. ``shuffle`` orders them by a permutation of ``seed`` and
    the epoch (:meth:`set_epoch`), the same on every rank. ``verify`` checks
    each file's checksums; ``skip_errors`` leaves out (with a warning) a file
    that fails them or cannot be read, instead of raising. fp8 files come
    dequantised to float32 unless ``dequantize=False``; bf16 stays bf16.

    Ranks' shares differ by at most one sample: a distributed loop that
    needs the same number of steps on every rank must stop at the shortest.
    """

    def __init__(
        self,
        root: PathLike,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        verify: bool = True,
        skip_errors: bool = False,
        dequantize: bool = True,
    ):
        super().__init__()
        self.folder = _folder(root, verify, dequantize)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.skip_errors = skip_errors

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration shuffles for (call it before each epoch, as with DistributedSampler)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        indices = self.folder.indices(
            self.rank, self.world_size, worker, num_workers, shuffle=self.shuffle, seed=self.seed, epoch=self.epoch
        )
        return self.folder.iter(indices, skip_errors=self.skip_errors, as_torch=True)

    def __len__(self) -> int:
        """Samples of this rank (all its workers together), before any skipped."""
        return len(self.folder.indices(self.rank, self.world_size))


class BulkDataset(Dataset):
    """Map-style: sample ``i`` of a ``layertap bulk`` folder as torch tensors.

    Shard and shuffle it with a sampler (``DistributedSampler`` across
    ranks). With ``skip_errors=True`` a file that cannot be used gives
    ``None`` (with a warning) instead of raising: drop those in the collate
    function.
    """

    def __init__(self, root: PathLike, verify: bool = True, skip_errors: bool = False, dequantize: bool = True):
        super().__init__()
        self.folder = _folder(root, verify, dequantize)
        self.skip_errors = skip_errors

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, i: int) -> Optional[Dict[str, Any]]:
        if not 0 <= i < len(self.folder):
            raise IndexError(f"sample {i} of {len(self.folder)}")
        try:
            return self.folder.load(i, as_torch=True)
        except LOAD_ERRORS as e:
            if not self.skip_errors:
                raise
            warnings.warn(f"skipping sample {self.folder.entries[i]['id']!r}: {e}", RuntimeWarning, stacklevel=2)
            return None


__all__ = ["BulkIterableDataset", "BulkDataset"]
