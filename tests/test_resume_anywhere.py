"""Resuming a stream's epoch on another number of ranks or DataLoader workers (issue #35): the
states of every saved rank and worker, merged with ``merge_states``, resume on any topology,
handing out exactly what the saved run had not (each once, but for the padding that keeps the new
ranks' counts equal), through torchdata's ``StatefulDataLoader``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from torch_serialized import (
    BlockShuffleSampler,
    VOCSerializedIterableDataset,
    merge_states,
    pack_voc,
)
from torch_serialized.tools import make_synthetic_voc

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),  # torchdata 0.11
]


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A VOC2012 pack of 40 images (one file) and a VOC2007 one of 26 (shards of 7)."""
    tmp = tmp_path_factory.mktemp("anywhere")
    a = pack_voc(make_synthetic_voc(tmp / "a", 40, seed=1), tmp / "a.tser").path
    root = make_synthetic_voc(tmp / "b", 26, year="2007", seed=2)
    b = pack_voc(root, tmp / "b.shards", year="2007", max_samples_per_shard=7).path
    return [a, b]


def stream(packs: list[Path], world: int = 1, rank: int = 0, **kwargs: Any) -> Any:
    kwargs = {"block_size": 4, "shuffle": True, "seed": 4, "decode": "none", **kwargs}
    ds = VOCSerializedIterableDataset(packs, "trainval", rank=rank, world_size=world, **kwargs)
    ds.set_epoch(3)
    return ds


def key(sample: tuple[Any, dict[str, Any]]) -> str:
    return sample[1]["annotation"]["folder"] + "/" + sample[1]["annotation"]["filename"]


def loader(ds: Any, workers: int, stateful: Any = DataLoader) -> Any:
    return stateful(ds, batch_size=2, num_workers=workers, collate_fn=lambda batch: batch)


def assert_rest(handed: list[str], tails: list[list[str]], everything: Counter[str]) -> None:
    """``tails`` (one per new rank, equal counts) hand out what ``handed`` had not, each once,
    but for fewer repeats than ranks (padding, as ``DistributedSampler``)."""
    rest = everything - Counter(handed)
    assert len({len(tail) for tail in tails}) == 1
    got = Counter(k for tail in tails for k in tail)
    assert not rest - got, "a sample not handed out before is missing"
    padding = got - rest
    assert sum(padding.values()) < len(tails) and set(padding) <= set(rest)
    assert sum(padding.values()) == sum(map(len, tails)) - sum(rest.values())


@pytest.mark.parametrize(
    "saved, resumed, options",
    [
        ((2, 2), (1, 3), {}),
        ((2, 2), (3, 1), {}),
        ((2, 2), (3, 1), {"weights": [1, 3], "epoch_size": 70}),  # repeats the small source
    ],
    ids=["2x2-to-1x3", "2x2-to-3x1", "weighted-2x2-to-3x1"],
)
def test_an_epoch_saved_on_2x2_resumes_on_another_topology(
    packs: list[Path], saved: tuple[int, int], resumed: tuple[int, int], options: dict[str, Any]
) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    everything = Counter(key(s) for s in stream(packs, **options))
    world, workers = saved
    handed, states = [], []
    for rank in range(world):  # each rank stops after a few batches and saves its loader
        saving = loader(stream(packs, world, rank, **options), workers, stateful.StatefulDataLoader)
        it = iter(saving)
        handed += [key(s) for _ in range(3 + rank) for s in next(it)]
        states.append(saving.state_dict())
    world, workers = resumed
    tails = []
    merged = merge_states(states)  # as gathered from every rank with all_gather_object
    for rank in range(world):
        ds = stream(packs, world, rank, **options)
        ds.load_state_dict(merged)
        tails.append([key(s) for batch in loader(ds, workers) for s in batch])
    assert_rest(handed, tails, everything)


def test_a_resumed_epoch_saves_and_resumes_again_anywhere(packs: list[Path]) -> None:
    everything = Counter(key(s) for s in stream(packs))
    handed: list[str] = []

    def stop(datasets: list[Any], counts: list[int]) -> list[dict[str, Any]]:
        states = []
        for ds, count in zip(datasets, counts):
            it = iter(ds)
            handed.extend(key(next(it)) for _ in range(count))
            states.append(ds.state_dict())
        return states

    merged = merge_states(stop([stream(packs, 2, rank) for rank in range(2)], [5, 9]))
    three = [stream(packs, 3, rank) for rank in range(3)]
    for ds in three:
        ds.load_state_dict(merged)
    states = stop(three, [4, 0, 6])
    # on the same topology a state of the resumed epoch resumes as any state does
    again = stream(packs, 3, 2)
    again.load_state_dict(states[2])
    resumed_rank = stream(packs, 3, 2)
    resumed_rank.load_state_dict(merged)
    assert [key(s) for s in again] == [key(s) for s in resumed_rank][6:]
    # and merged again, onto one process
    last = stream(packs)
    last.load_state_dict(merge_states(states))
    assert_rest(handed, [[key(s) for s in last]], everything)
    assert merge_states(states)["progress"]["after"] == merged["progress"]


def test_merging_refuses_what_is_not_one_checkpoint(packs: list[Path]) -> None:
    states = [stream(packs, 2, rank).state_dict() for rank in range(2)]
    with pytest.raises(ValueError, match=r"1 of the 2 states .* missing, e.g. rank 1, worker 0"):
        merge_states(states[:1])
    later = stream(packs, 2, 1)
    later.set_epoch(4)
    with pytest.raises(ValueError, match=r"rank 1, worker 0 differs in \['epoch'\]"):
        merge_states([states[0], later.state_dict()])
    with pytest.raises(ValueError, match="no VOCSerializedIterableDataset state"):
        merge_states([{"sampler": BlockShuffleSampler(10).state_dict()}])
    with pytest.raises(ValueError, match="snapshot_every_n_steps=1"):
        merge_states([{"_snapshot": states, "_steps_since_snapshot": 2}])
    sampler = BlockShuffleSampler(10)
    sampler.load_state_dict(merge_states(states))
    with pytest.raises(ValueError, match="only a VOCSerializedIterableDataset resumes on another"):
        iter(sampler)
    other = stream(packs, 3, 0, seed=5)
    other.load_state_dict(merge_states(states))
    with pytest.raises(ValueError, match="seed: saved 4, now 5"):
        next(iter(other))
