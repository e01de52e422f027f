"""Contracts of BlockShuffleSampler: a permutation, deterministic, local, split like
DistributedSampler."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

from torch_serialized.data.samplers import BlockShuffleSampler, block_shuffle


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 300),
    block=st.integers(1, 20),
    window=st.integers(1, 6),
    seed=st.integers(0, 99),
)
def test_block_shuffle_is_a_permutation_kept_within_windows(n, block, window, seed) -> None:
    order = block_shuffle(n, block, window, np.random.default_rng(seed))
    assert sorted(order.tolist()) == list(range(n))
    where = np.empty(n, dtype=np.int64)
    where[order] = np.arange(n)
    for start in range(0, n, block):  # a block's indices stay within one window
        spots = where[start : start + block]
        assert spots.max() - spots.min() < block * window


def test_indices_are_mixed_within_each_window() -> None:
    """Blocks are not only reordered: each window's indices come out mixed together, so no
    block is handed out as its own run of consecutive indices."""
    order = block_shuffle(64, 4, 4, np.random.default_rng(0))
    for start in range(0, 64, 16):
        window = order[start : start + 16]
        assert len(set((window // 4).tolist())) == 4  # four whole blocks per window
        runs = [window[k : k + 4] for k in range(0, 16, 4)]
        assert not all(np.array_equal(run, np.arange(run[0], run[0] + 4)) for run in runs)


def test_sampler_is_deterministic_per_epoch_and_changes_between_epochs() -> None:
    a = BlockShuffleSampler(1000, block_size=16, seed=5)
    b = BlockShuffleSampler(1000, block_size=16, seed=5)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    assert sorted(a) == list(range(1000))
    assert list(BlockShuffleSampler(1000, block_size=16, seed=6)) != first


def test_reads_stay_local() -> None:
    """Most consecutive indices lie in blocks drawn within the current window."""
    order = list(BlockShuffleSampler(4096, block_size=64, window=4))
    windows = [set(np.array(order[i : i + 256]) // 64) for i in range(0, 4096, 256)]
    assert all(len(w) == 4 for w in windows)
    assert order != sorted(order)


def test_no_shuffle_is_in_order() -> None:
    assert list(BlockShuffleSampler(range(10), shuffle=False)) == list(range(10))


@pytest.mark.parametrize("n", [0, 1, 7, 100, 101])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_distributed_split_matches_distributed_sampler_counts(n, world, drop_last, shuffle) -> None:
    samplers = [
        BlockShuffleSampler(
            n, block_size=8, rank=r, world_size=world, drop_last=drop_last, shuffle=shuffle
        )
        for r in range(world)
    ]
    reference = DistributedSampler(
        range(n), num_replicas=world, rank=0, drop_last=drop_last, shuffle=False
    )
    lists = [list(s) for s in samplers]
    assert [len(x) for x in lists] == [len(s) for s in samplers] == [len(reference)] * world
    seen = [i for x in lists for i in x]
    if drop_last:
        assert len(seen) == len(set(seen))
    else:
        assert set(seen) == set(range(n))
        assert len(seen) - n == len(reference) * world - n
    if n and not drop_last and not shuffle:
        assert seen == (list(range(n)) * world)[: len(seen)]


def test_ranks_share_one_epoch_order() -> None:
    whole = list(BlockShuffleSampler(90, block_size=8, seed=2))
    parts = [BlockShuffleSampler(90, block_size=8, seed=2, rank=r, world_size=3) for r in range(3)]
    for s in parts:
        s.set_epoch(0)
    assert [i for s in parts for i in s] == whole


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        BlockShuffleSampler(10, block_size=0)
    with pytest.raises(ValueError):
        BlockShuffleSampler(10, window=0)
    with pytest.raises(ValueError):
        BlockShuffleSampler(10, rank=3, world_size=3)


def test_works_as_a_dataloader_sampler() -> None:
    data = list(range(50))
    loader = DataLoader(data, batch_size=8, sampler=BlockShuffleSampler(data, block_size=4))
    assert sorted(int(i) for batch in loader for i in batch) == data


# -- resuming (torchdata's Stateful protocol) ---------------------------------------------------
N, BATCH, STOP = 400, 10, 5  # the case: 400 samples, stop after 50


def _epoch_order(epoch: int, **kwargs: object) -> list[int]:
    sampler = BlockShuffleSampler(N, block_size=16, seed=3, **kwargs)  # type: ignore[arg-type]
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata 0.11
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("epoch", [0, 1])
@pytest.mark.parametrize("set_epoch_again", [True, False], ids=["set_epoch", "no_set_epoch"])
def test_resume_through_stateful_dataloader(
    workers: int, epoch: int, set_epoch_again: bool
) -> None:
    """Stopped after 50 of 400 samples in ``epoch``, a new loader with a new sampler resumes:
    every sample of that epoch exactly once, in the epoch's order; the next epoch is whole."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def loader(sampler: BlockShuffleSampler) -> Any:
        return stateful.StatefulDataLoader(
            list(range(N)), batch_size=BATCH, sampler=sampler, num_workers=workers
        )

    sampler = BlockShuffleSampler(N, block_size=16, seed=3)
    first = loader(sampler)
    for earlier in range(epoch):
        sampler.set_epoch(earlier)
        assert sorted(int(i) for b in first for i in b) == list(range(N))
    sampler.set_epoch(epoch)
    batches = iter(first)
    seen = [int(i) for _ in range(STOP) for i in next(batches)]
    state = first.state_dict()
    del batches

    resumed = BlockShuffleSampler(N, block_size=16, seed=3)  # a new process: epoch 0
    second = loader(resumed)
    second.load_state_dict(state)
    if set_epoch_again:
        resumed.set_epoch(epoch)
    rest = [int(i) for b in second for i in b]
    assert len(seen) == STOP * BATCH
    assert seen + rest == _epoch_order(epoch)  # the whole epoch, each sample once, in order
    resumed.set_epoch(epoch + 1)
    assert [int(i) for b in second for i in b] == _epoch_order(epoch + 1)


