"""Append a VOC source folder's new and changed samples to its pack: ``append_voc``.

The source is planned as a full pack plans it and each id sorted against the pack
(``changes.classify``: new, unchanged, changed, no longer listed). New ids and, with
``replace_changed``, new versions of changed ones are written as new records; replaced and
unlisted records are retired. Image set lists, class counts and list files are rebuilt from
the source as it is now, so the pack reads as a full re-pack; class ids never move.

A shard folder is appended to in place (``GrowWriter``: new shards, a new catalog, the
manifest replaced last; retired records keep their bytes until the next full pack). A single
file is rewritten: its kept records copied from the old file with ``copy_file_range``, the
new ones after them, the result renamed over the old file. This module never imports torch.
"""

from __future__ import annotations

import contextlib
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
from . import schema
from .changes import Plan, classify
from .classes import label_classes
from .images import ImageOptions
from .layout import find_voc_root, image_set_files, read_image_sets
from .packed import VOCPackReader
from .records import (
    Books,
    PackResult,
    check_options,
    check_report_path,
    history_entry,
    progress_bar,
    size_on_disk,
    warn_untyped,
    write,
)
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
    for a local path): the pack is staged through the cache, appended
    to locally by these same rules, and only its new files are uploaded, the manifest last
    (``append_remote``).
    """
    check_options(on_error, workers, max_file_bytes)
    if os.fspath(pack) == "":  # Path("") is the current folder: never append to that by accident
        raise ValueError(
            "the pack path is empty: pass the .tser file (or shard folder) to append to, e.g. "
            "'voc.tser', or its URL"
        )
    local = functools.partial(
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
    if is_url(pack):  # staged locally, appended to by this function, the new files uploaded
        from .append_remote import append_to_url

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
            functools.partial(local, check_shards=False),  # the download checks the others
            compare,
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )
    else:
        result = local(pack, check_shards=True)
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
    report = check_report_path(path)
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
    books = _old_books(old, plan_, sharded)
    copied = len(books.ids)
    with progress_bar(len(plan_.jobs), f"appending to {old.reader.path}", progress) as bar:
        written = functools.partial(
            write,
            jobs=plan_.jobs,
            books=books,
            source=(voc_root, image_sets, max_file_bytes),
            metadata=functools.partial(_metadata, old, plan_),
            skip=on_error == "skip",
            workers=workers,
            bar=bar,
            started=started,
        )
        bytes_written = (_append_shards if sharded else _append_file)(old, plan_, written)
        replaced = [job.id for job in plan_.replaced if job.id in books.record_of]
        return books.result(
            path,
            report,
            started,
            bar,
            year=old.year,
            voc_root=voc_root,
            added=len(books.ids) - copied - len(replaced),
            replaced=replaced,
            retired=_retired_ids(plan_, books),
            notes=plan_.notes,
            bytes_written=bytes_written,
        )


def _retired_ids(plan: Plan, books: Books) -> list[str]:
    """The packed ids this append leaves out: those no longer listed, then those loaded again
    (changed, or missing a file they now need) that ``on_error="skip"`` skipped."""
    skipped = {s.id for s in books.skipped}
    return [*plan.dropped, *(i for i in plan.reloading if i in skipped)]


def _check_shards(old: VOCPackReader) -> None:
    """Every shard of the folder, which the appended pack keeps, opens as a reader's first read
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
def _old_books(old: VOCPackReader, plan: Plan, sharded: bool) -> Books:
    """Books for the old pack's records the new one holds first: every record of a shard
    folder (its shards are kept; those not kept by ``plan`` retired), the kept ones of a
    single file (copied, in order): ids, class ids, statistics, digests."""
    books = Books(classes={name: c for c, name in enumerate(old.classes)})
    names = schema.decode_ids(*old.id_table())
    classes, counts = old.object_classes()  # the catalog's, or read from old shards
    chosen = np.arange(len(old)) if sharded else plan.kept
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
    if sharded:
        books.record_of = {books.ids[r]: r for r in plan.kept.tolist()}
        books.retired = np.setdiff1d(chosen, plan.kept).tolist()
    else:
        books.record_of = {name: r for r, name in enumerate(books.ids)}
    return books


