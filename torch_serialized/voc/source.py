"""The source side of a pack: ``survey`` orders a devkit's distinct ids (jobs made on demand);
``load`` reads and parses one id (class ids are the writer's). Both are picklable: pack
processes use them."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..container.fileio import (
    DEFAULT_MAX_FILE_BYTES,
    FileKindError,
    FileSizeError,
    read_regular_file_stat,
)
from ..errors import SourceDataError, SourceNotFoundError
from . import schema
from .images import SKIP_HINT, ImageOptions, check_mask, resize_mask, scale_target, store_image
from .layout import TASKS, near_miss
from .xml import VOCObjects, extract_objects, parse_annotation

#: Image sets in layout order: train ids first, then val, test, trainval, then custom lists.
_LAYOUT_ORDER = {"train": 0, "val": 1, "test": 2, "trainval": 3}


@dataclass(frozen=True)
class Job:
    voc_root: str
    id: str
    listed_in: str  # "ImageSets/Main/train.txt line 3", for error messages
    needs_annotation: bool
    needs_mask: bool
    options: ImageOptions
    #: which ``source_paths`` ``load`` opens: the image; the others if needed or their folder
    #: lists the file (listed once per folder: a failed open per absent file was ~5% of a pack)
    reads: tuple[bool, ...]
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES


@dataclass
class LoadedSample:
    """One id, ready to be written (objects not yet encoded)."""

    id: str
    payloads: list[bytes]  # in schema.FIELDS order, objects empty
    width: int
    height: int
    flags: int
    names: list[str]
    objects: VOCObjects | None
    source_bytes: int
    stats: tuple[int, ...] = ()  # (size, mtime_ns) per ``SOURCE_FILES``; ``ABSENT, 0``: unread
    digest: bytes = b""  # SHA-256 of the source image when stored transformed
    untyped: str = ""  # why the objects have no rows (``schema.UNTYPED_OBJECTS``)
    unparsed: str = ""


@dataclass(frozen=True)
class Planned:
    """A devkit's distinct ids in layout order and the ``Job`` each would get: an append
    makes jobs only for the ids it loads."""

    voc_root: str
    options: ImageOptions
    max_file_bytes: int
    ids: list[str]
    main: frozenset[str]  # ids listed in ImageSets/Main
    segmentation: frozenset[str]  # ids listed in ImageSets/Segmentation
    names: tuple[frozenset[str], ...]
    first: Mapping[str, tuple[int, int]]  # id -> where first listed: ``lists`` number, line
    lists: tuple[str, ...]  # "ImageSets/Main/train.txt", in layout order

    def __len__(self) -> int:
        return len(self.ids)

    def job(self, i: int) -> Job:
        """The job of ``ids[i]``, as a full pack makes it."""
        return self.jobs([i])[0]

    def jobs(self, positions: Sequence[int] | None = None) -> list[Job]:
        """The jobs of ``ids[i]`` for ``positions`` (default: every id)."""
        positions = range(len(self.ids)) if positions is None else positions
        files, needs = self.reads(positions)
        jobs = []
        for i, opens, (annotation, mask) in zip(positions, files.tolist(), needs.tolist()):
            image_id = self.ids[i]
            number, line = self.first[image_id]
            where = f"{self.lists[number]} line {line}"
            opened = tuple(opens)
            limit = self.max_file_bytes
            jobs.append(
                Job(self.voc_root, image_id, where, annotation, mask, self.options, opened, limit)
            )
        return jobs

    def reads(self, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``job(i).reads`` for ``positions`` without making jobs (bool ``[n, 4]``), and whether
        each needs its annotation and mask (bool ``[n, 2]``)."""
        ids = [self.ids[i] for i in positions]
        folded = [i.casefold() for i in ids]
        needs = np.array([(i in self.main, i in self.segmentation) for i in ids], dtype=bool)
        needs = needs.reshape(len(ids), 2)
        files = np.ones((len(ids), len(_FOLDERS) + 1), dtype=bool)
        for k, (ext, names) in enumerate(zip(_EXTENSIONS, self.names), start=1):
            files[:, k] = [f + ext in names for f in folded]
        files[:, 1] |= needs[:, 0]
        files[:, 2] |= needs[:, 1]
        return files, needs


_FOLDERS = schema.SOURCE_FOLDERS[1:]
_EXTENSIONS = schema.SOURCE_EXTENSIONS[1:]


