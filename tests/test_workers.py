"""worker_init_fn: finds our datasets in wrappers, reopens idempotently, works per start method."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _reliability_helpers import PidDataset, list_collate, pin_mmap_threshold
from torch.utils.data import ConcatDataset, DataLoader, Subset
from torchvision.datasets import wrap_dataset_for_transforms_v2

import torch_serialized
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
    shard = ds.pack.reader.shard(0)
    before = shard._local
    ts.workers.reopen_dataset(ds)
    ts.workers.reopen_dataset(ds)
    assert shard._local is before  # same process: nothing to do, nothing dropped
    assert _bytes_of(ds[0]) == _bytes_of(
        ts.VOCSerializedDataset(synthetic_packs.single, "train", decode="none")[0]
    )


@pytest.mark.parametrize(
    "method",
    [
        "fork",
        pytest.param("spawn", marks=pytest.mark.slow),
        pytest.param("forkserver", marks=pytest.mark.slow),
    ],
)
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
        # one worker where each costs a torch import (the six such runs took 70 s of CI)
        num_workers=2 if method == "fork" else 1,
        collate_fn=first_item,
        multiprocessing_context=method,
        worker_init_fn=ts.worker_init_fn if use_init else None,
        persistent_workers=True,
    )
    for _ in range(2):  # persistent workers keep their maps across epochs
        assert [_bytes_of(sample) for sample in loader] == expected


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def uss(pid: int) -> int:
    """Unique set size: private clean + private dirty bytes (``smaps_rollup``)."""
    total = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        if key in ("Private_Clean", "Private_Dirty"):
            total += int(value.split()[0]) * 1024
    return total


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_twenty_epochs_with_persistent_workers_keep_fds_and_memory_flat(voc40_packs):
    if not Path("/proc/self/smaps_rollup").exists():
        pytest.skip("needs /proc/<pid>/smaps_rollup (Linux >= 4.14)")
    if not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("needs glibc's mallopt (see pin_mmap_threshold)")
    from torch.utils.data import DataLoader

    dataset = PidDataset(
        torch_serialized.VOCSerializedDataset(voc40_packs["single"], "trainval", decode="tensor")
    )
    loader = DataLoader(
        dataset,  # type: ignore[arg-type]
        batch_size=8,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        collate_fn=list_collate,
        worker_init_fn=pin_mmap_threshold,  # allocator caching is not a leak: see its doc
        # spawn, not fork: a forked worker's USS also grows as its refcount and GC writes copy
        # the pages it shares with this (test-suite-sized) parent, which says nothing of ours
        multiprocessing_context="spawn",
    )
    seen: dict[int, tuple[dict[int, tuple[int, int]], int]] = {}
    for epoch in range(1, 21):
        pids, count = set(), 0
        for batch in loader:
            for pid, (image, target) in batch:
                assert image.ndim == 3 and image.shape[0] == 3 and "annotation" in target
                pids.add(pid)
                count += 1
        assert count == len(dataset)
        if epoch in (2, 20):
            seen[epoch] = ({pid: (open_fds(pid), uss(pid)) for pid in pids}, open_fds(os.getpid()))
    workers_2, main_2 = seen[2]
    workers_20, main_20 = seen[20]
    assert len(workers_2) == 2 and set(workers_2) == set(workers_20)
    assert os.getpid() not in workers_2
    for pid, (fds, memory) in workers_2.items():
        assert workers_20[pid][0] == fds, f"worker {pid}: open fds {fds} -> {workers_20[pid][0]}"
        growth = workers_20[pid][1] - memory
        assert growth < 5 << 20, f"worker {pid}: USS grew {growth / 2**20:.1f} MiB"
    assert main_20 == main_2, f"main process: open fds {main_2} -> {main_20}"
    del loader
