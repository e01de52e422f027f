"""Pack a VOCdevkit folder into one file (or shards): the ``pack_voc`` entry point.

Every id listed in ``ImageSets/Main`` or ``ImageSets/Segmentation`` is stored once, with its
original image, XML and mask bytes, plus what makes reading fast (the parsed target as JSON,
the objects as arrays, the image size). With ``workers > 1``, worker processes read, parse
and lay out chunks of records in scratch files exactly as the output will hold them; the
writing process only fills in the class ids (assigned in dataset order) and has the kernel
copy each record into place. Records are written in one fixed order, so the output is
byte-identical for any number of workers.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image, UnidentifiedImageError

from .._version import __version__
from ..errors import SourceDataError
from ..parallel import Record, Spilled, SpillPool, pays_off
from ..writer import PackWriter
from . import codec
from .layout import find_voc_root, read_image_sets
from .xml import extract_objects, parse_annotation

__all__ = ["pack_voc", "PackResult", "SkippedSample", "ImageStorage", "Serializer"]

ImageStorage = Literal["original", "raw"]
_RESIZE_QUALITY = 90


@dataclass(frozen=True)
class SkippedSample:
    """An id left out by ``on_error="skip"``, and why."""

    id: str
    reason: str


@dataclass(frozen=True)
class PackResult:
    """What ``pack_voc`` wrote."""

    path: Path
    num_samples: int
    num_bytes: int
    source_bytes: int
    seconds: float
    skipped: list[SkippedSample] = field(default_factory=list)
    report: Path | None = None

    @property
    def samples_per_second(self) -> float:
        return self.num_samples / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class _Options:
    image_storage: str
    max_size: int | None
    check_images: bool


@dataclass(frozen=True)
class _Job:
    voc_root: str
    id: str
    listed_in: str  # "ImageSets/Main/train.txt line 3", for error messages
    needs_annotation: bool
    needs_mask: bool
    options: _Options
    #: The ``_OPTIONAL_FILES`` folders that list this id's file: only those are opened, as a
    #: failed open per absent mask cost ~5% of a pack.
    listed_in_folders: frozenset[str]


@dataclass
class _Loaded:
    id: str
    payloads: list[bytes]  # empty once a pack worker wrote them to a scratch file
    width: int
    height: int
    flags: int
    names: list[str]
    objects: Any  # VOCObjects, or None
    source_bytes: int


def pack_voc(
    root: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    year: str | None = "2012",
    max_samples_per_shard: int | None = None,
    max_shard_bytes: int | None = None,
    workers: int = 1,
    image_storage: ImageStorage = "original",
    max_size: int | None = None,
    check_images: bool = False,
    on_error: Literal["raise", "skip"] = "raise",
    progress: bool = False,
) -> PackResult:
    """Pack a VOC dataset into ``output`` (a ``.tser`` file, or a shard folder with a limit).

    ``root`` is what torchvision calls root (the folder holding ``VOCdevkit/``) or the
    ``VOCdevkit/VOC20xx`` folder itself (whose name then gives the year); ``year=None``
    finds the year from the folder names. ``image_storage="raw"``
    stores decoded RGB pixels (no decode at read time, larger file); ``max_size`` resizes
    images so their longer side is at most that many pixels, scaling boxes and sizes with
    them. Both change what is returned, so such packs are no longer byte-exact drop-ins.
    ``check_images`` decodes every image at pack time. ``on_error="skip"`` leaves out bad
    samples (listed in the result and a ``.skipped.json`` report) instead of failing.
    ``workers > 1`` reads, parses and writes samples in that many spawned processes (scratch
    files beside the output, removed at the end); the output is byte-identical to one
    process. ``progress`` shows a progress bar.
    """
    if image_storage not in ("original", "raw"):
        raise ValueError(f"image_storage must be 'original' or 'raw', got {image_storage!r}")
    if max_size is not None and max_size < 1:
        raise ValueError(f"max_size must be a positive number of pixels, got {max_size}")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    started = time.perf_counter()
    voc_root, year = find_voc_root(root, None if _is_voc_folder(Path(root)) else year)
    image_sets = read_image_sets(voc_root)
    options = _Options(image_storage, max_size, check_images)
    jobs = _plan(voc_root, image_sets, options)
    output = Path(output)

    skipped: list[SkippedSample] = []
    classes: dict[str, int] = {}
    record_of: dict[str, int] = {}
    record_classes: list[list[int]] = []
    source_bytes = 0
    pool = (
        SpillPool(
            functools.partial(_load_spilled, skip=on_error == "skip"), jobs, codec.FIELDS, workers
        )
        if pays_off(len(jobs), workers)
        else None
    )
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(
            PackWriter(
                output,
                codec.FIELDS,
                columns=codec.COLUMNS,
                max_records_per_shard=max_samples_per_shard,
                max_shard_bytes=max_shard_bytes,
                before_finish=pool.drain if pool is not None else None,
            )
        )
        if pool is not None:  # on an error, stop the processes before the output is removed
            stack.callback(pool.close)
        from tqdm.auto import tqdm  # here, not at the top: pack workers import this module

        bar = tqdm(total=len(jobs), unit="img", disable=not progress, desc=f"packing {output.name}")
        last = time.perf_counter()
        items: Iterable[_Loaded | Spilled | SkippedSample] = (
            pool.items(writer) if pool is not None else _load_each(jobs, on_error)
        )
        for item in items:
            if isinstance(item, SkippedSample):
                skipped.append(item)
                bar.update(1)
                continue
            loaded = item.info if isinstance(item, Spilled) else item
            class_ids = [classes.setdefault(n, len(classes)) for n in loaded.names]
            objects = b""
            if loaded.objects is not None:
                obj = loaded.objects
                objects = codec.encode_objects(obj.boxes, class_ids, obj.difficult, obj.truncated)
            row = (loaded.width, loaded.height, len(loaded.names), loaded.flags)
            if isinstance(item, Spilled):
                assert pool is not None  # only pack processes spill
                entries = item.fill(codec.OBJECTS, objects)
                record_of[loaded.id], target, at = writer.reserve(entries, row)
                pool.place(item, target, at)
            else:
                payloads = list(loaded.payloads)
                payloads[codec.OBJECTS] = objects
                record_of[loaded.id] = writer.add(payloads, row)
            record_classes.append(class_ids)
            source_bytes += loaded.source_bytes
            bar.update(1)
            now = time.perf_counter()
            if progress and (now - last > 0.5 or bar.n == 1):
                elapsed = now - started
                bar.set_postfix_str(f"{writer.bytes_written / elapsed / 1e6:.0f} MB/s")
                last = now
        bar.close()

        ids = list(record_of)
        blob, offsets = codec.encode_ids(ids)
        writer.add_array("ids", blob)
        writer.add_array("id_offsets", offsets)
        splits: dict[str, dict[str, int]] = {}
        class_counts: dict[str, dict[str, int]] = {}
        for task, sets in image_sets.items():
            for name, listed in sets.items():
                records = np.array([record_of[i] for i in listed if i in record_of], dtype="<i8")
                writer.add_array(codec.split_array_name(task, name), records)
                splits.setdefault(task, {})[name] = len(records)
                listed_classes = [c for r in records for c in record_classes[r]]
                counts = np.bincount(
                    np.array(listed_classes, dtype=np.int64), minlength=len(classes)
                )
                class_counts[f"{task}/{name}"] = {
                    n: int(counts[c]) for n, c in classes.items() if counts[c]
                }
        for rel, data in _imageset_files(voc_root):
            writer.add_array(f"file/{rel}", np.frombuffer(data, dtype=np.uint8))
        metadata = {
            "schema": codec.SCHEMA,
            "schema_version": codec.SCHEMA_VERSION,
            "year": year,
            "base_dir": _base_dir(voc_root, year),
            "voc_folder": voc_root.name,
            "num_samples": len(ids),
            "splits": splits,
            "classes": list(classes),
            "class_counts": class_counts,
            "image_storage": image_storage,
            "max_size": max_size,
            "options": {
                "max_samples_per_shard": max_samples_per_shard,
                "max_shard_bytes": max_shard_bytes,
                "check_images": check_images,
                "on_error": on_error,
            },
            "source_bytes": source_bytes,
            "skipped": [{"id": s.id, "reason": s.reason} for s in skipped],
            "packed_by": f"torch_serialized {__version__}",
        }
        path = writer.close(metadata)
        num_bytes = writer.bytes_written

    report = None
    if skipped:
        report = path.with_name(path.name + ".skipped.json")
        report.write_text(
            json.dumps(metadata["skipped"], indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
        )
    return PackResult(
        path=path,
        num_samples=len(ids),
        num_bytes=num_bytes,
        source_bytes=source_bytes,
        seconds=time.perf_counter() - started,
        skipped=skipped,
        report=report,
    )


def _plan(
    voc_root: Path, image_sets: Mapping[str, Mapping[str, Sequence[str]]], options: _Options
) -> list[_Job]:
    """One job per distinct id, in layout order: train ids first, then val, test, the rest."""
    order = {"train": 0, "val": 1, "test": 2, "trainval": 3}
    first: dict[str, str] = {}
    needs: dict[str, set[str]] = {}
    for task in codec.TASKS:
        sets = image_sets.get(task, {})
        for name in sorted(sets, key=lambda n: (order.get(n, 4), n)):
            for line, image_id in enumerate(sets[name], start=1):
                first.setdefault(image_id, f"ImageSets/{task}/{name}.txt line {line}")
                needs.setdefault(image_id, set()).add(task)
    listings = {folder: _listing(voc_root / folder) for folder in _OPTIONAL_FILES}
    return [
        _Job(
            str(voc_root),
            image_id,
            listed_in,
            "Main" in needs[image_id],
            "Segmentation" in needs[image_id],
            options,
            frozenset(
                folder
                for folder, extension in _OPTIONAL_FILES.items()
                if (image_id + extension).casefold() in listings[folder]
            ),
        )
        for image_id, listed_in in first.items()
    ]


#: Per-id files that may be absent, by folder: the extension after the id.
_OPTIONAL_FILES = {"Annotations": ".xml", "SegmentationClass": ".png", "SegmentationObject": ".png"}


def _listing(folder: Path) -> frozenset[str]:
    """The case-folded names in ``folder`` (none if it is missing): case-blind, so a file a
    case-insensitive file system would open is never skipped."""
    try:
        return frozenset(name.casefold() for name in os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return frozenset()


def _load_spilled(job: _Job, skip: bool) -> Record | SkippedSample:
    """A job's record for a pack process (``parallel.spill_chunk``): objects are left as
    zero bytes, since their class ids are only known in the writing process, which sees the
    samples in dataset order."""
    loaded = _load_or_skip(job, skip)
    if isinstance(loaded, SkippedSample):
        return loaded
    payloads = list(loaded.payloads)
    if loaded.objects is not None:
        payloads[codec.OBJECTS] = bytes(codec.OBJECT_DTYPE.itemsize * len(loaded.names))
    loaded.payloads = []
    return Record(payloads, loaded)


def _load_each(jobs: Sequence[_Job], on_error: str) -> Iterator[_Loaded | SkippedSample]:
    """Every job's sample (or why it was skipped), loaded in this process."""
    for job in jobs:
        yield _load_or_skip(job, on_error == "skip")


