"""Streaming VOC from a pack: an ``IterableDataset`` chaining the stages of ``pipeline`` and
decoding as ``VOCSerializedDataset`` does; torchdata-``Stateful`` (``state``)."""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict
from multiprocessing.context import get_spawning_popen
from typing import Any, TypeVar

import numpy as np
from torch.utils.data import IterableDataset
from torchvision.datasets.vision import VisionDataset

from ..errors import ChecksumError
from ..voc.layout import TASKS
from .datasets import JoinedSamples, PackedSamples, Source, parse_sources
from .decode import Classes, Decode, SampleDecoder, TargetFormat
from .pipeline import (
    AHEAD,
    BUFFER,
    Fields,
    Gate,
    block_bounds,
    epoch_order,
    rank_order,
    rank_share,
    read_block,
    read_blocks,
    shuffle_buffer,
    source_shares,
    split_blocks,
    views_fit,
    weighted_order,
    worker_share,
)
from .state import Resumable, samples_identity
from .topology import Topology, distributed_info, epoch_total, seeded_rng
from .workers import SHARED_RUN, in_worker

__all__ = ["VOCSerializedIterableDataset"]

T = TypeVar("T")


def _shares(
    parts: Sequence[PackedSamples], weights: Sequence[float] | None, epoch_size: int | None
) -> list[int] | None:
    """Samples of each source an epoch (``weights``, ``epoch_size``), or None: all, once."""
    if weights is None and epoch_size is None:
        return None
    sizes = [len(part.records) for part in parts]
    weights = sizes if weights is None else [float(w) for w in weights]
    if len(weights) != len(parts):
        raise ValueError(f"weights has {len(weights)} values for {len(parts)} sources")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {list(weights)}")
    empty = [str(part.pack.name) for part, w, n in zip(parts, weights, sizes) if w and not n]
    if empty:
        raise ValueError(f"sources with a weight but no samples in their image set: {empty}")
    total = sum(sizes) if epoch_size is None else epoch_size
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"epoch_size must be an int >= 1, got {epoch_size!r}")
    return source_shares(weights, total)


