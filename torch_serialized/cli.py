"""The ``torch-serialized`` command line (also ``python -m torch_serialized``).

A thin layer over the public API: ``pack`` (``pack_voc``; ``append_voc`` with ``--append``),
``info`` and ``verify`` (the reader), ``export`` (``export_voc``), ``cache`` (``list_cache``,
``clear_cache``), ``prune`` (``prune_remote``), ``bench``
(``torch_serialized.tools.run_benchmark``) and ``demo`` (``torch_serialized.tools.run_demo``);
this is the only module of the library that imports ``tools``. Errors of torch_serialized,
bad paths and bad values print one line on stderr and exit with status 2 (``--debug`` shows
the traceback instead); ``verify`` exits 1 when it finds damage.
"""

# More than 400 lines: one function per command, then the one argument parser (``_parser``)
# holding every command's options, so the whole command line reads in one file.

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import functools
import json
import os
import re
import sys
import time
import unicodedata
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._version import __version__
from .container import spec as fmt
from .container.fileio import DEFAULT_MAX_FILE_BYTES
from .errors import ChecksumError, FormatError, TorchSerializedError, UntypedObjectsWarning

if TYPE_CHECKING:
    from .container.reader import Member, PackReader

__all__ = ["main", "parse_size"]

PROG = "torch-serialized"
EXIT_OK, EXIT_DAMAGED, EXIT_ERROR = 0, 1, 2
#: What a shell reports for a process a closed pipe stopped (128 + SIGPIPE), as ``ls | head``.
EXIT_BROKEN_PIPE = 141

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
    "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes in ``"256MB"``, ``"1.5GiB"``, ``"4096"``: kB/MB/GB are powers of 1000, KiB/MiB/GiB
    of 1024 (``K``/``M``/``G`` alone mean kB/MB/GB)."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use a number with an optional unit, e.g. 256MB or 1GiB"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte, got {text!r}")
    return size


def _int_at_least(minimum: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _int_at_least(1, text)


def _non_negative_int(text: str) -> int:
    return _int_at_least(0, text)


def _files(count: int, sharded: bool) -> str:
    """What a pack is made of: "1 file" (a ``.tser``), "1 shard", "8 shards" (a folder)."""
    if not sharded:
        return "1 file"
    return f"{count} shard" if count == 1 else f"{count} shards"


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:,.1f} MB"


def _storage_options(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--storage-options must be JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            "--storage-options must be a JSON object, e.g. '{\"anon\": true}'"
        )
    return value


def _progress(args: argparse.Namespace) -> bool:
    """Show a progress bar only on a terminal (tqdm's own rule), never with ``-q``: in a log
    or a CI job each update of a bar would be one more line."""
    return not args.quiet and sys.stderr.isatty()


def _remote(args: argparse.Namespace) -> dict[str, Any]:
    """The reader keywords of the remote options (``_remote_options``)."""
    return {
        "storage_options": args.storage_options,
        "cache_dir": args.cache_dir,
        "cache_limit_bytes": args.cache_limit,
    }


def _is_url(path: str) -> bool:
    from .remote.store import is_url

    return is_url(path)


