"""Streaming VOC from a pack: an ``IterableDataset`` that reads blocks sequentially.

The dataset is a chain of small stages, each a plain function that can be tested alone::

    block_bounds     image set positions 0..n-1 cut into blocks (runs of neighbouring records)
    epoch_order      the blocks in epoch order (a (seed, epoch) permutation, same on every rank)
    rank_share       padded to equal rank counts (or the remainder dropped); rank's slice
    worker_share     the rank's slice split evenly across DataLoader workers
    split_blocks     a worker's positions regrouped into the blocks they came from
    read_blocks      each block's bytes, one pread per run of records, next block prefetched
    shuffle_buffer   bounded sample mixing (shuffle=True)
    decode           SampleDecoder + transforms, as VOCSerializedDataset

Only positions (integers) travel through the first five stages, so a plan costs microseconds
and resumption can replay it without I/O.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from . import state as keys
from .datasets import joint_transforms, open_split
from .decode import Classes, Decode, TargetFormat
from .reader import PackReader
from .state import Stateful
from .topology import Topology, distributed_info, epoch_total, pad_or_trim, seeded_rng
from .voc import schema
from .voc.layout import TASKS

__all__ = [
    "VOCSerializedIterableDataset",
    "block_bounds",
    "epoch_order",
    "rank_share",
    "worker_share",
    "split_blocks",
    "record_runs",
    "read_block",
    "read_blocks",
    "shuffle_buffer",
]

_BLOCK_ORDER, _BUFFER = 0, 1  # independent random streams under one seed


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
        seeded_rng(seed, _BLOCK_ORDER, epoch).permutation(num_blocks)
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
        rows = reader.shards[shard].read_records(local, fields)
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
                reader.shards[shard].prefetch(local)
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


# -- the dataset -------------------------------------------------------------------------------
class VOCSerializedIterableDataset(IterableDataset, Stateful):
    """The samples of ``VOCSerializedDataset`` (or ``VOCSerializedSegmentation`` with
    ``task="Segmentation"``) streamed in blocks, split across ranks and DataLoader workers.

    Args:
        path, image_set, transform, target_transform, transforms, decode, target_format,
            classes, checked: as ``VOCSerializedDataset``; a sample is exactly what it returns
            for the same record (``target_format``/``classes`` apply to task "Main" only).
        shuffle, seed: shuffle blocks and mix samples; see *Randomness* below.
        task: ``"Main"`` (detection targets) or ``"Segmentation"`` (mask targets).
        rank, world_size: this process's share; default torch.distributed's, else (0, 1).
        drop_last: drop the tail so ranks get equal counts, instead of padding with repeats.
        block_size: positions per block (the unit of sequential reading).
        shuffle_buffer: samples held for mixing when ``shuffle`` (0 or 1: blocks only).

    **Work split.** Each epoch the image set's positions ``0..n-1`` are cut into blocks (see
    ``block_bounds``: runs of at most ``block_size`` consecutive positions, also cut at shard
    boundaries when the list visits the shards in order). The blocks, in epoch order, are
    padded to a multiple of the world size with repeats of the first samples (as
    ``DistributedSampler(drop_last=False)``) or cut (``drop_last=True``); rank ``r`` takes the
    ``r``-th contiguous slice, and its DataLoader workers split that slice into contiguous,
    near-equal pieces. Across ranks and workers an epoch delivers every sample once plus the
    padding. ``len()`` is the samples one rank yields per epoch, all its workers together.

    **Reading.** A worker reads each block with one ``pread`` per run of neighbouring records
    (see ``read_block``), in storage order, while a background thread already reads the next
    block, so I/O overlaps decoding. Held bytes per worker: at most ``2 * block_size +
    shuffle_buffer`` records' stored image and target bytes (about 110 KB a VOC JPEG: 42 MB
    at the defaults); decoded images are never buffered.

    **Randomness** (``shuffle=True``). The block order is a permutation seeded by
    ``(seed, epoch)``, identical on every rank; the buffer is seeded by
    ``(seed, epoch, rank, worker)``. The order therefore depends only on seed, epoch, world
    size and number of workers, and changes with ``set_epoch``. It is not a uniform
    permutation: the buffer emits a sample at most ``shuffle_buffer`` places before it was
    read, so with buffer ``B`` and blocks of ``S`` a window of ``B`` consecutive samples mixes
    about ``B / S + 1`` blocks and samples of one block stay within a few ``B`` of each other
    (delays beyond that are geometrically rare). ``B < S`` mixes little beyond one block;
    ``B >= 4 S`` (the default 256 over 64) gives batches drawn from several blocks. Smaller
    blocks shuffle better and read less sequentially.

    **Epochs and resumption.** Call ``set_epoch`` before each epoch, as with
    ``DistributedSampler``. The epoch lives in a shared-memory integer handed to DataLoader
    workers when they start, so ``persistent_workers=True`` workers see every ``set_epoch``
    too (a plain pickle of the dataset carries the number only). ``state_dict`` /
    ``load_state_dict`` follow torchdata's ``StatefulDataLoader`` protocol: it snapshots
    each worker's copy of the dataset; the state is the epoch and the samples this worker
    yielded in it (plus the settings, checked on load). A resumed
    iterator replays the plan and the shuffle buffer's draws without reading, so it yields
    exactly the rest of the interrupted epoch, in the same order. One live iterator per
    dataset object.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        image_set: str = "train",
        *,
        shuffle: bool = False,
        seed: int = 0,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        transforms: Callable | None = None,
        decode: Decode = "pil",
        target_format: TargetFormat = "dict",
        classes: Classes = None,
        task: str = "Main",
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        block_size: int = 64,
        shuffle_buffer: int = 256,
        checked: bool = False,
    ) -> None:
        super().__init__()
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        if task == "Segmentation" and (target_format != "dict" or classes is not None):
            raise ValueError("target_format and classes apply to task='Main' only")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0, got {shuffle_buffer}")
        self.transforms = joint_transforms(transforms, transform, target_transform)
        self.transform = transform
        self.target_transform = target_transform
        if world_size is not None or rank is not None:
            distributed_info(rank, world_size)  # validate early

        self.root = str(path)
        self.image_set = image_set
        self.task = task
        self.pack, records, self.decoder = open_split(
            path,
            task,
            image_set,
            decode=decode,
            target_format=target_format,
            classes=classes,
            checked=checked,
        )
        self.year = self.pack.year
        self.records = np.array(records, dtype=np.int64)
        target_field = schema.MASK if task == "Segmentation" else self.decoder.target_field
        self._fields = (schema.IMAGE, target_field)
        self._bounds = block_bounds(self.records, self.pack.reader.starts, block_size)

        self.shuffle, self.seed = shuffle, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.block_size, self.shuffle_buffer = block_size, shuffle_buffer
        self._epoch = 0
        #: The epoch as DataLoader workers see it: shared memory they inherit at start, so a
        #: set_epoch in the main process reaches persistent workers (see __getstate__).
        self._shared_epoch: Any = multiprocessing.RawValue("q", 0)
        self._yielded = 0  # samples the current iterator has yielded in this epoch
        self._resume: dict[str, Any] | None = None  # a loaded state awaiting the next __iter__

    # -- plan --------------------------------------------------------------------------------
    def _topology(self) -> Topology:
        """The calling process's place: this dataset's rank and world size (or DDP's) and
        the calling DataLoader worker."""
        return Topology.current(self.rank, self.world_size)

    def __len__(self) -> int:
        return self._topology().samples_per_rank(len(self.records), self.drop_last)

    def blocks(self, worker: int | None = None, num_workers: int | None = None) -> list[np.ndarray]:
        """Positions this rank's ``worker`` reads this epoch, block by block, in read order.

        Defaults to the calling DataLoader worker (the whole rank in the main process).
        """
        here = self._topology()
        worker = here.worker if worker is None else worker
        num_workers = here.num_workers if num_workers is None else num_workers
        plan = epoch_order(self._bounds, shuffle=self.shuffle, seed=self.seed, epoch=self.epoch)
        plan = rank_share(*plan, here.rank, here.world_size, drop_last=self.drop_last)
        return split_blocks(*worker_share(*plan, worker, num_workers))

    def reopen(self) -> None:
        """Map the packed file(s) again in this process (what ``worker_init_fn`` calls)."""
        self.pack.reader.reopen()

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows."""
        if epoch != self.epoch:
            self._resume = None
            self._yielded = 0
        self.epoch = epoch

    @property
    def epoch(self) -> int:
        """The epoch whose order the next iteration follows."""
        return int(self._shared_epoch.value) if self._shared_epoch is not None else self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._epoch = int(value)
        if self._shared_epoch is not None:
            self._shared_epoch.value = self._epoch

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if get_spawning_popen() is None:  # not a worker being started: keep the number only
            state["_shared_epoch"] = None
            state["_epoch"] = self.epoch
        return state

    # -- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        here = self._topology()
        skip = 0
        if self._resume is not None:
            self._check_state(self._resume, here)
            skip = int(self._resume[keys.YIELDED])
            self._resume = None
        self._yielded = skip
        return self._samples(self.blocks(here.worker, here.num_workers), here, skip)

    def _samples(
        self, blocks: list[np.ndarray], here: Topology, skip: int
    ) -> Iterator[tuple[Any, Any]]:
        gate = Gate(open=skip == 0)
        items: Iterator[Item] = read_blocks(
            blocks, self.records, self.pack.reader, self._fields, gate
        )
        if self.shuffle:
            rng = seeded_rng(self.seed, _BUFFER, self.epoch, here.rank, here.worker)
            items = shuffle_buffer(items, self.shuffle_buffer, rng)
        for _ in itertools.islice(items, skip):
            pass
        gate.open = True
        for item in items:
            sample = self.decode(item)
            self._yielded += 1
            yield sample

    def decode(self, item: Item) -> tuple[Any, Any]:
        """The sample for one read item, as the map-style dataset returns it."""
        data = item.data
        if data is None:  # planned during a resume replay: read it now
            data = read_block(self.pack.reader, np.array([item.record]), self._fields)[item.record]
        img = self.decoder.image(item.record, data[0])
        if self.task == "Segmentation":
            target = self.decoder.mask(data[1])
        else:
            target = self.decoder.target(item.record, data[1])
        if self.transforms is not None:
            img, target = self.transforms(img, target)
        return img, target

    # -- resumption (``state``: torchdata's Stateful protocol) --------------------------------
    def _settings(self) -> dict[str, Any]:
        values = (
            len(self.records),
            self.shuffle,
            self.seed,
            self.drop_last,
            self.block_size,
            self.shuffle_buffer,
        )
        return dict(zip(keys.ORDER_KEYS, values, strict=True))

    def state_dict(self) -> dict[str, Any]:
        """Where this worker is: epoch, samples yielded in it, and the settings that fix the
        order (JSON-compatible)."""
        if self._resume is not None:  # loaded, not yet iterated: still that point
            return dict(self._resume)
        return {
            keys.VERSION: keys.STATE_VERSION,
            keys.EPOCH: self.epoch,
            keys.YIELDED: self._yielded,
            **_topology_state(self._topology()),
            **self._settings(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next iteration continues that epoch where it
        stopped. Settings and topology must match the saved ones (checked then)."""
        if state.get(keys.VERSION) != keys.STATE_VERSION:
            raise ValueError(
                f"state version {state.get(keys.VERSION)!r} is not {keys.STATE_VERSION}; it "
                "was not saved by this VOCSerializedIterableDataset"
            )
        self.epoch = int(state[keys.EPOCH])
        self._yielded = int(state[keys.YIELDED])
        self._resume = dict(state)

    def _check_state(self, state: dict[str, Any], here: Topology) -> None:
        now = {**_topology_state(here), **self._settings()}
        diff = {k: (state.get(k), now[k]) for k in now if state.get(k) != now[k]}
        if diff:
            detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"cannot resume {self.root}: the state was saved with other settings ({detail}); "
                "resume with the same dataset arguments, world size and num_workers"
            )

    def __repr__(self) -> str:
        lines = [
            f"Number of datapoints: {len(self.records)}",
            f"Root location: {self.root}",
            f"Year: {self.year}",
            f"Image set: {self.image_set}",
            f"Task: {self.task}",
            f"Shuffle: {self.shuffle} (seed {self.seed}, epoch {self.epoch})",
        ]
        if self.transforms is not None:
            lines.append(repr(self.transforms))
        body = "\n".join(" " * 4 + line for text in lines for line in text.splitlines())
        return f"{type(self).__name__}\n{body}"


def _topology_state(here: Topology) -> dict[str, int]:
    """The topology's part of a state (``state.TOPOLOGY_KEYS``)."""
    values = (here.rank, here.world_size, here.worker, here.num_workers)
    return dict(zip(keys.TOPOLOGY_KEYS, values, strict=True))