class VOCSerializedIterableDataset(JoinedSamples, IterableDataset, Resumable):
    """The samples of ``VOCSerializedDataset`` (or ``VOCSerializedSegmentation`` with
    ``task="Segmentation"``) streamed in blocks, split across ranks and DataLoader workers.

    Args:
        path: a pack (path or URL), or a sequence of sources, each a pack or a ``(pack,
            image_set)`` pair: an epoch is then every sample of every source once, as
            ``ConcatDataset`` of their ``VOCDetection``s, blocks of all sources mixed when
            ``shuffle``; labels (``"tv_tensors"``) mean the same class in every source
            (``label_names``: the sources' classes, the first source's first, or ``classes``).
        weights, epoch_size: draw ``epoch_size`` samples an epoch (default: all the sources
            hold) in proportion to ``weights`` (one per source; default: their sizes): a source
            whose share exceeds its size repeats its samples as evenly as possible, a smaller
            share is a subset seeded by ``(seed, epoch)``. Without either, every sample once.
        image_set, transform, target_transform, transforms, decode, target_format,
            classes, checked: as ``VOCSerializedDataset``; a sample is exactly what it returns
            for the same record (``target_format``/``classes`` apply to task "Main" only).
        shuffle, seed: shuffle blocks and mix samples; see *Randomness* below.
        task: ``"Main"`` (detection targets) or ``"Segmentation"`` (mask targets).
        rank, world_size: this process's share; default torch.distributed's, else (0, 1).
        drop_last: drop the tail so ranks get equal counts, instead of padding with repeats.
        block_size: positions per block (the unit of sequential reading).
        shuffle_buffer: samples held for mixing when ``shuffle`` (0 or 1: blocks only).
        storage_options, cache_dir, cache_limit_bytes: for a pack at a URL, as the map datasets.
        prefetch: URL packs: a rank's workers queue the next ``2 * prefetch`` shards each that
            the rank will read, in that order, and download them two at a time each, a shard
            once for all of them, whether readers read or wait (0: each when first read).

    **Work split** as ``DistributedSampler``: the epoch padded with its first samples to a
    multiple of the world size (or cut, ``drop_last``), rank ``r`` taking the ``r``-th
    contiguous slice, its workers near-equal pieces; ``len()`` is one rank's samples.

    **Randomness** (``shuffle=True``): the block order is seeded by ``(seed, epoch)`` (the
    same on every rank), the buffer by ``(seed, epoch, rank, worker)``; a window of ``B``
    samples mixes about ``B / block_size + 1`` blocks (smaller blocks shuffle better). It
    grows to ``B`` over a worker's first ``2 * B`` reads, one sample out for two in, so a first
    batch of ``k`` waits for ``2k`` reads, not ``B``.

    **Epochs and resumption.** Call ``set_epoch`` before each epoch (persistent workers see it).
    ``state_dict``/``load_state_dict`` follow torchdata's ``StatefulDataLoader``: a resumed
    iterator yields exactly the rest of the epoch, skips unread; one live iterator per dataset.
    On another number of ranks or workers, load ``merge_states`` of every saved rank's state
    into each new rank's dataset (before its loader is made): it hands out what the saved run
    had not, each once (padded to equal rank counts, or cut, as an epoch).
    """

    root: str  # set by ``VisionDataset.__init__``, as for the map-style datasets

    def __init__(
        self,
        path: Source | Sequence[Source],
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
        weights: Sequence[float] | None = None,
        epoch_size: int | None = None,
    ) -> None:
        super().__init__()
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        for name, value, low in (
            ("block_size", block_size, 1),
            ("shuffle_buffer", shuffle_buffer, 0),
            ("prefetch", prefetch, 0),
        ):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        sources = parse_sources(path, image_set)
        # root and the transforms as torchvision sets them (``transforms`` or the two, not both)
        root = ", ".join(str(source) for source, _ in sources)
        VisionDataset.__init__(self, root, transforms, transform, target_transform)
        distributed_info(rank, world_size)  # validates them now
        self.task = task
        self._join(
            sources,
            task,
            decode=decode,
            target_format=target_format,
            classes=classes,
            checked=checked,
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )
        self._bounds = np.unique(
            np.concatenate(
                [
                    block_bounds(part.records, part.pack.reader.starts, block_size) + start
                    for part, start in zip(self._parts, self._offsets)
                ]
            )
        )
        self.prefetch = prefetch
        self._shares = _shares(self._parts, weights, epoch_size)
        self._epoch_samples = len(self.records) if self._shares is None else sum(self._shares)
        self.shuffle, self.seed = shuffle, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.block_size, self.shuffle_buffer = block_size, shuffle_buffer
        self._epoch = 0
        #: the epoch in shared memory that DataLoader workers inherit (see __getstate__)
        self._shared_epoch: Any = multiprocessing.RawValue("q", 0)
        self._identity = samples_identity(self)

    def _topology(self) -> Topology:
        return Topology.current(self.rank, self.world_size)

    def __len__(self) -> int:
        return self._topology().samples_per_rank(self._epoch_samples, self.drop_last)

    def blocks(self, worker: int | None = None, num_workers: int | None = None) -> list[np.ndarray]:
        """Positions this rank's ``worker`` (default: the caller's) reads this epoch, by block."""
        here = self._topology()
        worker = here.worker if worker is None else worker
        num_workers = here.num_workers if num_workers is None else num_workers
        return self._rank_blocks(num_workers)[worker]

    def _rank_blocks(self, num_workers: int) -> list[list[np.ndarray]]:
        """The positions each of this rank's ``num_workers`` workers reads this epoch, by block."""
        here = self._topology()
        plan = self._plan(self._after)
        plan = rank_share(*plan, here.rank, here.world_size, drop_last=self.drop_last)
        return [split_blocks(*worker_share(*plan, w, num_workers)) for w in range(num_workers)]

    def _plan(self, after: Mapping[str, Any] | None) -> tuple[np.ndarray, np.ndarray]:
        """``(positions, block_ids)`` of the epoch, all ranks'; resumed on another topology
        (``after``: a merged state's ``progress``), only what that one had not handed out, in
        the same order: each old worker's output replayed (no I/O), its positions struck out."""
        order: dict[str, Any] = dict(shuffle=self.shuffle, seed=self.seed, epoch=self.epoch)
        if after is None and self._shares is not None:
            return weighted_order(self._offsets, self._shares, self.block_size, **order)
        if after is None:
            return epoch_order(self._bounds, **order)
        positions, block_ids = self._plan(after["after"])
        world, workers = after["world_size"], after["num_workers"]
        total = epoch_total(len(positions), world, self.drop_last)  # a cut tail is not in it
        positions, block_ids = positions[:total], block_ids[:total]
        handed: Counter[int] = Counter()
        for rank, counts in enumerate(after["yielded"]):
            share = rank_share(positions, block_ids, rank, world, drop_last=self.drop_last)
            for worker, count in enumerate(counts):
                blocks = split_blocks(*worker_share(*share, worker, workers))
                items = self._mixed(itertools.chain.from_iterable(blocks), rank, worker)
                handed.update(int(p) for p in itertools.islice(items, count))
        keep = np.ones(len(positions), dtype=bool)
        for i, p in enumerate(positions.tolist()):
            if handed[p]:  # handed out (a padding repeat strikes out the first one)
                handed[p] -= 1
                keep[i] = False
        return positions[keep], block_ids[keep]

    def _mixed(self, items: Iterator[T], rank: int, worker: int) -> Iterator[T]:
        """``items`` in the order ``worker`` of ``rank`` hands them out (the shuffle buffer's):
        one place, so a resume's replay is the order read."""
        if not self.shuffle:
            return items
        rng = seeded_rng(self.seed, BUFFER, self.epoch, rank, worker)
        return shuffle_buffer(items, self.shuffle_buffer, rng)

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

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        here = self._topology()
        skip = self._start(self.root)
        return self._samples(self._rank_blocks(here.num_workers), here, skip)

    def _samples(
        self, rank_blocks: list[list[np.ndarray]], here: Topology, skip: int
    ) -> Iterator[tuple[Any, Any]]:
        gate = Gate(open=skip == 0)
        parts = self._parts
        # views held at once: the shuffle buffer, the blocks read ahead, a worker's run
        in_flight = self.shuffle_buffer + (AHEAD + 1) * self.block_size + SHARED_RUN
        blocks = rank_blocks[here.worker]
        source: list[int] = []  # of this worker's blocks, in order (the rank's order keeps it)
        rank: list[list[np.ndarray]] = [[] for _ in parts]  # each source's, as the rank reads
        at: list[list[int]] = [[] for _ in parts]  # where this worker's blocks are among them
        for w, j in rank_order(rank_blocks):
            b = rank_blocks[w][j]
            k = int(np.searchsorted(self._offsets, b[0], side="right")) - 1
            if w == here.worker:
                source.append(k)
                at[k].append(len(rank[k]))
            rank[k].append(b - self._offsets[k])
        streams = [  # each source's blocks, read in order, as from a single pack
            read_blocks(
                [rank[k][i] for i in at[k]],  # this worker's blocks of source k
                part.records,
                part.pack.reader,
                part._fields,
                gate,
                copy=not views_fit(part.pack.reader, in_flight),
                shards_ahead=self.prefetch * here.num_workers,  # the rank's, shared
                streams=here.num_workers * len(parts),  # of a rank, that may share a cache
                rank=(rank[k], at[k]),
            )
            for k, part in enumerate(parts)
        ]
        reading = [0]  # the source of the block being read, for errors

        def merged() -> Iterator[tuple[int, int, Fields | None]]:
            for block, k in zip(blocks, source):
                reading[0] = k
                for record, data in itertools.islice(streams[k], len(block)):
                    yield k, record, data

        items = self._mixed(merged(), here.rank, here.worker)
        for _ in itertools.islice(items, skip):
            pass
        gate.open = True

        def read() -> Iterator[tuple[SampleDecoder, int, Fields]]:
            for k, record, data in items:
                reading[0] = k
                if data is None:  # planned during a resume replay: read now
                    reader, fields = parts[k].pack.reader, parts[k]._fields
                    data = read_block(reader, np.array([record]), fields)[record]
                yield parts[k].decoder, record, data

        reads = read()
        if in_worker():  # each run of SHARED_RUN samples travels in one shared block
            runs = iter(lambda: self._shared(itertools.islice(reads, SHARED_RUN)), [])
            samples: Iterator[Any] = itertools.chain.from_iterable(runs)
        else:
            samples = (self._decoded(*item) for item in reads)
        try:
            yield from self._counted(samples)
        except ChecksumError as exc:  # checked=True: name the sample, not only the file
            raise parts[reading[0]].pack.named(exc) from None

    # -- resumption (``state.Resumable``) ------------------------------------------------------
    _HINT = "dataset arguments, world size and num_workers"

    def _settings(self) -> dict[str, Any]:
        return {
            **asdict(self._topology()),  # rank, world_size, worker, num_workers
            "num_samples": self._epoch_samples,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "block_size": self.block_size,
            "shuffle_buffer": self.shuffle_buffer,
            "shares": self._shares,  # samples of each source an epoch if weighted (else None)
            "after": self._after,  # resumed on another topology: what it had handed out
        }

    _repr_indent = 4
    __repr__ = VisionDataset.__repr__  # with the lines of ``extra_repr``, as the map datasets

    def extra_repr(self) -> str:
        shuffle = f"Shuffle: {self.shuffle} (seed {self.seed}, epoch {self.epoch})"
        return "\n".join([super().extra_repr(), f"Task: {self.task}", shuffle])
