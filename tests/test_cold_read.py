"""A cold-cache epoch reads the pack block by block, each block in storage order.

The pages of the pack are evicted first, then every read of record bytes is logged. The test
checks the order of reads, not their speed (timings live in benchmarks/).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

import torch_serialized
from torch_serialized.iterable import VOCSerializedIterableDataset
from torch_serialized.reader import ContainerReader
from torch_serialized.voc.synthetic import make_synthetic_voc


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("cold")
    root = make_synthetic_voc(tmp / "src", 60, year="2007")
    return {
        "single": torch_serialized.pack_voc(root, tmp / "one.tser", year="2007").path,
        "shards": torch_serialized.pack_voc(
            root, tmp / "shards", year="2007", max_samples_per_shard=7
        ).path,
    }


def evict(path: Path) -> None:
    files = sorted(path.glob("*.tser")) if path.is_dir() else [path]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
@pytest.mark.parametrize("kind", ["single", "shards"])
@pytest.mark.parametrize("image_set", ["test", "trainval"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_cold_epoch_reads_each_block_in_storage_order(
    packs, monkeypatch, kind, image_set, shuffle
) -> None:
    ds = VOCSerializedIterableDataset(
        packs[kind], image_set, shuffle=shuffle, block_size=5, shuffle_buffer=8, decode="none"
    )
    ds.set_epoch(1)
    reader = ds.pack.reader
    shard_start = {s.path: int(reader.starts[i]) for i, s in enumerate(reader.shards)}
    log: list[tuple[str, int]] = []  # ("read", global record) / ("advise", global record)
    field, madvise = ContainerReader.field, ContainerReader.madvise

    def logged_field(self: ContainerReader, i: int, k: int) -> memoryview:
        log.append(("read", shard_start[self.path] + i))
        return field(self, i, k)

    def logged_madvise(self: ContainerReader, option: int, start: int = 0, length=None) -> None:
        if option == mmap.MADV_WILLNEED:
            local = self._offsets[:, 0]  # type: ignore[index]
            hit = np.flatnonzero((local >= start) & (local < start + (length or 0)))
            log.extend(("advise", shard_start[self.path] + int(i)) for i in hit)
        madvise(self, option, start, length)

    monkeypatch.setattr(ContainerReader, "field", logged_field)
    monkeypatch.setattr(ContainerReader, "madvise", logged_madvise)
    evict(packs[kind])
    samples = list(ds)

    blocks = ds.blocks()
    assert len(samples) == sum(len(b) for b in blocks) == len(ds.records)
    reads = [r for op, r in log if op == "read"]
    fields = 2  # image and target bytes, each read once
    assert len(reads) == fields * len(ds.records)
    at = 0
    advised: set[int] = set()
    entries = iter(log)
    for block in blocks:
        records = ds.records[block]
        chunk = reads[at : at + fields * len(block)]
        at += len(chunk)
        assert chunk == sorted(chunk), "a block is read in storage order"
        assert sorted(set(chunk)) == sorted(records.tolist())
        for op, record in entries:  # advice for a block comes before its first read
            if op == "advise":
                advised.add(record)
            elif record == chunk[0]:
                break
        assert set(records.tolist()) <= advised