# -- pack ---------------------------------------------------------------------------------------
def _cmd_pack(args: argparse.Namespace) -> int:
    from .container.reader import open_pack
    from .container.writer import member_refusal
    from .remote.upload import check_writable
    from .voc.pack import pack_voc

    _check_output(args.output)
    cache = [flag for dest, flag in _CACHE_OPTIONS.items() if getattr(args, dest) is not None]
    if cache and not (args.append and _is_url(args.output)):
        raise ValueError(
            f"{' and '.join(cache)} only {'applies' if len(cache) == 1 else 'apply'} with "
            "--append to a URL, which stages the pack "
            "through the cache: a pack is written in $TMPDIR and uploaded, and a local pack is "
            "appended to in place, neither through the cache"
        )
    if args.append:
        return _cmd_append(args)
    for flag in ("replace_changed", "checksum", "retire_all"):
        if getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} only applies with --append")
    remote = _is_url(args.output)
    output: str | Path = args.output if remote else Path(args.output)
    if remote:
        check_writable(args.output, "pack")  # before asking the server, or packing
        if not args.overwrite and _remote_pack_exists(args.output, args.storage_options):
            raise FileExistsError(
                errno.EEXIST,
                f"{args.output} already holds a pack; pass --overwrite to upload a new one "
                "(readers of the old one keep working; `prune` removes its files later)",
            )
    elif (refusal := member_refusal(Path(output))) is not None:  # --overwrite would not help
        raise FileExistsError(errno.EEXIST, refusal)
    elif not args.overwrite and (Path(output).exists() or Path(output).is_symlink()):
        raise FileExistsError(
            errno.EEXIST,
            f"{output} already exists; pass --overwrite to replace it (or choose another OUTPUT)",
        )
    started = time.perf_counter()
    with _untyped_printed():  # said in the summary below, not as a warning too
        result = pack_voc(
            args.root,
            output,
            year=args.year,
            max_samples_per_shard=args.samples_per_shard,
            max_shard_bytes=args.shard_size,
            num_shards=args.shards,
            workers=args.workers,
            image_storage=args.image_storage or "original",
            max_size=args.max_size,
            check_images=args.check_images,
            on_error="skip" if args.skip_bad else "raise",
            progress=_progress(args),
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
        made_of = _files(packed.num_shards, packed.manifest is not None)
        print(f"  output   {result.path} ({made_of})")
    print(
        f"  size     {_mb(result.num_bytes)}, {ratio} of the {_mb(result.source_bytes)} "
        "source files"
    )
    print(
        f"  time     {result.seconds:.2f} s: {result.num_samples / seconds:,.0f} samples/s, "
        f"{result.num_bytes / seconds / 1e6:,.0f} MB/s"
    )
    if result.url:  # the pack was written locally first: its upload is timed apart
        upload = max(took - result.seconds, 1e-9)
        print(f"  upload   {upload:.2f} s: {result.num_bytes / upload / 1e6:,.1f} MB/s")
    if result.skipped:
        report = f"{result.url}.skipped.json" if result.url else result.report
        print(f"  skipped  {len(result.skipped)} samples; reasons in {report}")
    _print_untyped(result.untyped)
    _print_unparsed(result.unparsed)
    if args.shards is not None and result.num_samples < args.shards:
        print(
            f"  note     --shards {args.shards} asked, but only {result.num_samples} samples "
            "were packed: one shard each"
        )
    return EXIT_OK


@contextlib.contextmanager
def _untyped_printed() -> Iterator[None]:
    """Around a pack or append whose summary prints ``_print_untyped``: the same news once."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntypedObjectsWarning)
        yield


def _print_untyped(untyped: Mapping[str, str]) -> None:
    _print_ids(
        "untyped ",
        untyped,
        "samples ({named}) whose objects do not fit a tv_tensors target: packed as torchvision "
        "reads them; target_format='tv_tensors' raises for them (README, Guarantees)",
    )


def _print_unparsed(unparsed: Mapping[str, str]) -> None:
    _print_ids(
        "unparsed",
        unparsed,
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


def _check_output(output: str) -> None:
    """Refuse an OUTPUT of ``""`` (``Path`` reads it as the current folder) or ``-``: many
    tools read ``-`` as standard output, but a pack is a file or folder on disk, written
    beside its destination, mapped and renamed into place, so it cannot go to a pipe. The
    Python API takes ``"-"`` as a file name, as ``open`` does; here ``./-`` says that."""
    if output == "":
        raise ValueError(
            "OUTPUT is empty: pass the .tser file (or shard folder) to write or, with "
            "--append, to grow, e.g. voc.tser, or a URL"
        )
    if output == "-":
        raise ValueError(
            "OUTPUT '-' is not standard output here: a pack cannot be written to a pipe (it is "
            "written to disk, mapped and renamed into place). Pass the .tser file (or shard "
            "folder) to write; for a file named '-' in this folder, pass ./-"
        )


def _remote_pack_exists(url: str, storage_options: dict[str, Any] | None) -> bool:
    from .errors import RemoteNotFoundError
    from .remote.store import RemoteStore

    store = RemoteStore(url, storage_options)
    try:
        store.size("" if url.rstrip("/").endswith(fmt.FILE_SUFFIX) else fmt.MANIFEST_NAME)
    except RemoteNotFoundError:
        return False
    return True


def _cmd_prune(args: argparse.Namespace) -> int:
    from .remote.upload import local_prune_refusal, prune_remote

    if not _is_url(args.url):
        raise ValueError(local_prune_refusal(args.url, f"run {PROG} prune"))
    stale = prune_remote(args.url, args.storage_options, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {len(stale)} file(s) of earlier packs under {args.url}")
    for name in stale:
        print(f"  {printable(name)}")
    return EXIT_OK


# -- cache --------------------------------------------------------------------------------------
def _cmd_cache(args: argparse.Namespace) -> int:
    from .remote.cache import cache_folder, clear_cache, list_cache

    folder = cache_folder(args.cache_dir)  # a file given as the folder is refused, named
    if args.action == "clear":
        done = clear_cache(args.cache_dir, url=args.url)
        if args.json:
            print(json.dumps(dataclasses.asdict(done), indent=1))
            return EXIT_OK
        print(
            f"removed {done.packs_removed} pack(s), {done.objects_removed} file(s), "
            f"{_mb(done.bytes_freed)} from {folder}"
            + (f"; {done.objects_in_use} file(s) in use were left" if done.objects_in_use else "")
        )
        return EXIT_OK
    packs = list_cache(args.cache_dir)
    if args.json:
        rows = [
            {
                "url": p.url,
                "identity": p.identity,
                "directory": str(p.directory),
                "objects": p.objects,
                "bytes": p.bytes,
                "last_used": p.last_used,
                "in_use": p.in_use,
                "partial_bytes": p.partial_bytes,
            }
            for p in packs
        ]
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    total = sum(p.bytes for p in packs)
    missing = "" if folder.exists() else " (no such folder yet: nothing cached)"
    print(f"{folder}: {len(packs)} pack(s), {_mb(total)}{missing}")
    for p in packs:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(p.last_used)) if p.last_used else "-"
        busy = f", {p.in_use} in use" if p.in_use else ""
        busy += f", {_mb(p.partial_bytes)} partly downloaded" if p.partial_bytes else ""
        print(
            printable(
                f"  {p.url}  [{p.identity[:12]}]  {p.objects} file(s), {_mb(p.bytes)}, "
                f"last used {used}{busy}"
            )
        )
    return EXIT_OK


#: The cache options of ``pack``, which only an append to a URL uses (dest -> flag).
_CACHE_OPTIONS = {"cache_dir": "--cache-dir", "cache_limit": "--cache-limit"}

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


def _cmd_append(args: argparse.Namespace) -> int:
    """``pack ROOT PACK --append``: ``append_voc``, and what it did."""
    from .voc.append import append_voc

    given = [flag for dest, flag in _PACK_ONLY.items() if getattr(args, dest)]
    if given:
        raise ValueError(
            f"{', '.join(given)} cannot be combined with --append: an append keeps the pack's "
            "own options (see `torch-serialized info OUTPUT`); re-pack to change them"
        )
    started = time.perf_counter()
    with _untyped_printed():
        result = append_voc(
            args.root,
            args.output,
            year=args.year,
            on_error="skip" if args.skip_bad else "raise",
            progress=_progress(args),
            workers=args.workers,
            replace_changed=args.replace_changed,
            checksum=args.checksum,
            max_file_bytes=args.max_file_size or DEFAULT_MAX_FILE_BYTES,
            retire_all=args.retire_all,
            storage_options=args.storage_options,
            cache_dir=args.cache_dir,
            cache_limit_bytes=args.cache_limit,
        )
    took = time.perf_counter() - started  # with a URL: staging, the append, the upload
    where = f"{result.url} (new files uploaded, manifest last)" if result.url else result.path
    print(f"appended to {where} from {result.voc_root}")
    print(f"  added    {result.added} new samples, {len(result.replaced)} changed samples replaced")
    print(f"  retired  {len(result.retired)} samples no longer listed in the source")
    print(
        f"  pack     {result.num_samples} samples, {_mb(result.num_bytes)} "
        f"{'at the URL' if result.url else 'on disk'} "
        f"({_mb(result.bytes_written)} written)"
    )
    print(f"  time     {result.seconds:.2f} s")
    if result.url:  # staged through the cache and grown locally: the transfers timed apart
        print(f"  transfer {max(took - result.seconds, 0.0):.2f} s (downloads and upload)")
    if result.skipped:
        report = f"{result.url}.skipped.json" if result.url else result.report
        print(f"  skipped  {len(result.skipped)} samples; reasons in {report}")
    _print_untyped(result.untyped)
    _print_unparsed(result.unparsed)
    for note in result.notes:
        print(f"  note     {note}")
    return EXIT_OK


# -- info ---------------------------------------------------------------------------------------
def _pack_info(path: str, remote: dict[str, Any]) -> dict[str, Any]:
    """Everything ``info`` shows, as JSON-ready values."""
    from .voc import schema
    from .voc.packed import VOCPackReader

    pack = VOCPackReader(path, **remote)
    reader, meta = pack.reader, pack.meta
    live = pack.live  # records an append retired are not samples
    columns = pack.columns[live]
    flags = columns["flags"].astype(np.int64)
    # from the catalog's class id of every object: no shard is read (a URL: none downloaded)
    classes, counts = pack.object_classes()
    alive = np.zeros(len(pack), dtype=bool)
    alive[live] = True
    per_class = np.bincount(classes[np.repeat(alive, counts)], minlength=len(pack.classes))
    histogram = Counter({pack.classes[c]: int(n) for c, n in enumerate(per_class.tolist()) if n})
    sizes = Counter(zip(columns["width"].tolist(), columns["height"].tolist()))
    num_objects = columns["num_objects"]
    major, minor = reader.version
    return {
        "path": reader.name,
        **({"cached_in": reader.path} if reader.url else {}),
        "format_version": f"{major}.{minor}",
        "schema": f"{meta.get('schema')} {meta.get('schema_version')}",
        "packed_by": meta.get("packed_by"),
        "year": pack.year,
        "base_dir": pack.base_dir,
        "options": {
            "image_storage": pack.image_storage,
            "max_size": meta.get("max_size"),
            **meta.get("options", {}),
        },
        "num_samples": len(live),
        "retired": len(pack) - len(live),
        "with_annotation": int(np.count_nonzero(flags & schema.HAS_ANNOTATION)),
        "with_mask": int(np.count_nonzero(flags & schema.HAS_MASK)),
        "with_object_mask": int(np.count_nonzero(flags & schema.HAS_OBJECT_MASK)),
        "with_untyped_objects": int(np.count_nonzero(flags & schema.UNTYPED_OBJECTS)),
        "with_unparsed_annotation": int(np.count_nonzero(flags & schema.UNPARSED_ANNOTATION)),
        "image_sets": meta.get("splits", {}),
        "classes": dict(histogram.most_common()),
        "class_counts": meta.get("class_counts", {}),
        "num_objects": int(num_objects.sum()),
        "objects_per_image": _range(num_objects, mean=True),
        "width": _range(columns["width"]),
        "height": _range(columns["height"]),
        "common_sizes": [[w, h, n] for (w, h), n in sizes.most_common(5)],
        "bytes": reader.nbytes,
        "source_bytes": meta.get("source_bytes"),
        "sharded": reader.manifest is not None,
        "shards": [  # records: stored; samples: those a reader shows (not retired)
            {"file": entry.file, "records": entry.num_records, "samples": n, "bytes": entry.bytes}
            for entry, n in zip(
                reader.entries, np.diff(np.searchsorted(live, reader.starts)).tolist()
            )
        ],
        "skipped": meta.get("skipped", []),
        "history": meta.get("history", []),
    }


def _history_line(entry: dict[str, Any]) -> str:
    """One pack or append of a pack's history, as ``info`` shows it."""
    when = entry.get("at") or "(time not recorded)"
    what = f"{entry.get('action')}  {when}  {entry.get('records')} samples"
    if entry.get("action") == "append":
        what += (
            f" (+{entry.get('added')} new, {entry.get('replaced')} replaced, "
            f"{entry.get('retired')} retired)"
        )
    return f"{what}  by {entry.get('by')}"


def _range(values: np.ndarray, *, mean: bool = False) -> dict[str, Any]:
    if values.size == 0:
        return {"min": None, "max": None, **({"mean": None} if mean else {})}
    out: dict[str, Any] = {"min": int(values.min()), "max": int(values.max())}
    if mean:
        out["mean"] = round(float(values.mean()), 3)
    return out


def _member(path: str) -> Member | None:
    """What ``path`` is when it is a shard or catalog file of a shard folder, else None."""
    from .container.reader import member_of, read_binding

    if _is_url(path) or not Path(path).is_file():
        return None
    return member_of(path, read_binding(path))


def _member_info(path: str, member: Member) -> dict[str, Any]:
    """What ``info`` shows for one shard or catalog file: where it belongs and what it holds."""
    from .container.reader import ContainerReader

    reader = ContainerReader(path)
    try:
        records = len(reader)
    finally:
        reader.close()
    where: dict[str, Any] = {"catalog_of": member.folder}
    if member.role == fmt.ROLE_SHARD:
        where = {"shard_of": member.folder, "shard": member.index, "num_shards": member.num_shards}
    return {
        "path": str(path),
        **where,
        # named by the folder's manifest; false: an earlier version's, or outside its folder
        "current": member.num_shards is not None,
        "records": records,
        "bytes": os.path.getsize(path),
    }


def _cmd_info(args: argparse.Namespace) -> int:
    member = _member(args.path)
    if member is not None:  # one piece of a pack: describe the piece, point at the pack
        info = _member_info(args.path, member)
        if args.json:
            print(json.dumps(info, indent=1, ensure_ascii=False))
            return EXIT_OK
        label = "shard" if member.role == fmt.ROLE_SHARD else "catalog"
        if member.num_shards is not None:
            place = (
                f"{member.index + 1} of {member.num_shards} of the pack"
                if member.role == fmt.ROLE_SHARD and member.index is not None
                else "of the pack"
            )
            place += f" {member.folder} (its manifest.json names it)"
        elif member.folder is not None:  # kept by an append for readers that opened it
            place = (
                f"of an earlier version of the pack at {member.folder} (an append kept it "
                "for the readers that opened that version; its manifest.json names another)"
            )
        else:
            place = "of a shard folder (its metadata says so; it is not in that folder)"
        whole = (
            f"{PROG} info {member.folder}"
            if member.folder is not None
            else "the folder with its manifest.json"
        )
        print(
            printable(
                f"{info['path']}\n"
                f"  {label:<12} {place}\n"
                f"  holds        {info['records']} records, {_mb(info['bytes'])}\n"
                f"The dataset is the whole folder: {whole}"
            )
        )
        return EXIT_OK
    info = _pack_info(args.path, _remote(args))
    if args.json:  # JSON escapes C0 controls itself; the rest become \\u escapes
        print(printable(json.dumps(info, indent=1, ensure_ascii=False), json_text=True))
        return EXIT_OK
    options = ", ".join(f"{k}={v}" for k, v in info["options"].items())
    sets = "; ".join(
        f"{task}: " + ", ".join(f"{name} {n}" for name, n in lists.items())
        for task, lists in info["image_sets"].items()
    )
    w, h = info["width"], info["height"]
    common = ", ".join(f"{cw}x{ch} ({n})" for cw, ch, n in info["common_sizes"])
    per = info["objects_per_image"]
    source = info["source_bytes"]
    ratio = f" ({info['bytes'] / source:.1%} of the {_mb(source)} source)" if source else ""
    shards = info["shards"]
    lines = [
        f"{info['path']}",
        f"  format       torch_serialized {info['format_version']}, schema {info['schema']}, "
        f"packed by {info['packed_by']}",
        f"  dataset      VOC{info['year']} (torchvision root + {info['base_dir']})",
        f"  options      {options}",
        f"  samples      {info['num_samples']} ({info['with_annotation']} annotated, "
        f"{info['with_mask']} with class mask, {info['with_object_mask']} with object mask)",
        f"  image sets   {sets}",
        f"  image size   width {w['min']}-{w['max']}, height {h['min']}-{h['max']}; "
        f"most common {common}",
        f"  objects      {info['num_objects']}, {per['min']}-{per['max']} per image "
        f"(mean {per['mean']})"
        + (", untyped samples counted as 0" if info["with_untyped_objects"] else ""),
        f"  on disk      {_mb(info['bytes'])} in {_files(len(shards), info['sharded'])}{ratio}",
    ]
    if info["sharded"]:
        lines += [
            f"    {s['file']}  {s['samples']} samples"
            + (f" ({s['records'] - s['samples']} retired)" if s["records"] > s["samples"] else "")
            + f"  {_mb(s['bytes'])}"
            for s in shards
        ]
    if info["retired"]:
        lines.append(
            f"  retired      {info['retired']} records replaced or dropped by appends (their "
            "bytes stay until the next full pack)"
        )
    if info["skipped"]:
        lines.append(f"  skipped      {len(info['skipped'])} samples at pack time")
    if info["with_untyped_objects"]:
        lines.append(
            f"  untyped      {info['with_untyped_objects']} samples whose objects have no box "
            "rows (target_format='tv_tensors' raises for them)"
        )
    if info["with_unparsed_annotation"]:
        lines.append(
            f"  unparsed     {info['with_unparsed_annotation']} segmentation-only samples whose "
            "annotation XML did not parse (stored as the files' bytes, no target)"
        )
    if info["history"]:
        lines.append("  history")
        lines += [f"    {_history_line(entry)}" for entry in info["history"]]
    if info["classes"]:
        lines.append("  classes      (objects in all samples)")
        top = max(info["classes"].values())
        width = max(len(name) for name in info["classes"])
        for name, count in info["classes"].items():
            bar = "#" * max(1, round(30 * count / top))
            lines.append(f"    {name:<{width}} {count:>7}  {bar}")
    print("\n".join(printable(line) for line in lines))
    return EXIT_OK


# -- verify -------------------------------------------------------------------------------------
def _cmd_verify(args: argparse.Namespace) -> int:
    from .container.reader import PackReader, member_of
    from .voc import schema
    from .voc.packed import check_record_fields, check_voc_pack

    started = time.perf_counter()
    try:
        # checks header, footer, metadata, index and arrays (a URL: downloads and checks all)
        # ``check_records``: each shard's columns against its fields (a VOC pack's; a no-op
        # for other files)
        reader = PackReader(args.path, check_records=check_record_fields, **_remote(args))
    except (TorchSerializedError, OSError) as exc:
        message = _describe(exc)
        _error(message if str(args.path) in message else f"cannot open {args.path}: {message}")
        return EXIT_ERROR
    bad: list[int] = []
    bad_shards: list[str] = []  # shards that fail their own checks: every record is suspect
    # one file of a shard folder (a shard, a catalog, one kept for readers) is no VOC pack alone
    member = None if reader.manifest is not None else member_of(reader.name, reader.binding)
    voc = reader.user.get("schema") == schema.SCHEMA and member is None
    bad_voc = None  # a VOC pack whose metadata every VOC reader refuses
    if voc:
        try:
            check_voc_pack(reader)
        except FormatError as exc:
            bad_voc = _describe(exc)
    for s, start in enumerate(reader.starts[:-1].tolist()):
        try:
            shard = reader.shard(s)
        except (TorchSerializedError, OSError) as exc:
            bad_shards.append(_describe(exc))
            continue
        bad.extend(start + i for i in shard.verify())
    seconds = time.perf_counter() - started
    made_of = _files(reader.num_shards, reader.manifest is not None)
    where = f"{reader.name} ({len(reader)} records in {made_of})"
    if not bad and not bad_shards and bad_voc is None:
        print(
            printable(
                f"OK {where}: header, footer, metadata{', VOC metadata' if voc else ''}, index, "
                "arrays and all "
                f"{len(reader) * len(reader.fields)} field checksums match "
                f"({_mb(reader.nbytes)} in {seconds:.2f} s)"
            )
        )
        if member is not None:
            whole = f"{PROG} verify {member.folder}" if member.folder else "verifying its folder"
            print(printable(f"This file is {member}; {whole} checks the whole pack."))
        return EXIT_OK
    lines = []
    if bad_voc is not None:
        lines.append(f"FAILED {where}: VOC readers refuse it")
        lines.append(f"  {' '.join(bad_voc.split())}")
    if bad_shards:
        lines.append(f"FAILED {where}: {len(bad_shards)} damaged shard(s)")
        lines += [f"  {' '.join(message.split())}" for message in bad_shards]
    if bad:
        lines.append(f"FAILED {where}: {len(bad)} damaged record(s)")
        lines += _damaged_records(args.path, reader, bad, _remote(args))
    lines.append("Re-copy the pack or re-pack the dataset.")
    print("\n".join(printable(line) for line in lines))
    return EXIT_DAMAGED


def _damaged_records(
    path: str, reader: PackReader, bad: list[int], remote: dict[str, Any]
) -> list[str]:
    """One line per damaged record: its id when the pack is a readable VOC pack, its shard,
    and the fields that fail their checksum."""
    from .container.reader import PackReader
    from .voc.packed import VOCPackReader

    try:
        ids: Callable[[int], str] | None = VOCPackReader(path, **remote).id
    except (TorchSerializedError, OSError):
        ids = None
    checked = PackReader(path, checked=True, **remote)
    lines = []
    for record in bad:
        failing = []
        for k, name in enumerate(reader.fields):
            try:
                checked.field(record, k)
            except ChecksumError:
                failing.append(name)
        shard, local = reader.locate(record)
        label = f"record {record}"
        if ids is not None:
            label += f" (id {_safe_id(ids, record)})"
        if reader.num_shards > 1:
            label += f" [{os.path.basename(shard.path)} record {local}]"
        lines.append(f"  {label}: field(s) {', '.join(failing)} fail their checksum")
    return lines


def _safe_id(ids: Callable[[int], str], record: int) -> str:
    try:
        return repr(ids(record))
    except (UnicodeDecodeError, IndexError, ValueError):
        return "unreadable"


# -- export -------------------------------------------------------------------------------------
def _cmd_export(args: argparse.Namespace) -> int:
    from .voc.export import export_voc
    from .voc.packed import VOCPackReader

    started = time.perf_counter()
    remote = _remote(args)
    folder = export_voc(
        args.path, args.out_root, overwrite=args.overwrite, progress=_progress(args), **remote
    )
    seconds = time.perf_counter() - started
    pack = VOCPackReader(args.path, **remote)
    print(
        f"exported {len(pack.live)} samples and {len(pack.files())} list files to {folder} in "
        f"{seconds:.2f} s; torchvision reads it with root={str(args.out_root)!r}, "
        f"year={pack.year!r}"
    )
    return EXIT_OK


# -- bench and demo -----------------------------------------------------------------------------
def _cmd_bench(args: argparse.Namespace) -> int:
    from .tools import run_benchmark

    options = {
        "year": args.year,
        "num_images": args.num_images,
        "repeats": args.repeats,
        "workers": args.workers,
        "work_dir": args.work_dir,
        "scenarios": [s.strip() for s in args.scenarios.split(",")] if args.scenarios else None,
    }
    kwargs = {name: value for name, value in options.items() if value is not None}
    result = run_benchmark(args.root, quick=args.quick, out_dir=args.out_dir, **kwargs)
    if args.out_dir is None:
        print("(nothing saved: --out-dir DIR writes results.md, results.json and a chart)")
    else:
        out_dir = Path(args.out_dir)
        print(f"results written to {out_dir / 'results.md'} and results.json", end="")
        print(f", chart {result['chart']}" if result.get("chart") else "")
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from .tools import run_demo

    run_demo(
        num_images=args.num_images,
        workers=args.workers,
        directory=args.dir,
        batch_size=args.batch_size,
    )
    return EXIT_OK


# -- parser and entry point ---------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show the full traceback of an error",
    )
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Pack a Pascal VOC devkit into one file (or shards) and read it fast.",
        epilog=f"Run '{PROG} COMMAND --help' for the options of a command.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"{PROG} {__version__} (file format {fmt.FORMAT_MAJOR}.{fmt.FORMAT_MINOR})",
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(
        name: str, help: str, description: str, *, url: bool = False, cache: bool = True
    ) -> argparse.ArgumentParser:
        """A command; ``url``: it takes URLs (``--storage-options``), and with ``cache`` reads
        them through the cache (``--cache-dir``, ``--cache-limit``)."""
        parser = commands.add_parser(name, help=help, description=description, parents=[common])
        if url:
            _remote_options(parser, cache=cache)
        return parser

    pack = command(
        "pack",
        "pack a VOCdevkit into a .tser file or a shard folder",
        "Pack every id listed in ImageSets/Main and ImageSets/Segmentation (images, XML, "
        "masks and list files) into OUTPUT. With a shard option OUTPUT is a folder of "
        "shards, a catalog and manifest.json. The output appears atomically when packing "
        "succeeds. An existing OUTPUT is replaced only with --overwrite (as export), and only "
        "if it is a pack torch_serialized wrote. With --append, OUTPUT is an existing pack "
        "brought up to date with ROOT at the cost of what changed (README: Updating a pack). "
        "OUTPUT may be a URL (s3://bucket/prefix/voc): the pack is written to a temporary "
        "folder, then uploaded with its manifest last; with --append only its new files go "
        "up, then the manifest (https:// URLs are read-only).",
        url=True,
    )
    pack.add_argument("root", help="torchvision's root (holding VOCdevkit/) or VOC20xx itself")
    pack.add_argument("output", help="the .tser file (or shard folder) to write, or a URL")
    pack.add_argument(
        "--year",
        help="VOC year, e.g. 2007 (default: the one VOC<year> folder under ROOT; "
        "required when there are several)",
    )
    limit = pack.add_mutually_exclusive_group()
    limit.add_argument(
        "--shards",
        type=_positive_int,
        metavar="N",
        help="write N shards, their sample counts differing by at most one (one a sample "
        "when there are fewer than N; samples --skip-bad leaves out make theirs smaller)",
    )
    limit.add_argument(
        "--shard-size",
        type=parse_size,
        metavar="SIZE",
        help="start a new shard before one exceeds SIZE (e.g. 256MB, 1GiB)",
    )
    limit.add_argument(
        "--samples-per-shard", type=_positive_int, metavar="N", help="at most N samples a shard"
    )
    pack.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        metavar="N",
        help="processes reading and parsing the source (default 1; output is identical)",
    )
    pack.add_argument(
        "--image-storage",
        choices=("original", "raw"),
        default=None,
        help="original: the JPEG bytes, byte-exact (default); raw: decoded RGB pixels",
    )
    pack.add_argument(
        "--max-size",
        type=_positive_int,
        metavar="PX",
        help="shrink images whose longer side exceeds PX (boxes scaled; not byte-exact)",
    )
    pack.add_argument(
        "--check-images", action="store_true", help="decode every image while packing"
    )
    pack.add_argument(
        "--skip-bad",
        action="store_true",
        help="leave out unreadable samples (listed in OUTPUT.skipped.json) instead of failing",
    )
    pack.add_argument(
        "--overwrite", action="store_true", help="replace OUTPUT if it exists (a pack only)"
    )
    pack.add_argument(
        "--max-file-size",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="refuse a source file larger than SIZE (default 1GiB; e.g. 4GiB)",
    )
    pack.add_argument(
        "--append",
        action="store_true",
        help="bring the existing pack OUTPUT up to date with ROOT: pack new ids, keep "
        "unchanged ones, retire ids no longer listed (the pack's own options are used)",
    )
    pack.add_argument(
        "--replace-changed",
        action="store_true",
        help="with --append: store new versions of packed ids whose files changed (otherwise "
        "an error names them)",
    )
    pack.add_argument(
        "--checksum",
        action="store_true",
        help="with --append: compare every packed file's content, not only sizes and times",
    )
    pack.add_argument(
        "--retire-all",
        action="store_true",
        help="with --append: accept a ROOT that lists none of the pack's ids (every sample "
        "retired; refused otherwise, as most likely the wrong folder)",
    )
    pack.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar (shown only on a terminal)"
    )
    pack.set_defaults(run=_cmd_pack)

    info = command(
        "info",
        "describe a pack",
        "Show format version, packing options, samples per image set, class histogram, "
        "image size range, bytes on disk and shards of a pack.",
        url=True,
    )
    info.add_argument("path", help="a .tser file or shard folder, or its URL")
    info.add_argument("--json", action="store_true", help="print one JSON object instead")
    info.set_defaults(run=_cmd_info)

    verify = command(
        "verify",
        "check every checksum of a pack",
        "Check header, footer, metadata, index, arrays and the checksum of every field of "
        "every record. Exit status: 0 when all is well, 1 when records are damaged (each "
        "is named), 2 when the file cannot be opened at all. A URL is downloaded into the "
        "cache (each file checked in full before it enters the cache).",
        url=True,
    )
    verify.add_argument("path", help="a .tser file or shard folder, or its URL")
    verify.set_defaults(run=_cmd_verify)

    export = command(
        "export",
        "rebuild the VOCdevkit folder from a pack",
        "Write OUT_ROOT/VOCdevkit/VOC20xx/ (images, annotations, masks, ImageSets lists) "
        "byte for byte as packed. Only packs with --image-storage original and no "
        "--max-size can be exported. Existing files are replaced only with --overwrite "
        "(as pack).",
        url=True,
    )
    export.add_argument("path", help="a .tser file or shard folder, or its URL")
    export.add_argument("out_root", help="folder to write into (torchvision's root)")
    export.add_argument(
        "--overwrite", action="store_true", help="replace files that exist in OUT_ROOT"
    )
    export.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar (shown only on a terminal)"
    )
    export.set_defaults(run=_cmd_export)

    from tsbench.core import OPTIONAL_SCENARIOS, SCENARIOS

    bench = command(
        "bench",
        "compare reading speed with torchvision's VOCDetection",
        "Benchmark torch_serialized against torchvision on ROOT (any VOC-format dataset), "
        "or on a generated synthetic VOC set when ROOT is not given "
        "(torch_serialized.tools.run_benchmark). Prints the table; files are written only "
        "with --out-dir.",
    )
    bench.add_argument("root", nargs="?", help="torchvision's VOC root (default: synthetic data)")
    bench.add_argument(
        "--year", help="VOC year of ROOT (default: the one VOC<year> folder under ROOT)"
    )
    bench.add_argument("--num-images", type=_positive_int, metavar="N", help="synthetic images")
    bench.add_argument("--repeats", type=_positive_int, metavar="N", help="timed repeats")
    bench.add_argument("--workers", type=_non_negative_int, metavar="N", help="DataLoader workers")
    bench.add_argument("--quick", action="store_true", help="a small, fast run")
    bench.add_argument(
        "--out-dir", metavar="DIR", help="write results.md/.json/.png here (default: none)"
    )
    bench.add_argument("--work-dir", metavar="DIR", help="keep generated data and packs here")
    bench.add_argument(
        "--scenarios",
        metavar="A,B",
        help=f"comma-separated subset to run, of: {', '.join(SCENARIOS)} (default: all), "
        f"or {', '.join(OPTIONAL_SCENARIOS)} (only when asked: a pack streamed from a "
        "loopback S3 server through a 20 ms / 100 MB/s proxy)",
    )
    bench.set_defaults(run=_cmd_bench)

    cache = command(
        "cache",
        "list or clear the local cache of remote packs",
        "list: every pack in the cache (URL, identity, files, bytes, last use, files in use). "
        "clear: delete cached packs (only those of --url if given); files some process reads "
        "or downloads right now are left.",
    )
    cache.add_argument("action", choices=("list", "clear"))
    cache.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="the cache folder (default: $TORCH_SERIALIZED_CACHE, else ~/.cache/torch_serialized)",
    )
    cache.add_argument("--url", help="clear: only the packs of this URL")
    cache.add_argument("--json", action="store_true", help="print JSON instead")
    cache.set_defaults(run=_cmd_cache)

    prune = command(
        "prune",
        "delete the files earlier packs left at a URL",
        "A pack written to a URL over an earlier one leaves the earlier shards and catalog in "
        "place, so readers that opened it keep working. Delete the shard and catalog files "
        "that the current manifest does not name, once no reader of an earlier pack is left. "
        "A pack at a local path needs none: a re-pack replaces its files.",
        url=True,
        cache=False,
    )
    prune.add_argument("url", help="the shard folder's URL")
    prune.add_argument("--dry-run", action="store_true", help="list, delete nothing")
    prune.set_defaults(run=_cmd_prune)

    demo = command(
        "demo",
        "generate a sample, pack it, check it and time it against torchvision (start here)",
        "Generate the built-in synthetic VOC sample, pack it, check samples against "
        "torchvision's VOCDetection, then time both side by side: bytes-level reads (warm "
        "and with the page cache dropped), decoded images (the PIL drop-in and "
        "decode='tensor') and DataLoader epochs with warm workers. Medians of repeated runs "
        "with their range; overlapping ranges are reported as within noise. Under a "
        "minute on 2 cores.",
    )
    demo.add_argument(
        "--num-images", type=_positive_int, default=200, metavar="N", help="default 200"
    )
    demo.add_argument(
        "--workers", type=_non_negative_int, default=2, metavar="N", help="DataLoader workers"
    )
    demo.add_argument("--batch-size", type=_positive_int, default=16, metavar="N")
    demo.add_argument("--dir", metavar="DIR", help="keep the data here (default: a temp folder)")
    demo.set_defaults(run=_cmd_demo)
    return parser


