"""Pack a VOCdevkit folder into one file (or shards): the ``pack_voc`` entry point.

Every id listed in ``ImageSets/Main`` or ``ImageSets/Segmentation`` is stored once
(``source.plan``), with its original image, XML and mask bytes, plus what makes reading fast
(the parsed target as JSON, the objects as arrays, the image size; ``source.load``). This
module only orchestrates: it assigns class ids in dataset order, writes each record
(``PackWriter``, or ``parallel.SpillPool`` with ``workers > 1``), then the dataset-level arrays
and the metadata described in ``schema``. Records are written in one fixed order, so the
output is byte-identical for any number of pack processes (given the same pack id, file-name
token and time in its history: ``utc_now``). This module never imports torch.
"""

# More than 400 lines: pack_voc and the pieces append_voc reuses (books, records, dataset
# arrays, the report), kept together so that a pack and an append write records alike.

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import itertools
import json
import os
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..container import spec as fmt
from ..container.atomic import replace_file
from ..container.fileio import DEFAULT_MAX_FILE_BYTES, read_regular_file
from ..container.parallel import Record, Spilled, SpillPool, pays_off
from ..container.reader import read_manifest
from ..container.writer import CREATED_BY, PackWriter, check_output_name
from ..errors import SourceDataError, UntypedObjectsWarning, WriteError
from ..remote.store import is_url
from ..remote.upload import check_writable, write_then_upload
from . import schema
from .images import ImageOptions
from .layout import base_dir, find_voc_root, image_set_files, read_image_sets
from .source import Job, LoadedSample, load, plan

__all__ = [
    "pack_voc",
    "PackResult",
    "SkippedSample",
    "ImageStorage",
    "Books",
    "REPORT_SUFFIX",
    "history_entry",
    "utc_now",
    "progress_bar",
    "rate",
    "size_on_disk",
    "write_records",
    "write_dataset_arrays",
    "write_report",
    "check_report_path",
    "load_spilled",
]

ImageStorage = Literal["original", "raw"]
#: The skipped-samples report is ``OUTPUT`` + this, beside the output.
REPORT_SUFFIX = ".skipped.json"


@dataclass(frozen=True)
class SkippedSample:
    """An id left out by ``on_error="skip"``, and why."""

    id: str
    reason: str


