"""``torch-serialized pack``: ``pack_voc``, or ``append_voc`` with ``--append``, and what
it did.

The option combinations that mean nothing are refused here (an append keeps the pack's own
options; the cache stages only an append to a URL); everything about the paths and the data
is ``pack_voc``'s and ``append_voc``'s to check.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..container import spec as fmt
from ..container.fileio import DEFAULT_MAX_FILE_BYTES
from ..errors import UntypedObjectsWarning
from ..remote.store import is_url
from .commands import EXIT_OK, files, mb, progress, remote

#: ``pack`` options an append cannot take: the pack keeps its own (dest -> flag).
_PACK_ONLY = {
    "shards": "--shards",
    "shard_size": "--shard-size",
    "samples_per_shard": "--samples-per-shard",
    "image_storage": "--image-storage",
    "max_size": "--max-size",
    "check_images": "--check-images",
    "overwrite": "--overwrite",
}
#: ``--append`` options (dest -> flag), and the cache's, which only an append to a URL uses.
_APPEND_ONLY = {
    "replace_changed": "--replace-changed",
    "checksum": "--checksum",
    "retire_all": "--retire-all",
}
_CACHE_OPTIONS = {"cache_dir": "--cache-dir", "cache_limit": "--cache-limit"}


def cmd_pack(args: argparse.Namespace) -> int:
    """``pack ROOT OUTPUT``: ``pack_voc`` (``append_voc`` with ``--append``)."""
    from ..container.shards import open_pack
    from ..voc.pack import pack_voc

    cache = [flag for dest, flag in _CACHE_OPTIONS.items() if getattr(args, dest) is not None]
    if cache and not (args.append and is_url(args.output)):
        raise ValueError(
            f"{' and '.join(cache)} only {'applies' if len(cache) == 1 else 'apply'} with "
            "--append to a URL, which stages the pack through the cache: a pack is written "
            "in $TMPDIR and uploaded, and a local pack is appended to in place, neither "
            "through the cache"
        )
    wrong = _PACK_ONLY if args.append else _APPEND_ONLY
    given = [flag for dest, flag in wrong.items() if getattr(args, dest)]
    if given and args.append:
        raise ValueError(
            f"{', '.join(given)} cannot be combined with --append: an append keeps the pack's "
            "own options (see `torch-serialized info OUTPUT`); re-pack to change them"
        )
    if given:
        raise ValueError(f"{', '.join(given)} only applies with --append")
    if args.append:
        return _append(args)
    if not args.overwrite:
        _refuse_existing(args.output, args.storage_options)
    started = time.perf_counter()
    with _untyped_printed():  # said in the summary below, not as a warning too
        result = pack_voc(
            args.root,
            args.output,
            year=args.year,
            max_samples_per_shard=args.samples_per_shard,
            max_shard_bytes=args.shard_size,
            num_shards=args.shards,
            workers=args.workers,
            image_storage=args.image_storage or "original",
            max_size=args.max_size,
            check_images=args.check_images,
            on_error="skip" if args.skip_bad else "raise",
            progress=progress(args),
            max_file_bytes=args.max_file_size or DEFAULT_MAX_FILE_BYTES,
            storage_options=args.storage_options,
        )
    took = time.perf_counter() - started  # with a URL: packing, then the upload
    seconds = max(result.seconds, 1e-9)
    ratio = f"{result.num_bytes / result.source_bytes:.1%}" if result.source_bytes else "n/a"
    how = "as asked" if args.year else "found in the folder names; --year picks another"
    print(f"packed {result.num_samples} samples of {result.voc_root}")
    print(f"  year     {result.year} ({how})")
    if result.url:
        print(f"  output   {result.url} (uploaded, manifest last)")
    else:
        packed = open_pack(result.path)
        made_of = files(packed.num_shards, packed.manifest is not None)
        print(f"  output   {result.path} ({made_of})")
    print(
        f"  size     {mb(result.num_bytes)}, {ratio} of the {mb(result.source_bytes)} source files"
    )
    print(
        f"  time     {result.seconds:.2f} s: {result.num_samples / seconds:,.0f} samples/s, "
        f"{result.num_bytes / seconds / 1e6:,.0f} MB/s"
    )
    if result.url:  # the pack was written locally first: its upload is timed apart
        upload = max(took - result.seconds, 1e-9)
        print(f"  upload   {upload:.2f} s: {result.num_bytes / upload / 1e6:,.1f} MB/s")
    _print_outcome(result)
    if args.shards is not None and result.num_samples < args.shards:
        print(
            f"  note     --shards {args.shards} asked, but only {result.num_samples} samples "
            "were packed: one shard each"
        )
    return EXIT_OK


def _refuse_existing(output: str, storage_options: dict[str, Any] | None) -> None:
    """Without ``--overwrite`` the command line replaces no existing pack (``pack_voc``
    replaces one when asked to write there). What may never be replaced (someone's file, one
    shard of a folder) is left to ``pack_voc`` to refuse, with its own advice."""
    from ..container.shardwriter import replace_refusal
    from ..errors import RemoteNotFoundError
    from ..remote.store import RemoteStore
    from ..remote.upload import check_writable

    if not is_url(output):
        if os.path.lexists(output) and replace_refusal(Path(output)) is None:
            raise FileExistsError(
                errno.EEXIST,
                f"{output} already exists; pass --overwrite to replace it (or choose another "
                "OUTPUT)",
            )
        return
    check_writable(output, "pack")  # before asking a read-only server anything
    try:
        key = "" if output.rstrip("/").endswith(fmt.FILE_SUFFIX) else fmt.MANIFEST_NAME
        RemoteStore(output, storage_options).size(key)
    except RemoteNotFoundError:
        return
    raise FileExistsError(
        errno.EEXIST,
        f"{output} already holds a pack; pass --overwrite to upload a new one (readers of the "
        "old one keep working; `prune` removes its files later)",
    )


def _append(args: argparse.Namespace) -> int:
    """``pack ROOT PACK --append``: ``append_voc``, and what it did."""
    from ..voc.append import append_voc

    started = time.perf_counter()
    with _untyped_printed():
        result = append_voc(
            args.root,
            args.output,
            year=args.year,
            on_error="skip" if args.skip_bad else "raise",
            progress=progress(args),
            workers=args.workers,
            replace_changed=args.replace_changed,
            checksum=args.checksum,
            max_file_bytes=args.max_file_size or DEFAULT_MAX_FILE_BYTES,
            retire_all=args.retire_all,
            **remote(args),
        )
    took = time.perf_counter() - started  # with a URL: staging, the append, the upload
    where = f"{result.url} (new files uploaded, manifest last)" if result.url else result.path
    print(f"appended to {where} from {result.voc_root}")
    print(f"  added    {result.added} new samples, {len(result.replaced)} changed samples replaced")
    print(f"  retired  {len(result.retired)} samples no longer listed in the source")
    print(
        f"  pack     {result.num_samples} samples, {mb(result.num_bytes)} "
        f"{'at the URL' if result.url else 'on disk'} "
        f"({mb(result.bytes_written)} written)"
    )
    print(f"  time     {result.seconds:.2f} s")
    if result.url:  # staged through the cache and grown locally: the transfers timed apart
        print(f"  transfer {max(took - result.seconds, 0.0):.2f} s (downloads and upload)")
    _print_outcome(result)
    for note in result.notes:
        print(f"  note     {note}")
    return EXIT_OK


@contextlib.contextmanager
def _untyped_printed() -> Iterator[None]:
    """Around a pack or append whose summary prints ``_print_outcome``: the news once."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntypedObjectsWarning)
        yield


def _print_outcome(result: Any) -> None:
    """The samples a pack or append skipped, and those packed without a usable target."""
    if result.skipped:
        report = f"{result.url}.skipped.json" if result.url else result.report
        print(f"  skipped  {len(result.skipped)} samples; reasons in {report}")
    _print_ids(
        "untyped ",
        result.untyped,
        "samples ({named}) whose objects do not fit a tv_tensors target: packed as torchvision "
        "reads them; target_format='tv_tensors' raises for them (docs/guarantees.md)",
    )
    _print_ids(
        "unparsed",
        result.unparsed,
        "segmentation-only samples ({named}) whose annotation XML did not parse: packed with "
        "the files' bytes and no target (VOCSegmentation never reads it)",
    )


def _print_ids(label: str, why: Mapping[str, str], what: str) -> None:
    """One summary line for the ids of ``why`` (id -> reason): how many, the first three,
    ``what`` they are (``{named}``: where the ids go), and the first one's reason."""
    if why:
        ids = list(why)
        named = ", ".join(repr(i) for i in ids[:3]) + (", ..." if len(ids) > 3 else "")
        print(f"  {label} {len(ids)} {what.format(named=named)}. The first: {why[ids[0]]}")
