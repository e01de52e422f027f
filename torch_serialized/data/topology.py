"""Who this process is in a training job (DDP rank, DataLoader worker), and how an epoch is
shared, as ``DistributedSampler`` does: padded or cut to a multiple of the world size, rank
``r`` taking the ``r``-th contiguous slice, its workers splitting that."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist
from torch.utils.data import get_worker_info


@dataclass(frozen=True)
class Topology:
    """DDP ``rank`` of ``world_size``, DataLoader ``worker`` of ``num_workers`` (main: 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        for i, n, a, b in (
            (self.rank, self.world_size, "rank", "world_size"),
            (self.worker, self.num_workers, "worker", "num_workers"),
        ):
            if n < 1 or not 0 <= i < n:
                raise ValueError(f"need 0 <= {a} < {b}, got {a}={i}, {b}={n}")

    @classmethod
    def current(cls, rank: int | None = None, world_size: int | None = None) -> Topology:
        """The calling process's topology; ``rank`` / ``world_size`` override DDP's."""
        info = get_worker_info()
        worker = (0, 1) if info is None else (info.id, info.num_workers)
        return cls(*distributed_info(rank, world_size), *worker)

    def samples_per_rank(self, n: int, drop_last: bool) -> int:
        return epoch_total(n, self.world_size, drop_last) // self.world_size

    def rank_slice(self, n: int, drop_last: bool) -> slice:
        """This rank's share of an epoch order of ``n`` padded or cut to ``epoch_total``."""
        per_rank = self.samples_per_rank(n, drop_last)
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def worker_slice(self, n: int) -> slice:
        """This worker's contiguous piece of ``n`` items; piece sizes differ by at most 1."""
        size, extra = divmod(n, self.num_workers)
        start = self.worker * size + min(self.worker, extra)
        return slice(start, start + size + (self.worker < extra))


def distributed_info(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: the arguments if given, else torch.distributed's, else (0, 1)."""
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    Topology(rank, world_size)  # checks them
    return rank, world_size


def epoch_total(n: int, world_size: int, drop_last: bool) -> int:
    """Samples of an epoch of ``n`` across ``world_size`` ranks, each taking as many."""
    return n // world_size * world_size if drop_last else math.ceil(n / world_size) * world_size


def seeded_rng(seed: int, *key: int) -> np.random.Generator:
    """The generator of ``seed`` and ``key`` (numbers naming one independent stream)."""
    sequence = np.random.SeedSequence(seed % 2**64, spawn_key=tuple(k % 2**64 for k in key))
    return np.random.Generator(np.random.PCG64(sequence))
