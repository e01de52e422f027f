"""Resume state: the Stateful protocol and the key names the iterable dataset's and the
sampler's states use."""

from __future__ import annotations

import json
from typing import Any

import pytest

from torch_serialized import BlockShuffleSampler, VOCSerializedDataset, VOCSerializedIterableDataset
from torch_serialized.data.state import STATE_VERSION, Stateful

TOPOLOGY = ["rank", "world_size", "worker", "num_workers"]
ORDER = ["num_samples", "shuffle", "seed", "drop_last", "block_size"]


def test_the_iterable_dataset_and_the_sampler_are_stateful(stream_packs: dict[str, Any]) -> None:
    ds = VOCSerializedIterableDataset(stream_packs["single"], "train", decode="none")
    assert isinstance(ds, Stateful) and issubclass(VOCSerializedIterableDataset, Stateful)
    assert isinstance(BlockShuffleSampler(10), Stateful)
    assert issubclass(BlockShuffleSampler, Stateful)
    # map-style datasets hold no position: with them the sampler's state is the state
    assert not isinstance(VOCSerializedDataset(stream_packs["single"], image_set="train"), Stateful)


def test_torchdata_sees_the_same_protocol(stream_packs: dict[str, Any]) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader").Stateful
    ds = VOCSerializedIterableDataset(stream_packs["single"], "train", decode="none")
    assert isinstance(ds, stateful)
    assert isinstance(BlockShuffleSampler(10), stateful)


def test_state_keys_are_the_named_ones(stream_packs: dict[str, Any]) -> None:
    ds = VOCSerializedIterableDataset(stream_packs["shards"], "trainval", shuffle=True, seed=3)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    expected = [
        "version",
        "epoch",
        "yielded",
        *TOPOLOGY,
        *ORDER,
        "shuffle_buffer",
        "shares",
        "after",
    ]
    expected.append("pack")
    assert list(state) == expected
    assert state["version"] == STATE_VERSION and state["yielded"] == 1
    assert json.loads(json.dumps(state)) == state  # JSON-compatible


def test_a_state_of_another_version_is_refused(stream_packs: dict[str, Any]) -> None:
    ds = VOCSerializedIterableDataset(stream_packs["single"], "train")
    state = {**ds.state_dict(), "version": STATE_VERSION + 1}
    with pytest.raises(ValueError, match="state version"):
        ds.load_state_dict(state)


def test_sampler_state_keys_are_the_named_ones() -> None:
    sampler = BlockShuffleSampler(100, block_size=8, seed=1)
    it = iter(sampler)
    next(it)
    state = sampler.state_dict()
    expected = ["version", "epoch", "yielded", *TOPOLOGY[:2], *ORDER, "window"]
    assert list(state) == expected
    assert state["yielded"] == 1
    assert json.loads(json.dumps(state)) == state


def test_a_state_of_another_class_is_refused(stream_packs: dict[str, Any]) -> None:
    dataset = VOCSerializedIterableDataset(stream_packs["single"], "train")
    sampler = BlockShuffleSampler(10)
    sampler.load_state_dict(dataset.state_dict())
    with pytest.raises(ValueError, match="cannot resume BlockShuffleSampler.*window: saved None"):
        iter(sampler)
    dataset.load_state_dict(BlockShuffleSampler(10).state_dict())
    with pytest.raises(ValueError, match="cannot resume .*worker: saved None"):
        iter(dataset)
    with pytest.raises(ValueError, match="state version"):
        BlockShuffleSampler(10).load_state_dict({"version": 99})
