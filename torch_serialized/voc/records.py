"""Writing VOC records, as ``pack_voc`` and ``append_voc`` both do.

``write`` loads each job (in spawned pack processes with ``workers > 1``: ``SpillPool``),
assigns class ids as names first appear, writes the records in job order, then the
dataset-level arrays (``write_dataset_arrays``) and the metadata the caller builds from the
``Books``: what the writing process records about the records it wrote. Records are written
in one fixed order, so the output is byte-identical for any number of pack processes (given
the same pack id, file-name token and time in its history: ``utc_now``). Also here: what both
return (``PackResult``), the skipped-samples report and the progress bar. This module never
imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..container import spec as fmt
from ..container.fileio import read_regular_file, replace_file
from ..container.manifest import read_manifest
from ..container.parallel import Record, Spilled, SpillPool, pays_off
from ..container.shardwriter import PackWriter
from ..container.writer import CREATED_BY
from ..errors import SourceDataError, UntypedObjectsWarning, WriteError
from . import schema
from .layout import image_set_files
from .source import Job, LoadedSample, load

#: The skipped-samples report is ``OUTPUT`` + this, beside the output.
REPORT_SUFFIX = ".skipped.json"
ImageSets = Mapping[str, Mapping[str, Sequence[str]]]


@dataclass(frozen=True)
class SkippedSample:
    """An id left out by ``on_error="skip"``, and why."""

    id: str
    reason: str


@dataclass(frozen=True)
class PackResult:
    """What ``pack_voc`` or ``append_voc`` wrote: ``num_bytes`` is the pack's size on disk as
    ``torch-serialized info`` reports it (the file, or the files its manifest names and the
    manifest); ``year`` the VOC year packed (given, or detected), from the folder ``voc_root``."""

    path: Path
    num_samples: int
    num_bytes: int
    source_bytes: int
    seconds: float
    skipped: list[SkippedSample] = field(default_factory=list)
    report: Path | None = None
    year: str = ""
    voc_root: Path | None = None
    #: what the write did, in ids, as the pack's history (``info``) counts it: ``added`` new
    #: ones (a pack: all), ``replaced`` those packed again because their files changed,
    #: ``retired`` those no longer listed (the old records of both retired); then
    #: ``append_voc``'s ``notes``, and the bytes of the files written
    added: int = 0
    replaced: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bytes_written: int = 0
    #: the URL written to: then ``num_bytes`` is the pack's size there (as ``info URL`` says)
    #: and ``bytes_written`` what went up; ``path`` and ``report`` were local temporary copies,
    #: removed before the call returns (the report went up as ``url + ".skipped.json"``)
    url: str | None = None
    #: id -> why, for the ids packed whose objects do not fit object rows (README,
    #: "Guarantees"): their dict targets are torchvision's, their ``"tv_tensors"`` ones raise
    untyped: dict[str, str] = field(default_factory=dict)
    #: id -> why, for the ids packed whose XML did not parse (listed only in
    #: ``ImageSets/Segmentation``): stored as the file's bytes, with no target
    unparsed: dict[str, str] = field(default_factory=dict)

    @property
    def samples_per_second(self) -> float:
        return self.num_samples / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class Books:
    """What the writing process records about the records it wrote, in record order (an
    append starts from the books of the pack it appends to: the ``base_*`` fields describe the
    records it copied, the others the records written after them)."""

    classes: dict[str, int] = field(default_factory=dict)  # name -> class id, first seen first
    record_of: dict[str, int] = field(default_factory=dict)  # live id -> record number
    ids: list[str] = field(default_factory=list)  # every record's id
    #: class ids of the copied records (flat, and per record how many)
    base_classes: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    base_counts: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    record_classes: list[list[int]] = field(default_factory=list)  # class ids per later record
    skipped: list[SkippedSample] = field(default_factory=list)
    source_bytes: int = 0
    #: per later record: size and mtime_ns of each ``schema.SOURCE_FILES`` file when read, flat
    stats: list[tuple[int, ...]] = field(default_factory=list)
    #: per later record, the source image's SHA-256 when images are transformed
    digests: list[bytes] = field(default_factory=list)
    #: the same of the copied records: int64 ``[n, 4, 2]``, and uint8 ``[n, 32]`` (``None``:
    #: no digest known)
    base_stats: np.ndarray = field(
        default_factory=lambda: np.empty((0, len(schema.SOURCE_FILES), 2), np.int64)
    )
    base_digests: np.ndarray | None = None
    retired: list[int] = field(default_factory=list)  # records no longer live (shard folders)
    #: (id, why) of later records whose objects have no rows (``schema.UNTYPED_OBJECTS``),
    #: and how many of the copied records are such
    untyped: list[tuple[str, str]] = field(default_factory=list)
    base_untyped: int = 0
    #: the same for records whose annotations did not parse (``schema.UNPARSED_ANNOTATION``)
    unparsed: list[tuple[str, str]] = field(default_factory=list)
    base_unparsed: int = 0

    def metadata(
        self, splits: Mapping[str, Mapping[str, int]], counts: Mapping[str, Mapping[str, int]]
    ) -> dict[str, Any]:
        """The metadata values these books decide (the rest is the pack's own)."""
        return {
            "schema_version": schema.schema_version(
                retired=bool(self.retired),
                untyped=bool(self.untyped) or self.base_untyped > 0,
                unparsed=bool(self.unparsed) or self.base_unparsed > 0,
            ),
            "num_samples": len(self.ids),
            "splits": splits,
            "classes": list(self.classes),
            "class_counts": counts,
            "source_bytes": self.source_bytes,
            "skipped": [{"id": s.id, "reason": s.reason} for s in self.skipped],
            "source_stats": schema.SOURCE_STATS_VERSION,
        }

    def result(self, path: Path, report: Path, started: float, bar: Any, **more: Any) -> PackResult:
        """Write (or remove) the skipped-samples ``report``; what the write returns, whose
        rate (bytes written over the whole time) ``bar`` shows last."""
        write_report(report, self.skipped)
        result = PackResult(
            path=path,
            num_samples=len(self.record_of),
            num_bytes=size_on_disk(path),
            source_bytes=self.source_bytes,
            seconds=time.perf_counter() - started,
            skipped=self.skipped,
            report=report if self.skipped else None,
            untyped=dict(self.untyped),
            unparsed=dict(self.unparsed),
            **more,
        )
        bar.set_postfix_str(rate(result.bytes_written, result.seconds), refresh=False)
        return result


def check_options(on_error: str, workers: int, max_file_bytes: int) -> None:
    """The arguments ``pack_voc`` and ``append_voc`` share."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if max_file_bytes < 1:
        raise ValueError(f"max_file_bytes must be a positive number, got {max_file_bytes}")


def utc_now() -> str:
    """The time a history entry records: UTC, to the second (tests that compare the bytes of
    two packs pin it, as they pin the pack id and the file-name token)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def history_entry(
    action: str, records: int, added: int, replaced: int = 0, retired: int = 0
) -> dict[str, Any]:
    """One line of a pack's history (metadata ``history``): what a pack or append did, when
    (``utc_now``), and which version did it."""
    return {
        "action": action,
        "at": utc_now(),
        "records": records,
        "added": added,
        "replaced": replaced,
        "retired": retired,
        "by": CREATED_BY,
    }


def rate(num_bytes: int, seconds: float) -> str:
    return f"{num_bytes / max(seconds, 1e-9) / 1e6:.0f} MB/s"


def size_on_disk(path: Path) -> int:
    """Bytes of the pack at ``path`` as ``info`` counts them (``PackReader.nbytes``): a single
    file's, or every file its manifest names and the manifest. Not the folder's other files:
    the previous catalog an append keeps for readers of the old manifest is not the pack's."""
    if not path.is_dir():
        return path.stat().st_size
    manifest = path / fmt.MANIFEST_NAME
    return read_manifest(manifest).files_bytes() + manifest.stat().st_size


def warn_untyped(result: PackResult) -> None:
    """Say, once per pack or append (from the public call, naming what the user named), which
    ids were packed without object rows, and why for the first of them."""
    if not result.untyped:
        return
    ids = list(result.untyped)
    named = ", ".join(repr(i) for i in ids[:5]) + (", ..." if len(ids) > 5 else "")
    warnings.warn(
        f"{result.url or result.path}: {len(ids)} sample(s) ({named}) have annotations whose "
        f"objects do not fit a tv_tensors target; the first: {result.untyped[ids[0]]} They "
        "are packed as torchvision reads them (target_format='dict'); target_format="
        "'tv_tensors' raises for them. Fix the XML and append with replace_changed=True to "
        "give them boxes.",
        UntypedObjectsWarning,
        stacklevel=3,
    )


def write_report(report: Path, skipped: Sequence[SkippedSample]) -> None:
    """Write the skipped-samples report, or remove an earlier one when nothing was skipped
    (those samples are all in now)."""
    if skipped:
        entries = [{"id": s.id, "reason": s.reason} for s in skipped]
        text = json.dumps(entries, indent=1, ensure_ascii=False) + "\n"
        replace_file(report, text.encode("utf-8"))
    elif os.path.lexists(report):
        report.unlink()


def check_report_path(output: Path) -> Path:
    """The report path of ``output`` (``OUTPUT.skipped.json``). Refuse to write when it exists
    but is not a report of ours: writing or removing it would destroy someone's file."""
    report = output.with_name(output.name + REPORT_SUFFIX)
    if not os.path.lexists(report):
        return report
    try:
        entries = json.loads(read_regular_file(report, 64 << 20, "the report"))
        ours = isinstance(entries, list) and all(
            isinstance(e, dict) and set(e) == {"id", "reason"} for e in entries
        )
    except (OSError, ValueError):
        ours = False
    if not ours:
        raise WriteError(
            errno.EEXIST,
            f"{report} exists and is not a skipped-samples report of torch_serialized; "
            "refusing to replace it. Move it away or choose another output path",
        )
    return report


def progress_bar(total: int, label: str, show: bool) -> Any:
    """A tqdm bar of ``total`` images; its last figure, set by the caller, is the summary's."""
    from tqdm.auto import tqdm  # here, not at the top: pack processes import this module

    return tqdm(total=total, unit="img", disable=not show, desc=label)


def write(
    open_writer: Callable[[Callable[[], None] | None], AbstractContextManager[PackWriter]],
    jobs: Sequence[Job],
    books: Books,
    source: tuple[Path, ImageSets, int],
    metadata: Callable[[Books, dict[str, Any]], dict[str, Any]],
    *,
    skip: bool,
    workers: int,
    bar: Any,
    started: float,
) -> Path:
    """Write every job's record after those ``books`` holds, then the dataset arrays of
    ``source`` (VOC root, image sets, ``max_file_bytes``) and ``metadata(books, values)``
    (``values``: ``Books.metadata``); close the writer, return what it wrote.
    ``open_writer(before_finish)`` opens it; ``bar`` (``progress_bar``) shows the progress."""
    pool = (
        SpillPool(functools.partial(load_spilled, skip=skip), jobs, schema.FIELDS, workers)
        if pays_off(len(jobs), workers)
        else None
    )
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(open_writer(pool.drain if pool is not None else None))
        if pool is not None:  # on an error, stop the processes before the output is removed
            stack.callback(pool.close)
        write_records(writer, jobs, pool, skip, bar, started, books)
        splits, counts = write_dataset_arrays(writer, books, *source)
        return writer.close(metadata(books, books.metadata(splits, counts)))


def write_records(
    writer: PackWriter,
    jobs: Sequence[Job],
    pool: SpillPool[Job] | None,
    skip: bool,
    bar: Any,
    started: float,
    books: Books,
) -> None:
    """Write every job's record in job order, assigning class ids as names first appear
    (after those ``books`` already holds); ``bar`` (a tqdm bar) shows the progress and the
    write rate so far."""
    last = time.perf_counter()
    items: Iterable[LoadedSample | Spilled | SkippedSample] = (
        pool.items(writer) if pool is not None else (_load_or_skip(job, skip) for job in jobs)
    )
    for item in items:
        bar.update(1)
        if isinstance(item, SkippedSample):
            books.skipped.append(item)
            continue
        loaded: LoadedSample = item.info if isinstance(item, Spilled) else item
        class_ids = [books.classes.setdefault(n, len(books.classes)) for n in loaded.names]
        objects = b""
        if loaded.objects is not None:
            obj = loaded.objects
            objects = schema.encode_objects(obj.boxes, class_ids, obj.difficult, obj.truncated)
        row = (loaded.width, loaded.height, len(loaded.names), loaded.flags)
        if isinstance(item, Spilled):
            assert pool is not None  # only pack processes spill
            entries = item.fill(schema.OBJECTS, objects)
            books.record_of[loaded.id], target, at = writer.reserve(entries, row)
            pool.place(item, target, at)
        else:
            payloads = list(loaded.payloads)
            payloads[schema.OBJECTS] = objects
            books.record_of[loaded.id] = writer.add(payloads, row)
        books.ids.append(loaded.id)
        if loaded.untyped:
            books.untyped.append((loaded.id, loaded.untyped))
        if loaded.unparsed:
            books.unparsed.append((loaded.id, loaded.unparsed))
        books.record_classes.append(class_ids)
        books.source_bytes += loaded.source_bytes
        books.stats.append(loaded.stats)
        books.digests.append(loaded.digest)
        now = time.perf_counter()
        if not bar.disable and (now - last > 0.5 or bar.n == 1):
            bar.set_postfix_str(rate(writer.bytes_written, now - started))
            last = now


def write_dataset_arrays(
    writer: PackWriter,
    books: Books,
    voc_root: Path,
    image_sets: ImageSets,
    max_file_bytes: int,
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """Ids, the source statistics, the retired records, one record list per image set and
    the raw list files; return the image set sizes and class counts for the metadata."""
    blob, offsets = schema.encode_ids(books.ids)
    writer.add_array("ids", blob)
    writer.add_array("id_offsets", offsets)
    files = len(schema.SOURCE_FILES)
    written = np.array(books.stats, dtype="<i8").reshape(len(books.stats), files, 2)
    stats = np.concatenate([books.base_stats.astype("<i8", copy=False), written])
    writer.add_array(schema.SIZE_ARRAY, np.ascontiguousarray(stats[:, :, 0]))
    writer.add_array(schema.MTIME_ARRAY, np.ascontiguousarray(stats[:, :, 1]))
    if books.base_digests is not None or any(books.digests):
        known = b"".join(d or bytes(32) for d in books.digests)  # zeros: not known
        base = books.base_digests
        if base is None:
            base = np.zeros((len(books.base_stats), 32), dtype=np.uint8)
        digests = np.concatenate([base, np.frombuffer(known, np.uint8).reshape(-1, 32)])
        writer.add_array(schema.DIGEST_ARRAY, digests)
    if books.retired:
        writer.add_array(schema.RETIRED_ARRAY, np.array(sorted(books.retired), dtype="<i8"))
    splits: dict[str, dict[str, int]] = {}
    class_counts: dict[str, dict[str, int]] = {}
    # every object's class and record, so an image set's class counts are two bincounts
    per_record = np.concatenate(
        [books.base_counts, np.array([len(c) for c in books.record_classes], dtype=np.int64)]
    )
    later = itertools.chain.from_iterable(books.record_classes)
    classes = np.concatenate([books.base_classes, np.fromiter(later, dtype=np.int64)])
    writer.add_array(schema.OBJECT_CLASSES_ARRAY, classes.astype("<i4"))
    owner = np.repeat(np.arange(len(per_record)), per_record)
    for task, sets in image_sets.items():
        for name, listed in sets.items():
            records = np.array(
                [books.record_of[i] for i in listed if i in books.record_of], dtype="<i8"
            )
            writer.add_array(schema.split_array_name(task, name), records)
            splits.setdefault(task, {})[name] = len(records)
            times = np.bincount(records, minlength=len(per_record))[owner]  # duplicates count
            counts = np.bincount(classes, weights=times, minlength=len(books.classes))
            class_counts[f"{task}/{name}"] = {
                n: int(counts[c]) for n, c in books.classes.items() if counts[c]
            }
    for rel, data in image_set_files(voc_root, max_file_bytes):
        writer.add_array(f"file/{rel}", np.frombuffer(data, dtype=np.uint8))
    return splits, class_counts


def _load_or_skip(job: Job, skip: bool) -> LoadedSample | SkippedSample:
    try:
        return load(job)
    except SourceDataError as exc:
        if not skip:
            raise
        return SkippedSample(job.id, str(exc))


def load_spilled(job: Job, skip: bool) -> Record | SkippedSample:
    """A job's record for a pack process (``parallel.spill_chunk``): objects are left as
    zero bytes, since their class ids are only known in the writing process, which sees the
    samples in dataset order."""
    loaded = _load_or_skip(job, skip)
    if isinstance(loaded, SkippedSample):
        return loaded
    payloads = list(loaded.payloads)
    if loaded.objects is not None:
        payloads[schema.OBJECTS] = bytes(schema.OBJECT_DTYPE.itemsize * len(loaded.names))
    loaded.payloads = []
    return Record(payloads, loaded)
