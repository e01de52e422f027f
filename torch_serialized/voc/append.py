"""``append_voc``: a VOC source folder's new and changed samples added to its pack. A shard folder
grows in place; a single file is rewritten, kept records copied (``copy_file_range``). No torch."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..container import spec as fmt
from ..container.append import GrowWriter
from ..container.fileio import DEFAULT_MAX_FILE_BYTES, open_regular
from ..container.parallel import copy_range
from ..container.reader import ContainerReader
from ..container.shardwriter import PackWriter
from ..errors import FormatError, SourceDataError, SourceNotFoundError, WriteError
from ..remote.store import is_url
from . import records, schema
from .changes import Plan, classify
from .classes import label_classes
from .images import ImageOptions
from .layout import find_source, find_voc_root, image_set_files, read_image_sets
from .packed import VOCPackReader
from .records import Books, Options, PackResult
from .source import survey

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
    """Bring the pack at ``pack`` up to date with the VOC source at ``root``; return what was
    done (``added``, ``replaced``, ``retired``, ``notes``, ``bytes_written``).

    New ids become new records; a changed id raises ``SourceDataError`` unless ``replace_changed``.
    Ids no longer listed are retired, but a ``root`` listing none of the pack's ids (likely the
    wrong folder) raises unless ``retire_all``. The result reads as a full re-pack of ``root`` that
    keeps the pack's class ids and options. Change is found by size and mtime; ``checksum``
    compares contents. Other options are ``pack_voc``'s. An interrupted append changes nothing.
    ``pack`` may be a writable URL (``storage_options``, ``cache_dir``, ``cache_limit_bytes`` as
    readers take them): appended to through the cache, new files uploaded, the manifest last."""
    opts = Options(
        year=year,
        on_error=on_error,
        workers=workers,
        progress=progress,
        max_file_bytes=max_file_bytes,
        replace_changed=replace_changed,
        checksum=checksum,
        retire_all=retire_all,
    )
    if os.fspath(pack) == "":  # Path("") is the current folder: never append to that by accident
        raise ValueError("the pack path is empty: pass the .tser file (or shard folder) or URL")
    if is_url(pack):
        from .append_remote import append_to_url

        # the staging sort must not raise for changed ids: the append itself will
        sort = dataclasses.replace(opts, replace_changed=True)
        result = append_to_url(
            str(pack),
            functools.partial(_append_local, root, opts=opts, check_shards=False),
            functools.partial(_sort_source, root, opts=sort),
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )
    else:
        result = _append_local(root, pack, opts)
    records.warn_untyped(result)
    return result


def _append_local(
    root: str | os.PathLike[str],
    pack: str | os.PathLike[str],
    opts: Options,
    check_shards: bool = True,
) -> PackResult:
    """``append_voc`` on a local pack; a URL's staged copy skips ``check_shards`` (it has few)."""
    started = time.perf_counter()
    old = VOCPackReader(pack, check_files=False)  # _check_shards says more, or a staged copy
    path = Path(old.path)
    report = records.check_report_path(path)
    voc_root, image_sets, plan = _sort_source(root, old, opts)
    if plan.current and old.files() == dict(image_set_files(voc_root, opts.max_file_bytes)):
        return PackResult(
            path=path,
            num_samples=len(plan.kept),
            num_bytes=records.size_on_disk(path),
            source_bytes=int(old.meta.get("source_bytes") or 0),
            seconds=time.perf_counter() - started,
            year=old.year,
            voc_root=voc_root,
            notes=[f"{path} is up to date with {voc_root}: nothing was written"],
        )
    sharded = old.reader.manifest is not None
    if sharded and check_shards:
        _check_shards(old)
    books = _old_books(old, plan, sharded)
    with records.progress_bar(
        len(plan.jobs), f"appending to {old.reader.path}", opts.progress
    ) as bar:
        written = functools.partial(
            records.write,
            jobs=plan.jobs,
            books=books,
            source=(voc_root, image_sets),
            metadata=functools.partial(_metadata, old, plan),
            opts=opts,
            bar=bar,
            started=started,
        )
        if sharded:
            bytes_written = _append_shards(old, written)
        else:
            bytes_written = _append_file(old, plan.kept.tolist(), written)
        added, replaced, retired = _outcome(plan, books)
        return books.result(
            path,
            report,
            started,
            bar,
            year=old.year,
            voc_root=voc_root,
            added=added,
            replaced=replaced,
            retired=retired,
            bytes_written=bytes_written,
        )


