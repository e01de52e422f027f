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
from .state import Resumable
from .topology import Topology, distributed_info, seeded_rng
from .workers import SHARED_RUN, in_worker, share_batch

__all__ = ["VOCSerializedIterableDataset"]


# -- the dataset -------------------------------------------------------------------------------
class VOCSerializedIterableDataset(IterableDataset, Resumable):
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

    **Work split**, as ``DistributedSampler``: each epoch the image set's positions are cut
    into blocks (``block_bounds``); the blocks, in epoch order, are padded to a multiple of
    the world size with repeats of the first samples, or cut (``drop_last``); rank ``r``
    takes the ``r``-th contiguous slice and its DataLoader workers split it into contiguous,
    near-equal pieces. ``len()`` is the samples one rank yields per epoch.

    **Reading.** A worker takes each block's fields as views of the mapped pack after
    hinting the kernel to read the next blocks (``read_blocks``): on a cold cache the disk
    reads ahead while this block is decoded. The shuffle buffer holds views, never decoded
    images. A remote pack's shards are downloaded ``prefetch`` shards ahead and released
    after their last block, so a bounded cache needs only the working set; the samples and
    their order are those of the pack read locally.

    **Randomness** (``shuffle=True``): the block order is seeded by ``(seed, epoch)``, the
    same on every rank, the buffer by ``(seed, epoch, rank, worker)``, so the order depends
    only on seed, epoch, world size and number of workers. It is not a uniform permutation:
    the buffer emits a sample at most ``shuffle_buffer`` (``B``) places before it was read,
    so with blocks of ``S`` a window of ``B`` samples mixes about ``B / S + 1`` blocks
    (``B >= 4 S``, the default 256 over 64, draws batches from several blocks). Smaller
    blocks shuffle better and read less sequentially.

    **Epochs and resumption.** Call ``set_epoch`` before each epoch. The epoch lives in a
    shared-memory integer that DataLoader workers inherit, so ``persistent_workers=True``
    workers see every ``set_epoch``. ``state_dict`` / ``load_state_dict`` follow torchdata's
    ``StatefulDataLoader`` protocol (``state.Resumable``): a worker's state is the epoch and
    the samples it yielded, plus the settings, checked on resume. A resumed iterator replays
    the plan and the buffer's draws without reading and yields exactly the rest of the
    epoch, in the same order. One live iterator per dataset object.
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
        for name, value, low in (
            ("block_size", block_size, 1),
            ("shuffle_buffer", shuffle_buffer, 0),
            ("prefetch", prefetch, 0),
        ):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        self.transforms = joint_transforms(transforms, transform, target_transform)
        self.transform = transform
        self.target_transform = target_transform
        distributed_info(rank, world_size)  # validates them now

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
        self._fields = (schema.IMAGE, self.decoder.target_field)
        self._bounds = block_bounds(self.records, self.pack.reader.starts, block_size)

        self.shuffle, self.seed = shuffle, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.block_size, self.shuffle_buffer = block_size, shuffle_buffer
        self._epoch = 0
        #: The epoch as DataLoader workers see it: shared memory they inherit at start, so a
        #: set_epoch in the main process reaches persistent workers (see __getstate__).
        self._shared_epoch: Any = multiprocessing.RawValue("q", 0)
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
        skip = self._start(self.root)
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
            yield from self._counted(samples)
        except ChecksumError as exc:  # checked=True: name the sample, not only the file
            raise self.pack.named(exc) from None

    def _decoded(self, items: Iterable[Item], view: bool = False) -> Iterator[tuple[Any, Any]]:
        """The samples of read ``items`` (``view``: see ``SampleDecoder.image``)."""
        decoder = self.decoder
        for record, data in items:
            if data is None:  # planned during a resume replay: read it now
                data = read_block(self.pack.reader, np.array([record]), self._fields)[record]
            image, tgt = decoder.image(record, data[0], view=view), decoder.target(record, data[1])
            yield (image, tgt) if self.transforms is None else self.transforms(image, tgt)

    def _shared_runs(self, items: Iterator[Item]) -> Iterator[tuple[Any, Any]]:
        """A worker's samples, each run of ``SHARED_RUN`` sharing one block of shared memory
        (``share_batch``, as a map-style batch: stored bytes read as views of the map are
        copied once, into the block; decoded images go in as they are decoded)."""
        plain = self.transforms is None
        view = plain and self.decoder.stored_bytes
        while run := list(itertools.islice(items, SHARED_RUN)):
            records = [record for record, _ in run]
            sizes = self.decoder.decoded_nbytes(records) if plain else None
            yield from share_batch(self._decoded(run, view), sizes, borrowed=0 if view else None)

    # -- resumption (``state.Resumable``) ------------------------------------------------------
    _HINT = "dataset arguments, world size and num_workers"

    def _settings(self) -> dict[str, Any]:
        here = self._topology()
        values = (
            *(here.rank, here.world_size, here.worker, here.num_workers),
            *(len(self.records), self.shuffle, self.seed, self.drop_last),
            *(self.block_size, self.shuffle_buffer),
        )
        return dict(zip(keys.TOPOLOGY_KEYS + keys.ORDER_KEYS, values, strict=True))

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
