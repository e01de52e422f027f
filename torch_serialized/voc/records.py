"""Writing VOC records, for ``pack_voc`` and ``append_voc``: jobs loaded (in spawned processes
with ``workers > 1``), class ids assigned as names first appear, records written in job order,
so the output is byte-identical for any number of processes. Never imports torch."""

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..container import spec as fmt
from ..container.fileio import DEFAULT_MAX_FILE_BYTES, read_regular_file, replace_file
from ..container.manifest import read_manifest
from ..container.parallel import Record, Spilled, SpillPool, pays_off
from ..container.shardwriter import PackWriter
from ..container.writer import CREATED_BY
from ..errors import (
    FileChangedError,
    FormatError,
    SourceDataError,
    UntypedObjectsWarning,
    WriteError,
)
from . import schema
from .images import ImageOptions
from .layout import image_set_files
from .source import Job, LoadedSample, load

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
    ``torch-serialized info`` reports it; ``year`` the VOC year packed."""

    path: Path
    num_samples: int
    num_bytes: int
    source_bytes: int
    seconds: float
    skipped: list[SkippedSample] = field(default_factory=list)
    report: Path | None = None
    year: str = ""
    voc_root: Path | None = None
    added: int = 0  #: ids added (a pack: all); replaced: changed; retired: unlisted
    replaced: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bytes_written: int = 0
    url: str | None = None  #: written to: num_bytes is the size there, path a removed copy
    #: id -> why, for objects without rows (``"tv_tensors"`` raises) and XML that did not parse
    untyped: dict[str, str] = field(default_factory=dict)
    unparsed: dict[str, str] = field(default_factory=dict)

    @property
    def samples_per_second(self) -> float:
        return self.num_samples / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class Options:
    """``pack_voc``'s and ``append_voc``'s arguments past the paths, checked once."""

    year: str | None = None
    on_error: str = "raise"
    workers: int = 1
    progress: bool = False
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    image: ImageOptions = field(default_factory=ImageOptions)
    max_samples_per_shard: int | None = None
    max_shard_bytes: int | None = None
    num_shards: int | None = None
    replace_changed: bool = False
    checksum: bool = False
    retire_all: bool = False

    def __post_init__(self) -> None:
        if self.num_shards is not None:
            if self.num_shards < 1:
                raise ValueError(f"num_shards must be a positive number, got {self.num_shards}")
            if self.max_samples_per_shard is not None or self.max_shard_bytes is not None:
                raise ValueError(
                    "num_shards cannot be combined with max_samples_per_shard or max_shard_bytes"
                )
        storage, max_size = self.image.image_storage, self.image.max_size
        if storage not in ("original", "raw"):
            raise ValueError(f"image_storage must be 'original' or 'raw', got {storage!r}")
        if max_size is not None and max_size < 1:
            raise ValueError(f"max_size must be a positive number of pixels, got {max_size}")
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.max_file_bytes < 1:
            raise ValueError(f"max_file_bytes must be a positive number, got {self.max_file_bytes}")
        bounded = ("max_samples_per_shard", "max_shard_bytes", "num_shards", "max_file_bytes")
        values = {**{name: getattr(self, name) for name in bounded}, "max_size": max_size}
        for name, value in values.items():  # as the pack's metadata holds them (container.spec)
            if value is not None and value > fmt.MAX_JSON_INT:
                raise ValueError(
                    f"{name} must be at most 2**53 - 1 ({fmt.MAX_JSON_INT}), the largest "
                    f"integer a pack's metadata holds; got {value}"
                )


@dataclass
class Books:
    """What the writer records of the records it wrote, in order (an append's kept ones first)."""

    classes: dict[str, int] = field(default_factory=dict)  # name -> class id, first seen first
    record_of: dict[str, int] = field(default_factory=dict)  # live id -> record number
    ids: list[str] = field(default_factory=list)  # every record's id
    #: class ids of the kept records (flat, counts per record), then of each later record
    base_classes: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    base_counts: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    record_classes: list[list[int]] = field(default_factory=list)
    #: per record: (size, mtime_ns) of its source files, flat; image SHA-256 (b"": unknown)
    stats: list[Sequence[int]] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)
    skipped: list[SkippedSample] = field(default_factory=list)
    source_bytes: int = 0
    retired: list[int] = field(default_factory=list)  # records no longer live (shard folders)
    #: (id, why) of records without object rows, or whose XML did not parse
    untyped: list[tuple[str, str]] = field(default_factory=list)
    unparsed: list[tuple[str, str]] = field(default_factory=list)
    base_flags: int = 0

    def metadata(
        self, splits: Mapping[str, Mapping[str, int]], counts: Mapping[str, Mapping[str, int]]
    ) -> dict[str, Any]:
        """The metadata values these books decide."""
        return {
            "schema_version": schema.schema_version(
                retired=bool(self.retired),
                untyped=bool(self.untyped or self.base_flags & schema.UNTYPED_OBJECTS),
                unparsed=bool(self.unparsed or self.base_flags & schema.UNPARSED_ANNOTATION),
            ),
            "num_samples": len(self.ids),
            "splits": splits,
            "classes": list(self.classes),
            "class_counts": counts,
            "source_bytes": self.source_bytes,
            "skipped": [asdict(s) for s in self.skipped],
            "source_stats": schema.SOURCE_STATS_VERSION,
        }

    def result(self, path: Path, report: Path, started: float, bar: Any, **more: Any) -> PackResult:
        """Write (or remove) the skipped ``report``; return the result, its rate shown last."""
        if self.skipped:
            text = json.dumps([asdict(s) for s in self.skipped], indent=1, ensure_ascii=False)
            replace_file(report, (text + "\n").encode("utf-8"))
        elif os.path.lexists(report):
            report.unlink()
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