def _outcome(plan: Plan, books: Books) -> tuple[int, list[str], list[str]]:
    """Ids added, replaced and retired (no longer listed, or reloaded and then skipped)."""
    skipped = {s.id for s in books.skipped}
    replaced = [job.id for job in plan.replaced if job.id in books.record_of]
    retired = [*plan.dropped, *(i for i in plan.reloading if i in skipped)]
    return len(plan.jobs) - len(books.skipped) - len(replaced), replaced, retired


def _check_shards(old: VOCPackReader) -> None:
    """Open every shard (O(metadata)): never build a new generation on a damaged one."""
    reader = old.reader
    for s in range(reader.num_shards):
        try:
            reader.shard(s)
        except (FileNotFoundError, FormatError) as exc:
            raise type(exc)(
                f"{exc}. Nothing was appended to {reader.path}: run `torch-serialized verify` "
                "on it, then restore the shard or re-pack the dataset"
            ) from None


def _sort_source(
    root: str | os.PathLike[str], old: VOCPackReader, opts: Options
) -> tuple[Path, dict[str, dict[str, list[str]]], Plan]:
    """VOC root, image sets and ids sorted against ``old``; ``WriteError`` for pre-append packs."""
    arrays, meta = old.reader.arrays(), old.meta
    checks = bool(meta.get("options", {}).get("check_images"))
    options = ImageOptions(old.image_storage, meta.get("max_size"), checks)
    if (
        "history" not in meta
        or meta.get("source_stats") != schema.SOURCE_STATS_VERSION
        or schema.OBJECT_CLASSES_ARRAY not in arrays
        or (len(old) and options.transformed and schema.DIGEST_ARRAY not in arrays)
    ):
        raise WriteError(
            errno.EINVAL,
            f"{old.name} was written by an older version of torch_serialized, which kept no "
            "record of its sources; nothing was appended: re-pack it once with pack_voc (or "
            "torch-serialized pack --overwrite), then append",
        )
    try:
        voc_root, found_year = find_source(root, old.year if opts.year is None else opts.year)
    except SourceNotFoundError as missing:
        if opts.year is not None:
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
    image_sets = read_image_sets(voc_root, opts.max_file_bytes)
    planned = survey(voc_root, image_sets, options, opts.max_file_bytes)
    plan = classify(old, planned, opts.replace_changed, opts.checksum, opts.retire_all)
    return voc_root, image_sets, plan


def _old_books(old: VOCPackReader, plan: Plan, sharded: bool) -> Books:
    """Books for the old records the new pack holds first: all of a shard folder's
    (unkept ones retired), the kept ones of a single file (copied, in order)."""
    books = Books(classes={name: c for c, name in enumerate(old.classes)})
    names = schema.decode_ids(*old.id_table())
    classes, counts = old.object_classes()
    chosen = np.arange(len(old)) if sharded else plan.kept
    books.base_classes = classes[np.repeat(np.isin(np.arange(len(counts)), chosen), counts)]
    books.base_counts = counts[chosen]
    books.ids = [names[r] for r in chosen.tolist()]
    stats = plan.stats[chosen]  # retired records: (ABSENT, 0), unused
    books.stats = list(stats.reshape(len(stats), 2 * len(schema.SOURCE_FILES)))
    digests = plan.digests
    books.digests = [b""] * len(chosen) if digests is None else [bytes(d) for d in digests[chosen]]
    sizes = plan.stats[plan.kept, :, 0]
    books.source_bytes = int(sizes[sizes > 0].sum())
    books.base_flags = int(np.bitwise_or.reduce(old.columns["flags"][chosen], initial=0))
    if sharded:
        books.record_of = {books.ids[r]: r for r in plan.kept.tolist()}
        books.retired = np.setdiff1d(chosen, plan.kept).tolist()
    else:
        books.record_of = {name: r for r, name in enumerate(books.ids)}
    return books