def _remote_options(parser: argparse.ArgumentParser, *, cache: bool) -> None:
    """The options of a command that takes URLs (read by ``_remote``); ``cache``: with the
    cache's, for commands that read a pack through it."""
    group = parser.add_argument_group("packs at URLs (s3://, gs://, https://...)")
    group.add_argument(
        "--storage-options",
        type=_storage_options,
        metavar="JSON",
        help='fsspec options as a JSON object, e.g. \'{"endpoint_url": "http://..."}\' '
        "(default: the backend's usual configuration)",
    )
    if not cache:
        return
    group.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="local cache of remote packs (default: $TORCH_SERIALIZED_CACHE, else "
        "~/.cache/torch_serialized)",
    )
    group.add_argument(
        "--cache-limit",
        type=parse_size,
        metavar="SIZE",
        help="bound the cache (e.g. 20GB); least recently used files no process reads go first",
    )


def printable(text: str, *, json_text: bool = False) -> str:
    """``text`` with every character a terminal could act on escaped (``\\x1b``, ``\\u202e``):
    C0 and C1 controls, DEL, format characters (bidirectional overrides...), line or paragraph
    separators, unassigned and private code points. A pack's metadata is untrusted; what
    ``info`` prints of it must not move the cursor, recolour the terminal or reorder the text
    around it. ``json_text``: escapes as JSON spells them (``\\u001b``), for JSON output."""
    return _UNPRINTABLE.sub(functools.partial(_escape, json_text=json_text), text)


