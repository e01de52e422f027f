"""The stages of the streaming dataset, plain functions testable alone, chained by
``VOCSerializedIterableDataset``: block_bounds, epoch_order, rank_share, worker_share,
split_blocks, read_blocks, shuffle_buffer. Only positions travel through the first five, so a
plan costs microseconds and a resume replays it without I/O; ``topology`` rules the sharing."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ..container.shards import PackReader
from .topology import Topology, epoch_total, seeded_rng

BLOCK_ORDER, BUFFER, SUBSET = 0, 1, 2  #: independent random streams under one seed


def block_bounds(records: np.ndarray, shard_starts: np.ndarray, block_size: int) -> np.ndarray:
    """Bounds of blocks of at most ``block_size`` over positions ``0..n-1``, cut at shard changes
    if the image set visits shards in order (not if interleaved, as ``trainval``: tiny blocks)."""
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
    """``(positions, block_ids)`` of one epoch: whole blocks, shuffled as blocks when asked."""
    blocks = [np.arange(a, b, dtype=np.int64) for a, b in zip(bounds[:-1], bounds[1:])]
    return _in_order(blocks, shuffle=shuffle, seed=seed, epoch=epoch)


def _in_order(
    blocks: list[np.ndarray], *, shuffle: bool, seed: int, epoch: int
) -> tuple[np.ndarray, np.ndarray]:
    """``blocks`` as listed, or shuffled by ``(seed, epoch)``, as ``(positions, block_ids)``:
    ``block_ids[i]`` is the rank of the block of ``positions[i]`` in this order."""
    order = np.arange(len(blocks))
    if shuffle:
        order = seeded_rng(seed, BLOCK_ORDER, epoch).permutation(len(blocks))
    positions = np.concatenate([np.zeros(0, np.int64), *(blocks[b] for b in order)])
    sizes = [len(blocks[b]) for b in order]
    return positions, np.repeat(np.arange(len(blocks), dtype=np.int64), sizes)


def source_shares(weights: Sequence[float], total: int) -> list[int]:
    """``total`` samples split in proportion to ``weights``: largest remainders, so the shares
    sum to ``total`` and each is within 1 of its exact proportion."""
    exact = total * np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    shares = np.floor(exact).astype(np.int64)
    extra = np.argsort(shares - exact, kind="stable")[: total - int(shares.sum())]
    shares[extra] += 1
    return [int(share) for share in shares]


def weighted_order(
    offsets: np.ndarray,
    shares: Sequence[int],
    block_size: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``(positions, block_ids)`` of an epoch taking ``shares[k]`` samples of source ``k``
    (positions ``offsets[k]`` to ``offsets[k + 1]``): each of its samples ``shares[k] // n``
    times, then a subset seeded by ``(seed, epoch, k)`` for the rest; each pass in position
    order, cut into blocks, blocks shuffled as ``epoch_order`` shuffles them."""
    blocks: list[np.ndarray] = []
    for k, share in enumerate(shares):
        start, n = int(offsets[k]), int(offsets[k + 1] - offsets[k])
        passes, rest = divmod(share, n) if n else (0, 0)
        runs = [np.arange(start, start + n, dtype=np.int64)] * passes
        if rest:
            pick = seeded_rng(seed, SUBSET, epoch, k).choice(n, rest, replace=False)
            runs.append(start + np.sort(pick).astype(np.int64))
        blocks += [run[i : i + block_size] for run in runs for i in range(0, len(run), block_size)]
    return _in_order(blocks, shuffle=shuffle, seed=seed, epoch=epoch)


