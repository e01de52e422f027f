"""Map-style drop-ins for torchvision's ``VOCDetection`` and ``VOCSegmentation``: index for
index the same samples (of several packs: as ``ConcatDataset``). They subclass torchvision's
classes so ``isinstance`` and ``wrap_dataset_for_transforms_v2`` keep working; ``PackedSamples``
and ``JoinedSamples`` are shared with the stream."""

from __future__ import annotations

import itertools
import os
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import attrgetter, itemgetter
from operator import index as as_index
from typing import Any

import numpy as np
from torchvision.datasets import VOCDetection, VOCSegmentation
from torchvision.datasets.vision import VisionDataset

from ..errors import ChecksumError
from ..voc import schema
from ..voc.names import ChainedNames, record_names
from ..voc.packed import VOCPackReader
from .decode import Buffer, Classes, Decode, SampleDecoder, TargetFormat
from .workers import in_worker, share_batch

__all__ = ["VOCSerializedDataset", "VOCSerializedSegmentation"]

#: A pack (path or URL), or a ``(pack, image_set)`` pair.
Source = str | os.PathLike[str] | tuple[str | os.PathLike[str], str]


class PackedSamples:
    """What every dataset of a pack shares: decoding, worker batches, reopening, label names."""

    transforms: Callable | None
    pack: VOCPackReader
    decoder: SampleDecoder
    records: np.ndarray  #: of ``image_set``, in list-file order
    year: str
    image_set: str
    _fields: tuple[int, int]  #: the fields a sample reads: image, target

    def reopen(self) -> None:
        """Map the packed file(s) again in this process (what ``worker_init_fn`` calls)."""
        self.pack.reader.reopen()

    @property
    def label_names(self) -> list[str]:
        """The name of each ``"tv_tensors"`` label (label ``i`` is ``label_names[i]``; 0 is
        ``"__background__"`` unless ``classes`` says otherwise): what ``classes`` resolved to."""
        return list(self.decoder.label_names)

    def extra_repr(self) -> str:
        lines = [f"Year: {self.year}", f"Image set: {self.image_set}"]
        if self.decoder.decode != "pil":
            lines.append(f"Decode: {self.decoder.decode}")
        if self.decoder.target_format != "dict":
            lines.append(f"Target format: {self.decoder.target_format}")
        if self.decoder.zero_copy:
            lines.append("Zero copy: True")
        return "\n".join(lines)

    def _decoded(
        self, decoder: SampleDecoder, record: int, fields: Sequence[Buffer], view: bool = False
    ) -> Any:
        """``record``'s sample, decoded by its pack's ``decoder`` (``view``: see
        ``SampleDecoder.image``) and transformed."""
        image = decoder.image(record, fields[0], view=view)
        target = decoder.target(record, fields[1])
        return (image, target) if self.transforms is None else self.transforms(image, target)

    def _shared(self, items: Iterable[tuple[SampleDecoder, int, Sequence[Buffer]]]) -> list[Any]:
        """The samples of ``(decoder, record, fields)`` items, their tensors in one shared-memory
        block (``share_batch``): map views copied once, into it; decoded images sized up front."""
        items = list(items)
        plain = self.transforms is None
        view = plain and self.decoder.stored_bytes  # the same decode in every pack
        sizes: list[int] | None = [] if plain else None
        for decoder, run in itertools.groupby(items, key=itemgetter(0)):  # one run per pack
            more = decoder.decoded_nbytes([record for _, record, _ in run])
            sizes = None if sizes is None or more is None else sizes + more
        made = (self._decoded(*item, view) for item in items)
        return share_batch(made, sizes, borrowed=0 if view else None)


def parse_sources(path: Source | Sequence[Source], image_set: str) -> list[tuple[Any, str]]:
    """``(pack, image_set)`` of each source ``path`` names (one pack, or a sequence)."""
    if isinstance(path, (str, os.PathLike)):
        return [(path, image_set)]
    if isinstance(path, tuple) and len(path) == 2 and isinstance(path[1], str):
        raise TypeError(f"for one (pack, image_set) pair pass a list of it: [{path!r}]")
    sources = []
    for source in path:
        if isinstance(source, (str, os.PathLike)):
            sources.append((source, image_set))
        elif isinstance(source, tuple) and len(source) == 2 and isinstance(source[1], str):
            sources.append((source[0], source[1]))
        else:
            raise TypeError(
                f"a source is a path or URL, or a (path, image_set) pair; got {source!r}"
            )
    if not sources:
        raise ValueError("no sources: pass a pack's path or URL, or a list of them")
    return sources


