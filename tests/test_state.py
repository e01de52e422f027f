"""Resume state: the Stateful protocol and the key names the iterable dataset's and the
sampler's states use."""

from __future__ import annotations

import json
from typing import Any

import pytest

from torch_serialized import BlockShuffleSampler, VOCSerializedDataset, VOCSerializedIterableDataset
from torch_serialized.data import state as keys
from torch_serialized.data.state import Stateful


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
        keys.VERSION,
        keys.EPOCH,
        keys.YIELDED,
        *keys.TOPOLOGY_KEYS,
        *keys.ORDER_KEYS,
        keys.PACK,
    ]
    assert list(state) == expected
    assert state[keys.VERSION] == keys.STATE_VERSION and state[keys.YIELDED] == 1
    assert json.loads(json.dumps(state)) == state  # JSON-compatible


def test_a_state_of_another_version_is_refused(stream_packs: dict[str, Any]) -> None:
    ds = VOCSerializedIterableDataset(stream_packs["single"], "train")
    state = {**ds.state_dict(), keys.VERSION: keys.STATE_VERSION + 1}
    with pytest.raises(ValueError, match="state version"):
        ds.load_state_dict(state)


def test_sampler_state_keys_are_the_named_ones() -> None:
    sampler = BlockShuffleSampler(100, block_size=8, seed=1)
    it = iter(sampler)
    next(it)
    state = sampler.state_dict()
    expected = [
        keys.VERSION,
        keys.KIND,
        keys.EPOCH,
        keys.YIELDED,
        *keys.SAMPLER_TOPOLOGY_KEYS,
        *keys.SAMPLER_ORDER_KEYS,
    ]
    assert list(state) == expected
    assert state[keys.YIELDED] == 1 and state[keys.KIND] == "BlockShuffleSampler"
    assert json.loads(json.dumps(state)) == state


def test_a_state_of_another_kind_is_refused(stream_packs: dict[str, Any]) -> None:
    dataset_state = VOCSerializedIterableDataset(stream_packs["single"], "train").state_dict()
    with pytest.raises(ValueError, match="state kind None is not 'BlockShuffleSampler'"):
        BlockShuffleSampler(10).load_state_dict(dataset_state)
    with pytest.raises(ValueError, match="state version"):
        BlockShuffleSampler(10).load_state_dict({keys.VERSION: 99})
