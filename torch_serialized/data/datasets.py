"""Map-style datasets over a packed VOC file: drop-in replacements for torchvision's.

``VOCSerializedDataset`` returns, index for index, what ``torchvision.datasets.VOCDetection``
returns for the same image set; ``VOCSerializedSegmentation`` does the same for
``VOCSegmentation``. Both subclass the torchvision classes so ``isinstance`` checks and
``torchvision.datasets.wrap_dataset_for_transforms_v2`` keep working.

``open_split`` (a pack, one image set's records and their decoder) and ``joint_transforms``
(torchvision's rule for ``transforms`` vs ``transform`` / ``target_transform``) are shared with
the iterable dataset, so both kinds open packs and apply transforms the same way.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from operator import index as as_index
from typing import Any

import numpy as np
from torchvision.datasets import VOCDetection, VOCSegmentation
from torchvision.datasets.vision import VisionDataset

from ..errors import ChecksumError
from ..voc import schema
from ..voc.names import RecordNames, record_names
from ..voc.packed import VOCPackReader
from .decode import Classes, Decode, SampleDecoder, TargetFormat
from .workers import in_worker, share_batch

__all__ = [
    "VOCSerializedDataset",
    "VOCSerializedSegmentation",
    "open_split",
    "joint_transforms",
]


def open_split(
    path: str | os.PathLike[str],
    task: str,
    image_set: str,
    *,
    decode: Decode = "pil",
    target_format: TargetFormat = "dict",
    classes: Classes = None,
    zero_copy: bool = False,
    year: str | None = None,
    **pack_options: Any,
) -> tuple[VOCPackReader, np.ndarray, SampleDecoder]:
    """Open the pack at ``path`` (local, or a URL read through the cache) for ``image_set``
    of ``task``: the pack, the image set's record numbers (list-file order) and the decoder
    of its records. ``year``, if given, must be the pack's; ``pack_options`` go to
    ``VOCPackReader`` (``checked``, ``storage_options``, ``cache_dir``...)."""
    pack = VOCPackReader(path, **pack_options)
    if year is not None and str(year) != pack.year:
        raise ValueError(
            f"{pack.name} holds VOC{pack.year}, not VOC{year}; pass that pack's "
            "year (or none: the pack knows it)"
        )
    records = pack.split(task, image_set)
    decoder = SampleDecoder(
        pack,
        task=task,
        image_set=image_set,
        decode=decode,
        target_format=target_format,
        classes=classes,
        zero_copy=zero_copy,
    )
    return pack, records, decoder


def joint_transforms(
    transforms: Callable | None, transform: Callable | None, target_transform: Callable | None
) -> Callable | None:
    """The one callable applied to ``(image, target)``, by torchvision's own ``VisionDataset``
    rule: ``transforms``, or ``transform`` / ``target_transform`` wrapped together, never both
    kinds (``ValueError``)."""
    return VisionDataset("", transforms, transform, target_transform).transforms


class _PackedVOCBase:
    """Shared by both datasets: opening the split, the torchvision attributes as lazy
    sequences, index checks, and the per-index and per-batch read paths."""

    _TASK: str
    _TARGET_DIR: str
    _TARGET_EXT: str
    transforms: Callable | None  # set by torchvision's VisionDataset.__init__

    def _open(
        self, path: str | os.PathLike[str], image_set: str, download: bool, **kw: Any
    ) -> None:
        """Open the split; ``kw``: the keyword arguments of ``open_split``."""
        if download:
            raise ValueError(
                "a pack is not downloaded from torchvision's mirrors: download with "
                "torchvision's VOCDetection(download=True) once, pack it with "
                "torch_serialized.pack_voc, then pass the pack's path or URL"
            )
        self.pack, self.records, self.decoder = open_split(path, self._TASK, image_set, **kw)
        self.year = self.pack.year
        self.image_set = image_set
        self._fields = (schema.IMAGE, self.decoder.target_field)
        self._ids = record_names(self.pack, self.records)
        self._images = record_names(self.pack, self.records, "JPEGImages", ".jpg")
        self._targets = record_names(self.pack, self.records, self._TARGET_DIR, self._TARGET_EXT)

    @property
    def ids(self) -> RecordNames:
        """Image ids of this image set, in order: a lazy read-only sequence of ``str``."""
        return self._ids

    @property
    def images(self) -> RecordNames:
        """Image paths relative to torchvision's ``root``, as torchvision's ``images`` list:
        a lazy read-only sequence (O(1) indexing, no list of N strings in memory)."""
        return self._images

    @property
    def targets(self) -> RecordNames:
        """Target paths relative to torchvision's ``root`` (lazy, as ``images``)."""
        return self._targets

    def __len__(self) -> int:
        return len(self.records)

    def extra_repr(self) -> str:
        lines = [f"Year: {self.year}", f"Image set: {self.image_set}"]
        if self.decoder.decode != "pil":
            lines.append(f"Decode: {self.decoder.decode}")
        if self.decoder.target_format != "dict":
            lines.append(f"Target format: {self.decoder.target_format}")
        if self.decoder.zero_copy:
            lines.append("Zero copy: True")
        return "\n".join(lines)

    def reopen(self) -> None:
        """Map the packed file(s) again in this process (what ``worker_init_fn`` calls)."""
        self.pack.reader.reopen()

    def _record(self, index: Any) -> int:
        """The record number at dataset ``index``, or the ``IndexError`` / ``TypeError`` a
        list raises, naming the index and the length (the one index check of a read: record
        numbers of the split are valid by the pack's open-time checks)."""
        name = type(self).__name__
        try:
            i = as_index(index)
        except TypeError:
            hint = ""
            if isinstance(index, str):
                hint = f"; to find an image id use dataset.ids.index({index!r})"
            elif isinstance(index, slice):
                span = range(*index.indices(len(self)))
                hint = f"; for a part of the dataset use torch.utils.data.Subset(dataset, {span})"
            raise TypeError(
                f"{name} indices must be integers, not {type(index).__name__}{hint}"
            ) from None
        n = len(self)
        if not -n <= i < n:
            raise IndexError(
                f"{name} index {i} is out of range: image set {self.image_set!r} of "
                f"{self.pack.name} has {n} samples (0 to {n - 1}, or -{n} to -1)"
            )
        return int(self.records[i])

    def _sample(self, record: int, view: bool = False) -> tuple[Any, Any]:
        """The sample of ``record``: its fields read as views of the map, decoded (``view``:
        see ``SampleDecoder.image``), transformed."""
        shard, local = self.pack.reader.locate(record)
        try:
            image, target = shard.record(local, self._fields)
        except ChecksumError as exc:  # checked=True: name the sample, not only the file
            raise self.pack.named(exc) from None
        image = self.decoder.image(record, image, view=view)
        target = self.decoder.target(record, target)
        return (image, target) if self.transforms is None else self.transforms(image, target)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self._sample(self._record(index))

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, Any]]:
        """The samples at ``indices``, exactly as ``[self[i] for i in indices]`` (what
        ``DataLoader`` calls with a batch of indices); every index is checked before any read.

        In a ``DataLoader`` worker the batch's tensors are put in one block of shared memory
        (``workers.share_batch``: same values, one segment per batch instead of one per
        tensor, ~3x the samples/s of ``decode="none"`` through 2 workers).

        A subclass that overrides ``__getitem__`` (torchvision's transforms-v2 wrapper is
        one) gets per-index calls, so its ``__getitem__`` always decides.
        """
        if type(self).__getitem__ is not _PackedVOCBase.__getitem__:
            return [self[i] for i in indices]
        records = [self._record(i) for i in indices]
        if not in_worker():
            return [self._sample(record) for record in records]
        # Stored bytes are read as views of the map, so that the copy into the block is their
        # only copy: the workers' CPU 107 -> 96 µs a sample of decode="none" (README.md of
        # benchmarks, "Measurements behind the code"). Samples are made one at a time.
        plain = self.transforms is None
        view = plain and self.decoder.stored_bytes
        made = (self._sample(record, view) for record in records)
        sizes = self.decoder.decoded_nbytes(records) if plain else None
        return share_batch(made, sizes, borrowed=0 if view else None)


