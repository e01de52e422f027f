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
from collections.abc import Callable
from typing import Any

import numpy as np
from torchvision.datasets import VOCDetection, VOCSegmentation
from torchvision.datasets.vision import VisionDataset

from .decode import Classes, Decode, SampleDecoder, TargetFormat
from .voc import schema
from .voc.reader import VOCPackReader

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
    checked: bool = False,
    zero_copy: bool = False,
    year: str | None = None,
) -> tuple[VOCPackReader, np.ndarray, SampleDecoder]:
    """Open the pack at ``path`` for ``image_set`` of ``task``: the pack, the image set's
    record numbers (list-file order) and the decoder of its records. ``year``, if given,
    must be the pack's."""
    pack = VOCPackReader(path, checked=checked)
    if year is not None and str(year) != pack.year:
        raise ValueError(
            f"{pack.path} holds VOC{pack.year}, not VOC{year}; pass that pack's "
            "year (or none: the pack knows it)"
        )
    records = pack.split(task, image_set)
    decoder = SampleDecoder(
        pack,
        decode=decode,
        target_format=target_format,
        classes=classes,
        split_key=f"{task}/{image_set}",
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
    """Shared by both datasets: the pack, the split's record numbers, the decoder."""

    _TASK: str
    _TARGET_DIR: str
    _TARGET_EXT: str
    pack: VOCPackReader
    records: np.ndarray
    decoder: SampleDecoder
    image_set: str
    year: str

    def _open(
        self,
        path: str | os.PathLike[str],
        image_set: str,
        decode: Decode,
        target_format: TargetFormat,
        classes: Classes,
        checked: bool,
        year: str | None,
        download: bool,
        zero_copy: bool,
    ) -> None:
        if download:
            raise ValueError(
                "a pack is a local file: download with torchvision's VOCDetection(download=True) "
                "once, pack it with torch_serialized.pack_voc, then pass the pack's path"
            )
        self.pack, self.records, self.decoder = open_split(
            path,
            self._TASK,
            image_set,
            decode=decode,
            target_format=target_format,
            classes=classes,
            checked=checked,
            zero_copy=zero_copy,
            year=year,
        )
        self.year = self.pack.year
        self.image_set = image_set

    def __len__(self) -> int:
        return len(self.records)

    def _record(self, index: int) -> int:
        return int(self.records[index])  # IndexError and negative indices as a list's

    def _names(self, folder: str, ext: str) -> list[str]:
        base = os.path.join(self.pack.base_dir, folder)
        return [os.path.join(base, self.pack.id(int(r)) + ext) for r in self.records]

    @property
    def ids(self) -> list[str]:
        """Image ids of this image set, in order (built on access, not stored)."""
        return [self.pack.id(int(r)) for r in self.records]

    @property
    def images(self) -> list[str]:
        """Original image paths relative to torchvision's ``root`` (built on access)."""
        return self._names("JPEGImages", ".jpg")

    @property
    def targets(self) -> list[str]:
        """Original target paths relative to torchvision's ``root`` (built on access)."""
        return self._names(self._TARGET_DIR, self._TARGET_EXT)

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


class VOCSerializedDataset(_PackedVOCBase, VOCDetection):  # type: ignore[misc]
    """``VOCDetection`` read from a pack: same samples, order and outputs.

    Args:
        path: a ``.tser`` file or shard folder written by ``pack_voc``.
        image_set: ``"train"``, ``"val"``, ``"trainval"``, ``"test"`` (2007), or any other
            list packed from ``ImageSets/Main``.
        transform, target_transform, transforms: as in torchvision.
        decode: ``"pil"`` (default, exact), ``"tensor"`` or ``"none"``; see ``Decode``.
        target_format: ``"dict"`` (default, exact) or ``"tv_tensors"``; see ``TargetFormat``.
        classes: label names for ``"tv_tensors"`` targets; see ``Classes``.
        checked: verify each record's checksum as it is read.
        zero_copy: with ``decode="none"`` (and raw-pixel packs), return read-only views of
            the mapped file instead of copies: no per-sample copy of the stored bytes,
            for pipelines that only read the bytes, such as batched GPU ``decode_jpeg``.
            Writing into such a tensor crashes the process (the map is read-only); views
            keep the map alive and reading them pages the file in.
        year, download: accepted as keywords so ``VOCDetection(...)`` calls migrate by changing
            the first argument only; ``year`` must match the pack, ``download`` must be False.
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
    ) -> None:
        VisionDataset.__init__(self, str(path), transforms, transform, target_transform)
        self._open(
            path, image_set, decode, target_format, classes, checked, year, download, zero_copy
        )

    @property
    def annotations(self) -> list[str]:
        return self.targets

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        record = self._record(index)
        pack, decoder = self.pack, self.decoder
        img = decoder.image(record, pack.field(record, schema.IMAGE))
        target = decoder.target(record, pack.field(record, decoder.target_field))
        if self.transforms is not None:
            img, target = self.transforms(img, target)
        return img, target


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
    ) -> None:
        VisionDataset.__init__(self, str(path), transforms, transform, target_transform)
        self._open(path, image_set, decode, "dict", None, checked, year, download, zero_copy)

    @property
    def masks(self) -> list[str]:
        return self.targets

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        record = self._record(index)
        pack, decoder = self.pack, self.decoder
        img = decoder.image(record, pack.field(record, schema.IMAGE))
        target = decoder.mask(record, pack.field(record, schema.MASK))
        if self.transforms is not None:
            img, target = self.transforms(img, target)
        return img, target