def survey(
    voc_root: Path,
    image_sets: Mapping[str, Mapping[str, Sequence[str]]],
    options: ImageOptions,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> Planned:
    """The distinct ids of ``image_sets`` in layout order."""
    ordered = [
        (task, name, image_sets[task][name])
        for task in TASKS
        for name in sorted(image_sets.get(task, {}), key=lambda n: (_LAYOUT_ORDER.get(n, 4), n))
    ]
    first: dict[str, tuple[int, int]] = {}  # in first-listed order: the ids
    for number, (*_, listed) in enumerate(ordered):
        for line, image_id in enumerate(listed, start=1):
            first.setdefault(image_id, (number, line))
    main, segmentation = (
        frozenset(i for t, _, listed in ordered if t == task for i in listed) for task in TASKS
    )
    names = tuple(_listing(voc_root / folder) for folder in _FOLDERS)
    return Planned(
        str(voc_root),
        options,
        max_file_bytes,
        list(first),
        main,
        segmentation,
        names,
        first,
        tuple(f"ImageSets/{task}/{name}.txt" for task, name, _ in ordered),
    )


def _listing(folder: Path) -> frozenset[str]:
    """Case-folded names in ``folder`` (none if missing), as a case-blind file system sees."""
    try:
        return frozenset(map(str.casefold, os.listdir(folder)))
    except (FileNotFoundError, NotADirectoryError):
        return frozenset()


def source_paths(job: Job) -> tuple[str, ...]:
    voc, name = job.voc_root, job.id
    return tuple(
        f"{voc}{os.sep}{folder}{os.sep}{name}{ext}"
        for folder, ext in zip(schema.SOURCE_FOLDERS, schema.SOURCE_EXTENSIONS)
    )


_WHAT = ("the image", "the annotation", "the mask", "the object mask")


def load(job: Job) -> LoadedSample:
    """Read and parse everything about one id; ``SourceDataError`` names what is wrong."""
    paths = source_paths(job)
    image_path, xml_path, mask_path, object_path = paths
    required = (True, job.needs_annotation, job.needs_mask, False)
    stats = [(schema.ABSENT, 0)] * len(schema.SOURCE_FILES)
    files = [
        _read(paths[k], required[k], job, _WHAT[k], stats, k) if wanted else None
        for k, wanted in enumerate(job.reads)
    ]
    image, annotation, mask, object_mask = files
    source_bytes = sum(len(b) for b in files if b)
    flags = sum(flag for flag, data in zip(schema.SOURCE_FLAGS, files) if data is not None)
    target: dict[str, Any] | None = None
    untyped = unparsed = ""
    if annotation is not None:
        try:
            target = parse_annotation(annotation, source=xml_path)
        except SourceDataError as exc:
            unparsed = _unparsed(exc, job)
    for data, path in ((mask, mask_path), (object_mask, object_path)):
        if data is not None:
            check_mask(data, path, job.options)
    image = image or b""  # _read raised if it is missing
    stored, width, height, scale = store_image(image, image_path, job.options)
    if scale is not None:  # the target and masks of a resized image are resized with it
        if target is not None:
            scale_target(target, scale, width, height)
        mask = mask and resize_mask(mask, mask_path, scale)
        object_mask = object_mask and resize_mask(object_mask, object_path, scale)
    target_json, objects, names = b"", None, []
    if target is not None:
        try:
            target_json = schema.encode_target(target)
        except schema.TargetTooDeepError as exc:  # parsed, but not storable so it reads back
            error = SourceDataError(
                f"{xml_path}: elements are nested too deeply to store ({exc}); flatten the "
                "annotation."
            )
            target, unparsed = None, _unparsed(error, job)
    if target is not None:
        try:  # the object rows hold the stored (scaled) target's numbers
            objects = extract_objects(target, source=xml_path)
            names = objects.names
        except SourceDataError as exc:  # torchvision reads it: packed, without object rows
            flags |= schema.UNTYPED_OBJECTS
            untyped = str(exc)
    if unparsed:
        flags |= schema.UNPARSED_ANNOTATION
    payloads = [stored, annotation or b"", mask or b"", object_mask or b"", target_json, b""]
    digest = hashlib.sha256(image).digest() if job.options.transformed else b""
    return LoadedSample(
        job.id,
        payloads,
        width,
        height,
        flags,
        names,
        objects,
        source_bytes,
        tuple(x for pair in stats for x in pair),
        digest,
        untyped,
        unparsed,
    )


def _unparsed(error: SourceDataError, job: Job) -> str:
    """Why the annotation did not parse, for an id only ``VOCSegmentation`` reads (it never
    parses XML); for any other id ``error`` is raised."""
    if job.needs_annotation:
        raise error from None
    return str(error)


def _read(
    path: str, required: bool, job: Job, what: str, stats: list[tuple[int, int]], k: int
) -> bytes | None:
    """A regular file's bytes (``None``: absent, not ``required``); size, mtime to ``stats[k]``."""
    try:
        data, st = read_regular_file_stat(path, job.max_file_bytes, what)
        stats[k] = (st.st_size, st.st_mtime_ns)
        return data
    except FileNotFoundError:
        if not required:
            return None
        found = near_miss(path)  # `000002.JPG` beside the missing `000002.jpg`: say so
        advice = "add the file or remove the id from the list"
        if found is not None:
            there, name = os.path.basename(found), os.path.basename(path)
            advice = f"{there!r} is there, but torchvision read only {name!r}: rename the file"
        raise SourceNotFoundError(
            f"{path}: {what} of id {job.id!r} (listed in {job.listed_in}) is missing; "
            f"{advice} {SKIP_HINT}"
        ) from None
    except (FileKindError, FileSizeError) as exc:
        fix = "replace it with the file"
        if isinstance(exc, FileSizeError):
            fix = "pass a larger max_file_bytes (--max-file-size) if the file is genuine"
        raise SourceDataError(
            f"{exc} (id {job.id!r}); {fix}, or remove the id from the lists"
        ) from None
    except OSError as exc:
        raise SourceDataError(
            f"{path}: cannot read {what} of id {job.id!r}: {exc.strerror or exc}; "
            "fix the file's permissions or remove the id from the lists"
        ) from None
