"""A sampler for map-style datasets on a cold disk: shuffled, but reading mostly in order, so
the kernel's read-ahead serves most reads where a full permutation seeks for each."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from .state import Resumable, samples_identity
from .topology import Topology, distributed_info, epoch_total, seeded_rng

__all__ = ["BlockShuffleSampler", "block_shuffle"]


def block_shuffle(n: int, block_size: int, window: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of ``0..n-1``: blocks in random order, then each run of ``window``
    blocks shuffled together."""
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
        window: blocks mixed together: ``window * block_size`` indices are in flight at once.
        seed, shuffle: order seeded by ``(seed, epoch)``; without ``shuffle``, in order.
        rank, world_size, drop_last: as ``DistributedSampler`` (default: torch.distributed's);
            each rank takes a contiguous slice of the same order.

    Call ``set_epoch`` before each epoch. ``state_dict`` / ``load_state_dict`` follow torchdata's
    ``StatefulDataLoader``; a resume on a pack re-packed since is refused."""

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
        self._identity = samples_identity(data_source_or_length)  # None for a length

    def __len__(self) -> int:
        return Topology(self.rank, self.world_size).samples_per_rank(
            self.num_indices, self.drop_last
        )

    def indices(self) -> np.ndarray:
        """This rank's indices for the current epoch."""
        n = self.num_indices
        order = np.arange(n)
        if self.shuffle:
            rng = seeded_rng(self.seed, self.epoch)
            order = block_shuffle(n, self.block_size, self.window, rng)
        share = Topology(self.rank, self.world_size).rank_slice(n, self.drop_last)
        return np.resize(order, epoch_total(n, self.world_size, self.drop_last))[share]

    def __iter__(self) -> Iterator[int]:
        skip = self._start("BlockShuffleSampler")
        return self._counted(self.indices()[skip:].tolist())

    def _settings(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "num_samples": self.num_indices,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "block_size": self.block_size,
            "window": self.window,
        }