@dataclass(frozen=True)
class PackResult:
    """What ``pack_voc`` wrote: ``num_bytes`` is the pack's size on disk as ``torch-serialized
    info`` reports it (the file, or the files its manifest names and the manifest); ``year``
    the VOC year packed (given, or detected), from the folder ``voc_root``."""

    path: Path
    num_samples: int
    num_bytes: int
    source_bytes: int
    seconds: float
    skipped: list[SkippedSample] = field(default_factory=list)
    report: Path | None = None
    year: str = ""
    voc_root: Path | None = None
    #: what the write did, in samples (ids): ``added`` how many were new (a pack: all),
    #: ``replaced`` the ids packed again because their files changed (their old records
    #: retired), ``retired`` the ids no longer listed, whose records were retired; so
    #: ``num_samples`` is the previous count plus ``added`` minus ``len(retired)`` (less any
    #: changed id ``on_error="skip"`` left out). The pack's history (``info``) and the
    #: ``pack --append`` summary count the same. Then ``notes`` (``append_voc``), and the
    #: bytes of the files it wrote
    added: int = 0
    replaced: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bytes_written: int = 0
    #: where the pack was uploaded (``pack_voc`` or ``append_voc`` to a URL). ``num_bytes`` is
    #: then the size of the pack at the URL (every file its manifest names, as ``info URL``
    #: reports it) and ``bytes_written`` what went up; ``path`` and ``report`` are the local
    #: temporary copies the pack was written or grown in, removed before the call returns
    #: (so open ``url``, not ``path``; the report went up as ``url + ".skipped.json"``)
    url: str | None = None
    #: id -> why, for the ids this write packed whose annotations' objects do not fit the
    #: pack's object rows (an object without a numeric ``<bndbox>`` or a ``<name>``...: README,
    #: "Guarantees"): their ``target_format="dict"`` targets are torchvision's, their
    #: ``"tv_tensors"`` ones raise
    untyped: dict[str, str] = field(default_factory=dict)
    #: id -> why, for the ids this write packed whose annotations did not parse, all listed
    #: only in ``ImageSets/Segmentation`` (``VOCSegmentation`` never reads their XML): stored
    #: as the files' bytes (an export writes them back), with no target
    unparsed: dict[str, str] = field(default_factory=dict)

    @property
    def samples_per_second(self) -> float:
        return self.num_samples / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class Books:
    """What the writing process records about the records it wrote, in record order (an
    append starts from the books of the pack it grows)."""

    classes: dict[str, int] = field(default_factory=dict)  # name -> class id, first seen first
    record_of: dict[str, int] = field(default_factory=dict)  # live id -> record number
    ids: list[str] = field(default_factory=list)  # every record's id
    #: class ids of the first records, those an append copied (flat, and per record how many)
    base_classes: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    base_counts: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    record_classes: list[list[int]] = field(default_factory=list)  # class ids per later record
    skipped: list[SkippedSample] = field(default_factory=list)
    source_bytes: int = 0
    #: per later record: size and mtime_ns of each ``schema.SOURCE_FILES`` file when read, flat
    stats: list[tuple[int, ...]] = field(default_factory=list)
    digests: list[bytes] = field(
        default_factory=list
    )  # per later record, when images are transformed
    #: the same of the first records, those an append copied: int64 ``[n, 4, 2]``, and uint8
    #: ``[n, 32]`` (``None``: no digest known)
    base_stats: np.ndarray = field(
        default_factory=lambda: np.empty((0, len(schema.SOURCE_FILES), 2), np.int64)
    )
    base_digests: np.ndarray | None = None
    retired: list[int] = field(default_factory=list)  # records no longer live (shard folders)
    #: (id, why) of later records whose objects have no rows (``schema.UNTYPED_OBJECTS``),
    #: and how many of the first records, those an append copied, are such
    untyped: list[tuple[str, str]] = field(default_factory=list)
    base_untyped: int = 0
    #: the same for records whose annotations did not parse (``schema.UNPARSED_ANNOTATION``)
    unparsed: list[tuple[str, str]] = field(default_factory=list)
    base_unparsed: int = 0

    @property
    def schema_version(self) -> int:
        """The version the pack these books describe is written as."""
        return schema.schema_version(
            retired=bool(self.retired),
            untyped=bool(self.untyped) or self.base_untyped > 0,
            unparsed=bool(self.unparsed) or self.base_unparsed > 0,
        )


def pack_voc(
    root: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    year: str | None = None,
    max_samples_per_shard: int | None = None,
    max_shard_bytes: int | None = None,
    num_shards: int | None = None,
    workers: int = 1,
    image_storage: ImageStorage = "original",
    max_size: int | None = None,
    check_images: bool = False,
    on_error: Literal["raise", "skip"] = "raise",
    progress: bool = False,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    storage_options: Mapping[str, Any] | None = None,
) -> PackResult:
    """Pack a VOC dataset into ``output`` (a ``.tser`` file, or a shard folder with a limit).

    ``root`` is what torchvision calls root (the folder holding ``VOCdevkit/``) or the
    ``VOCdevkit/VOC20xx`` folder itself. ``year=None`` (the default) detects the year from
    the folder names (``voc.layout.find_voc_root``): the one ``VOC<year>`` folder there is,
    an error naming them when there are several; the result says which year was packed.
    A shard limit makes ``output`` a shard folder: ``max_samples_per_shard``,
    ``max_shard_bytes``, or ``num_shards``, exactly that many shards whose sample counts
    differ by at most one (one a sample when there are fewer samples; planned before the
    samples are read, so samples skipped with ``on_error="skip"`` leave their shards smaller,
    or fewer shards; the pack records the largest shard's count as its
    ``max_samples_per_shard``, which the shards an append adds then hold at most).
    ``image_storage="raw"``
    stores decoded RGB pixels (no decode at read time, larger file); ``max_size`` resizes
    images so their longer side is at most that many pixels, scaling boxes and sizes with
    them. Both change what is returned, so such packs are no longer byte-exact drop-ins.
    ``check_images`` decodes every image and mask at pack time. ``on_error="skip"`` leaves out
    bad samples (listed in the result and a ``.skipped.json`` report beside ``output``) instead
    of failing; a pack without skipped samples removes an earlier report.
    Only regular files are read, each of at most ``max_file_bytes`` (1 GiB by default): a
    FIFO or a link to a device in the source tree is refused, not waited on or read forever.
    ``workers > 1`` reads, parses and writes samples in that many spawned processes (scratch
    files beside the output, removed at the end); the output is byte-identical to one
    process (but for the random pack id and file names, and the time in its history).
    ``progress`` shows a progress bar.

    ``output`` may be an fsspec URL (``s3://bucket/prefix/voc``; ``storage_options`` go to
    fsspec): the pack is written to a temporary folder, then uploaded, its manifest last
    (``upload.write_then_upload``), so readers never see a partial pack and readers of an
    earlier pack at that URL keep working.
    """
    local = functools.partial(
        _pack_local,
        root,
        year=year,
        max_samples_per_shard=max_samples_per_shard,
        max_shard_bytes=max_shard_bytes,
        workers=workers,
        image_storage=image_storage,
        max_size=max_size,
        check_images=check_images,
        on_error=on_error,
        progress=progress,
        max_file_bytes=max_file_bytes,
        num_shards=num_shards,
    )
    if is_url(output):
        check_writable(str(output), "pack")
        result = write_then_upload(
            str(output),
            storage_options,
            local,
            written=lambda r: r.path,
            report=lambda r: r.report,
        )
        result = dataclasses.replace(result, url=str(output))
    else:
        result = local(output)
    warn_untyped(result)
    return result