class VOCSerializedDataset(_PackedVOCBase, VOCDetection):  # type: ignore[misc]
    """``VOCDetection`` read from a pack: same samples, order and outputs.

    Args:
        path: a ``.tser`` file or shard folder written by ``pack_voc``.
        image_set: ``"train"``, ``"val"``, ``"trainval"``, ``"test"`` (2007), or any other
            list packed from ``ImageSets/Main``.
        transform, target_transform, transforms: as in torchvision.
        decode: ``"pil"`` (default, exact), ``"tensor"`` or ``"none"``; see ``Decode``.
        target_format: ``"dict"`` (default, exact) or ``"tv_tensors"``; see ``TargetFormat``.
        classes: label names for ``"tv_tensors"`` targets: by default VOC's 20 classes after
            ``"__background__"`` when the pack holds only those, else the pack's own classes
            in pack order; see ``Classes``. ``label_names`` shows the result.
        checked: verify each record's checksum as it is read.
        zero_copy: with ``decode="none"`` (and raw-pixel packs), return read-only views of
            the mapped file instead of copies: no per-sample copy of the stored bytes,
            for pipelines that only read the bytes, such as batched GPU ``decode_jpeg``.
            Writing into such a tensor crashes the process (the map is read-only); views
            keep the map alive and reading them pages the file in.
        year, download: accepted as keywords so ``VOCDetection(...)`` calls migrate by changing
            the first argument only; ``year`` must match the pack, ``download`` must be False.
        storage_options, cache_dir, cache_limit_bytes: for a pack at a URL (``s3://``,
            ``gs://``, ``https://``...): options passed to fsspec (credentials, endpoint), the
            local cache folder (default ``$TORCH_SERIALIZED_CACHE``, else
            ``~/.cache/torch_serialized``) and its bound in bytes (None: unbounded). Each shard
            is downloaded on first touch: random access ends with the whole pack cached.
            Ignored for a local path.
    """

    _TASK, _TARGET_DIR, _TARGET_EXT = "Main", "Annotations", ".xml"

    def __init__(
        self,
        path: str | os.PathLike[str],
        image_set: str = "train",
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        transforms: Callable | None = None,
        *,
        decode: Decode = "pil",
        target_format: TargetFormat = "dict",
        classes: Classes = None,
        checked: bool = False,
        zero_copy: bool = False,
        year: str | None = None,
        download: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit_bytes: int | None = None,
    ) -> None:
        VisionDataset.__init__(self, str(path), transforms, transform, target_transform)
        self._open(
            path,
            image_set,
            download,
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

    @property
    def label_names(self) -> list[str]:
        """The name of each ``"tv_tensors"`` label (label ``i`` is ``label_names[i]``; 0 is
        ``"__background__"`` unless ``classes`` says otherwise): what ``classes`` resolved to."""
        return list(self.decoder.label_names)


class VOCSerializedSegmentation(_PackedVOCBase, VOCSegmentation):  # type: ignore[misc]
    """``VOCSegmentation`` read from a pack: same images and masks (mode P, palette kept).

    Arguments as ``VOCSerializedDataset`` (``target_format`` and ``classes`` do not apply).
    """

    _TASK, _TARGET_DIR, _TARGET_EXT = "Segmentation", "SegmentationClass", ".png"

    def __init__(
        self,
        path: str | os.PathLike[str],
        image_set: str = "train",
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        transforms: Callable | None = None,
        *,
        decode: Decode = "pil",
        checked: bool = False,
        zero_copy: bool = False,
        year: str | None = None,
        download: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit_bytes: int | None = None,
    ) -> None:
        VisionDataset.__init__(self, str(path), transforms, transform, target_transform)
        self._open(
            path,
            image_set,
            download,
            decode=decode,
            checked=checked,
            zero_copy=zero_copy,
            year=year,
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )
