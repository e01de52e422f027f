"""Pack a VOCdevkit folder into one file or a shard folder: ``pack_voc``. Every listed id is
stored once (``source.survey``); this module plans shards and metadata, ``records.write`` writes
the records. Never imports torch."""

from __future__ import annotations

import dataclasses
import errno
import functools
import itertools
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from ..container.fileio import DEFAULT_MAX_FILE_BYTES
from ..container.shardwriter import PackWriter, check_output_name, replace_refusal
from ..container.spec import FILE_SUFFIX, MANIFEST_NAME
from ..container.writer import CREATED_BY
from ..errors import RemoteNotFoundError, SourceDataError
from ..remote.store import RemoteStore, is_url
from ..remote.upload import check_writable, write_then_upload
from . import records, schema
from .images import ImageOptions
from .layout import base_dir, find_source, read_image_sets
from .records import REPORT_SUFFIX, Books, Options, PackResult, SkippedSample
from .source import survey

__all__ = ["pack_voc", "PackResult", "SkippedSample", "REPORT_SUFFIX"]

_OVERWRITE = "pass overwrite=True (torch-serialized pack --overwrite) to replace it"


def pack_voc(
    root: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    year: str | None = None,
    max_samples_per_shard: int | None = None,
    max_shard_bytes: int | None = None,
    num_shards: int | None = None,
    workers: int = 1,
    image_storage: Literal["original", "raw"] = "original",
    max_size: int | None = None,
    check_images: bool = False,
    on_error: Literal["raise", "skip"] = "raise",
    progress: bool = False,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = True,
) -> PackResult:
    """Pack a VOC dataset into ``output`` (a ``.tser`` file, or a shard folder with a limit).

    ``root`` is torchvision's root (holding ``VOCdevkit/``) or ``VOCdevkit/VOC20xx``;
    ``year=None`` takes the one ``VOC<year>`` folder there. A shard limit makes a shard folder:
    ``max_samples_per_shard``, ``max_shard_bytes`` or ``num_shards`` (exactly that many, counts
    differing by at most one). ``image_storage="raw"`` (decoded pixels) and ``max_size``
    (resized images, boxes and masks) make packs that are not byte-exact drop-ins.
    ``check_images`` decodes every image. ``on_error="skip"`` leaves out bad samples, listed in
    the result and a ``.skipped.json`` beside ``output``. Only regular files of at most
    ``max_file_bytes`` are read. ``workers > 1``: spawned loader processes, same output. A URL
    ``output`` (``storage_options`` go to fsspec) is written locally, then uploaded manifest
    last, so readers never see a partial pack. ``overwrite=False`` refuses (``FileExistsError``)
    an ``output`` holding a pack; what is no pack is never replaced.
    """
    opts = Options(
        year=year,
        on_error=on_error,
        workers=workers,
        progress=progress,
        max_file_bytes=max_file_bytes,
        image=ImageOptions(image_storage, max_size, check_images),
        max_samples_per_shard=max_samples_per_shard,
        max_shard_bytes=max_shard_bytes,
        num_shards=num_shards,
    )
    limits = (num_shards, max_samples_per_shard, max_shard_bytes)
    as_file = str(output).rstrip("/").endswith(FILE_SUFFIX) and limits != (None,) * 3
    # a file that no pack may replace (a shard of a folder...): the writer's refusal says more
    if as_file and not (os.path.isfile(output) and replace_refusal(Path(output))):
        raise ValueError(
            f"{output}: a shard limit makes a shard folder: drop the {FILE_SUFFIX} suffix, or "
            "pass no shard limit for one file"
        )
    local = functools.partial(_pack_local, root, opts=opts)
    if is_url(output):
        check_writable(str(output), "pack")
        if not overwrite:
            _refuse_remote_pack(str(output), storage_options)
        result = write_then_upload(
            str(output), storage_options, local, written=lambda r: r.path, report=lambda r: r.report
        )
        result = dataclasses.replace(result, url=str(output))
    else:
        if not overwrite and os.path.lexists(output) and replace_refusal(Path(output)) is None:
            raise FileExistsError(errno.EEXIST, f"{output} already holds a pack; {_OVERWRITE}")
        result = local(output)
    records.warn_untyped(result)
    return result


def _refuse_remote_pack(url: str, storage_options: Mapping[str, Any] | None) -> None:
    """``FileExistsError`` if ``url`` already holds a pack (its file, or its manifest)."""
    key = "" if url.rstrip("/").endswith(FILE_SUFFIX) else MANIFEST_NAME
    try:
        RemoteStore(url, storage_options).info(key)
    except RemoteNotFoundError:
        return
    raise FileExistsError(errno.EEXIST, f"{url} already holds a pack; {_OVERWRITE}")


def _pack_local(
    root: str | os.PathLike[str], output: str | os.PathLike[str], opts: Options
) -> PackResult:
    """``pack_voc`` to a local path (a URL's temporary copy included), without its warning."""
    check_output_name(output)
    started = time.perf_counter()
    voc_root, year = find_source(root, opts.year)
    image_sets = read_image_sets(voc_root, opts.max_file_bytes)
    jobs = survey(voc_root, image_sets, opts.image, opts.max_file_bytes).jobs()
    ends: list[int] = []  # with num_shards: the record counts after which a shard ends
    per_shard = opts.max_samples_per_shard
    if opts.num_shards is not None:
        count = max(1, min(opts.num_shards, len(jobs)))
        sizes = [len(jobs) // count + (k < len(jobs) % count) for k in range(count)]
        ends = list(itertools.accumulate(sizes))
        per_shard = max(1, sizes[0])
    output = Path(output)
    report = records.check_report_path(output)  # before any work: never overwrite someone's file

    def metadata(books: Books, values: dict[str, Any]) -> dict[str, Any]:
        if books.skipped and not books.record_of:  # likelier a layout mistake than bad files
            shown = "; ".join(s.reason for s in books.skipped[:3])
            more = len(books.skipped) - 3
            raise SourceDataError(  # the output is removed as we leave
                f"{voc_root}: every one of the {len(books.skipped)} listed samples was skipped, "
                f"so nothing was packed and no output written. The first: {shown}"
                f"{f' (and {more} more)' if more > 0 else ''}. Fix that cause and pack again"
            )
        return {
            "schema": schema.SCHEMA,
            "year": year,
            "base_dir": base_dir(year),
            "voc_folder": voc_root.name,
            "image_storage": opts.image.image_storage,
            "max_size": opts.image.max_size,
            "options": {
                "num_shards": opts.num_shards,  # as asked; appends write max_samples_per_shard
                "max_samples_per_shard": per_shard,
                "max_shard_bytes": opts.max_shard_bytes,
                "check_images": opts.image.check_images,
                "on_error": opts.on_error,
            },
            "packed_by": CREATED_BY,
            **values,
            "history": [records.history_entry("pack", len(books.ids), len(books.ids))],
        }

    books = Books()
    open_writer = functools.partial(
        PackWriter,
        output,
        schema.FIELDS,
        shard_ends=ends,
        columns=schema.COLUMNS,
        max_records_per_shard=per_shard,
        max_shard_bytes=opts.max_shard_bytes,
    )
    with records.progress_bar(len(jobs), f"packing {output.name}", opts.progress) as bar:
        path = records.write(
            open_writer, jobs, books, (voc_root, image_sets), metadata, opts, bar, started
        )
        return books.result(
            path,
            report,
            started,
            bar,
            year=year,
            voc_root=voc_root,
            added=len(books.ids),
            bytes_written=records.size_on_disk(path),
        )
