"""Grow a VOC pack from its source folder without re-packing: ``append_voc``.

The source is planned as a full pack plans it and each id sorted against the pack
(``changes.classify``: new, unchanged, changed, no longer listed). New ids and, with
``replace_changed``, new versions of changed ones are written as new records; replaced and
unlisted records are retired. Image set lists, class counts and list files are rebuilt from
the source as it is now, so the pack reads as a full re-pack; class ids never move.

A shard folder grows in place (``grow.GrowWriter``: new shards, a new catalog, the manifest
replaced last; retired records keep their bytes in their shards until the next full pack). A
single file is rewritten: its kept records copied from the old file with ``copy_file_range``
(no source file is read for them), the new ones after them, the result renamed over the old
file. This module never imports torch.
"""

# More than 400 lines: the whole append, both forms, kept together so the two stay alike; the
# decisions about what changed are apart, in changes.py.

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..container import spec as fmt
from ..container.fileio import DEFAULT_MAX_FILE_BYTES, open_regular
from ..container.grow import GrowWriter
from ..container.parallel import SpillPool, copy_range, pays_off
from ..container.reader import ContainerReader
from ..container.writer import PackWriter
from ..errors import FormatError, SourceDataError, SourceNotFoundError, WriteError
from ..remote.store import is_url
from . import schema
from .changes import Plan, classify
from .classes import label_classes
from .images import ImageOptions
from .layout import find_voc_root, image_set_files, read_image_sets
from .pack import (
    REPORT_SUFFIX,
    Books,
    PackResult,
    check_report_path,
    history_entry,
    load_spilled,
    progress_bar,
    rate,
    size_on_disk,
    warn_untyped,
    write_dataset_arrays,
    write_records,
    write_report,
)
from .packed import VOCPackReader
from .source import Job, survey

__all__ = ["append_voc"]


