"""Resume state: the Stateful protocol and the key names the iterable dataset's state uses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from torch_serialized import BlockShuffleSampler, VOCSerializedDataset, VOCSerializedIterableDataset
from torch_serialized import state as keys
from torch_serialized.state import Stateful


def test_the_iterable_dataset_is_stateful(stream_packs: dict[str, Any]) -> None:
    ds = VOCSerializedIterableDataset(stream_packs["single"], "train", decode="none")
    assert isinstance(ds, Stateful) and issubclass(VOCSerializedIterableDataset, Stateful)
    # map-style datasets hold no position: with them the sampler's state is the state
    assert not isinstance(VOCSerializedDataset(stream_packs["single"], "train"), Stateful)
    assert not isinstance(BlockShuffleSampler(10), Stateful)


def test_torchdata_sees_the_same_protocol(stream_packs: dict[str, Any]) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader").Stateful
    ds = VOCSerializedIterableDataset(stream_packs["single"], "train", decode="none")
    assert isinstance(ds, stateful)


def test_state_keys_are_the_named_ones(stream_packs: dict[str, Any]) -> None:
    ds = VOCSerializedIterableDataset(stream_packs["shards"], "trainval", shuffle=True, seed=3)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    expected = [keys.VERSION, keys.EPOCH, keys.YIELDED, *keys.TOPOLOGY_KEYS, *keys.ORDER_KEYS]
    assert list(state) == expected
    assert state[keys.VERSION] == keys.STATE_VERSION and state[keys.YIELDED] == 1
    assert json.loads(json.dumps(state)) == state  # JSON-compatible


def test_a_state_of_another_version_is_refused(stream_packs: dict[str, Any]) -> None:
    ds = VOCSerializedIterableDataset(stream_packs["single"], "train")
    state = {**ds.state_dict(), keys.VERSION: keys.STATE_VERSION + 1}
    with pytest.raises(ValueError, match="state version"):
        ds.load_state_dict(state)
