"""worker_init_fn: finds our datasets in wrappers, reopens idempotently, works per start method."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Subset
from torchvision.datasets import wrap_dataset_for_transforms_v2

import torch_serialized as ts
from torch_serialized.workers import reopen_dataset


def first_item(batch: list[Any]) -> Any:
    return batch[0]


def _bytes_of(sample: tuple[torch.Tensor, Any]) -> bytes:
    return sample[0].numpy().tobytes()


def test_reopen_finds_datasets_inside_wrappers(synthetic_packs: Any) -> None:
    ds = ts.VOCSerializedDataset(synthetic_packs.single, "train", decode="none")
    seg = ts.VOCSerializedSegmentation(synthetic_packs.shards, "train")
    it = ts.VOCSerializedIterableDataset(synthetic_packs.single, "train")
    assert reopen_dataset(ds) == 1
    assert reopen_dataset(Subset(ds, [0, 1])) == 1
    assert reopen_dataset(ConcatDataset([ds, seg])) == 2
    assert (
        reopen_dataset(
            wrap_dataset_for_transforms_v2(ts.VOCSerializedDataset(synthetic_packs.single))
        )
        == 1
    )
    assert reopen_dataset(it) == 1
    assert reopen_dataset(object()) == 0


def test_reopen_is_idempotent_in_one_process(synthetic_packs: Any) -> None:
    ds = ts.VOCSerializedDataset(synthetic_packs.single, "train", decode="none")
    shard = ds.pack.reader.shards[0]
    before = shard._local
    ts.workers.reopen_dataset(ds)
    ts.workers.reopen_dataset(ds)
    assert shard._local is before  # same process: nothing to do, nothing dropped
    assert _bytes_of(ds[0]) == _bytes_of(
        ts.VOCSerializedDataset(synthetic_packs.single, "train", decode="none")[0]
    )


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize(("use_init", "zero_copy"), [(True, False), (False, False), (False, True)])
def test_worker_init_fn_is_optional_and_harmless(
    synthetic_packs: Any, method: str, use_init: bool, zero_copy: bool
) -> None:
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"{method} is not available here")
    ds = Subset(
        ts.VOCSerializedDataset(
            synthetic_packs.shards, "trainval", decode="none", zero_copy=zero_copy
        ),
        range(12),
    )
    expected = [_bytes_of(ds[i]) for i in range(len(ds))]
    loader = DataLoader(
        ds,
        batch_size=1,
        num_workers=2,
        collate_fn=first_item,
        multiprocessing_context=method,
        worker_init_fn=ts.worker_init_fn if use_init else None,
        persistent_workers=True,
    )
    for _ in range(2):  # persistent workers keep their maps across epochs
        assert [_bytes_of(sample) for sample in loader] == expected
