"""Map-style datasets over a packed VOC file: drop-in replacements for torchvision's.

``VOCSerializedDataset`` returns, index for index, what ``torchvision.datasets.VOCDetection``
returns for the same image set; ``VOCSerializedSegmentation`` does the same for
``VOCSegmentation``. Both subclass the torchvision classes so ``isinstance`` checks and
``torchvision.datasets.wrap_dataset_for_transforms_v2`` keep working.

``open_split`` (a pack, one image set's records and their decoder) and ``joint_transforms``
(torchvision's rule for ``transforms`` vs ``transform`` / ``target_transform``) are shared with
the iterable dataset, so both kinds open packs and apply transforms the same way.
"""

# More than 400 lines: both drop-in classes (torchvision's full argument lists, documented)
# and the read paths they share, per index and per batch, kept where they must stay alike.

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from operator import index as _as_index
from typing import Any

import numpy as np
from torchvision.datasets import VOCDetection, VOCSegmentation
from torchvision.datasets.vision import VisionDataset

from ..container.reader import ContainerReader
from ..errors import ChecksumError
from ..voc import schema
from ..voc.names import RecordNames, record_names
from ..voc.packed import VOCPackReader
from .decode import Buffer, Classes, Decode, SampleDecoder, TargetFormat
from .workers import in_worker, share_as_made

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
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit_bytes: int | None = None,
) -> tuple[VOCPackReader, np.ndarray, SampleDecoder]:
    """Open the pack at ``path`` (local, or a URL read through the cache) for ``image_set``
    of ``task``: the pack, the image set's record numbers (list-file order) and the decoder
    of its records. ``year``, if given, must be the pack's."""
    pack = VOCPackReader(
        path,
        checked=checked,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_limit_bytes=cache_limit_bytes,
    )
    if year is not None and str(year) != pack.year:
        raise ValueError(
            f"{pack.name} holds VOC{pack.year}, not VOC{year}; pass that pack's "
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
    """Shared by both datasets: the pack, the split's record numbers, the decoder, the
    torchvision attributes as lazy sequences, and the single and batch read paths."""

    _TASK: str
    _TARGET_DIR: str
    _TARGET_EXT: str
    pack: VOCPackReader
    records: np.ndarray
    decoder: SampleDecoder
    image_set: str
    year: str
    _fields: tuple[int, int]
    _index: memoryview
    _single: ContainerReader | None
    _fetch_fields: Callable[[int, tuple[int, int]], Sequence[Buffer]]
    _image_of: Callable[[int, Buffer], Any]
    _target_of: Callable[[int, Buffer], Any]
    _ids: RecordNames
    _images: RecordNames
    _targets: RecordNames
    transforms: Callable | None  # set by torchvision's VisionDataset.__init__

    def __getitem__(self, index: int) -> tuple[Any, Any]:  # each dataset's own
        raise NotImplementedError

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
        storage_options: Mapping[str, Any] | None,
        cache_dir: str | os.PathLike[str] | None,
        cache_limit_bytes: int | None,
    ) -> None:
        if download:
            raise ValueError(
                "a pack is not downloaded from torchvision's mirrors: download with "
                "torchvision's VOCDetection(download=True) once, pack it with "
                "torch_serialized.pack_voc, then pass the pack's path or URL"
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
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )
        self.year = self.pack.year
        self.image_set = image_set
        target_field = schema.MASK if self._TASK == "Segmentation" else self.decoder.target_field
        self._fields = (schema.IMAGE, target_field)
        #: the per-sample calls, dispatched once (``_one_file``, ``SampleDecoder.image_reader``):
        #: ``(record, fields) -> views of the map``, the image's and the target's decoders
        self._single = self._one_file()
        self._fetch_fields = self._located if self._single is None else self._single.record
        self._image_of = self.decoder.image_reader()
        self._view_of = self.decoder.view_reader()
        self._target_of = self.decoder.target_reader()
        self._index = _index_of(self.records)
        self._ids = record_names(self.pack, self.records)
        self._images = record_names(self.pack, self.records, "JPEGImages", ".jpg")
        self._targets = record_names(self.pack, self.records, self._TARGET_DIR, self._TARGET_EXT)

    def __len__(self) -> int:
        return len(self.records)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_index"]  # a memoryview: rebuilt from ``records``
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._index = _index_of(self.records)

    def _record(self, index: int) -> int:
        try:
            return self._index[_as_index(index)]  # type: ignore[no-any-return]
        except (IndexError, TypeError):
            raise self._bad_index(index) from None

    def _bad_index(self, index: Any) -> Exception:
        """The ``IndexError`` or ``TypeError`` a list raises for ``index``, naming the index
        and the length (the index memoryview's own messages name neither). Error path only:
        the lookups call it after the memoryview refused ``index``."""
        name = type(self).__name__
        try:
            index = _as_index(index)
        except TypeError:
            hint = ""
            if isinstance(index, str):
                hint = f"; to find an image id use dataset.ids.index({index!r})"
            elif isinstance(index, slice):
                span = range(*index.indices(len(self)))
                hint = f"; for a part of the dataset use torch.utils.data.Subset(dataset, {span})"
            return TypeError(f"{name} indices must be integers, not {type(index).__name__}{hint}")
        n = len(self)
        return IndexError(
            f"{name} index {index} is out of range: image set {self.image_set!r} of "
            f"{self.pack.name} has {n} samples (0 to {n - 1}, or -{n} to -1)"
        )

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

    # -- reading -------------------------------------------------------------------------------
    def _one_file(self) -> ContainerReader | None:
        """The container of a one-file pack (its record numbers are the pack's: no shard to
        locate per read), else None."""
        reader = self.pack.reader
        if reader.manifest_path is not None or not len(reader):
            return None
        return reader.locate(0)[0]

    def _located(self, record: int, fields: tuple[int, int]) -> Sequence[Buffer]:
        """``(record, fields) -> views`` for a sharded pack: the shard located first."""
        shard, local = self.pack.reader.locate(record)
        return shard.record(local, fields)

    def _fetch_many(self, records: Sequence[int]) -> list[list[Buffer]]:
        """The fields of every one of ``records`` (views of the map, in that order), the
        kernel hinted to read all of them at once (``ContainerReader.advise``)."""
        if self._single is not None:  # one file: record numbers are the file's
            return self._views(self._single, records)
        reader = self.pack.reader
        groups: dict[int, tuple[Any, list[int], list[int]]] = {}
        for position, record in enumerate(records):
            shard, local = reader.locate(record)
            group = groups.setdefault(id(shard), (shard, [], []))
            group[1].append(local)
            group[2].append(position)
        out: list[list[Buffer]] = [[] for _ in records]
        for shard, locals_, positions in groups.values():
            for position, row in zip(positions, self._views(shard, locals_)):
                out[position] = row
        return out

    def _views(self, shard: ContainerReader, records: Sequence[int]) -> list[list[Buffer]]:
        """Views of the fields of ``records`` of ``shard`` after one read hint for them all
        (the copies out of the map, made later in batch order, then find their pages read)."""
        wanted = np.asarray(records, dtype=np.int64)
        shard.advise(wanted)
        return shard.views(wanted, self._fields)  # type: ignore[return-value]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, Any]]:
        """The samples at ``indices``, exactly as ``[self[i] for i in indices]``, read as one
        batch (what ``DataLoader`` calls with a batch of indices): one index lookup, reads
        hinted together and done in storage order, targets built for the whole batch.

        In a ``DataLoader`` worker the batch's tensors are then put in one block of shared
        memory (``workers.share_batch``: same values, one segment per batch instead of one
        per tensor, ~3x the samples/s of ``decode="none"`` through 2 workers).

        A subclass that overrides ``__getitem__`` (torchvision's transforms-v2 wrapper is
        one) gets per-index calls, so its ``__getitem__`` always decides.
        """
        if type(self).__getitem__ not in _BATCHABLE:
            return [self[i] for i in indices]
        index = self._index
        try:
            records = [index[_as_index(i)] for i in indices]  # IndexError before any read
        except (IndexError, TypeError):
            records = [self._record(i) for i in indices]  # raises, naming the first bad one
        if not records:
            return []
        try:
            rows = self._fetch_many(records)
        except ChecksumError as exc:  # checked=True: name the sample, not only the file
            raise self.pack.named(exc) from None
        transforms, worker = self.transforms, in_worker()
        # A worker copies the batch into shared memory: read as views of the map, the images
        # are copied once (into the block) instead of twice (by us, then into the block).
        view_of = self._view_of if worker and transforms is None else None
        image_of = view_of or self._image_of
        targets = self._batch_targets(records, [row[1] for row in rows])
        made: Iterator[tuple[Any, Any]]  # samples made as taken: one decoded image at a time
        if transforms is None:
            made = ((image_of(r, row[0]), t) for r, row, t in zip(records, rows, targets))
        else:
            made = (transforms(image_of(r, row[0]), t) for r, row, t in zip(records, rows, targets))
        if not worker:
            return list(made)
        sizes = self.decoder.decoded_nbytes(records) if transforms is None else None
        return share_as_made(made, sizes, borrowed=None if view_of is None else 0)

    def _batch_targets(self, records: list[int], data: list[Buffer]) -> list[Any]:
        raise NotImplementedError


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
            decode,
            target_format,
            classes,
            checked,
            year,
            download,
            zero_copy,
            storage_options,
            cache_dir,
            cache_limit_bytes,
        )

    @property
    def annotations(self) -> RecordNames:
        """Annotation paths relative to torchvision's ``root`` (lazy, as ``images``)."""
        return self._targets

    @property
    def label_names(self) -> list[str]:
        """The name of each ``"tv_tensors"`` label (label ``i`` is ``label_names[i]``; 0 is
        ``"__background__"`` unless ``classes`` says otherwise): what ``classes`` resolved to."""
        return list(self.decoder.label_names)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        # the per-sample path, kept flat: each call or lookup saved is ~0.1 µs of a ~12 µs
        # bytes-level sample (benchmarks/README.md, "Measurements behind the code")
        try:
            record = self._index[_as_index(index)]  # a memoryview takes slices and tuples
        except (IndexError, TypeError):  # free until raised: the message costs only then
            raise self._bad_index(index) from None
        try:
            image, target = self._fetch_fields(record, self._fields)
        except ChecksumError as exc:  # checked=True: name the sample, not only the file
            raise self.pack.named(exc) from None
        image, target = self._image_of(record, image), self._target_of(record, target)
        transforms = self.transforms
        return (image, target) if transforms is None else transforms(image, target)

    def _batch_targets(self, records: list[int], data: list[Buffer]) -> list[Any]:
        return self.decoder.targets(records, data)


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
            decode,
            "dict",
            None,
            checked,
            year,
            download,
            zero_copy,
            storage_options,
            cache_dir,
            cache_limit_bytes,
        )

    @property
    def masks(self) -> RecordNames:
        """Mask paths relative to torchvision's ``root`` (lazy, as ``images``)."""
        return self._targets

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        try:
            record = self._index[_as_index(index)]  # flat, as VOCSerializedDataset.__getitem__
        except (IndexError, TypeError):
            raise self._bad_index(index) from None
        try:
            image_data, mask_data = self._fetch_fields(record, self._fields)
        except ChecksumError as exc:  # as in VOCSerializedDataset.__getitem__
            raise self.pack.named(exc) from None
        image, mask = self._image_of(record, image_data), self.decoder.mask(record, mask_data)
        transforms = self.transforms
        return (image, mask) if transforms is None else transforms(image, mask)

    def _batch_targets(self, records: list[int], data: list[Buffer]) -> list[Any]:
        return [self.decoder.mask(r, mask) for r, mask in zip(records, data)]


#: The ``__getitem__`` methods that ``__getitems__`` reproduces in batch form.
_BATCHABLE = (VOCSerializedDataset.__getitem__, VOCSerializedSegmentation.__getitem__)


def _index_of(records: np.ndarray) -> memoryview:
    """``records`` as a memoryview of native int64: indexing it gives a Python ``int`` in a
    third of the time of ``int(records[i])``, with a list's ``IndexError`` and negative
    indices (a copy only on a big-endian host)."""
    return np.ascontiguousarray(records, dtype=np.int64).data