def utc_now() -> str:
    """UTC to the second (tests pin it)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def history_entry(
    action: str, records: int, added: int, replaced: int = 0, retired: int = 0
) -> dict[str, Any]:
    """One entry of metadata ``history``: what a pack or append did, when, by which version."""
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
    """The pack's bytes as ``info`` counts them: the file, or the manifest and files it names;
    ``FileChangedError`` if another writer is replacing it right now (two packs of one output)."""
    try:
        if not path.is_dir():
            return path.stat().st_size
        manifest = path / fmt.MANIFEST_NAME
        return read_manifest(manifest).files_bytes() + manifest.stat().st_size
    except (FileNotFoundError, FormatError) as exc:
        raise FileChangedError(
            f"{path} was written, then moved aside by another process writing the same output "
            f"({exc}); the pack there is the last one written: run one pack of it at a time"
        ) from exc


def warn_untyped(result: PackResult) -> None:
    """Warn which ids were packed without object rows, and why."""
    if not result.untyped:
        return
    ids = list(result.untyped)
    named = ", ".join(repr(i) for i in ids[:5]) + (", ..." if len(ids) > 5 else "")
    warnings.warn(
        f"{result.url or result.path}: {len(ids)} sample(s) ({named}) read only with "
        f"target_format='dict' (first: {result.untyped[ids[0]]}); fix the XML and append "
        "with replace_changed=True to give them boxes.",
        UntypedObjectsWarning,
        stacklevel=3,
    )


def check_report_path(output: Path) -> Path:
    """``output``'s report path; refuse a file there that is not our report."""
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
    from tqdm.auto import tqdm  # here, not at the top: pack processes import this module

    return tqdm(total=total, unit="img", disable=not show, desc=label)


def write(
    open_writer: Callable[..., AbstractContextManager[PackWriter]],
    jobs: Sequence[Job],
    books: Books,
    source: tuple[Path, ImageSets],
    metadata: Callable[[Books, dict[str, Any]], dict[str, Any]],
    opts: Options,
    bar: Any,
    started: float,
) -> Path:
    """Write every job's record after those ``books`` holds, then the dataset arrays of
    ``source`` (VOC root, image sets) and ``metadata(books, values)``; return the output."""
    skip = opts.on_error == "skip"
    pool: SpillPool[Job] | None = None
    if pays_off(len(jobs), opts.workers):
        spill = functools.partial(load_spilled, skip=skip)
        pool = SpillPool(spill, jobs, schema.FIELDS, opts.workers)
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(open_writer(before_finish=pool.drain if pool else None))
        if pool is not None:  # on an error, stop the processes before the output is removed
            stack.callback(pool.close)
        items: Iterable[LoadedSample | Spilled | SkippedSample] = (
            pool.items(writer) if pool else (_load_or_skip(job, skip) for job in jobs)
        )
        last = time.perf_counter()
        for item in items:
            bar.update(1)
            if isinstance(item, SkippedSample):
                books.skipped.append(item)
                continue
            loaded: LoadedSample = item.info if isinstance(item, Spilled) else item
            class_ids = [books.classes.setdefault(n, len(books.classes)) for n in loaded.names]
            objects = b""
            if (obj := loaded.objects) is not None:
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
        splits, counts = write_dataset_arrays(writer, books, *source, opts.max_file_bytes)
        return writer.close(metadata(books, books.metadata(splits, counts)))


def write_dataset_arrays(
    writer: PackWriter,
    books: Books,
    voc_root: Path,
    image_sets: ImageSets,
    max_file_bytes: int,
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """Ids, statistics, retired, image-set and list-file arrays; return set sizes, class counts."""
    blob, offsets = schema.encode_ids(books.ids)
    writer.add_array("ids", blob)
    writer.add_array("id_offsets", offsets)
    files = len(schema.SOURCE_FILES)
    stats = np.array(books.stats, dtype="<i8").reshape(len(books.stats), files, 2)
    writer.add_array(schema.SIZE_ARRAY, np.ascontiguousarray(stats[:, :, 0]))
    writer.add_array(schema.MTIME_ARRAY, np.ascontiguousarray(stats[:, :, 1]))
    if any(books.digests):
        known = b"".join(d or bytes(32) for d in books.digests)  # zeros: not known
        writer.add_array(schema.DIGEST_ARRAY, np.frombuffer(known, np.uint8).reshape(-1, 32))
    if books.retired:
        writer.add_array(schema.RETIRED_ARRAY, np.array(sorted(books.retired), dtype="<i8"))
    splits: dict[str, dict[str, int]] = {}
    class_counts: dict[str, dict[str, int]] = {}
    # every object's class and record: an image set's class counts are two bincounts
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
    """A job's record for a pack process: objects left as zeros, since class ids are only
    known in the writing process, which sees samples in dataset order."""
    loaded = _load_or_skip(job, skip)
    if isinstance(loaded, SkippedSample):
        return loaded
    payloads = list(loaded.payloads)
    if loaded.objects is not None:
        payloads[schema.OBJECTS] = bytes(schema.OBJECT_DTYPE.itemsize * len(loaded.names))
    loaded.payloads = []
    return Record(payloads, loaded)
