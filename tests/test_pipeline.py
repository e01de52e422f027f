"""The streaming stages alone: block plans partition an epoch, the shuffle buffer is bounded."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_serialized.pipeline import (
    block_bounds,
    epoch_order,
    rank_share,
    shuffle_buffer,
    split_blocks,
    worker_share,
)


# -- stages -----------------------------------------------------------------------------------
def test_block_bounds_cut_at_shards_only_for_ordered_lists() -> None:
    starts = np.array([0, 5, 10])
    ordered = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert list(block_bounds(ordered, starts, 3)) == [0, 3, 4, 7, 9]
    interleaved = np.array([5, 6, 0, 1, 7, 2])
    assert list(block_bounds(interleaved, starts, 4)) == [0, 4, 6]
    assert list(block_bounds(np.zeros(0, np.int64), starts, 4)) == [0]
    assert list(block_bounds(ordered, np.array([0, 10]), 4)) == [0, 4, 8, 9]


def expected_counts(n: int, world: int, drop_last: bool) -> tuple[int, int]:
    """(samples per rank, samples in all) as DistributedSampler."""
    per_rank = n // world if drop_last else -(-n // world)
    return per_rank, per_rank * world


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 40),
    block=st.integers(1, 9),
    world=st.integers(1, 5),
    workers=st.integers(1, 4),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    epoch=st.integers(0, 3),
)
def test_plan_partitions_the_epoch(n, block, world, workers, shuffle, drop_last, epoch) -> None:
    bounds = np.append(np.arange(0, n, block), n) if n else np.zeros(1, np.int64)
    positions, ids = epoch_order(bounds, shuffle=shuffle, seed=3, epoch=epoch)
    assert sorted(positions.tolist()) == list(range(n))
    per_rank, total = expected_counts(n, world, drop_last)
    got: list[int] = []
    for rank in range(world):
        share = rank_share(positions, ids, rank, world, drop_last=drop_last)
        assert len(share[0]) == per_rank
        sizes = []
        for w in range(workers):
            blocks = split_blocks(*worker_share(*share, w, workers))
            sizes.append(sum(len(b) for b in blocks))
            for b in blocks:
                assert len(b) <= block
                assert list(b) == list(range(b[0], b[0] + len(b)))  # a run of one block
                got += b.tolist()
        assert max(sizes) - min(sizes) <= 1
    assert len(got) == total
    if drop_last:
        assert len(set(got)) == total
    else:
        assert set(got) == set(range(n))
        assert got[n:] == (got[:n] * world)[: total - n]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 50), size=st.integers(0, 12), seed=st.integers(0, 2**32))
def test_shuffle_buffer_is_a_bounded_permutation(n, size, seed) -> None:
    rng = np.random.default_rng(seed)
    out = list(shuffle_buffer(range(n), size, rng))
    assert sorted(out) == list(range(n))
    assert all(i >= item - max(size, 1) for i, item in enumerate(out))
    again = list(shuffle_buffer(range(n), size, np.random.default_rng(seed)))
    assert out == again


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 3000), size=st.integers(0, 300), seed=st.integers(0, 2**32))
def test_shuffle_buffer_draws_in_chunks_with_the_same_stream(n, size, seed) -> None:
    """Announcing the total only batches the random draws: the order is the one-by-one one."""
    one_by_one = list(shuffle_buffer(range(n), size, np.random.default_rng(seed)))
    chunked = list(shuffle_buffer(range(n), size, np.random.default_rng(seed), total=n))
    assert chunked == one_by_one
