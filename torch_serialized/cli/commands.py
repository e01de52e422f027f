"""One function per command (``cmd_<name>``): call the library, print what it answered, return
the exit status (errors propagate to ``main``). Refused here, as no library call can:
``pack`` options that mean nothing together (``append_voc`` takes no shard options)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from typing import Any

from ..container import spec as fmt
from ..container.fileio import DEFAULT_MAX_FILE_BYTES
from ..errors import UntypedObjectsWarning
from ..remote.store import is_url

PROG = "torch-serialized"
EXIT_OK, EXIT_DAMAGED, EXIT_ERROR = 0, 1, 2


def printable(text: str) -> str:
    """``text`` with non-printables but newlines escaped as Python writes them (``\\x1b``,
    ``\\u202e``): a pack's metadata is untrusted and must not move the cursor or reorder text."""
    escaped = (
        c if c.isprintable() or c == "\n" else c.encode("unicode_escape").decode() for c in text
    )
    return "".join(escaped)


def say(*lines: str) -> None:
    """Print ``lines``, escaped (``printable``): they may hold a pack's metadata."""
    print("\n".join(printable(line) for line in lines))


def plural(count: int, noun: str) -> str:
    """``"1 sample"``, ``"2 samples"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def files(count: int, sharded: bool) -> str:
    """What a pack is made of: "1 file" (a ``.tser``), "1 shard", "8 shards" (a folder)."""
    return plural(count, "shard") if sharded else "1 file"


def mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:,.1f} MB"


def progress(args: argparse.Namespace) -> bool:
    """A progress bar only on a terminal (in a log each update is one more line), never -q."""
    return not args.quiet and sys.stderr.isatty()


def remote(args: argparse.Namespace) -> dict[str, Any]:
    """The reader keywords of the remote options (``--storage-options``, the cache's)."""
    return dict(
        storage_options=args.storage_options,
        cache_dir=args.cache_dir,
        cache_limit_bytes=args.cache_limit,
    )


#: ``pack`` options an append cannot take (it keeps the pack's own), and ``--append``'s.
_PACK_ONLY = ["shards", "shard_size", "samples_per_shard", "image_storage", "max_size"]
_PACK_ONLY += ["check_images", "overwrite"]
_APPEND_ONLY = ["replace_changed", "checksum", "retire_all"]


def _given(args: argparse.Namespace, dests: list[str]) -> list[str]:
    """The options of ``dests`` given on the command line, as typed (``--shard-size``)."""
    return ["--" + d.replace("_", "-") for d in dests if getattr(args, d) not in (None, False)]


def cmd_pack(args: argparse.Namespace) -> int:
    """``pack ROOT OUTPUT``: ``pack_voc`` (``append_voc`` with ``--append``)."""
    cache = _given(args, ["cache_dir", "cache_limit"])
    if cache and not (args.append and is_url(args.output)):
        raise ValueError(
            f"{' and '.join(cache)} only {'applies' if len(cache) == 1 else 'apply'} with "
            "--append to a URL, which stages the pack through the cache: a pack is written "
            "in $TMPDIR and uploaded, and a local pack is appended to in place"
        )
    given = _given(args, _PACK_ONLY if args.append else _APPEND_ONLY)
    if given and args.append:
        raise ValueError(
            f"{', '.join(given)} cannot be combined with --append: an append keeps the pack's "
            "own options (see `torch-serialized info OUTPUT`); re-pack to change them"
        )
    if given:
        raise ValueError(f"{', '.join(given)} only applies with --append")
    options: dict[str, Any] = dict(
        year=args.year,
        workers=args.workers,
        on_error="skip" if args.skip_bad else "raise",
        progress=progress(args),
        max_file_bytes=args.max_file_size or DEFAULT_MAX_FILE_BYTES,
    )
    with warnings.catch_warnings():  # the summary says it, not a warning too
        warnings.simplefilter("ignore", UntypedObjectsWarning)
        return (_append if args.append else _pack)(args, options)


def _pack(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from ..container.shards import open_pack
    from ..voc.pack import pack_voc

    started = time.perf_counter()
    result = pack_voc(
        args.root,
        args.output,
        max_samples_per_shard=args.samples_per_shard,
        max_shard_bytes=args.shard_size,
        num_shards=args.shards,
        image_storage=args.image_storage or "original",
        max_size=args.max_size,
        check_images=args.check_images,
        storage_options=args.storage_options,
        overwrite=args.overwrite,
        **options,
    )
    upload = max(time.perf_counter() - started - result.seconds, 1e-9)  # after the packing
    seconds, size = max(result.seconds, 1e-9), result.num_bytes
    ratio = f"{size / result.source_bytes:.1%}" if result.source_bytes else "n/a"
    how = "as asked" if args.year else "found in the folder names; --year picks another"
    output = f"{result.url} (uploaded, manifest last)"
    if not result.url:
        packed = open_pack(result.path)
        output = f"{result.path} ({files(packed.num_shards, packed.manifest is not None)})"
    print(f"packed {plural(result.num_samples, 'sample')} of {result.voc_root}")
    _rows(
        year=f"{result.year} ({how})",
        output=output,
        size=f"{mb(size)}, {ratio} of the {mb(result.source_bytes)} source files",
        time=f"{result.seconds:.2f} s: {result.num_samples / seconds:,.0f} samples/s, "
        f"{size / seconds / 1e6:,.0f} MB/s",
        upload=f"{upload:.2f} s: {size / upload / 1e6:,.1f} MB/s" if result.url else None,
    )
    _print_outcome(result)
    if args.shards is not None and result.num_samples < args.shards:
        _rows(
            note=f"--shards {args.shards} asked, but only {plural(result.num_samples, 'sample')} "
            "packed: one shard each"
        )
    return EXIT_OK


def _rows(**rows: str | None) -> None:
    """The lines of a summary, ``  label    value``; a row whose value is None is left out."""
    for label, value in rows.items():
        if value is not None:
            print(f"  {label:<8} {value}")


def _append(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from ..voc.append import append_voc

    started = time.perf_counter()
    result = append_voc(
        args.root,
        args.output,
        replace_changed=args.replace_changed,
        checksum=args.checksum,
        retire_all=args.retire_all,
        **remote(args),
        **options,
    )
    transfer = max(time.perf_counter() - started - result.seconds, 0.0)  # with a URL
    where = f"{result.url} (new files uploaded, manifest last)" if result.url else result.path
    print(f"appended to {where} from {result.voc_root}")
    _rows(
        added=f"{plural(result.added, 'new sample')}, "
        f"{plural(len(result.replaced), 'changed sample')} replaced",
        retired=f"{plural(len(result.retired), 'sample')} no longer listed in the source",
        pack=f"{plural(result.num_samples, 'sample')}, {mb(result.num_bytes)} "
        f"{'at the URL' if result.url else 'on disk'} ({mb(result.bytes_written)} written)",
        time=f"{result.seconds:.2f} s",
        transfer=f"{transfer:.2f} s (downloads and upload)" if result.url else None,
    )
    _print_outcome(result)
    for note in result.notes:
        _rows(note=note)
    return EXIT_OK


def _print_outcome(result: Any) -> None:
    """Samples skipped, and those packed without a usable target (the first ids, a reason)."""
    if result.skipped:
        report = f"{result.url}.skipped.json" if result.url else result.report
        _rows(skipped=f"{plural(len(result.skipped), 'sample')}; reasons in {report}")
    for label, why, noun, what in (
        ("untyped", result.untyped, "sample", _UNTYPED),
        ("unparsed", result.unparsed, "segmentation-only sample", _UNPARSED),
    ):
        if why:
            ids = list(why)
            named = ", ".join(repr(i) for i in ids[:3]) + (", ..." if len(ids) > 3 else "")
            said = f"{plural(len(ids), noun)} ({named}) {what}. The first: {why[ids[0]]}"
            _rows(**{label: said})


_UNTYPED = "whose objects fit no tv_tensors target (target_format='tv_tensors' raises for them)"
_UNPARSED = "whose annotation XML did not parse: packed with no target (VOCSegmentation reads none)"


def cmd_prune(args: argparse.Namespace) -> int:
    from ..remote.upload import prune_remote

    stale = prune_remote(args.url, args.storage_options, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {len(stale)} file(s) of earlier packs under {args.url}")
    for name in stale:
        print(f"  {printable(name)}")
    return EXIT_OK


def cmd_cache(args: argparse.Namespace) -> int:
    from ..remote.cache import cache_folder, clear_cache, list_cache

    folder = cache_folder(args.cache_dir)  # a file given as the folder is refused, named
    if args.action == "clear":
        done = clear_cache(args.cache_dir, url=args.url)
        if args.json:
            return _json(dataclasses.asdict(done))
        print(
            f"removed {done.packs_removed} pack(s), {done.objects_removed} file(s), "
            f"{mb(done.bytes_freed)} from {folder}"
            + (f"; {done.objects_in_use} file(s) in use were left" if done.objects_in_use else "")
        )
        return EXIT_OK
    packs = list_cache(args.cache_dir)
    if args.json:
        return _json([dataclasses.asdict(p) for p in packs])
    missing = "" if folder.exists() else " (no such folder yet: nothing cached)"
    print(f"{folder}: {len(packs)} pack(s), {mb(sum(p.bytes for p in packs))}{missing}")
    for p in packs:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(p.last_used)) if p.last_used else "-"
        busy = f", {p.in_use} in use" if p.in_use else ""
        busy += f", {mb(p.partial_bytes)} partly downloaded" if p.partial_bytes else ""
        say(
            f"  {p.url}  [{p.identity[:12]}]  {p.objects} file(s), {mb(p.bytes)}, "
            f"last used {used}{busy}"
        )
    return EXIT_OK


def _json(value: Any) -> int:
    """Print ``value`` as JSON (paths as strings), all but ASCII escaped: metadata is untrusted."""
    print(json.dumps(value, indent=1, default=str))
    return EXIT_OK


def cmd_info(args: argparse.Namespace) -> int:
    from ..summary import info, part_info

    part = part_info(args.path)
    if part is not None:  # one piece of a pack: describe the piece, point at the pack
        return _part(part, args.json)
    about = info(args.path, **remote(args))
    if args.json:
        return _json(dataclasses.asdict(about))
    options = ", ".join(f"{k}={v}" for k, v in about.options.items())
    sets = "; ".join(
        f"{task}: " + ", ".join(f"{name} {n}" for name, n in lists.items())
        for task, lists in about.image_sets.items()
    )
    w, h, per = about.width, about.height, about.objects_per_image
    common = ", ".join(f"{cw}x{ch} ({n})" for cw, ch, n in about.common_sizes)
    source = about.source_bytes
    ratio = f" ({about.bytes / source:.1%} of the {mb(source)} source)" if source else ""
    untyped = about.with_untyped_objects
    lines = [
        about.path,
        f"  format       torch_serialized {about.format_version}, schema {about.schema}, "
        f"packed by {about.packed_by}",
        f"  dataset      VOC{about.year} (torchvision root + {about.base_dir})",
        f"  options      {options}",
        f"  samples      {about.num_samples} ({about.with_annotation} annotated, "
        f"{about.with_mask} with class mask, {about.with_object_mask} with object mask)",
        f"  image sets   {sets}",
        f"  image size   width {w['min']}-{w['max']}, height {h['min']}-{h['max']}; "
        f"most common {common}",
        f"  objects      {about.num_objects}, {per['min']}-{per['max']} per image "
        f"(mean {per['mean']})" + (", untyped samples counted as 0" if untyped else ""),
        f"  on disk      {mb(about.bytes)} in {files(len(about.shards), about.sharded)}{ratio}",
    ]
    if about.sharded:
        lines += [
            f"    {s.file}  {plural(s.samples, 'sample')}"
            + (f" ({s.records - s.samples} retired)" if s.records > s.samples else "")
            + f"  {mb(s.bytes)}"
            for s in about.shards
        ]
    notes = [
        ("retired", about.retired, "record", "replaced or dropped by appends (re-pack to free)"),
        ("skipped", len(about.skipped), "sample", "at pack time"),
        ("untyped", untyped, "sample", _UNTYPED),
        ("unparsed", about.with_unparsed_annotation, "segmentation-only sample", _UNPARSED),
    ]
    lines += [f"  {k:<12} {plural(n, noun)} {what}" for k, n, noun, what in notes if n]
    if about.history:  # each pack and append: when, how many added/replaced/retired, by whom
        lines.append("  history")
        lines += ["    " + ", ".join(f"{k} {v}" for k, v in e.items()) for e in about.history]
    if about.classes:
        width = max(map(len, about.classes))
        lines.append("  classes      (objects in all samples)")
        lines += [f"    {name:<{width}} {count:>7}" for name, count in about.classes.items()]
    say(*lines)
    return EXIT_OK


def _part(part: Any, as_json: bool) -> int:
    """``info`` of one shard or catalog file of a shard folder (``summary.PartInfo``)."""
    member = part.member
    if as_json:
        if member.role == fmt.ROLE_SHARD:
            where = {"shard_of": member.folder, "shard": member.index}
            where["num_shards"] = member.num_shards
        else:
            where = {"catalog_of": member.folder}
        current = member.num_shards is not None  # named by its folder's manifest
        fields = {"current": current, "records": part.records, "bytes": part.bytes}
        return _json({"path": part.path, **where, **fields})
    whole = f"{PROG} info {member.folder}" if member.folder else "the folder with its manifest.json"
    say(
        part.path,
        f"  is {member}; holds {plural(part.records, 'record')}, {mb(part.bytes)}",
        f"The dataset is the whole folder: {whole}",
    )
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from ..summary import verify

    report = verify(args.path, **remote(args))  # what cannot be opened raises, named
    where = (
        f"{report.path} ({plural(report.records, 'record')} in "
        f"{files(report.num_shards, report.sharded)})"
    )
    if report.ok:
        say(
            f"OK {where}: header, footer, metadata{', VOC metadata' if report.voc else ''}, "
            f"index, arrays and all {report.checksums} field checksums match "
            f"({mb(report.bytes)} in {report.seconds:.2f} s)"
        )
        if report.part is not None:
            whole = f"{PROG} verify {report.folder}" if report.folder else "verifying its folder"
            say(f"This file is {report.part}; {whole} checks the whole pack.")
        return EXIT_OK
    lines = []
    if report.voc_error is not None:
        lines += [f"FAILED {where}: VOC readers refuse it", f"  {one_line(report.voc_error)}"]
    if report.damaged_shards:
        lines.append(f"FAILED {where}: {len(report.damaged_shards)} damaged shard(s)")
        lines += [f"  {one_line(message)}" for message in report.damaged_shards]
    if report.damaged_records:
        lines.append(f"FAILED {where}: {len(report.damaged_records)} damaged record(s)")
    for bad in report.damaged_records:
        label = f"record {bad.record}" + (f" (id {bad.id!r})" if bad.id is not None else "")
        if report.num_shards > 1:
            label += f" [{bad.shard} record {bad.local}]"
        lines.append(f"  {label}: field(s) {', '.join(bad.fields)} fail their checksum")
    lines.append("Re-copy the pack or re-pack the dataset.")
    say(*lines)
    return EXIT_DAMAGED


def one_line(message: str) -> str:
    """``message`` on one line, its whitespace runs made single spaces."""
    return " ".join(message.split())


def cmd_export(args: argparse.Namespace) -> int:
    from ..voc.export import export_voc
    from ..voc.packed import VOCPackReader

    started = time.perf_counter()
    options = remote(args)
    folder = export_voc(
        args.path, args.out_root, overwrite=args.overwrite, progress=progress(args), **options
    )
    seconds = time.perf_counter() - started
    pack = VOCPackReader(args.path, **options)
    print(
        f"exported {plural(len(pack.live), 'sample')} and {plural(len(pack.files()), 'list file')} "
        f"to {folder} in {seconds:.2f} s; torchvision reads it with "
        f"root={str(args.out_root)!r}, year={pack.year!r}"
    )
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from ..tools import run_benchmark

    names = ("year", "num_images", "repeats", "workers", "work_dir")
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.scenarios:
        given["scenarios"] = args.scenarios.split(",")
    bars = sys.stderr.isatty()  # progress bars only on a terminal, as pack shows them
    run_benchmark(args.root, quick=args.quick, out_dir=args.out_dir, progress=bars, **given)
    if args.out_dir is None:
        print("(nothing saved: --out-dir DIR writes the details)")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from ..tools import run_demo

    run_demo(
        num_images=args.num_images,
        workers=args.workers,
        directory=args.dir,
        batch_size=args.batch_size,
    )
    return EXIT_OK
