"""Topology and the rules that share an epoch among ranks and workers (one copy, two users)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_serialized.data.pipeline import rank_share, worker_share
from torch_serialized.data.samplers import BlockShuffleSampler
from torch_serialized.data.topology import (
    Topology,
    distributed_info,
    epoch_total,
    seeded_rng,
)


def test_the_main_process_is_rank_0_of_1_worker_0_of_1() -> None:
    assert Topology.current() == Topology(0, 1, 0, 1)
    assert Topology.current(rank=2, world_size=3) == Topology(2, 3, 0, 1)
    assert distributed_info() == (0, 1)


@pytest.mark.parametrize(
    "fields",
    [
        {"rank": 1, "world_size": 1},
        {"rank": -1, "world_size": 2},
        {"world_size": 0},
        {"worker": 2, "num_workers": 2},
        {"num_workers": 0},
    ],
)
def test_impossible_places_are_refused(fields: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="need 0 <="):
        Topology(**fields)


def test_topology_is_a_frozen_value() -> None:
    here = Topology(1, 2, 0, 3)
    assert here == Topology(1, 2, 0, 3) and hash(here) == hash(Topology(1, 2, 0, 3))
    with pytest.raises(AttributeError):
        here.rank = 0  # type: ignore[misc]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 60), world=st.integers(1, 7), drop_last=st.booleans())
def test_ranks_share_an_epoch_as_distributed_sampler(n: int, world: int, drop_last: bool) -> None:
    total = epoch_total(n, world, drop_last)
    assert total % world == 0
    assert total == (n // world * world if drop_last else -(-n // world) * world)
    order = np.arange(100, 100 + n)
    padded = np.resize(order, total)
    assert len(padded) == total and list(padded[: min(n, total)]) == list(order[:total])
    if total > n:  # padding repeats the beginning of the order
        assert list(padded[n:]) == list(np.resize(order, total - n))
    shares = [padded[Topology(r, world).rank_slice(n, drop_last)] for r in range(world)]
    assert [len(s) for s in shares] == [Topology(0, world).samples_per_rank(n, drop_last)] * world
    assert list(np.concatenate(shares)) == list(padded)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 50), workers=st.integers(1, 8))
def test_workers_split_a_share_into_near_equal_pieces(n: int, workers: int) -> None:
    pieces = [
        range(n)[Topology(worker=w, num_workers=workers).worker_slice(n)] for w in range(workers)
    ]
    assert [i for piece in pieces for i in piece] == list(range(n))
    assert max(map(len, pieces)) - min(map(len, pieces)) <= 1


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 60), world=st.integers(1, 5), drop_last=st.booleans())
def test_sampler_and_iterable_use_the_same_rank_rule(n: int, world: int, drop_last: bool) -> None:
    positions = np.arange(n, dtype=np.int64)
    for rank in range(world):
        sampler = BlockShuffleSampler(
            n, shuffle=False, rank=rank, world_size=world, drop_last=drop_last
        )
        mine, _ = rank_share(positions, positions.copy(), rank, world, drop_last=drop_last)
        assert list(sampler.indices()) == list(mine)
        assert len(sampler) == len(mine)


def test_worker_share_is_the_topology_rule() -> None:
    positions = np.arange(10)
    got = [list(worker_share(positions, positions, w, 3)[0]) for w in range(3)]
    assert got == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_seeded_streams_are_reproducible_and_independent() -> None:
    a = seeded_rng(7, 0, 3).permutation(50)
    assert list(a) == list(seeded_rng(7, 0, 3).permutation(50))
    assert list(a) != list(seeded_rng(7, 1, 3).permutation(50))
    assert list(a) != list(seeded_rng(8, 0, 3).permutation(50))
    # the sampler's order is the generator of (seed, epoch)
    sampler = BlockShuffleSampler(50, block_size=5, window=2, seed=7)
    sampler.set_epoch(4)
    assert list(BlockShuffleSampler(50, block_size=5, window=2, seed=7).indices()) != list(
        sampler.indices()
    )
    assert seeded_rng(2**64 + 7, 4).integers(1 << 30) == seeded_rng(7, 4).integers(1 << 30)