def test_resume_of_one_rank_continues_its_share() -> None:
    sampler = BlockShuffleSampler(N, block_size=16, seed=3, rank=1, world_size=3)
    sampler.set_epoch(2)
    it = iter(sampler)
    head = [next(it) for _ in range(17)]
    state = json.loads(json.dumps(sampler.state_dict()))
    resumed = BlockShuffleSampler(N, block_size=16, seed=3, rank=1, world_size=3)
    resumed.load_state_dict(state)
    assert resumed.epoch == 2 and resumed.state_dict() == state
    assert head + list(resumed) == _epoch_order(2, rank=1, world_size=3)
    assert list(resumed) == _epoch_order(2, rank=1, world_size=3)  # then whole epochs again


def test_set_epoch_to_another_epoch_drops_a_loaded_position() -> None:
    sampler = BlockShuffleSampler(N, block_size=16, seed=3)
    it = iter(sampler)
    for _ in range(30):
        next(it)
    state = sampler.state_dict()
    resumed = BlockShuffleSampler(N, block_size=16, seed=3)
    resumed.load_state_dict(state)
    resumed.set_epoch(4)
    assert list(resumed) == _epoch_order(4)


@pytest.mark.parametrize(
    "change",
    [{"seed": 4}, {"block_size": 8}, {"window": 2}, {"shuffle": False}, {"drop_last": True}],
)
def test_resume_with_other_settings_is_refused(change: dict[str, Any]) -> None:
    sampler = BlockShuffleSampler(N, block_size=16, seed=3)
    next(iter(sampler))
    state = sampler.state_dict()
    other = BlockShuffleSampler(N, **{"block_size": 16, "seed": 3, **change})  # type: ignore[arg-type]
    other.load_state_dict(state)
    assert other.state_dict() == state  # loaded, not yet iterated: still the saved point
    with pytest.raises(
        ValueError, match=f"cannot resume BlockShuffleSampler.*{next(iter(change))}"
    ):
        iter(other)


def test_resume_with_another_length_or_world_is_refused() -> None:
    sampler = BlockShuffleSampler(N, seed=3)
    state = sampler.state_dict()
    for other in (
        BlockShuffleSampler(N + 1, seed=3),
        BlockShuffleSampler(N, seed=3, rank=0, world_size=2),
    ):
        other.load_state_dict(state)
        with pytest.raises(ValueError, match="cannot resume"):
            list(other)
    with pytest.raises(ValueError, match="negative"):
        sampler.load_state_dict({**state, "yielded": -1})


def test_resume_on_another_pack_of_the_same_size_is_refused(stream_packs, tmp_path) -> None:
    """Given a torch_serialized dataset, the state names its samples: a re-pack of the same
    source (same length) is refused; a sampler given a length cannot tell, and does not try."""
    import torch_serialized as ts

    source = stream_packs["single"].parent / "src"
    again = ts.pack_voc(source, tmp_path / "again.tser", year="2007").path
    sampler = BlockShuffleSampler(
        ts.VOCSerializedDataset(stream_packs["single"], image_set="trainval")
    )
    it = iter(sampler)
    next(it)
    state = json.loads(json.dumps(sampler.state_dict()))
    assert "pack" in state and "pack" not in BlockShuffleSampler(len(sampler)).state_dict()
    other = BlockShuffleSampler(ts.VOCSerializedDataset(again, image_set="trainval"))
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="saved on other samples"):
        iter(other)
    by_length = BlockShuffleSampler(len(sampler))
    by_length.load_state_dict(state)
    assert len(list(by_length)) == len(sampler) - 1