def append_voc(
    root: str | os.PathLike[str],
    pack: str | os.PathLike[str],
    *,
    year: str | None = None,
    on_error: Literal["raise", "skip"] = "raise",
    progress: bool = False,
    workers: int = 1,
    replace_changed: bool = False,
    checksum: bool = False,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    retire_all: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit_bytes: int | None = None,
) -> PackResult:
    """Bring the pack at ``pack`` up to date with the VOC source at ``root``; return what
    was done: ``added`` (how many new ids were packed), ``replaced`` (the ids packed again
    because their files changed), ``retired`` (the ids no longer listed), ``notes``,
    ``bytes_written``; the pack's history (``torch-serialized info``) counts the same three.

    New ids become new records; unchanged ids are left alone; an id whose image, annotation
    or masks changed raises ``SourceDataError`` naming it, the file and the change, unless
    ``replace_changed`` (then its new version is stored and the old record retired). Ids no
    longer in any list are retired; a ``root`` that lists none of the pack's ids (most likely
    the wrong folder) raises ``SourceDataError`` instead of retiring every sample, unless
    ``retire_all``. Afterwards every image set, class count and stored list
    file is the one a full re-pack of ``root`` would give, and existing class ids are kept (new
    classes get the next ids). Change is detected from each file's size and modification
    time, reading only files whose statistics differ; ``checksum`` compares every file's
    content. The pack's own options (image storage, ``max_size``, shard limits) are used.
    ``on_error``, ``progress``, ``workers`` and ``max_file_bytes`` are ``pack_voc``'s. An
    interrupted append leaves the pack as it was.

    ``pack`` may be a writable URL (``s3://bucket/prefix/voc``; ``storage_options``,
    ``cache_dir`` and ``cache_limit_bytes`` as the readers take them; all three are ignored
    for a local path): the pack is staged through the cache, grown
    locally by these same rules, and only its new files are uploaded, the manifest last
    (``append_remote``).
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if max_file_bytes < 1:
        raise ValueError(f"max_file_bytes must be a positive number, got {max_file_bytes}")
    if os.fspath(pack) == "":  # Path("") is the current folder: never grow that by accident
        raise ValueError(
            "the pack path is empty: pass the .tser file (or shard folder) to grow, e.g. "
            "'voc.tser', or its URL"
        )
    grow = functools.partial(
        _append_local,
        root,
        year=year,
        on_error=on_error,
        progress=progress,
        workers=workers,
        replace_changed=replace_changed,
        checksum=checksum,
        max_file_bytes=max_file_bytes,
        retire_all=retire_all,
    )
    if is_url(pack):  # staged locally, grown by this function, the growth uploaded
        from .append_remote import append_to_url

        # the old shards not staged are checked by their download
        local = functools.partial(grow, check_shards=False)
        compare = functools.partial(  # replace_changed: the sort must not raise, the append will
            _sort_source,
            root,
            year=year,
            replace_changed=True,
            checksum=checksum,
            max_file_bytes=max_file_bytes,
            retire_all=retire_all,
        )
        result = append_to_url(
            str(pack),
            local,
            compare,
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )
    else:
        result = grow(pack, check_shards=True)
    warn_untyped(result)
    return result


def _append_local(
    root: str | os.PathLike[str],
    pack: str | os.PathLike[str],
    *,
    year: str | None,
    on_error: Literal["raise", "skip"],
    progress: bool,
    workers: int,
    replace_changed: bool,
    checksum: bool,
    max_file_bytes: int,
    check_shards: bool,
    retire_all: bool = False,
) -> PackResult:
    """``append_voc`` on the local pack at ``pack`` (its arguments checked); ``check_shards``:
    check every old shard of a folder first (``_check_shards``), which a staged copy of a pack
    at a URL, holding only the shards the append reads, leaves off."""
    started = time.perf_counter()
    old = VOCPackReader(pack)
    path = Path(old.path)
    check_report_path(report := path.with_name(path.name + REPORT_SUFFIX))
    voc_root, image_sets, plan_ = _sort_source(
        root,
        old,
        year=year,
        replace_changed=replace_changed,
        checksum=checksum,
        max_file_bytes=max_file_bytes,
        retire_all=retire_all,
    )
    if plan_.current and old.files() == dict(image_set_files(voc_root, max_file_bytes)):
        plan_.notes.append(f"{path} is up to date with {voc_root}: nothing was written")
        return _up_to_date(old, plan_, voc_root, started)
    sharded = old.reader.manifest is not None
    if sharded and check_shards:
        _check_shards(old)
    books, bytes_written, new_meta = (_grow_shards if sharded else _rewrite_file)(
        old,
        plan_,
        voc_root,
        image_sets,
        on_error == "skip",
        progress,
        started,
        workers,
        max_file_bytes,
    )
    write_report(report, books.skipped)
    replaced = [job.id for job in plan_.replaced if job.id in books.record_of]
    written = len(books.ids) - (len(old) if sharded else len(plan_.kept))  # records
    return PackResult(
        path=path,
        num_samples=len(books.record_of),
        num_bytes=size_on_disk(path),
        source_bytes=int(new_meta["source_bytes"]),
        seconds=time.perf_counter() - started,
        skipped=books.skipped,
        report=report if books.skipped else None,
        year=old.year,
        voc_root=voc_root,
        added=written - len(replaced),
        replaced=replaced,
        retired=_retired_ids(plan_, books),
        notes=plan_.notes,
        bytes_written=bytes_written,
        untyped=dict(books.untyped),
        unparsed=dict(books.unparsed),
    )


def _retired_ids(plan: Plan, books: Books) -> list[str]:
    """The packed ids this append leaves out: those no longer listed, then those loaded again
    (changed, or missing a file they now need) that ``on_error="skip"`` skipped."""
    skipped = {s.id for s in books.skipped}
    return [*plan.dropped, *(i for i in plan.reloading if i in skipped)]


def _check_shards(old: VOCPackReader) -> None:
    """Every shard of the folder, which the grown pack keeps, opens as a reader's first read
    of it opens it (size and metadata checksum against the manifest, binding, header, footer,
    index, arrays: O(metadata), no record's bytes read), so that an append never builds a new
    generation on a damaged one. Raises the reader's error, saying nothing was appended."""
    reader = old.reader
    for s in range(reader.num_shards):
        try:
            reader.shard(s)
        except (FileNotFoundError, FormatError) as exc:
            raise type(exc)(
                f"{exc}. Nothing was appended to {reader.path}: run `torch-serialized verify` "
                "on it, then restore the shard or re-pack the dataset"
            ) from None


def _up_to_date(old: VOCPackReader, plan: Plan, voc_root: Path, started: float) -> PackResult:
    """What an append that has nothing to write returns (nothing is written: a single file
    is not copied, a shard folder keeps its catalog)."""
    path = Path(old.path)
    return PackResult(
        path=path,
        num_samples=len(plan.kept),
        num_bytes=size_on_disk(path),
        source_bytes=int(old.meta.get("source_bytes") or 0),
        seconds=time.perf_counter() - started,
        year=old.year,
        voc_root=voc_root,
        notes=plan.notes,
    )


def _sort_source(
    root: str | os.PathLike[str],
    old: VOCPackReader,
    *,
    year: str | None,
    replace_changed: bool,
    checksum: bool,
    max_file_bytes: int,
    retire_all: bool = False,
) -> tuple[Path, dict[str, dict[str, list[str]]], Plan]:
    """The VOC root at ``root``, its image sets and every listed id sorted against ``old``
    (``changes.classify``; records whose quick check fails are read from ``old``)."""
    try:
        voc_root, found_year = find_voc_root(root, year if year is not None else old.year)
    except SourceNotFoundError as missing:
        if year is not None:
            raise
        try:  # the one VOC folder there is another year's: say so, not "pass year=..."
            voc_root, found_year = find_voc_root(root, None)
        except SourceDataError:
            raise missing from None
    if found_year != old.year:
        raise ValueError(
            f"{voc_root} is VOC{found_year} but {old.name} holds VOC{old.year}; append the "
            "same year's devkit (or pack it into another pack)"
        )
    checks = bool(old.meta.get("options", {}).get("check_images"))
    options = ImageOptions(old.image_storage, old.meta.get("max_size"), checks)
    image_sets = read_image_sets(voc_root, max_file_bytes)
    planned = survey(voc_root, image_sets, options, max_file_bytes)
    return voc_root, image_sets, classify(old, planned, replace_changed, checksum, retire_all)


# -- writing -------------------------------------------------------------------------------------
def _old_books(old: VOCPackReader, plan: Plan, records: Sequence[int]) -> Books:
    """Books for the kept ``records`` of the old pack, in that order (record numbers as the
    new pack numbers them follow from their position): ids, class ids, statistics, digests."""
    books = Books(classes={name: c for c, name in enumerate(old.classes)})
    names = schema.decode_ids(*old.id_table())
    classes, counts = old.object_classes()  # the catalog's, or read from old shards
    chosen = np.asarray(records, dtype=np.int64)
    books.base_classes = classes[np.repeat(np.isin(np.arange(len(counts)), chosen), counts)]
    books.base_counts = counts[chosen]
    books.ids = [names[r] for r in chosen.tolist()]
    books.base_stats = plan.stats[chosen]  # retired records: (ABSENT, 0), unused
    books.base_digests = None if plan.digests is None else plan.digests[chosen]
    sizes = plan.stats[plan.kept, :, 0]
    books.source_bytes = int(sizes[sizes > 0].sum())
    flags = old.columns["flags"][chosen]
    books.base_untyped = int(np.count_nonzero(flags & schema.UNTYPED_OBJECTS))
    books.base_unparsed = int(np.count_nonzero(flags & schema.UNPARSED_ANNOTATION))
    return books


def _metadata(
    old: VOCPackReader,
    books: Books,
    plan: Plan,
    splits: Mapping[str, Mapping[str, int]],
    counts: Mapping[str, Mapping[str, int]],
) -> dict[str, Any]:
    """The old pack's metadata brought up to date, with this append in its history."""
    meta = dict(old.meta)
    if "label_base" not in meta:  # the label lists as they are, kept: no label ever moves
        meta["label_base"] = {
            rule: label_classes(rule, old.classes, None) for rule in ("default", "packed")
        }
    history = list(meta.get("history") or [])
    if not history:  # packed before histories were kept: what is known of that pack
        history.append(
            {"action": "pack", "at": None, "records": len(old), "by": meta.get("packed_by")}
        )
    replaced = sum(1 for job in plan.replaced if job.id in books.record_of)
    added = len(plan.jobs) - len(books.skipped)
    history.append(
        history_entry(
            "append",
            len(books.record_of),
            added - replaced,
            replaced,
            len(_retired_ids(plan, books)),  # as PackResult counts them: ids, not records
        )
    )
    meta.update(
        schema_version=books.schema_version,
        num_samples=len(books.ids),
        splits=splits,
        classes=list(books.classes),
        class_counts=counts,
        source_bytes=books.source_bytes,
        skipped=[{"id": s.id, "reason": s.reason} for s in books.skipped],
        source_stats=schema.SOURCE_STATS_VERSION,
        history=history,
    )
    return meta


def _pool(jobs: Sequence[Job], skip: bool, workers: int) -> SpillPool[Job] | None:
    load = functools.partial(load_spilled, skip=skip)
    return SpillPool(load, jobs, schema.FIELDS, workers) if pays_off(len(jobs), workers) else None


def _grow_shards(
    old: VOCPackReader,
    plan: Plan,
    voc_root: Path,
    image_sets: Mapping[str, Mapping[str, Sequence[str]]],
    skip: bool,
    progress: bool,
    started: float,
    workers: int,
    max_file_bytes: int,
) -> tuple[Books, int, dict[str, Any]]:
    """Grow a shard folder: new shards, a new catalog, the manifest last; return the books,
    the bytes of the files written and the metadata."""
    manifest = old.reader.manifest
    assert manifest is not None
    everything = range(len(old))
    books = _old_books(old, plan, everything)
    books.record_of = {books.ids[r]: r for r in plan.kept.tolist()}
    retired = np.ones(len(old), dtype=bool)
    retired[plan.kept] = False
    books.retired = np.flatnonzero(retired).tolist()
    kept_catalog, jobs = old.meta.get("previous_catalog"), plan.jobs
    pool = _pool(jobs, skip, workers)
    opts = old.meta.get("options", {})
    folder = Path(old.reader.path)
    before = set(os.listdir(folder))
    with contextlib.ExitStack() as outer:
        bar = outer.enter_context(
            progress_bar(len(jobs), old.reader.path, progress, "appending to")
        )
        with contextlib.ExitStack() as stack:
            writer = stack.enter_context(
                GrowWriter(
                    old.reader.path,
                    manifest,
                    old.columns,
                    schema.FIELDS,
                    columns=schema.COLUMNS,
                    max_records_per_shard=opts.get("max_samples_per_shard"),
                    max_shard_bytes=opts.get("max_shard_bytes"),
                    before_finish=pool.drain if pool is not None else None,
                    keep=[kept_catalog] if isinstance(kept_catalog, str) else [],
                    manifest_sha256=old.reader.manifest_sha256,
                )
            )
            if pool is not None:
                stack.callback(pool.close)
            write_records(writer, jobs, pool, skip, bar, started, books)
            splits, counts = write_dataset_arrays(
                writer, books, image_sets, voc_root, max_file_bytes
            )
            meta = _metadata(old, books, plan, splits, counts)
            assert manifest.catalog is not None
            meta["previous_catalog"] = manifest.catalog.file
            writer.close(meta)
        bar.set_postfix_str(
            rate(writer.bytes_written, time.perf_counter() - started), refresh=False
        )
    written = sum(
        (folder / name).stat().st_size
        for name in os.listdir(folder)
        if name not in before or name == fmt.MANIFEST_NAME
    )
    return books, written, meta


def _rewrite_file(
    old: VOCPackReader,
    plan: Plan,
    voc_root: Path,
    image_sets: Mapping[str, Mapping[str, Sequence[str]]],
    skip: bool,
    progress: bool,
    started: float,
    workers: int,
    max_file_bytes: int,
) -> tuple[Books, int, dict[str, Any]]:
    """Rewrite a single file: kept records copied from the old file, new ones after them;
    return the books, the bytes written (the whole new file) and the metadata."""
    kept = plan.kept.tolist()  # ascending
    books = _old_books(old, plan, kept)
    books.record_of = {books.ids[i]: i for i in range(len(kept))}
    jobs = plan.jobs
    pool = _pool(jobs, skip, workers)
    source = old.reader.shard(0)
    rows = source.index_rows(kept)
    columns = old.columns
    copies: list[list[int]] = []  # [source offset, target offset, length], runs merged
    target: list[Path] = []
    locked: list[int] = []  # the old file, open and locked

    def before_finish() -> None:  # the kept records' bytes, copied in before the file ends
        if copies:
            dst = os.open(target[0], os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                for offset, at, length in copies:
                    copy_range(locked[0], offset, dst, at, length)
            finally:
                os.close(dst)
            copies.clear()
        if pool is not None:
            pool.drain()

    with contextlib.ExitStack() as outer:
        locked.append(outer.enter_context(_locked(source)))
        bar = outer.enter_context(
            progress_bar(len(jobs), old.reader.path, progress, "appending to")
        )
        with contextlib.ExitStack() as stack:
            writer = stack.enter_context(
                PackWriter(
                    old.reader.path,
                    schema.FIELDS,
                    columns=schema.COLUMNS,
                    before_finish=before_finish,
                    pack_id=_pack_id(old),
                    locked=True,  # by _locked, above
                )
            )
            if pool is not None:
                stack.callback(pool.close)
            for record, entries in zip(kept, rows):
                _, file, at = writer.reserve(entries, tuple(columns[record].tolist()))
                _add_copy(copies, int(entries["offset"][0]), at, _span(entries))
                if not target:
                    target.append(file)
            write_records(writer, jobs, pool, skip, bar, started, books)
            splits, counts = write_dataset_arrays(
                writer, books, image_sets, voc_root, max_file_bytes
            )
            meta = _metadata(old, books, plan, splits, counts)
            writer.close(meta)
    return books, os.path.getsize(old.reader.path), meta


@contextlib.contextmanager
def _locked(source: ContainerReader) -> Iterator[int]:
    """The single file being grown, open (its descriptor) with an exclusive ``flock``, checked
    to be the file ``source`` validated: a second append is refused, not waited for, and one
    that opened the file before another append replaced it is refused rather than undoing
    it."""
    fd = open_regular(source.path, "the pack")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WriteError(
                errno.EBUSY,
                f"{source.path} is being appended to by another process; wait for it to finish",
            ) from None
        if not _still_the_file(fd, source):
            raise WriteError(
                errno.EBUSY,
                f"{source.path} changed since it was opened for this append (another process "
                "wrote it); nothing was written: append again",
            )
        yield fd
    finally:
        os.close(fd)


def _still_the_file(fd: int, source: ContainerReader) -> bool:
    """Whether ``fd``, opened on ``source``'s path, is the file ``source`` validated: still at
    the path, and its size and footer as readers check them (``ContainerReader.holds``)."""
    return os.path.samestat(os.fstat(fd), os.stat(source.path)) and source.holds(fd)


def _pack_id(old: VOCPackReader) -> str | None:
    """The single file's pack id, kept by the file that replaces it."""
    binding = old.reader.shard(0).meta.get("pack")
    return binding.get("pack_id") if isinstance(binding, dict) else None


def _span(entries: np.ndarray) -> int:
    offsets, lengths = entries["offset"].astype(np.int64), entries["length"].astype(np.int64)
    return int(offsets[-1] + lengths[-1] - offsets[0])


def _add_copy(copies: list[list[int]], offset: int, at: int, length: int) -> None:
    """Add a copy of ``length`` bytes from ``offset`` to ``at``, merged with the previous one
    when both files have the same gap (alignment padding: zeros in both) between them."""
    if copies:
        last = copies[-1]
        gap = offset - (last[0] + last[2])
        if gap >= 0 and at - (last[1] + last[2]) == gap:
            last[2] += gap + length
            return
    copies.append([offset, at, length])