def _metadata(
    old: VOCPackReader, plan: Plan, books: Books, values: dict[str, Any]
) -> dict[str, Any]:
    """The old pack's metadata updated, with this append in its history."""
    meta = dict(old.meta)
    if "label_base" not in meta:  # the label lists as they are, kept: no label ever moves
        meta["label_base"] = {
            rule: label_classes(rule, old.classes, None) for rule in ("default", "packed")
        }
    added, replaced, retired = _outcome(plan, books)
    live = len(books.record_of)
    entry = records.history_entry("append", live, added, len(replaced), len(retired))
    meta.update(values, history=[*meta["history"], entry])
    manifest = old.reader.manifest
    if manifest is not None:  # the catalog it replaces, kept for readers of the old manifest
        assert manifest.catalog is not None
        meta["previous_catalog"] = manifest.catalog.file
    return meta


def _append_shards(old: VOCPackReader, written: Callable[..., Path]) -> int:
    """Grow a shard folder via ``written(open_writer)``; return the bytes written."""
    manifest = old.reader.manifest
    assert manifest is not None
    kept_catalog = old.meta.get("previous_catalog")
    opts = old.meta.get("options", {})
    folder = Path(old.reader.path)
    before = set(os.listdir(folder))
    written(
        functools.partial(
            GrowWriter,
            old.reader.path,
            manifest,
            old.columns,
            schema.FIELDS,
            columns=schema.COLUMNS,
            max_records_per_shard=opts.get("max_samples_per_shard"),
            max_shard_bytes=opts.get("max_shard_bytes"),
            keep=[kept_catalog] if isinstance(kept_catalog, str) else [],
            manifest_sha256=old.reader.manifest_sha256,
        )
    )
    return sum(
        (folder / name).stat().st_size
        for name in os.listdir(folder)
        if name not in before or name == fmt.MANIFEST_NAME
    )


def _append_file(old: VOCPackReader, kept: list[int], written: Callable[..., Path]) -> int:
    """Rewrite a single file: ``kept`` records copied, then the new; return the new size."""
    source = old.reader.shard(0)
    copies: list[list[int]] = []  # source offset, target offset, length

    @contextlib.contextmanager
    def open_writer(before_finish: Callable[[], None] | None) -> Iterator[PackWriter]:
        def copy_kept() -> None:  # in the writer's finish, which says its errors as a write's
            if copies:
                with open(target, "r+b") as dst:
                    for offset, at, length in copies:
                        copy_range(locked, offset, dst.fileno(), at, length)
            if before_finish is not None:
                before_finish()

        with PackWriter(
            old.reader.path,
            schema.FIELDS,
            columns=schema.COLUMNS,
            before_finish=copy_kept,
            pack_id=(old.reader.binding or {}).get("pack_id"),  # kept by the new file
            locked=True,  # by _locked, below
        ) as writer:
            for record, entries in zip(kept, source.index_rows(kept)):
                _, target, at = writer.reserve(entries, tuple(old.columns[record].tolist()))
                start, end = entries["offset"][0], entries["offset"][-1] + entries["length"][-1]
                gap = int(start) - (copies[-1][0] + copies[-1][2]) if copies else -1
                if gap >= 0 and at - (copies[-1][1] + copies[-1][2]) == gap:
                    copies[-1][2] += gap + int(end - start)  # one copy of a run (0.12 vs 0.16 s)
                else:
                    copies.append([int(start), at, int(end - start)])
            yield writer

    with _locked(source) as locked:
        written(open_writer)
    return os.path.getsize(old.reader.path)


@contextlib.contextmanager
def _locked(source: ContainerReader) -> Iterator[int]:
    """The single file, under an exclusive ``flock`` and checked to be the one ``source``
    validated: a second append is refused, not waited for, and cannot undo another."""
    fd = open_regular(source.path, "the pack")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WriteError(
                errno.EBUSY,
                f"{source.path} is being appended to by another process; wait for it to finish",
            ) from None
        if not (os.path.samestat(os.fstat(fd), os.stat(source.path)) and source.holds(fd)):
            raise WriteError(
                errno.EBUSY,
                f"{source.path} changed since it was opened for this append (another process "
                "wrote it); nothing was written: append again",
            )
        yield fd
    finally:
        os.close(fd)
