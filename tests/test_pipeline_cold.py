"""A cold-cache epoch reads the pack block by block, each block in storage order.

The pages of the pack are evicted first, then every read of record bytes is logged. The test
checks the order of reads, not their speed (timings live in benchmarks/).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from tsbench.system import PageCache

from torch_serialized.container import reader as reader_module
from torch_serialized.container.reader import ContainerReader
from torch_serialized.data.iterable import VOCSerializedIterableDataset


def evict(path: Path) -> None:
    files = sorted(path.glob("*.tser")) if path.is_dir() else [path]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_copy(path: Path, tmp_path: Path) -> Path:
    """A private copy of the pack at ``path``, its pages evicted.

    Never the session's pack itself: a dataset of an earlier test that is still alive (not yet
    collected, or held by a generator) keeps that pack mapped, and the kernel does not drop
    mapped pages, so the "cold" epoch would find them cached and send no hint.
    """
    copy = tmp_path / path.name
    if path.is_dir():
        shutil.copytree(path, copy)
    else:
        shutil.copy(path, copy)
    evict(copy)
    return copy


def resident(fd: int, offset: int) -> bool:
    """The reader's cache probe for this module's hint test, asked with ``mincore``
    (``PageCache.page_cached``): a pure query. The reader's own probe (``reader._cached``, a
    ``preadv(RWF_NOWAIT)``) may start the kernel's read-ahead, and on a fast disk finish it
    before it returns, so on such a disk a cold block can answer "cached" to it by chance."""
    cached = PageCache().page_cached(fd, offset)
    if cached is None:
        pytest.skip("mincore cannot tell what is cached here")
    return cached


def evict_after_open(path: Path) -> None:
    """Evict the pack again once a dataset has opened it. Opening maps the file, and the
    kernel's read-around of the first fault (up to the device's read-ahead: 8 MiB on the
    benchmark machine, the whole test pack) may still be running when the epoch starts, so
    its first blocks would look cached by chance. Reading every byte waits for that I/O;
    then the pages drop (all but those the dataset's map holds)."""
    files = sorted(path.glob("*.tser")) if path.is_dir() else [path]
    for file in files:
        file.read_bytes()
    evict(path)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
@pytest.mark.parametrize("kind", ["single", "shards"])
@pytest.mark.parametrize("image_set", ["test", "trainval"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_cold_epoch_reads_each_block_in_storage_order(
    stream_packs, monkeypatch, tmp_path, kind, image_set, shuffle
) -> None:
    """Each block is looked up run by run, each run ascending and the runs moving forward
    through the file, every record of the block exactly once; no record is read apart."""
    ds = VOCSerializedIterableDataset(
        cold_copy(stream_packs[kind], tmp_path),
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
    calls: list[list[int]] = []  # global records of each lookup, in lookup order
    views = ContainerReader.views

    def logged_views(self: ContainerReader, records, fields):  # type: ignore[no-untyped-def]
        calls.append([shard_start[self.path] + int(r) for r in records])
        return views(self, records, fields)

    def no_field(self: ContainerReader, i: int, k: int) -> memoryview:
        raise AssertionError("the iterable reads whole runs, never one field at a time")

    monkeypatch.setattr(ContainerReader, "views", logged_views)
    monkeypatch.setattr(ContainerReader, "field", no_field)
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
def test_each_block_is_hinted_before_it_is_read(stream_packs, monkeypatch, tmp_path, kind) -> None:
    """On a cold cache every block's runs are hinted to the kernel (WILLNEED) before the
    block is used, blocks ahead of the one in use, so their disk reads overlap decoding;
    on a warm cache the reader's probe finds the runs cached and sends no hint. The probe is
    ``mincore`` here (``resident``): this test checks the planning, not how fast the disk
    answers the reader's own probe."""

    path = cold_copy(stream_packs[kind], tmp_path)
    ds = VOCSerializedIterableDataset(
        path, "trainval", shuffle=True, block_size=5, shuffle_buffer=0, decode="none"
    )
    reader = ds.pack.reader
    for s in range(reader.num_shards):
        reader.shard(s).reopen()  # every file the epoch reads is open and mapped before...
    evict_after_open(path)  # ...the eviction that makes the epoch cold
    start_of = {str(reader.shard_path(i)): int(reader.starts[i]) for i in range(reader.num_shards)}
    hinted: set[int] = set()
    order_ok: list[bool] = []
    ahead: list[int] = []  # records hinted or found cached but not yet read, at each read
    advised: list[tuple[int, int, int]] = []
    prefetch, views = ContainerReader.prefetch, ContainerReader.views
    fadvise = os.posix_fadvise
    read: set[int] = set()

    def logged_prefetch(self: ContainerReader, records) -> None:  # type: ignore[no-untyped-def]
        hinted.update(start_of[self.path] + int(r) for r in records)
        prefetch(self, records)

    def logged_views(self: ContainerReader, records, fields):  # type: ignore[no-untyped-def]
        order_ok.extend(start_of[self.path] + int(r) in hinted for r in records)
        read.update(start_of[self.path] + int(r) for r in records)
        ahead.append(len(hinted - read))  # hinted ahead of use
        return views(self, records, fields)

    def logged_fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        advised.append((offset, length, advice))
        fadvise(fd, offset, length, advice)

    monkeypatch.setattr(ContainerReader, "prefetch", logged_prefetch)
    monkeypatch.setattr(ContainerReader, "views", logged_views)
    monkeypatch.setattr(reader_module.os, "posix_fadvise", logged_fadvise)
    monkeypatch.setattr(reader_module, "_cached", resident)
    assert len(list(ds)) == len(ds.records)

    assert order_ok and all(order_ok), "every record is hinted before it is read"
    assert hinted == set(ds.records.tolist())
    assert ds.records[ds.blocks()[0]].tolist()[0] in hinted, "a cold epoch starts with hints"
    assert max(ahead) > 5, "hints run ahead of the block in use"
    assert advised and all(a == os.POSIX_FADV_WILLNEED and n > 0 for _, n, a in advised)

    shard = reader.shard(0)
    if not reader_module._cached(shard._mapped().fd, shard.size - 1):
        pytest.skip("this file system cannot tell what is cached (RWF_NOWAIT)")
    advised.clear()  # now warm: the same epoch again sends no hint
    assert len(list(ds)) == len(ds.records)
    assert advised == []