def _metadata(
    old: VOCPackReader, plan: Plan, books: Books, values: dict[str, Any]
) -> dict[str, Any]:
    """The old pack's metadata brought up to date (``values``: ``Books.metadata``), with this
    append in its history."""
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
    meta.update(values, history=history)
    manifest = old.reader.manifest
    if manifest is not None:  # the catalog it replaces, kept for readers of the old manifest
        assert manifest.catalog is not None
        meta["previous_catalog"] = manifest.catalog.file
    return meta


#: ``records.write`` with all but its first argument given: the writer's opener
_Write = Callable[[Callable[[Callable[[], None] | None], Any]], Path]


def _append_shards(old: VOCPackReader, plan: Plan, written: _Write) -> int:
    """Append to a shard folder: new shards, a new catalog, the manifest last; return the
    bytes of the files written."""
    manifest = old.reader.manifest
    assert manifest is not None
    kept_catalog = old.meta.get("previous_catalog")
    opts = old.meta.get("options", {})
    folder = Path(old.reader.path)
    before = set(os.listdir(folder))
    written(
        lambda before_finish: GrowWriter(
            old.reader.path,
            manifest,
            old.columns,
            schema.FIELDS,
            columns=schema.COLUMNS,
            max_records_per_shard=opts.get("max_samples_per_shard"),
            max_shard_bytes=opts.get("max_shard_bytes"),
            before_finish=before_finish,
            keep=[kept_catalog] if isinstance(kept_catalog, str) else [],
            manifest_sha256=old.reader.manifest_sha256,
        )
    )
    return sum(
        (folder / name).stat().st_size
        for name in os.listdir(folder)
        if name not in before or name == fmt.MANIFEST_NAME
    )


def _append_file(old: VOCPackReader, plan: Plan, written: _Write) -> int:
    """Rewrite a single file: kept records copied from the old file, new ones after them;
    return the bytes written (the whole new file)."""
    kept = plan.kept.tolist()  # ascending
    source = old.reader.shard(0)
    copies: list[list[int]] = []  # [source offset, target offset, length], runs merged
    target: list[Path] = []

    @contextlib.contextmanager
    def open_writer(drain: Callable[[], None] | None) -> Iterator[PackWriter]:
        def before_finish() -> None:  # the kept records' bytes, copied in before the file ends
            if copies:
                dst = os.open(target[0], os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
                try:
                    for offset, at, length in copies:
                        copy_range(locked, offset, dst, at, length)
                finally:
                    os.close(dst)
                copies.clear()
            if drain is not None:
                drain()

        with PackWriter(
            old.reader.path,
            schema.FIELDS,
            columns=schema.COLUMNS,
            before_finish=before_finish,
            pack_id=(old.reader.binding or {}).get("pack_id"),  # kept by the new file
            locked=True,  # by _locked, below
        ) as writer:
            for record, entries in zip(kept, source.index_rows(kept)):
                _, file, at = writer.reserve(entries, tuple(old.columns[record].tolist()))
                offsets, lengths = entries["offset"].astype(int), entries["length"].astype(int)
                span = int(offsets[-1] + lengths[-1] - offsets[0])
                _add_copy(copies, int(offsets[0]), at, span)
                if not target:
                    target.append(file)
            yield writer

    with _locked(source) as locked:
        written(open_writer)
    return os.path.getsize(old.reader.path)


@contextlib.contextmanager
def _locked(source: ContainerReader) -> Iterator[int]:
    """The single file appended to, open (its descriptor) with an exclusive ``flock``, checked
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
        # still at the path, and its size and footer as ``source`` validated them
        if not (os.path.samestat(os.fstat(fd), os.stat(source.path)) and source.holds(fd)):
            raise WriteError(
                errno.EBUSY,
                f"{source.path} changed since it was opened for this append (another process "
                "wrote it); nothing was written: append again",
            )
        yield fd
    finally:
        os.close(fd)


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