def _pack_local(
    root: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    year: str | None,
    max_samples_per_shard: int | None,
    max_shard_bytes: int | None,
    num_shards: int | None,
    workers: int,
    image_storage: ImageStorage,
    max_size: int | None,
    check_images: bool,
    on_error: Literal["raise", "skip"],
    progress: bool,
    max_file_bytes: int,
) -> PackResult:
    """``pack_voc`` to a local path (a URL's temporary copy included), without its warning."""
    check_output_name(output)
    if num_shards is not None:
        if num_shards < 1:
            raise ValueError(f"num_shards must be a positive number, got {num_shards}")
        if max_samples_per_shard is not None or max_shard_bytes is not None:
            raise ValueError(
                "num_shards cannot be combined with max_samples_per_shard or max_shard_bytes"
            )
    if image_storage not in ("original", "raw"):
        raise ValueError(f"image_storage must be 'original' or 'raw', got {image_storage!r}")
    if max_size is not None and max_size < 1:
        raise ValueError(f"max_size must be a positive number of pixels, got {max_size}")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if max_file_bytes < 1:
        raise ValueError(f"max_file_bytes must be a positive number, got {max_file_bytes}")
    for name, value in (
        ("max_samples_per_shard", max_samples_per_shard),
        ("max_shard_bytes", max_shard_bytes),
        ("num_shards", num_shards),
        ("max_size", max_size),
        ("max_file_bytes", max_file_bytes),
    ):  # each goes into the pack's metadata, whose integers readers bound (format.py)
        if value is not None and value > fmt.MAX_JSON_INT:
            raise ValueError(
                f"{name} must be at most 2**53 - 1 ({fmt.MAX_JSON_INT}), the largest integer "
                f"a pack's metadata holds; got {value}"
            )
    started = time.perf_counter()
    voc_root, year = find_voc_root(root, year)
    image_sets = read_image_sets(voc_root, max_file_bytes)
    options = ImageOptions(image_storage, max_size, check_images)
    jobs = plan(voc_root, image_sets, options, max_file_bytes)
    ends: list[int] = []  # with num_shards: the record counts after which a shard ends
    if num_shards is not None:
        count = max(1, min(num_shards, len(jobs)))
        sizes = [len(jobs) // count + (k < len(jobs) % count) for k in range(count)]
        ends = list(itertools.accumulate(sizes))
        max_samples_per_shard = max(1, sizes[0])
    output = Path(output)
    report = output.with_name(output.name + REPORT_SUFFIX)
    check_report_path(report)  # before any work: never overwrite someone's file with it
    skip = on_error == "skip"
    pool = (
        SpillPool(functools.partial(load_spilled, skip=skip), jobs, schema.FIELDS, workers)
        if pays_off(len(jobs), workers)
        else None
    )
    with contextlib.ExitStack() as outer:
        bar = outer.enter_context(progress_bar(len(jobs), output.name, progress))
        with contextlib.ExitStack() as stack:
            writer = stack.enter_context(
                PackWriter(
                    output,
                    schema.FIELDS,
                    shard_ends=ends,
                    columns=schema.COLUMNS,
                    max_records_per_shard=max_samples_per_shard,
                    max_shard_bytes=max_shard_bytes,
                    before_finish=pool.drain if pool is not None else None,
                )
            )
            if pool is not None:  # on an error, stop the processes before the output is removed
                stack.callback(pool.close)
            books = write_records(writer, jobs, pool, skip, bar, started)
            if books.skipped and not books.record_of:  # the output is removed as we leave
                raise _all_skipped(voc_root, books.skipped)
            splits, class_counts = write_dataset_arrays(
                writer, books, image_sets, voc_root, max_file_bytes
            )
            metadata = {
                "schema": schema.SCHEMA,
                "schema_version": books.schema_version,
                "year": year,
                "base_dir": base_dir(year),
                "voc_folder": voc_root.name,
                "num_samples": len(books.record_of),
                "splits": splits,
                "classes": list(books.classes),
                "class_counts": class_counts,
                "image_storage": image_storage,
                "max_size": max_size,
                "options": {
                    "max_samples_per_shard": max_samples_per_shard,
                    "max_shard_bytes": max_shard_bytes,
                    "check_images": check_images,
                    "on_error": on_error,
                },
                "source_bytes": books.source_bytes,
                "skipped": [{"id": s.id, "reason": s.reason} for s in books.skipped],
                "packed_by": CREATED_BY,
                "source_stats": schema.SOURCE_STATS_VERSION,
                "history": [history_entry("pack", len(books.record_of), len(books.record_of))],
            }
            path = writer.close(metadata)

        write_report(report, books.skipped)
        num_bytes = size_on_disk(path)
        result = PackResult(
            path=path,
            num_samples=len(books.record_of),
            num_bytes=num_bytes,
            source_bytes=books.source_bytes,
            seconds=time.perf_counter() - started,
            skipped=books.skipped,
            report=report if books.skipped else None,
            year=year,
            voc_root=voc_root,
            added=len(books.record_of),
            bytes_written=num_bytes,
            untyped=dict(books.untyped),
            unparsed=dict(books.unparsed),
        )
        # The bar's last figure is the summary's: all bytes on disk over the whole time.
        bar.set_postfix_str(rate(result.num_bytes, result.seconds), refresh=False)
    return result


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


def progress_bar(total: int, name: str, progress: bool, verb: str = "packing") -> Any:
    from tqdm.auto import tqdm  # here, not at the top: pack processes import this module

    return tqdm(total=total, unit="img", disable=not progress, desc=f"{verb} {name}")


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


def _all_skipped(voc_root: Path, skipped: Sequence[SkippedSample]) -> SourceDataError:
    """The error for ``on_error="skip"`` leaving out every listed id: an empty pack is never
    what was meant (a layout mistake, such as every image named ``.JPG``, is far likelier than
    every file being bad), so nothing is written and the first reasons are shown."""
    shown = "; ".join(s.reason for s in skipped[:3])
    more = f" (and {len(skipped) - 3} more)" if len(skipped) > 3 else ""
    return SourceDataError(
        f"{voc_root}: every one of the {len(skipped)} listed samples was skipped, so nothing was "
        f"packed and no output written. The first: {shown}{more}. Fix that cause and pack again"
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


def check_report_path(report: Path) -> None:
    """Refuse to pack when ``report`` (``OUTPUT.skipped.json``) exists but is not a report of
    ours: writing or removing it would destroy someone's file."""
    if not os.path.lexists(report):
        return
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


def write_records(
    writer: PackWriter,
    jobs: Sequence[Job],
    pool: SpillPool[Job] | None,
    skip: bool,
    bar: Any,
    started: float,
    books: Books | None = None,
) -> Books:
    """Write every job's record in job order, assigning class ids as names first appear
    (after those ``books`` already holds); ``bar`` (a tqdm bar) shows the progress and the
    write rate so far."""
    books = books if books is not None else Books()
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
    return books


def write_dataset_arrays(
    writer: PackWriter,
    books: Books,
    image_sets: Mapping[str, Mapping[str, Sequence[str]]],
    voc_root: Path,
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
