"""The source side of a pack: which ids to store, in which order, and loading one id.

``plan`` turns a devkit's image sets into one ``Job`` per distinct id, in the order a pack
lays them out (``survey``: the same ids and what their jobs would be, without making them,
for an append that loads only a few); ``load`` reads and parses everything about one id
into a ``LoadedSample`` (its payloads in ``schema.FIELDS`` order, objects still as names:
class ids are assigned by the writing process). Jobs and loaded samples are plain
picklable values, because pack processes load them too. This module never imports torch.
"""

from __future__ import annotations

import hashlib
import itertools
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
    """One id to load."""

    voc_root: str
    id: str
    listed_in: str  # "ImageSets/Main/train.txt line 3", for error messages
    needs_annotation: bool
    needs_mask: bool
    options: ImageOptions
    #: The folders (of files an id may lack) that hold this id's file: only those are opened,
    #: as a failed open costs (benchmarks/README.md, "Measurements behind the code").
    listed_in_folders: frozenset[str]
    #: The largest file read (``pack_voc(max_file_bytes=...)``).
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES


@dataclass
class LoadedSample:
    """Everything about one id, ready to be written (objects not yet encoded)."""

    id: str
    payloads: list[bytes]  # in schema.FIELDS order, objects empty
    width: int
    height: int
    flags: int
    names: list[str]
    objects: VOCObjects | None
    source_bytes: int
    #: size and mtime_ns of each of ``schema.SOURCE_FILES`` in turn (8 integers) when read,
    #: ``ABSENT, 0`` for a file not read
    stats: tuple[int, ...] = ()
    #: SHA-256 of the source image when the stored image is not its bytes, else empty
    digest: bytes = b""
    #: why the annotation's objects have no rows (``schema.UNTYPED_OBJECTS``), else empty
    untyped: str = ""
    #: why the annotation did not parse (``schema.UNPARSED_ANNOTATION``), else empty
    unparsed: str = ""