#: C0 controls but the newline, DEL and C1 controls; any other non-ASCII character is looked
#: up (``_escape``), which keeps the scan cheap for ASCII text.
_UNPRINTABLE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]|[^\x00-\x7f]")


def _escape(match: re.Match[str], *, json_text: bool) -> str:
    char = match.group()
    code = ord(char)
    if code > 0x9F and unicodedata.category(char) not in ("Cf", "Zl", "Zp", "Cs", "Co", "Cn"):
        return char  # a printable letter, digit, mark or symbol of any script
    if code < 0x100 and not json_text:
        return f"\\x{code:02x}"
    units = char.encode("utf-16-be", "surrogatepass")  # a surrogate pair above U+FFFF, as JSON
    return "".join(f"\\u{units[i] << 8 | units[i + 1]:04x}" for i in range(0, len(units), 2))


def _error(message: str) -> None:
    print(f"{PROG}: error: {printable(' '.join(message.split()))}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _parser().parse_args(argv)
    try:
        status: int = args.run(args)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (``info PACK | head``): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        if args.debug:
            raise
        _error("interrupted")
        return 130
    except (TorchSerializedError, OSError, ValueError) as exc:
        if args.debug:
            raise
        _error(_describe(exc))
        return EXIT_ERROR
    return status


def _describe(exc: BaseException) -> str:
    """The message of an error, without ``[Errno N]`` and with the file an OSError names."""
    if isinstance(exc, OSError) and exc.strerror:
        if exc.filename is not None and str(exc.filename) not in exc.strerror:
            return f"{exc.filename}: {exc.strerror}"
        return exc.strerror
    return str(exc) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
