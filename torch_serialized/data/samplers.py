"""A sampler for map-style datasets on a cold disk: shuffled, but reading mostly in order.

``BlockShuffleSampler`` shuffles blocks of neighbouring indices, then shuffles indices within
windows of a few consecutive blocks. A map-style pack stores neighbouring indices next to each
other (the packer lays an image set out contiguously), so each window touches ``window``
stretches of ``block_size`` records: the kernel's read-ahead turns most reads into sequential
ones, where a full permutation would seek for every sample. It is torchdata-``Stateful``
(``state``): a ``StatefulDataLoader`` resumes it mid-epoch, in any epoch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from . import state as keys
from .state import Stateful
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


class BlockShuffleSampler(Sampler[int], Stateful):
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

    **Resuming.** ``state_dict`` / ``load_state_dict`` follow torchdata's
    ``StatefulDataLoader`` protocol, as ``VOCSerializedIterableDataset`` does: the state is
    the epoch and the indices this rank's iterator handed out in it, plus the settings that
    fix the order (checked when the resumed iteration starts). After ``load_state_dict`` the
    next iteration yields the rest of that epoch, in the same order; ``set_epoch`` with
    another epoch drops the loaded position, with the same epoch keeps it. Given a
    torch_serialized dataset, the state also names its samples (``state.PACK``), so a resume
    on a pack re-packed since is refused.
    """

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
        if isinstance(data_source_or_length, int):
            n = data_source_or_length
        else:
            n = len(data_source_or_length)
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
        self._yielded = 0  # indices the current iterator has handed out in this epoch
        self._resume: dict[str, Any] | None = None  # a loaded state awaiting the next __iter__
        #: the samples a torch_serialized dataset holds (``state.PACK``), else None
        self._identity = keys.samples_identity(data_source_or_length)

    @property
    def total_size(self) -> int:
        """Indices across all ranks per epoch (padding included)."""
        return epoch_total(self.num_indices, self.world_size, self.drop_last)

    def __len__(self) -> int:
        return self._topology().samples_per_rank(self.num_indices, self.drop_last)

    def _topology(self) -> Topology:
        return Topology(self.rank, self.world_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows."""
        if epoch != self.epoch:
            self._resume = None
            self._yielded = 0
        self.epoch = epoch

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
        skip = 0
        if self._resume is not None:
            keys.check_same(self._resume, self._settings(), "BlockShuffleSampler", _HINT)
            keys.check_samples(self._resume, self._identity, "BlockShuffleSampler")
            skip = int(self._resume[keys.YIELDED])
            self._resume = None
        return self._indices_from(self.indices(), skip)

    def _indices_from(self, order: np.ndarray, skip: int) -> Iterator[int]:
        self._yielded = skip
        for index in order[skip:].tolist():
            self._yielded += 1  # counted when handed out: a state taken now resumes after it
            yield index

    # -- resumption (``state``: torchdata's Stateful protocol) --------------------------------
    def _settings(self) -> dict[str, Any]:
        topology = (self.rank, self.world_size)
        order = (
            self.num_indices,
            self.shuffle,
            self.seed,
            self.drop_last,
            self.block_size,
            self.window,
        )
        return {
            **dict(zip(keys.SAMPLER_TOPOLOGY_KEYS, topology, strict=True)),
            **dict(zip(keys.SAMPLER_ORDER_KEYS, order, strict=True)),
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this rank's iteration is: epoch, indices handed out in it, and the settings
        that fix the order (JSON-compatible)."""
        if self._resume is not None:  # loaded, not yet iterated: still that point
            return dict(self._resume)
        return {
            keys.VERSION: keys.STATE_VERSION,
            keys.KIND: _KIND,
            keys.EPOCH: self.epoch,
            keys.YIELDED: self._yielded,
            **self._settings(),
            **({} if self._identity is None else {keys.PACK: self._identity}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next iteration continues that epoch where it
        stopped. The settings must match the saved ones (checked then)."""
        keys.check_version(state, "BlockShuffleSampler", _KIND)
        yielded = int(state[keys.YIELDED])
        if yielded < 0:
            raise ValueError(f"state yielded {yielded} is negative; it is not a saved position")
        self.epoch = int(state[keys.EPOCH])
        self._yielded = yielded
        self._resume = dict(state)


_KIND = "BlockShuffleSampler"
_HINT = "sampler arguments, dataset length, rank and world size"
