"""Pack a VOCdevkit folder into one file (or shards): the ``pack_voc`` entry point.

Every id listed in ``ImageSets/Main`` or ``ImageSets/Segmentation`` is stored once
(``source.plan``), with its original image, XML and mask bytes, plus what makes reading fast
(the parsed target as JSON, the objects as arrays, the image size; ``source.load``). This
module checks the arguments, plans the shards and builds the metadata described in
``schema``; ``records.write`` writes the records, as it does for an append. This module
never imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from ..container import spec as fmt
from ..container.fileio import DEFAULT_MAX_FILE_BYTES
from ..container.shardwriter import PackWriter, check_output_name
from ..container.writer import CREATED_BY
from ..errors import SourceDataError
from ..remote.store import is_url
from ..remote.upload import check_writable, write_then_upload
from . import schema
from .images import ImageOptions
from .layout import base_dir, find_voc_root, read_image_sets
from .records import (
    REPORT_SUFFIX,
    Books,
    PackResult,
    SkippedSample,
    check_options,
    check_report_path,
    history_entry,
    progress_bar,
    size_on_disk,
    warn_untyped,
    write,
)
from .source import plan

__all__ = ["pack_voc", "PackResult", "SkippedSample", "REPORT_SUFFIX"]

ImageStorage = Literal["original", "raw"]


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
    check_options(on_error, workers, max_file_bytes)
    for name, value in (
        ("max_samples_per_shard", max_samples_per_shard),
        ("max_shard_bytes", max_shard_bytes),
        ("num_shards", num_shards),
        ("max_size", max_size),
        ("max_file_bytes", max_file_bytes),
    ):  # each goes into the pack's metadata, whose integers readers bound (container.spec)
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
    report = check_report_path(output)  # before any work: never overwrite someone's file

    def metadata(books: Books, values: dict[str, Any]) -> dict[str, Any]:
        if books.skipped and not books.record_of:  # the output is removed as we leave
            raise _all_skipped(voc_root, books.skipped)
        return {
            "schema": schema.SCHEMA,
            "year": year,
            "base_dir": base_dir(year),
            "voc_folder": voc_root.name,
            "image_storage": image_storage,
            "max_size": max_size,
            "options": {
                "max_samples_per_shard": max_samples_per_shard,
                "max_shard_bytes": max_shard_bytes,
                "check_images": check_images,
                "on_error": on_error,
            },
            "packed_by": CREATED_BY,
            **values,
            "history": [history_entry("pack", len(books.ids), len(books.ids))],
        }

    books = Books()
    with progress_bar(len(jobs), f"packing {output.name}", progress) as bar:
        path = write(
            lambda before_finish: PackWriter(
                output,
                schema.FIELDS,
                shard_ends=ends,
                columns=schema.COLUMNS,
                max_records_per_shard=max_samples_per_shard,
                max_shard_bytes=max_shard_bytes,
                before_finish=before_finish,
            ),
            jobs,
            books,
            (voc_root, image_sets, max_file_bytes),
            metadata,
            skip=on_error == "skip",
            workers=workers,
            bar=bar,
            started=started,
        )
        return books.result(
            path,
            report,
            started,
            bar,
            year=year,
            voc_root=voc_root,
            added=len(books.ids),
            bytes_written=size_on_disk(path),
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
