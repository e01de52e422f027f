"""The stages of the streaming dataset, each a plain function that can be tested alone.

``VOCSerializedIterableDataset`` (``iterable``) chains them, as webdataset chains its pipeline::

    block_bounds     image set positions 0..n-1 cut into blocks (runs of neighbouring records)
    epoch_order      the blocks in epoch order (a (seed, epoch) permutation, same on every rank)
    rank_share       padded to equal rank counts (or the remainder dropped); rank's slice
    worker_share     the rank's slice split evenly across DataLoader workers
    split_blocks     a worker's positions regrouped into the blocks they came from
    read_blocks      each block's fields as views of the map, the next blocks hinted ahead
    views_fit        whether a stream may hold views, or must copy (descriptors stay bounded)
    shuffle_buffer   bounded sample mixing (shuffle=True)

then decodes each item as the map-style dataset does. Only positions (integers) travel through
the first five stages, so a plan costs microseconds and resumption can replay it without I/O.
How ranks and workers share an epoch is ``topology``'s rule, shared with the sampler.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ..container.shards import PackReader
from .topology import Topology, epoch_total, pad_or_trim, seeded_rng

#: Independent random streams under one seed: the block order, and the shuffle buffer.
BLOCK_ORDER, BUFFER = 0, 1


# -- plan: positions only ---------------------------------------------------------------------
def block_bounds(records: np.ndarray, shard_starts: np.ndarray, block_size: int) -> np.ndarray:
    """Block boundaries over positions ``0..n-1``: block ``b`` is ``[bounds[b], bounds[b+1])``.

    Blocks hold at most ``block_size`` consecutive positions, and are cut where the shard
    changes when the image set visits the shards in order (train, val, test as packed), so
    each reads one file. An interleaved list (VOC's ``trainval`` mixes the train and val
    regions every few ids) is cut by size only: cut at every shard change it would make
    blocks of two or three samples."""
    n = len(records)
    segments = np.array([0, n], dtype=np.int64)
    if len(shard_starts) > 2:
        shard = np.searchsorted(shard_starts, records, side="right") - 1
        steps = np.diff(shard)
        if bool((steps >= 0).all()):
            segments = np.concatenate([[0], np.flatnonzero(steps) + 1, [n]]).astype(np.int64)
    starts = [np.arange(a, b, block_size) for a, b in zip(segments[:-1], segments[1:])]
    return np.concatenate([*starts, [n]]).astype(np.int64)


def epoch_order(
    bounds: np.ndarray, *, shuffle: bool, seed: int, epoch: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(positions, block_ids)`` of one epoch: whole blocks, shuffled as blocks when asked.

    ``block_ids[i]`` is the rank of the block of ``positions[i]`` in this order (0, 1, ...).
    """
    num_blocks = len(bounds) - 1
    order = (
        seeded_rng(seed, BLOCK_ORDER, epoch).permutation(num_blocks)
        if shuffle
        else np.arange(num_blocks)
    )
    blocks = [np.arange(bounds[b], bounds[b + 1], dtype=np.int64) for b in order]
    positions = np.concatenate([np.zeros(0, np.int64), *blocks])
    return positions, np.repeat(np.arange(num_blocks, dtype=np.int64), np.diff(bounds)[order])