def plan(
    voc_root: Path,
    image_sets: Mapping[str, Mapping[str, Sequence[str]]],
    options: ImageOptions,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> list[Job]:
    """One job per distinct id, in layout order: train ids first, then val, test, the rest."""
    planned = survey(voc_root, image_sets, options, max_file_bytes)
    return [planned.job(i) for i in range(len(planned))]


@dataclass(frozen=True)
class Planned:
    """The distinct ids of a devkit's lists in layout order, and what ``Job`` each would get,
    before any job is made: an append makes jobs only for the ids it loads or compares."""

    voc_root: str
    options: ImageOptions
    max_file_bytes: int
    ids: list[str]
    main: frozenset[str]  # ids listed in ImageSets/Main
    segmentation: frozenset[str]  # ids listed in ImageSets/Segmentation
    #: per ``_FOLDERS`` folder, the case-folded names of its files (casefold maps
    #: character by character, so an id's file is listed when its folded name is)
    names: tuple[frozenset[str], ...]
    #: id -> where it is first listed: ``lists`` number << 32 | line number
    first: Mapping[str, int]
    lists: tuple[str, ...]  # "ImageSets/Main/train.txt", in layout order

    def __len__(self) -> int:
        return len(self.ids)

    def job(self, i: int) -> Job:
        """The job of ``ids[i]``, the same a full pack makes."""
        image_id = self.ids[i]
        where = self.first[image_id]
        folded = image_id.casefold()
        return Job(
            self.voc_root,
            image_id,
            f"{self.lists[where >> 32]} line {where & 0xFFFFFFFF}",
            image_id in self.main,
            image_id in self.segmentation,
            self.options,
            _KINDS[tuple(folded + ext in names for ext, names in zip(_EXTENSIONS, self.names))],
            self.max_file_bytes,
        )

    def reads(self, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``reads(job(i))`` for each ``i`` of ``positions``, without making the jobs: a bool
        array ``[len(positions), 4]``, then whether each id's lists need its annotation and
        its mask, ``[len(positions), 2]``."""
        ids = [self.ids[i] for i in positions]
        folded = [i.casefold() for i in ids]
        main = [i in self.main for i in ids]
        seg = [i in self.segmentation for i in ids]
        files = np.ones((len(ids), len(_FOLDERS) + 1), dtype=bool)
        for k, (ext, names) in enumerate(zip(_EXTENSIONS, self.names), start=1):
            files[:, k] = [f + ext in names for f in folded]
        needs = np.array([main, seg], dtype=bool).T.reshape(len(ids), 2)
        files[:, 1] |= needs[:, 0]
        files[:, 2] |= needs[:, 1]
        return files, needs


#: The folders (and extensions) of the files an id may lack: all but the image's
_FOLDERS = schema.SOURCE_FOLDERS[1:]
_EXTENSIONS = schema.SOURCE_EXTENSIONS[1:]
#: whether each folder lists an id's file -> ``Job.listed_in_folders``: the few distinct
#: sets, shared by every job
_KINDS = {
    found: frozenset(f for f, has in zip(_FOLDERS, found) if has)
    for found in itertools.product((False, True), repeat=len(_FOLDERS))
}


def survey(
    voc_root: Path,
    image_sets: Mapping[str, Mapping[str, Sequence[str]]],
    options: ImageOptions,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> Planned:
    """What ``plan`` plans, without making a job per id (list and set work only, no
    per-id Python object)."""
    ordered = [
        (task, name, image_sets[task][name])
        for task in TASKS
        for name in sorted(image_sets.get(task, {}), key=lambda n: (_LAYOUT_ORDER.get(n, 4), n))
    ]
    ids = list(dict.fromkeys(itertools.chain.from_iterable(listed for *_, listed in ordered)))
    # first listing of each id: the lists walked backwards, each list's lines backwards, so the
    # value left for an id is its first line in its first list
    first: dict[str, int] = {}
    for number in range(len(ordered) - 1, -1, -1):
        listed = ordered[number][2]
        base = number << 32
        first.update(zip(reversed(listed), range(base + len(listed), base, -1)))
    by_task = {
        task: frozenset(
            itertools.chain.from_iterable(listed for t, _, listed in ordered if t == task)
        )
        for task in TASKS
    }
    names = tuple(_listing(voc_root / folder) for folder in _FOLDERS)
    return Planned(
        str(voc_root),
        options,
        max_file_bytes,
        ids,
        by_task["Main"],
        by_task["Segmentation"],
        names,
        first,
        tuple(f"ImageSets/{task}/{name}.txt" for task, name, _ in ordered),
    )


def _listing(folder: Path) -> frozenset[str]:
    """The case-folded names in ``folder`` (none if it is missing): case-blind, so a file a
    case-insensitive file system would open is never skipped."""
    try:
        return frozenset(map(str.casefold, os.listdir(folder)))
    except (FileNotFoundError, NotADirectoryError):
        return frozenset()


def stores_digest(options: ImageOptions) -> bool:
    """Whether images stored with ``options`` may differ from their files' bytes, so a pack
    keeps each source image's SHA-256 (``schema.DIGEST_ARRAY``) to compare content."""
    return options.image_storage != "original" or options.max_size is not None


def source_paths(job: Job) -> tuple[str, ...]:
    """The paths of ``job``'s image, annotation, mask and object mask (``SOURCE_FILES``)."""
    voc, name = job.voc_root, job.id  # plain strings, not pathlib: see benchmarks/README.md
    return tuple(
        f"{voc}{os.sep}{folder}{os.sep}{name}{ext}"
        for folder, ext in zip(schema.SOURCE_FOLDERS, schema.SOURCE_EXTENSIONS)
    )


def reads(job: Job) -> tuple[bool, bool, bool, bool]:
    """Which of ``source_paths(job)`` ``load`` opens (the image always; the others when the
    id's lists need them or their folder lists a file of the id)."""
    listed = job.listed_in_folders
    return (
        True,
        job.needs_annotation or "Annotations" in listed,
        job.needs_mask or "SegmentationClass" in listed,
        "SegmentationObject" in listed,
    )


def load(job: Job) -> LoadedSample:
    """Read and parse everything about one id; ``SourceDataError`` names what is wrong."""
    name = job.id
    image_path, xml_path, mask_path, object_path = source_paths(job)
    stats = [(schema.ABSENT, 0)] * len(schema.SOURCE_FILES)
    image = _read(image_path, job, "the image", stats, 0)
    annotation = mask = object_mask = None
    _, wants_xml, wants_mask, wants_object = reads(job)
    if wants_xml:
        annotation = _read_optional(xml_path, job.needs_annotation, job, "the annotation", stats, 1)
    if wants_mask:
        mask = _read_optional(mask_path, job.needs_mask, job, "the mask", stats, 2)
    if wants_object:
        object_mask = _read_optional(object_path, False, job, "the object mask", stats, 3)
    source_bytes = sum(len(b) for b in (image, annotation, mask, object_mask) if b)

    target_json = b""
    objects = None
    names: list[str] = []
    flags = 0
    target: dict[str, Any] | None = None
    untyped = ""
    unparsed = ""
    if annotation is not None:
        flags |= schema.HAS_ANNOTATION
        try:
            target = parse_annotation(annotation, source=xml_path)
        except SourceDataError as exc:
            unparsed = _unparsed(exc, job)
    if mask is not None:
        flags |= schema.HAS_MASK
        check_mask(mask, mask_path, job.options)
    if object_mask is not None:
        flags |= schema.HAS_OBJECT_MASK
        check_mask(object_mask, object_path, job.options)

    stored, width, height, scale = store_image(image, image_path, job.options)
    if scale is not None:  # the target and masks of a resized image are resized with it
        if target is not None:
            scale_target(target, scale, width, height)
        mask = mask and resize_mask(mask, mask_path, scale)
        object_mask = object_mask and resize_mask(object_mask, object_path, scale)
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
    digest = hashlib.sha256(image).digest() if stores_digest(job.options) else b""
    return LoadedSample(
        name,
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
    """Why ``job``'s annotation did not parse, for an id that needs no target (listed only in
    ``ImageSets/Segmentation``: ``VOCSegmentation`` never reads its XML, so the id is packed
    with the file's bytes and no target); ``error`` itself for any other id."""
    if job.needs_annotation:
        raise error from None
    return str(error)


def _read(path: str, job: Job, what: str, stats: list[tuple[int, int]], k: int) -> bytes:
    """A required file's bytes."""
    data = _read_optional(path, True, job, what, stats, k)
    if data is None:  # _read_optional raises for a missing required file
        raise SourceNotFoundError(f"{path}: {what} of id {job.id!r} is missing")
    return data


def _read_optional(
    path: str, required: bool, job: Job, what: str, stats: list[tuple[int, int]], k: int
) -> bytes | None:
    """A file's bytes, or ``None`` when it is absent and not ``required``; its size and
    modification time go to ``stats[k]``. Only a regular file of at most
    ``job.max_file_bytes`` is read (see ``container.fileio``)."""
    try:
        data, st = read_regular_file_stat(path, job.max_file_bytes, what or "the file")
        stats[k] = (st.st_size, st.st_mtime_ns)
        return data
    except FileNotFoundError:
        if not required:
            return None
        found = near_miss(path)
        if found is not None:  # `000002.JPG` beside the missing `000002.jpg`: say so
            raise SourceNotFoundError(
                f"{path}: {what} of id {job.id!r} (listed in {job.listed_in}) is missing, but "
                f"{os.path.basename(found)!r} is there: torchvision (and pack_voc) read only "
                f"{os.path.basename(path)!r}; rename the file (or the folder's files of that "
                f"extension) {SKIP_HINT}"
            ) from None
        raise SourceNotFoundError(
            f"{path}: {what} of id {job.id!r} (listed in {job.listed_in}) is missing; "
            f"add the file or remove the id from the list {SKIP_HINT}"
        ) from None
    except FileKindError as exc:
        raise SourceDataError(
            f"{exc} (id {job.id!r}); replace it with the file or remove the id from the lists"
        ) from None
    except FileSizeError as exc:
        raise SourceDataError(
            f"{exc} (id {job.id!r}); pass a larger max_file_bytes (--max-file-size) if the file "
            "is genuine, or remove the id from the lists"
        ) from None
    except OSError as exc:
        raise SourceDataError(
            f"{path}: cannot read {what} of id {job.id!r}: {exc.strerror or exc}; "
            "fix the file's permissions or remove the id from the lists"
        ) from None