def rank_share(
    positions: np.ndarray,
    block_ids: np.ndarray,
    rank: int,
    world_size: int,
    *,
    drop_last: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """This rank's slice after making all ranks' counts equal (``topology``); repeats get
    block ids of their own so a block never mixes a record with its repeat."""
    n = len(positions)
    total = epoch_total(n, world_size, drop_last)
    if total > n:
        copy = np.arange(total, dtype=np.int64) // n  # 0 for the original, then 1, 2...
        block_ids = np.resize(block_ids, total) + (int(block_ids.max()) + 1) * copy
    else:
        block_ids = block_ids[:total]
    share = Topology(rank, world_size).rank_slice(n, drop_last)
    return np.resize(positions, total)[share], block_ids[share]


def worker_share(
    positions: np.ndarray, block_ids: np.ndarray, worker: int, num_workers: int
) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``worker``'s contiguous piece of a rank's share; piece sizes differ by at most 1."""
    share = Topology(worker=worker, num_workers=num_workers).worker_slice(len(positions))
    return positions[share], block_ids[share]


def split_blocks(positions: np.ndarray, block_ids: np.ndarray) -> list[np.ndarray]:
    """Positions regrouped into runs that come from one block."""
    if len(positions) == 0:
        return []
    return np.split(positions, np.flatnonzero(np.diff(block_ids)) + 1)


#: A record's fields as read: views of the map, or private arrays (``read_block(copy=True)``).
Fields = list[memoryview] | list[np.ndarray]
#: One sample between read and decode: ``(global record, fields)``; no fields in a resume replay.
Item = tuple[int, Fields | None]


class Gate:
    """A switch the resume logic flips: while closed, ``read_blocks`` plans without reading."""

    __slots__ = ("open",)

    def __init__(self, open: bool = True) -> None:
        self.open = open


MAX_GAP = 8  #: records at most this far apart are read in one request, through the gap


def record_runs(reader: PackReader, records: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """The distinct ``records`` as ``(shard, local record numbers)`` runs in storage order,
    each in one shard with no gap wider than ``MAX_GAP``: one sequential read each."""
    ordered = np.unique(records)
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
    """``fields`` of a block's records by global number: map views, or ``copy``: private arrays."""
    out: dict[int, Fields] = {}
    for shard, local in record_runs(reader, records) if runs is None else runs:
        container = reader.shard(shard)
        rows = container.read_records(local, fields) if copy else container.views(local, fields)
        out.update(zip((local + int(reader.starts[shard])).tolist(), rows))
    return out


def views_fit(reader: PackReader, in_flight: int) -> bool:
    """Whether a stream holding ``in_flight`` records may hold views: a view keeps its shard
    mapped, so only if all shards can stay open or shards outnumber what is in flight."""
    shards = reader.num_shards
    return shards <= reader.max_open_shards or reader.num_records >= in_flight * shards


AHEAD = 2  #: blocks hinted to the kernel ahead of the one in use (see ``read_blocks``)
#: records of a remote block read at once: a shard in flight yields a batch's worth (a
#: worker's shared run) before the rest of the block is in
PIECE = 32


def read_blocks(
    blocks: Sequence[np.ndarray],
    records: np.ndarray,
    reader: PackReader,
    fields: Sequence[int],
    gate: Gate | None = None,
    *,
    copy: bool = False,
    shards_ahead: int = 0,
    streams: int = 1,
    rank: tuple[Sequence[np.ndarray], Sequence[int]] | None = None,
) -> Iterator[Item]:
    """Items of each block in position order, fields as views (``copy``: private arrays), no
    data while ``gate`` is closed. The ``AHEAD`` next blocks are hinted to the kernel (cold
    epoch: 6,160/s, 3,933/s without); remote shards come via ``ShardWindow`` (``rank``: the
    positions of the rank's blocks in its order of reading, and where each of ``blocks`` is
    among them), each of the ``streams`` sharing the cache with a like share of its limit."""
    gate = gate or Gate()
    runs: dict[int, list[tuple[int, np.ndarray]]] = {}  # of the blocks hinted, not yet read
    window = None
    if reader.remote is not None and reader.num_shards > 1:
        together = None if rank is None else ([records[b] for b in rank[0]], rank[1])
        own = [records[block] for block in blocks]
        window = ShardWindow(reader, own, shards_ahead, reader.shard_budget(streams), together)
    hinted = 0
    for b, block in enumerate(blocks):
        recs = records[block]
        listed = recs.tolist()
        if not gate.open:
            yield from zip(listed, itertools.repeat(None))
            continue
        while hinted <= min(b + AHEAD, len(blocks) - 1):
            runs[hinted] = record_runs(reader, records[blocks[hinted]])
            if window is None:
                for shard, local in runs[hinted]:
                    reader.shard(shard).prefetch(local)
            hinted += 1
        if window is None:
            data = read_block(reader, recs, fields, runs.pop(b), copy=copy)
            yield from zip(listed, [data[record] for record in listed])
            continue
        window.before(b, runs[b])
        for shard, local in runs.pop(b):
            reader.shard(shard).prefetch(local)  # in flight: bytes far ahead asked for now
        for piece in range(0, len(recs), PIECE):  # the first batch's records before the rest
            data = read_block(reader, recs[piece : piece + PIECE], fields, copy=copy)
            if piece + PIECE >= len(recs):
                window.after(b)
            yield from ((r, data[r]) for r in listed[piece : piece + PIECE])


def rank_order(worker_blocks: Sequence[Sequence[np.ndarray]]) -> list[tuple[int, int]]:
    """``(worker, block)`` of every block of a rank's workers, in the order its DataLoader
    reads them: workers yield at one pace, so a block comes when as many samples have come
    before it in its own worker (ties: the lower worker first)."""
    starts = [
        (int(start), w, j)
        for w, blocks in enumerate(worker_blocks)
        for j, start in enumerate(np.cumsum([0, *(len(b) for b in blocks[:-1])]))
        if len(blocks)
    ]
    return [(w, j) for _, w, j in sorted(starts)]


class ShardWindow:
    """A remote pack's shards a stream holds at block ``b``: its own, awaited by ``before(b)``,
    and the next ``2 * ahead`` distinct ones its rank will read, queued by ``after(b - 1)``
    and downloaded in that order two at a time whether the reader moves or waits (a shard
    another worker of the rank is downloading is left to it, and read from its download).
    ``after(b)`` releases what leaves, so the cache may evict it. ``rank``: the records of the
    rank's blocks in the order its DataLoader reads them (:func:`rank_order`), and where each
    of ``block_records`` is among them (default: this stream's blocks alone). ``budget``: the
    bytes the window may hold (a bounded cache's room), shards ahead included."""

    SCAN = 4096  #: blocks looked ahead at most (bounds the work per block)

    def __init__(
        self,
        reader: PackReader,
        block_records: Sequence[np.ndarray],
        ahead: int,
        budget: int | None = None,
        rank: tuple[Sequence[np.ndarray], Sequence[int]] | None = None,
    ):
        self.reader, self.ahead, self.budget = reader, ahead, budget
        self.records = block_records
        self.shards = [self._shards_of(recs) for recs in block_records]
        order, self.at = rank or (block_records, range(len(block_records)))
        self.order = [self._shards_of(r) for r in order] if rank else self.shards
        self.held: set[int] = set()

    def window(self, b: int) -> list[int]:
        """Block ``b``'s shards, then the next ``2 * ahead`` distinct shards in the rank's order
        of use, within the ``budget``."""
        if b >= len(self.shards):
            return []
        own, ahead, after = self.shards[b], list[int](), self.at[b] + 1
        room = None if self.budget is None else self.budget - self._bytes(own)
        for s in itertools.chain.from_iterable(self.order[after : after + self.SCAN]):
            if len(ahead) == 2 * self.ahead:
                break
            if s not in own and s not in ahead:
                if room is not None and (room := room - self._bytes([s])) < 0:
                    break
                ahead.append(s)
        return own + ahead

    def _shards_of(self, records: np.ndarray) -> list[int]:
        return np.unique(np.searchsorted(self.reader.starts, records, side="right") - 1).tolist()

    def _bytes(self, shards: Iterable[int]) -> int:
        return sum(self.reader.entries[s].bytes for s in shards)

    def before(self, b: int, runs: Sequence[tuple[int, np.ndarray]] = ()) -> None:
        """Download block ``b``'s own shards now, those queued too: they are awaited, with those
        of the next block's first records if ``b`` is short of a batch (``PIECE``), which waits
        for both (within the budget). ``runs``: the block's ``(shard, local records)``, so that a
        block ending a shard comes first."""
        own = list(self.shards[b]) if b < len(self.shards) else []
        if b + 1 < len(self.shards) and len(self.records[b]) < PIECE:
            rest = self.records[b + 1][: PIECE - len(self.records[b])]
            more = [s for s in self._shards_of(rest) if s not in own]
            if self.budget is None or self._bytes(self.held | {*own, *more}) <= self.budget:
                own += more
        self.reader.prefetch_shards(own, now=True, rows=dict(runs))
        self.held.update(own)

    def after(self, b: int) -> None:
        """Block ``b`` is read: release what the next window leaves out, download the rest."""
        keep = self.window(b + 1)
        for s in sorted(self.held - set(keep)):
            self.reader.release_shard(s)
        self.held &= set(keep)
        wanted = [s for s in keep if s not in self.held]
        if wanted:
            self.reader.prefetch_shards(wanted)
            self.held.update(wanted)


def shuffle_buffer(items: Iterable[Any], size: int, rng: np.random.Generator) -> Iterator[Any]:
    """Mix a stream in a buffer of up to ``size`` items (webdataset's, deterministic): a random
    item is emitted for every other arriving one until the buffer holds ``size``, then for each,
    so the first ``k`` wait for ``2k`` reads, not ``size`` (a first batch of 32 needs one block:
    from a remote pack 2.3 -> 1.0 s); no item leaves more than ``size`` places early."""
    if size <= 1:
        yield from items
        return
    buffer: list[Any] = []
    for n, item in enumerate(items):
        buffer.append(item)
        if len(buffer) < size and n % 2 == 0:  # held: the buffer grows
            continue
        j = int(rng.integers(len(buffer)))
        buffer[j], buffer[-1] = buffer[-1], buffer[j]
        yield buffer.pop()
    for j in rng.permutation(len(buffer)):
        yield buffer[j]
