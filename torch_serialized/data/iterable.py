"""Streaming VOC from a pack: an ``IterableDataset`` that reads blocks sequentially.

``VOCSerializedIterableDataset`` chains the stages of ``pipeline`` (a block plan over image set
positions, this rank's and this worker's share, block reads with the next block prefetched, a
bounded shuffle buffer) and decodes each item as ``VOCSerializedDataset`` does. It is
torchdata-``Stateful``: its state is the epoch and the samples a worker yielded (``state``).
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from ..errors import ChecksumError
from ..voc import schema
from ..voc.layout import TASKS
from . import state as keys
from .datasets import joint_transforms, open_split
from .decode import Classes, Decode, TargetFormat
from .pipeline import (
    AHEAD,
    BUFFER,
    Gate,
    Item,
    block_bounds,
    epoch_order,
    rank_share,
    read_block,
    read_blocks,
    shuffle_buffer,
    split_blocks,
    views_fit,
    worker_share,
)
from .state import Stateful
from .topology import Topology, distributed_info, seeded_rng
from .workers import SHARED_RUN, in_worker, share_as_made

__all__ = ["VOCSerializedIterableDataset"]


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
        storage_options, cache_dir, cache_limit_bytes: for a pack at a URL, as
            ``VOCSerializedDataset``.
        prefetch: for a pack at a URL, shards each worker downloads ahead of the one it
            reads, in background threads (0: download each shard when first read).

    **Work split.** Each epoch the image set's positions ``0..n-1`` are cut into blocks (see
    ``block_bounds``: runs of at most ``block_size`` consecutive positions, also cut at shard
    boundaries when the list visits the shards in order). The blocks, in epoch order, are
    padded to a multiple of the world size with repeats of the first samples (as
    ``DistributedSampler(drop_last=False)``) or cut (``drop_last=True``); rank ``r`` takes the
    ``r``-th contiguous slice, and its DataLoader workers split that slice into contiguous,
    near-equal pieces. Across ranks and workers an epoch delivers every sample once plus the
    padding. ``len()`` is the samples one rank yields per epoch, all its workers together.

    **Reading.** A worker takes each block's fields as views of the mapped pack (see
    ``read_blocks``) after hinting the kernel to read the next blocks' runs of neighbouring
    records, so on a cold cache the disk reads ahead while this block is decoded; on a warm
    one a sample costs a copy out of the page cache. The shuffle buffer holds views, not
    copies: the only memory a worker holds per buffered sample is a few Python objects;
    decoded images are never buffered.

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

    **Remote packs.** Each worker downloads only the shards its blocks touch, ``prefetch``
    shards ahead, and releases each shard once it has read its last block there, so a bounded
    cache (``cache_limit_bytes``) may evict it: streaming needs the working set cached, not the
    pack. Workers and ranks on one machine sharing a cache download each shard once. The
    samples and their order are those of the same pack read locally.

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
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit_bytes: int | None = None,
        prefetch: int = 2,
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
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
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
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )
        self.prefetch = prefetch
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
        #: the samples this dataset holds (``state.PACK``), named in every state
        self._identity = keys.samples_identity(self)

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

    @property
    def label_names(self) -> list[str]:
        """The name of each ``"tv_tensors"`` label, as ``VOCSerializedDataset.label_names``."""
        return list(self.decoder.label_names)

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
        reader = self.pack.reader
        # views held at once: the shuffle buffer, the blocks read ahead, a worker's run
        in_flight = self.shuffle_buffer + (AHEAD + 1) * self.block_size + SHARED_RUN
        items: Iterator[Item] = read_blocks(
            blocks,
            self.records,
            reader,
            self._fields,
            gate,
            copy=not views_fit(reader, in_flight),
            shards_ahead=self.prefetch,
        )
        if self.shuffle:
            rng = seeded_rng(self.seed, BUFFER, self.epoch, here.rank, here.worker)
            total = sum(len(block) for block in blocks)
            items = shuffle_buffer(items, self.shuffle_buffer, rng, total)
        for _ in itertools.islice(items, skip):
            pass
        gate.open = True
        # in a worker the tensors of each run of samples travel in one shared block
        samples = self._shared_runs(items) if in_worker() else self._decoded(items)
        try:
            for sample in samples:
                self._yielded += 1  # counted when handed out: a state taken now resumes after it
                yield sample
        except ChecksumError as exc:  # checked=True: name the sample, not only the file
            raise self.pack.named(exc) from None

    def decode(self, item: Item) -> tuple[Any, Any]:
        """The sample for one read item, as the map-style dataset returns it."""
        return next(self._decoded((item,)))

    def _decoded(
        self, items: Iterable[Item], image: Callable[[int, Any], Any] | None = None
    ) -> Iterator[tuple[Any, Any]]:
        """The samples of read ``items``, with everything looked up per sample bound once:
        the per-sample loop of every stream. ``image``: the image reader, if not the
        decoder's ``image_reader``."""
        image = image or self.decoder.image_reader()
        target: Callable[[int, Any], Any] = (
            self.decoder.mask if self.task == "Segmentation" else self.decoder.target_reader()
        )
        transforms, reader, fields = self.transforms, self.pack.reader, self._fields
        for record, data in items:
            if data is None:  # planned during a resume replay: read it now
                data = read_block(reader, np.array([record]), fields)[record]
            img, tgt = image(record, data[0]), target(record, data[1])
            yield (img, tgt) if transforms is None else transforms(img, tgt)

    def _shared_runs(self, items: Iterator[Item]) -> Iterator[tuple[Any, Any]]:
        """A worker's samples, each run of ``SHARED_RUN`` sharing one block of shared memory
        (``share_as_made``, as a map-style batch): stored bytes read as views of the map are
        copied once, into the block, and decoded images go in as they are decoded."""
        views = self.decoder.view_reader() if self.transforms is None else None
        borrowed = None if views is None else 0
        while run := list(itertools.islice(items, SHARED_RUN)):
            records = [record for record, _ in run]
            sizes = self.decoder.decoded_nbytes(records) if self.transforms is None else None
            yield from share_as_made(self._decoded(run, views), sizes, borrowed=borrowed)

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
            keys.PACK: self._identity,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next iteration continues that epoch where it
        stopped. Settings and topology must match the saved ones (checked then)."""
        keys.check_version(state, "VOCSerializedIterableDataset")
        self.epoch = int(state[keys.EPOCH])
        self._yielded = int(state[keys.YIELDED])
        self._resume = dict(state)

    def _check_state(self, state: dict[str, Any], here: Topology) -> None:
        now = {**_topology_state(here), **self._settings()}
        keys.check_samples(state, self._identity, self.root)
        keys.check_same(state, now, self.root, "dataset arguments, world size and num_workers")

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