def rank_share(
    positions: np.ndarray,
    block_ids: np.ndarray,
    rank: int,
    world_size: int,
    *,
    drop_last: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """This rank's contiguous slice after making all ranks' counts equal (``topology``'s
    rules, as ``DistributedSampler``): without ``drop_last`` the epoch order is extended with
    its own beginning to a multiple of ``world_size``; with it the tail is cut off. Repeats
    get block ids of their own so a block never mixes a record with its repeat.
    """
    n = len(positions)
    total = epoch_total(n, world_size, drop_last)
    if total > n:
        copy = np.arange(total, dtype=np.int64) // n  # 0 for the original, then 1, 2...
        block_ids = pad_or_trim(block_ids, total) + (int(block_ids.max()) + 1) * copy
    else:
        block_ids = block_ids[:total]
    share = Topology(rank, world_size).rank_slice(n, drop_last)
    return pad_or_trim(positions, total)[share], block_ids[share]


def worker_share(
    positions: np.ndarray, block_ids: np.ndarray, worker: int, num_workers: int
) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``worker``'s contiguous piece of a rank's share; piece sizes differ by at most 1."""
    share = Topology(worker=worker, num_workers=num_workers).worker_slice(len(positions))
    return positions[share], block_ids[share]


def split_blocks(positions: np.ndarray, block_ids: np.ndarray) -> list[np.ndarray]:
    """Positions regrouped into runs that come from one block (a block cut by a share boundary
    becomes a shorter run)."""
    if len(positions) == 0:
        return []
    return np.split(positions, np.flatnonzero(np.diff(block_ids)) + 1)


# -- reading, mixing ---------------------------------------------------------------------------
#: A record's fields as read: views of the map, or private arrays (``read_block(copy=True)``).
Fields = list[memoryview] | list[np.ndarray]


#: One sample between the read and decode stages: ``(global record number, fields)``;
#: ``fields`` is ``None`` for an item planned while replaying a resume (then read by the
#: decode stage).
Item = tuple[int, Fields | None]


class Gate:
    """A switch the resume logic flips: while closed, ``read_blocks`` plans without reading."""

    __slots__ = ("open",)

    def __init__(self, open: bool = True) -> None:
        self.open = open


#: Records at most this far apart (in record numbers) are read with one request, reading
#: through the gap: one large read beats several small ones on a cold disk.
MAX_GAP = 8


def record_runs(reader: PackReader, records: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """The distinct ``records`` as ``(shard, local record numbers)`` runs in storage order.

    A run stays in one shard and has no gap wider than ``MAX_GAP`` records, so it is one
    sequential read.
    """
    ordered = np.unique(records)  # repeated records are read once
    starts = reader.starts
    shard_of = np.searchsorted(starts, ordered, side="right") - 1
    cut = (np.diff(ordered) > MAX_GAP) | (np.diff(shard_of) != 0)
    return [
        (int(shard_of[run[0]]), ordered[run] - int(starts[shard_of[run[0]]]))
        for run in np.split(np.arange(len(ordered)), np.flatnonzero(cut) + 1)
        if len(run)
    ]


def read_block(
    reader: PackReader,
    records: np.ndarray,
    fields: Sequence[int],
    runs: list[tuple[int, np.ndarray]] | None = None,
    *,
    copy: bool = False,
) -> dict[int, Fields]:
    """``fields`` of every record of a block, by global record number, looked up run by run
    (``runs``: ``record_runs(reader, records)``, computed here when not given): read-only
    views of the map with one index lookup per run, or with ``copy`` private arrays read with
    one scatter read per run (see ``views_fit``)."""
    out: dict[int, Fields] = {}
    for shard, local in record_runs(reader, records) if runs is None else runs:
        container = reader.shard(shard)
        rows = container.read_records(local, fields) if copy else container.views(local, fields)
        out.update(zip((local + int(reader.starts[shard])).tolist(), rows))
    return out


def views_fit(reader: PackReader, in_flight: int) -> bool:
    """Whether a stream holding ``in_flight`` records at a time may hold them as views of
    the map rather than private copies: a view keeps its shard's map (on Python < 3.13, a
    file descriptor) alive after the reader closed the shard, so views only while every
    shard can stay open, or shards hold more records than are in flight; with thousands of
    tiny shards, copies, and descriptors bounded by ``max_open_shards``."""
    if reader.num_shards <= reader.max_open_shards:
        return True
    return reader.num_records >= in_flight * reader.num_shards


#: Blocks hinted to the kernel ahead of the one being used (see ``read_blocks``).
AHEAD = 2


def read_blocks(
    blocks: Sequence[np.ndarray],
    records: np.ndarray,
    reader: PackReader,
    fields: Sequence[int],
    gate: Gate | None = None,
    *,
    copy: bool = False,
    shards_ahead: int = 0,
) -> Iterator[Item]:
    """Items of each block in position order, their fields as views of the map (with
    ``copy``, private arrays: ``views_fit``); while ``gate`` is closed (a resume replay),
    without data.

    Before a block is used, the runs of the ``AHEAD`` blocks after it are hinted to the
    kernel (``ContainerReader.prefetch``), so on a cold cache the disk reads ahead while
    this block is decoded (a cold storage-order epoch: 6,160/s with the hints, 3,933/s
    without; benchmarks/README.md). A remote pack's shards are downloaded ``shards_ahead``
    ahead and released after their last block (``ShardWindow``), without kernel hints,
    which would wait for shards still downloading.
    """
    gate = gate or Gate()
    runs: dict[int, list[tuple[int, np.ndarray]]] = {}  # of the blocks hinted, not yet read
    window = None
    if reader.remote is not None and reader.num_shards > 1:
        window = ShardWindow(reader, [records[block] for block in blocks], shards_ahead)

    def hint(b: int) -> None:
        runs[b] = record_runs(reader, records[blocks[b]])
        if window is None:
            for shard, local in runs[b]:
                reader.shard(shard).prefetch(local)

    hinted = 0  # blocks hinted so far
    for b, block in enumerate(blocks):
        recs = records[block]
        listed = recs.tolist()
        if not gate.open:
            yield from zip(listed, itertools.repeat(None))
            continue
        if window is not None:
            window.before(b)
        while hinted <= min(b + AHEAD, len(blocks) - 1):
            hint(hinted)
            hinted += 1
        data = read_block(reader, recs, fields, runs.pop(b, None), copy=copy)
        rows = [data[record] for record in listed]
        if window is not None:
            window.after(b)
        yield from zip(listed, rows)


class ShardWindow:
    """Which shards of a remote pack a stream holds, downloads ahead and releases.

    The window at block ``b``: the shards it reads, then the next ``ahead`` distinct shards
    later blocks read. ``before(b)`` prefetches the window's shards not yet held; ``after(b)``
    releases those not in the next block's window, so a bounded cache may evict them. Each
    worker of each rank downloads only the shards its blocks read.
    """

    #: blocks looked ahead at most for the window (bounds the work per block)
    SCAN = 4096

    def __init__(self, reader: PackReader, block_records: Sequence[np.ndarray], ahead: int):
        self.reader, self.ahead = reader, ahead
        self.shards: list[list[int]] = [
            np.unique(np.searchsorted(reader.starts, recs, side="right") - 1).tolist()
            for recs in block_records
        ]
        self.held: set[int] = set()

    def window(self, b: int) -> list[int]:
        """Block ``b``'s shards, then the next ``ahead`` distinct shards, in order of use."""
        if b >= len(self.shards):
            return []
        own, ahead = self.shards[b], list[int]()
        for later in self.shards[b + 1 : b + 1 + self.SCAN]:
            for s in later:
                if len(ahead) == self.ahead:
                    return own + ahead
                if s not in own and s not in ahead:
                    ahead.append(s)
        return own + ahead

    def before(self, b: int) -> None:
        wanted = [s for s in self.window(b) if s not in self.held]
        if wanted:
            self.reader.prefetch_shards(wanted)
            self.held.update(wanted)

    def after(self, b: int) -> None:
        keep = set(self.window(b + 1))
        for s in sorted(self.held - keep):
            self.reader.release_shard(s)
        self.held &= keep