class JoinedSamples(PackedSamples):
    """A dataset of one or several sources (``PackedSamples`` each) read as one; the first
    source's pack and decoder stand for all where a single one is expected."""

    _parts: list[PackedSamples]

    def _join(
        self,
        sources: Sequence[tuple[Any, str]],
        task: str,
        *,
        decode: Decode = "pil",
        target_format: TargetFormat = "dict",
        classes: Classes = None,
        zero_copy: bool = False,
        year: str | None = None,
        **pack_options: Any,
    ) -> None:
        """Open the records of each source's image set of ``task`` (list-file order) and their
        decoders, into one label space: ``classes`` if a list, else the union of the sources'
        classes, the first source's first."""
        if task == "Segmentation" and (target_format != "dict" or classes is not None):
            raise ValueError("target_format and classes apply to task='Main' (detection) only")
        options: dict[str, Any] = dict(
            decode=decode, target_format=target_format, zero_copy=zero_copy
        )
        parts = []
        for path, image_set in sources:
            part = PackedSamples()
            parts.append(part)
            pack = part.pack = VOCPackReader(path, **pack_options)
            if year is not None and str(year) != pack.year:
                hint = "pass that pack's year (or none: the pack knows it)"
                if str(year) in pack.image_sets(task):  # the order before VOCDetection's
                    hint = f"{year!r} is an image set: the 2nd argument is the year, as in "
                    hint += f"VOCDetection; pass image_set={year!r}"
                raise ValueError(f"{pack.name} holds VOC{pack.year}, not VOC{year}; {hint}")
            part.decoder = SampleDecoder(
                pack, task=task, image_set=image_set, classes=classes, **options
            )
            part.records = np.asarray(pack.split(task, image_set), dtype=np.int64)
            part.year, part.image_set = pack.year, image_set
            part._fields = (schema.IMAGE, part.decoder.target_field)
        if len(parts) > 1 and (classes is None or isinstance(classes, str)):
            names = list(dict.fromkeys(n for part in parts for n in part.label_names))
            for part in parts:
                part.decoder = SampleDecoder(
                    part.pack, task=task, image_set=part.image_set, classes=names, **options
                )
        self._parts = parts
        first = parts[0]
        self.pack, self.decoder, self._fields = first.pack, first.decoder, first._fields
        self.year = "+".join(dict.fromkeys(part.year for part in parts))
        self.image_set = "+".join(dict.fromkeys(part.image_set for part in parts))
        self.records = np.concatenate([part.records for part in parts])
        #: where each source's positions start (and the last ends)
        self._offsets = np.cumsum([0, *(len(part.records) for part in parts)])

    def reopen(self) -> None:
        """Map the packed file(s) of every source again in this process (``worker_init_fn``)."""
        for part in self._parts:
            part.reopen()


