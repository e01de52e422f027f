"""A sampler for map-style datasets on a cold disk: shuffled, but reading mostly in order.

``BlockShuffleSampler`` shuffles blocks of neighbouring indices, then indices within windows
of a few blocks. The packer lays an image set out contiguously, so each window touches
``window`` stretches of ``block_size`` records: the kernel's read-ahead turns most reads into
sequential ones, where a full permutation would seek for every sample.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from . import state as keys
from .state import Resumable
from .topology import Topology, distributed_info, epoch_total, pad_or_trim, seeded_rng

__all__ = ["BlockShuffleSampler", "block_shuffle"]


def block_shuffle(n: int, block_size: int, window: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of ``0..n-1``: blocks of ``block_size`` in random order, then the indices
    of each run of ``window`` consecutive (shuffled) blocks shuffled together."""
    bounds = np.append(np.arange(0, n, block_size), n)
    order = rng.permutation(len(bounds) - 1)
    blocks = [np.arange(bounds[b], bounds[b + 1]) for b in order]
    windows = [np.concatenate(blocks[w : w + window]) for w in range(0, len(blocks), window)]
    return np.concatenate([rng.permutation(w) for w in windows] or [np.zeros(0, np.int64)])


class BlockShuffleSampler(Sampler[int], Resumable):
    """Shuffles blocks of neighbouring indices, then indices within windows of blocks.

    Args:
        data_source_or_length: the dataset (anything with ``len``) or its length.
        block_size: neighbouring indices kept together (one sequential read each).
        window: blocks whose indices are mixed together: a batch draws from up to
            ``window`` blocks, and ``window * block_size`` indices are in flight at once.
        seed, shuffle: the order is seeded by ``(seed, epoch)``; without ``shuffle`` the
            indices come in order (ranks still split them).
        rank, world_size, drop_last: as ``DistributedSampler``: default torch.distributed's
            rank and world size; every rank yields the same count, by repeating the first
            indices of the epoch order (default) or dropping its tail (``drop_last``).

    Every rank computes the same epoch order and takes its own contiguous slice, so a rank
    reads its own blocks only. Randomness: the block order is a uniform permutation; an index
    moves only within its window, so two indices of one block always land within
    ``window * block_size`` places of each other. Call ``set_epoch`` before each epoch.

    **Resuming** (``state.Resumable``, torchdata's ``StatefulDataLoader`` protocol): the
    state is the epoch and the indices this rank handed out in it, plus the settings that
    fix the order, checked when the resumed iteration starts; it then yields the rest of that
    epoch, in the same order. Given a torch_serialized dataset, the state also names its
    samples (``state.PACK``), so a resume on a pack re-packed since is refused.
    """

    _KIND = "BlockShuffleSampler"
    _HINT = "sampler arguments, dataset length, rank and world size"

    def __init__(
        self,
        data_source_or_length: Sized | int,
        *,
        block_size: int = 64,
        window: int = 4,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
    ) -> None:
        source = data_source_or_length
        n = source if isinstance(source, int) else len(source)
        if n < 0:
            raise ValueError(f"length must be >= 0, got {n}")
        if block_size < 1 or window < 1:
            raise ValueError(f"block_size and window must be >= 1, got {block_size}, {window}")
        self.num_indices = n
        self.block_size, self.window = block_size, window
        self.seed, self.shuffle = seed, shuffle
        self.rank, self.world_size = distributed_info(rank, world_size)
        self.drop_last = drop_last
        self.epoch = 0
        self._identity = keys.samples_identity(data_source_or_length)  # None for a length

    @property
    def total_size(self) -> int:
        """Indices across all ranks per epoch (padding included)."""
        return epoch_total(self.num_indices, self.world_size, self.drop_last)

    def __len__(self) -> int:
        return self._topology().samples_per_rank(self.num_indices, self.drop_last)

    def _topology(self) -> Topology:
        return Topology(self.rank, self.world_size)

    def indices(self) -> np.ndarray:
        """This rank's indices for the current epoch."""
        n = self.num_indices
        if self.shuffle:
            rng = seeded_rng(self.seed, self.epoch)
            order = block_shuffle(n, self.block_size, self.window, rng)
        else:
            order = np.arange(n)
        share = self._topology().rank_slice(n, self.drop_last)
        return pad_or_trim(order, self.total_size)[share]

    def __iter__(self) -> Iterator[int]:
        skip = self._start("BlockShuffleSampler")
        return self._counted(self.indices()[skip:].tolist())

    def _settings(self) -> dict[str, Any]:
        values = (
            *(self.rank, self.world_size),
            *(self.num_indices, self.shuffle, self.seed, self.drop_last),
            *(self.block_size, self.window),
        )
        names = keys.SAMPLER_TOPOLOGY_KEYS + keys.SAMPLER_ORDER_KEYS
        return dict(zip(names, values, strict=True))