def shuffle_buffer(
    items: Iterable[Any], size: int, rng: np.random.Generator, total: int | None = None
) -> Iterator[Any]:
    """Mix a stream in a buffer of ``size`` items (webdataset's shuffle, deterministic).

    The buffer fills to ``size``; then each arriving item replaces a uniformly chosen one,
    which is emitted; at the end the rest leaves in random order. An item is never emitted
    more than ``size`` places before its input place, and may leave any time later.

    ``total``, the number of items when known, lets the draws be made in chunks with the very
    same random stream: one numpy call per 1,024 items instead of ~7 µs per item, ~7% of a
    worker's CPU per sample of a shuffled ``decode="none"`` stream (~100 µs).
    """
    if size <= 1:
        yield from items
        return
    buffer: list[Any] = []
    draws: list[int] = []
    left = None if total is None else max(0, total - size)  # draws still to make
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        if not draws:
            if left:
                chunk = min(left, 1024)
                draws = rng.integers(size, size=chunk).tolist()[::-1]
                left -= chunk
            else:  # unknown total, or more items than announced: one draw at a time
                draws = [int(rng.integers(size))]
        j = draws.pop()
        out, buffer[j] = buffer[j], item
        yield out
    for j in rng.permutation(len(buffer)):
        yield buffer[j]
