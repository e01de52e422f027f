"""The stages of the streaming dataset, each a plain function that can be tested alone.

``VOCSerializedIterableDataset`` (``iterable``) chains them, as webdataset chains its pipeline::

    block_bounds     image set positions 0..n-1 cut into blocks (runs of neighbouring records)
    epoch_order      the blocks in epoch order (a (seed, epoch) permutation, same on every rank)
    rank_share       padded to equal rank counts (or the remainder dropped); rank's slice
    worker_share     the rank's slice split evenly across DataLoader workers
    split_blocks     a worker's positions regrouped into the blocks they came from
    read_blocks      each block's bytes, one pread per run of records, next block prefetched
    shuffle_buffer   bounded sample mixing (shuffle=True)

then decodes each item as the map-style dataset does. Only positions (integers) travel through
the first five stages, so a plan costs microseconds and resumption can replay it without I/O.
How ranks and workers share an epoch is ``topology``'s rule, shared with the sampler.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .reader import PackReader
from .topology import Topology, epoch_total, pad_or_trim, seeded_rng

__all__ = [
    "BLOCK_ORDER",
    "BUFFER",
    "block_bounds",
    "epoch_order",
    "rank_share",
    "worker_share",
    "split_blocks",
    "Item",
    "Gate",
    "MAX_GAP",
    "record_runs",
    "read_block",
    "read_blocks",
    "shuffle_buffer",
]

#: Independent random streams under one seed: the block order, and the shuffle buffer.
BLOCK_ORDER, BUFFER = 0, 1


# -- plan: positions only ---------------------------------------------------------------------
def block_bounds(records: np.ndarray, shard_starts: np.ndarray, block_size: int) -> np.ndarray:
    """Block boundaries over positions ``0..n-1``: block ``b`` is ``[bounds[b], bounds[b+1])``.

    Blocks hold at most ``block_size`` consecutive positions. When the image set visits the
    shards in order (its records never step back into an earlier shard, as train, val, test and
    the Segmentation lists laid out by the packer), blocks are also cut where the shard
    changes, so each block reads from one file. An interleaved list (VOC's ``trainval`` mixes
    the train and val regions every few ids) is cut by size only: cutting it at every shard
    change would leave blocks of two or three samples; its blocks read each region they touch
    in storage order instead.
    """
    n = len(records)
    if n == 0:
        return np.zeros(1, dtype=np.int64)
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
    lengths = np.diff(bounds)[order]
    total = int(lengths.sum())
    first = np.cumsum(lengths) - lengths
    offset = np.arange(total, dtype=np.int64) - np.repeat(first, lengths)
    positions = np.repeat(bounds[:-1][order], lengths) + offset
    return positions, np.repeat(np.arange(num_blocks, dtype=np.int64), lengths)


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
class Item:
    """One sample between the read and decode stages: its position, record and field bytes.

    ``data`` is ``None`` for an item produced while replaying a plan (resumption); the decode
    stage then reads its fields itself.
    """

    __slots__ = ("position", "record", "data")

    def __init__(self, position: int, record: int, data: list[np.ndarray] | None) -> None:
        self.position = position
        self.record = record
        self.data = data


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
    unique = np.unique(records)
    if len(unique) == 0:
        return []
    shard_of = np.searchsorted(reader.starts, unique, side="right") - 1
    breaks = np.flatnonzero((np.diff(unique) > MAX_GAP) | (np.diff(shard_of) != 0)) + 1
    return [
        (int(shards[0]), run - int(reader.starts[shards[0]]))
        for run, shards in zip(np.split(unique, breaks), np.split(shard_of, breaks))
    ]


def read_block(
    reader: PackReader, records: np.ndarray, fields: Sequence[int]
) -> dict[int, list[np.ndarray]]:
    """Private copies of ``fields`` of every record of a block, by global record number.

    One ``pread`` per run (see ``record_runs``), in storage order: whole-block sequential
    reads instead of page faults, which is what makes a cold epoch fast.
    """
    out: dict[int, list[np.ndarray]] = {}
    for shard, local in record_runs(reader, records):
        base = int(reader.starts[shard])
        rows = reader.shard(shard).read_records(local, fields)
        out.update((base + int(r), row) for r, row in zip(local, rows))
    return out


def read_blocks(
    blocks: Sequence[np.ndarray],
    records: np.ndarray,
    reader: PackReader,
    fields: Sequence[int],
    gate: Gate | None = None,
) -> Iterator[Item]:
    """Items of each block in position order; the next block is read while this one is used.

    A background thread reads block ``b + 1`` (the read releases the GIL) while the items of
    block ``b`` are decoded, so I/O and decoding overlap; before reading a block it asks the
    kernel to start on the one after (see benchmarks/README.md, "Measurements behind the
    code"). At most two blocks' bytes are held.
    Items produced while ``gate`` is closed (a resume replay) carry no data.
    """
    gate = gate or Gate()

    def load(b: int) -> dict[int, list[np.ndarray]] | None:
        if not gate.open:
            return None
        if b + 1 < len(blocks):  # the kernel reads block b + 1 while this thread reads b
            for shard, local in record_runs(reader, records[blocks[b + 1]]):
                reader.shard(shard).prefetch(local)
        return read_block(reader, records[blocks[b]], fields)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tser-read") as pool:
        pending = pool.submit(load, 0) if blocks else None
        for b, block in enumerate(blocks):
            assert pending is not None
            data = pending.result()
            if data is None and gate.open:  # the gate opened after this block was planned
                data = load(b)
            pending = pool.submit(load, b + 1) if b + 1 < len(blocks) else None
            recs = records[block]
            for j in range(len(block)):
                record = int(recs[j])
                yield Item(int(block[j]), record, None if data is None else data[record])


def shuffle_buffer(items: Iterable[Any], size: int, rng: np.random.Generator) -> Iterator[Any]:
    """Mix a stream in a buffer of ``size`` items (webdataset's shuffle, deterministic).

    The buffer fills to ``size``; then each arriving item replaces a uniformly chosen one,
    which is emitted; at the end the rest leaves in random order. An item is never emitted
    more than ``size`` places before its input place, and may leave any time later.
    """
    if size <= 1:
        yield from items
        return
    buffer: list[Any] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        j = int(rng.integers(size))
        out, buffer[j] = buffer[j], item
        yield out
    for j in rng.permutation(len(buffer)):
        yield buffer[j]
