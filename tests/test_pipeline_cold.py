"""A cold-cache epoch reads the pack block by block, each block in storage order.

The pages of the pack are evicted first, then every read of record bytes is logged. The test
checks the order of reads, not their speed (timings live in benchmarks/).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from torch_serialized import reader as reader_module
from torch_serialized.iterable import VOCSerializedIterableDataset
from torch_serialized.reader import ContainerReader


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
    stream_packs, monkeypatch, kind, image_set, shuffle
) -> None:
    ds = VOCSerializedIterableDataset(
        stream_packs[kind],
        image_set,
        shuffle=shuffle,
        block_size=5,
        shuffle_buffer=8,
        decode="none",
    )
    ds.set_epoch(1)
    reader = ds.pack.reader
    shard_start = {
        str(reader.shard_path(i)): int(reader.starts[i]) for i in range(reader.num_shards)
    }
    calls: list[list[int]] = []  # global records of each read request, in request order
    read_records = ContainerReader.read_records

    def logged_read_records(self: ContainerReader, records, fields):  # type: ignore[no-untyped-def]
        calls.append([shard_start[self.path] + int(r) for r in records])
        return read_records(self, records, fields)

    def no_field(self: ContainerReader, i: int, k: int) -> memoryview:
        raise AssertionError("the iterable must not read record bytes through page faults")

    monkeypatch.setattr(ContainerReader, "read_records", logged_read_records)
    monkeypatch.setattr(ContainerReader, "field", no_field)
    evict(stream_packs[kind])
    samples = list(ds)

    blocks = ds.blocks()
    assert len(samples) == sum(len(b) for b in blocks) == len(ds.records)
    requests = iter(calls)
    for block in blocks:
        records = sorted(set(ds.records[block].tolist()))
        got: list[int] = []
        previous_end = -1
        while len(got) < len(records):  # the requests of this block, in storage order
            request = next(requests)
            assert request == sorted(request), "one request reads its records in order"
            assert request[0] > previous_end, "a block's requests move forward through the file"
            previous_end = request[-1]
            got.extend(request)
        assert got == records, "each record of the block is read exactly once"
        assert len(ds.records[block]) == len(block)
    assert next(requests, None) is None


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
@pytest.mark.parametrize("kind", ["single", "shards"])
def test_each_block_is_hinted_before_it_is_read(stream_packs, monkeypatch, kind) -> None:
    """Before reading a block the reader asks the kernel to start on the next one, so on a
    cold disk their reads overlap: every record after the first block is hinted first."""

    ds = VOCSerializedIterableDataset(
        stream_packs[kind], "trainval", shuffle=True, block_size=5, shuffle_buffer=0, decode="none"
    )
    reader = ds.pack.reader
    start_of = {str(reader.shard_path(i)): int(reader.starts[i]) for i in range(reader.num_shards)}
    hinted: set[int] = set()
    order_ok: list[bool] = []
    advised: list[tuple[int, int, int]] = []
    prefetch, read_records = ContainerReader.prefetch, ContainerReader.read_records
    fadvise = os.posix_fadvise

    def logged_prefetch(self: ContainerReader, records) -> None:  # type: ignore[no-untyped-def]
        hinted.update(start_of[self.path] + int(r) for r in records)
        prefetch(self, records)

    def logged_read_records(self: ContainerReader, records, fields):  # type: ignore[no-untyped-def]
        order_ok.extend(start_of[self.path] + int(r) in hinted for r in records)
        return read_records(self, records, fields)

    def logged_fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        advised.append((offset, length, advice))
        fadvise(fd, offset, length, advice)

    monkeypatch.setattr(ContainerReader, "prefetch", logged_prefetch)
    monkeypatch.setattr(ContainerReader, "read_records", logged_read_records)
    monkeypatch.setattr(reader_module.os, "posix_fadvise", logged_fadvise)
    assert len(list(ds)) == len(ds.records)

    first_block = len(set(ds.records[ds.blocks()[0]].tolist()))
    assert order_ok[first_block:] and all(order_ok[first_block:])
    assert hinted == set(ds.records[np.concatenate(ds.blocks()[1:])].tolist())
    assert advised and all(a == os.POSIX_FADV_WILLNEED and n > 0 for _, n, a in advised)