def _load_or_skip(job: _Job, skip: bool) -> _Loaded | SkippedSample:
    try:
        return _load(job)
    except SourceDataError as exc:
        if not skip:
            raise
        return SkippedSample(job.id, str(exc))


def _read(path: str, required: bool, job: _Job, what: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        if not required:
            return None
        raise SourceDataError(
            f"{path}: {what} of id {job.id!r} (listed in {job.listed_in}) is missing; "
            "add the file or remove the id from the list (or pack with on_error='skip')"
        ) from None
    except OSError as exc:
        raise SourceDataError(
            f"{path}: cannot read {what} of id {job.id!r}: {exc.strerror or exc}; "
            "fix the file's permissions or remove the id from the lists"
        ) from None


def _load(job: _Job) -> _Loaded:
    """Read and parse everything about one id."""
    voc, name = job.voc_root, job.id  # plain strings: pathlib costs ~15% of a pack here
    image_path = os.path.join(voc, "JPEGImages", name + ".jpg")
    xml_path = os.path.join(voc, "Annotations", name + ".xml")
    mask_path = os.path.join(voc, "SegmentationClass", name + ".png")
    image = _read(image_path, True, job, "the image")
    annotation = mask = object_mask = None
    listed = job.listed_in_folders
    if job.needs_annotation or "Annotations" in listed:
        annotation = _read(xml_path, job.needs_annotation, job, "the annotation")
    if job.needs_mask or "SegmentationClass" in listed:
        mask = _read(mask_path, job.needs_mask, job, "the mask")
    if "SegmentationObject" in listed:
        object_mask = _read(os.path.join(voc, "SegmentationObject", name + ".png"), False, job, "")
    assert image is not None
    source_bytes = sum(len(b) for b in (image, annotation, mask, object_mask) if b)

    target_json = b""
    objects = None
    names: list[str] = []
    flags = 0
    target: dict[str, Any] | None = None
    if annotation is not None:
        flags |= codec.HAS_ANNOTATION
        target = parse_annotation(annotation, source=xml_path)
        objects = extract_objects(target, source=xml_path)
        names = objects.names
    if mask is not None:
        flags |= codec.HAS_MASK
    if object_mask is not None:
        flags |= codec.HAS_OBJECT_MASK

    stored, width, height, scale = _store_image(image, image_path, job.options)
    if scale is not None and objects is not None and target is not None:
        objects = _scale_objects(objects, scale)
        _scale_target(target, scale, width, height)
    if target is not None:
        target_json = codec.encode_target(target)
    payloads = [stored, annotation or b"", mask or b"", object_mask or b"", target_json, b""]
    return _Loaded(job.id, payloads, width, height, flags, names, objects, source_bytes)


def _store_image(
    data: bytes, path: str, options: _Options
) -> tuple[bytes, int, int, tuple[float, float] | None]:
    """The bytes to store for an image, its stored size, and the box scale if resized."""
    if not (options.check_images or options.image_storage == "raw" or options.max_size):
        size = jpeg_size(data)  # the common case: stored as is, only the size is needed
        if size is not None:
            _check_pixels(size, path)
            return data, size[0], size[1], None
    try:
        img: Image.Image = Image.open(io.BytesIO(data))
        width, height = img.size
        if options.check_images or options.image_storage == "raw" or options.max_size:
            img = img.convert("RGB")  # decodes every pixel: truncated data fails here
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise SourceDataError(
            f"{path}: not a readable image ({exc}); replace the file or remove its id "
            "from the lists (or pack with on_error='skip')"
        ) from None
    except Image.DecompressionBombError as exc:
        raise SourceDataError(f"{path}: {exc}; refusing a decompression bomb") from None
    scale = None
    if options.max_size and max(width, height) > options.max_size:
        factor = options.max_size / max(width, height)
        size = (max(1, round(width * factor)), max(1, round(height * factor)))
        img = img.resize(size, Image.Resampling.BILINEAR, reducing_gap=3.0)
        scale = (size[0] / width, size[1] / height)
        width, height = size
        if options.image_storage == "original":
            out = io.BytesIO()
            img.save(out, format="JPEG", quality=_RESIZE_QUALITY)
            return out.getvalue(), width, height, scale
    if options.image_storage == "raw":
        return img.tobytes(), width, height, scale
    return data, width, height, scale


#: Start-of-frame markers (baseline, extended, progressive, lossless...): they hold the size.
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` from a JPEG's start-of-frame header, or ``None`` if not found.

    Reads a few hundred bytes of markers instead of opening the image with PIL, which was
    ~15% of packing time. ``None`` (not a JPEG, odd markers) sends the caller to PIL.
    """
    if data[:2] != b"\xff\xd8":
        return None
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if length < 2:
            return None
        if marker in _SOF_MARKERS:
            if i + 9 > n:
                return None
            height = int.from_bytes(data[i + 5 : i + 7], "big")
            width = int.from_bytes(data[i + 7 : i + 9], "big")
            return (width, height) if width and height else None
        i += 2 + length
    return None


def _check_pixels(size: tuple[int, int], path: str) -> None:
    """Pillow's decompression-bomb rule, for images whose size was read without Pillow."""
    limit = Image.MAX_IMAGE_PIXELS
    pixels = size[0] * size[1]
    if limit and pixels > 2 * limit:
        raise SourceDataError(
            f"{path}: image size ({pixels} pixels) exceeds limit of {2 * limit} pixels, could "
            "be decompression bomb DOS attack; refusing a decompression bomb"
        )
    if limit and pixels > limit:
        warnings.warn(
            f"{path}: image size ({pixels} pixels) exceeds limit of {limit} pixels, could be "
            "decompression bomb DOS attack.",
            Image.DecompressionBombWarning,
            stacklevel=2,
        )


def _scale_objects(objects: Any, scale: tuple[float, float]) -> Any:
    boxes = objects.boxes * np.array([scale[0], scale[1], scale[0], scale[1]], np.float32)
    return type(objects)(
        boxes=boxes, names=objects.names, difficult=objects.difficult, truncated=objects.truncated
    )


def _scale_target(
    target: dict[str, Any], scale: tuple[float, float], width: int, height: int
) -> None:
    """Rewrite size and bndbox strings of a target dict for a resized image."""
    annotation = target.get("annotation")
    if not isinstance(annotation, dict):
        return
    size = annotation.get("size")
    if isinstance(size, dict):
        size["width"], size["height"] = str(width), str(height)
    for obj in annotation.get("object", []):
        box = obj.get("bndbox") if isinstance(obj, dict) else None
        if isinstance(box, dict):
            for key, factor in (("xmin", 0), ("xmax", 0), ("ymin", 1), ("ymax", 1)):
                if key in box:
                    value = float(box[key]) * scale[factor]
                    box[key] = f"{value:.2f}".rstrip("0").rstrip(".")


def _imageset_files(voc_root: Path) -> Iterator[tuple[str, bytes]]:
    """Every list file under ImageSets, raw, so ``export`` can restore them byte for byte."""
    base = voc_root / "ImageSets"
    for path in sorted(base.rglob("*.txt")):
        if path.is_file():
            yield path.relative_to(voc_root).as_posix(), path.read_bytes()


def _is_voc_folder(path: Path) -> bool:
    """Whether ``path`` is a ``VOC20xx`` folder itself (its name then gives the year)."""
    return re.fullmatch(r"VOC\d{4}", path.name) is not None and (path / "ImageSets").is_dir()


def _base_dir(voc_root: Path, year: str) -> str:
    """The devkit-relative folder torchvision expects under ``root`` for ``year``."""
    if year == "2011":
        return os.path.join("TrainVal", "VOCdevkit", "VOC2011")
    return os.path.join("VOCdevkit", f"VOC{year}")


class Serializer:
    """The original design's packer: ``Serializer(source_dir, output_file).serialize()``.

    ``source_dir`` is the ``VOCdevkit/VOC20xx`` folder; ``kwargs`` go to ``pack_voc``.
    """

    def __init__(
        self, source_dir: str | os.PathLike[str], output_file: str | os.PathLike[str], **kwargs: Any
    ) -> None:
        self.source_dir = Path(source_dir)
        self.output_file = Path(output_file)
        self.kwargs = kwargs

    def serialize(self) -> PackResult:
        """Pack ``source_dir`` into ``output_file``."""
        return pack_voc(self.source_dir, self.output_file, **self.kwargs)