class _PackedVOCBase(JoinedSamples):
    """Shared by both map-style datasets: torchvision's attributes, indexing, batch reads."""

    _TASK: str
    _TARGET_DIR: str
    _TARGET_EXT: str

    def __init__(
        self,
        path: Source | Sequence[Source],
        year: str | None = None,
        image_set: str = "train",
        download: bool = False,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        transforms: Callable | None = None,
        *,
        decode: Decode = "pil",
        target_format: TargetFormat = "dict",
        classes: Classes = None,
        checked: bool = False,
        zero_copy: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit_bytes: int | None = None,
    ) -> None:
        sources = parse_sources(path, image_set)
        root = ", ".join(str(source) for source, _ in sources)
        VisionDataset.__init__(self, root, transforms, transform, target_transform)
        if download:
            raise ValueError(
                "a pack is not downloaded: get VOC with torchvision's VOCDetection(download=True), "
                "pack it with torch_serialized.pack_voc, then pass the pack's path or URL"
            )
        self._join(
            sources,
            self._TASK,
            decode=decode,
            target_format=target_format,
            classes=classes,
            checked=checked,
            zero_copy=zero_copy,
            year=year,
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )
        self._starts = self._offsets.tolist()  # for bisect: a list, not an array (2 µs)
        self._ids, self._images, self._targets = (
            ChainedNames.of([record_names(part.pack, part.records, *where) for part in self._parts])
            for where in ((None,), ("JPEGImages", ".jpg"), (self._TARGET_DIR, self._TARGET_EXT))
        )

    # lazy sequences, read-only: setting one would not change what the dataset reads
    ids = property(attrgetter("_ids"), doc="the image ids, in list-file order")
    images = property(attrgetter("_images"), doc="image paths relative to torchvision's root")
    targets = property(attrgetter("_targets"), doc="target paths relative to torchvision's root")

    def __len__(self) -> int:
        return len(self.records)

    def _record(self, index: Any) -> tuple[PackedSamples, int]:
        """The source and record at ``index`` (a read's one index check); errors name index
        and length."""
        name, n = type(self).__name__, len(self)
        try:
            i = as_index(index)
        except TypeError:
            hint = ""
            if isinstance(index, str):
                hint = f"; to find an image id use dataset.ids.index({index!r})"
            elif isinstance(index, slice):
                span = range(*index.indices(n))
                hint = f"; for a part use torch.utils.data.Subset(dataset, {span})"
            raise TypeError(
                f"{name} indices must be integers, not {type(index).__name__}{hint}"
            ) from None
        if not -n <= i < n:
            packs = " + ".join(part.pack.name for part in self._parts)
            raise IndexError(
                f"{name} index {i} is out of range: image set {self.image_set!r} of "
                f"{packs} has {n} samples (0 to {n - 1}, or -{n} to -1)"
            )
        i %= n
        return self._parts[bisect_right(self._starts, i) - 1], int(self.records[i])

    def _read(self, part: PackedSamples, record: int) -> tuple[int, Sequence[Buffer]]:
        """``record`` of ``part`` and its image and target fields, as views of the map."""
        shard, local = part.pack.reader.locate(record)
        try:
            return record, shard.record(local, part._fields)
        except ChecksumError as exc:  # checked=True: name the sample, not only the file
            raise part.pack.named(exc) from None

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        part, record = self._record(index)
        return self._decoded(part.decoder, *self._read(part, record))

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, Any]]:
        """``[self[i] for i in indices]``, indices checked first; in a worker, tensors go in one
        shared-memory block. An overridden ``__getitem__`` (the v2 wrapper) gets per-index calls."""
        if type(self).__getitem__ is not _PackedVOCBase.__getitem__:
            return [self[i] for i in indices]
        records = [self._record(i) for i in indices]
        if not in_worker():
            return [self._decoded(at[0].decoder, *self._read(*at)) for at in records]
        return self._shared((at[0].decoder, *self._read(*at)) for at in records)


class VOCSerializedDataset(_PackedVOCBase, VOCDetection):  # type: ignore[misc]
    """``VOCDetection`` read from a pack: same samples, order and outputs.

    Positional arguments in ``VOCDetection``'s order, a pack in place of ``root``.

    Args:
        path: a ``.tser`` file or shard folder written by ``pack_voc``, or its URL; or a
            sequence of them, or of ``(pack, image_set)`` pairs: their samples one after the
            other, as ``ConcatDataset``, labels (``"tv_tensors"``) in one label space (see
            ``VOCSerializedIterableDataset``).
        year: the pack's year, checked (default None: whatever the pack holds).
        image_set: ``"train"``, ``"val"``, ``"trainval"``, ``"test"`` (2007) or any Main list.
        download: must be False (a pack is made with ``pack_voc``, not downloaded).
        transform, target_transform, transforms: as in torchvision.
        decode: ``"pil"`` (default, exact), ``"tensor"`` or ``"none"``; see ``Decode``.
        target_format: ``"dict"`` (default, exact) or ``"tv_tensors"``; see ``TargetFormat``.
        classes: label names for ``"tv_tensors"`` targets; see ``Classes``, ``label_names``.
        checked: verify each record's checksum as it is read.
        zero_copy: with ``decode="none"`` (and raw-pixel packs), read-only views of the map
            instead of copies (e.g. for batched GPU ``decode_jpeg``); writing into one crashes.
        storage_options, cache_dir, cache_limit_bytes: for a pack at a URL (``s3://``...):
            fsspec options, the cache folder (default ``$TORCH_SERIALIZED_CACHE``, else
            ``~/.cache/torch_serialized``), its bound in bytes (None: unbounded).
    """

    _TASK, _TARGET_DIR, _TARGET_EXT = "Main", "Annotations", ".xml"


class VOCSerializedSegmentation(_PackedVOCBase, VOCSegmentation):  # type: ignore[misc]
    """``VOCSegmentation`` read from a pack: same images and masks (mode P, palette kept).

    Arguments as ``VOCSerializedDataset`` (``target_format`` and ``classes`` do not apply)."""

    _TASK, _TARGET_DIR, _TARGET_EXT = "Segmentation", "SegmentationClass", ".png"
