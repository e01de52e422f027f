"""One function per command: call the library, print what it answered.

Each takes the parsed arguments and returns the exit status; errors propagate to ``main``,
which prints them in one line. What a pack holds and whether it is intact come from
``torch_serialized.summary``; nothing here checks what the library checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
import time
import unicodedata
from typing import Any

from ..container import spec as fmt
from ..errors import TorchSerializedError

PROG = "torch-serialized"
EXIT_OK, EXIT_DAMAGED, EXIT_ERROR = 0, 1, 2


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


def say(*lines: str) -> None:
    """Print ``lines``, escaped (``printable``): they may hold a pack's metadata."""
    print("\n".join(printable(line) for line in lines))


def files(count: int, sharded: bool) -> str:
    """What a pack is made of: "1 file" (a ``.tser``), "1 shard", "8 shards" (a folder)."""
    if not sharded:
        return "1 file"
    return f"{count} shard" if count == 1 else f"{count} shards"


def mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:,.1f} MB"


def progress(args: argparse.Namespace) -> bool:
    """Show a progress bar only on a terminal (tqdm's own rule), never with ``-q``: in a log
    or a CI job each update of a bar would be one more line."""
    return not args.quiet and sys.stderr.isatty()


def remote(args: argparse.Namespace) -> dict[str, Any]:
    """The reader keywords of the remote options (``--storage-options``, the cache's)."""
    return {
        "storage_options": args.storage_options,
        "cache_dir": args.cache_dir,
        "cache_limit_bytes": args.cache_limit,
    }


# -- prune, cache -------------------------------------------------------------------------------
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
            print(json.dumps(dataclasses.asdict(done), indent=1))
            return EXIT_OK
        print(
            f"removed {done.packs_removed} pack(s), {done.objects_removed} file(s), "
            f"{mb(done.bytes_freed)} from {folder}"
            + (f"; {done.objects_in_use} file(s) in use were left" if done.objects_in_use else "")
        )
        return EXIT_OK
    packs = list_cache(args.cache_dir)
    if args.json:
        rows = [{**dataclasses.asdict(p), "directory": str(p.directory)} for p in packs]
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    total = sum(p.bytes for p in packs)
    missing = "" if folder.exists() else " (no such folder yet: nothing cached)"
    print(f"{folder}: {len(packs)} pack(s), {mb(total)}{missing}")
    for p in packs:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(p.last_used)) if p.last_used else "-"
        busy = f", {p.in_use} in use" if p.in_use else ""
        busy += f", {mb(p.partial_bytes)} partly downloaded" if p.partial_bytes else ""
        say(
            f"  {p.url}  [{p.identity[:12]}]  {p.objects} file(s), {mb(p.bytes)}, "
            f"last used {used}{busy}"
        )
    return EXIT_OK


# -- info, verify, export -----------------------------------------------------------------------
def cmd_info(args: argparse.Namespace) -> int:
    from ..summary import info, part_info

    part = part_info(args.path)
    if part is not None:  # one piece of a pack: describe the piece, point at the pack
        return _part(part, args.json)
    about = info(args.path, **remote(args))
    if args.json:  # JSON escapes C0 controls itself; the rest become \\u escapes
        text = json.dumps(dataclasses.asdict(about), indent=1, ensure_ascii=False)
        print(printable(text, json_text=True))
        return EXIT_OK
    options = ", ".join(f"{k}={v}" for k, v in about.options.items())
    sets = "; ".join(
        f"{task}: " + ", ".join(f"{name} {n}" for name, n in lists.items())
        for task, lists in about.image_sets.items()
    )
    w, h, per = about.width, about.height, about.objects_per_image
    common = ", ".join(f"{cw}x{ch} ({n})" for cw, ch, n in about.common_sizes)
    source = about.source_bytes
    ratio = f" ({about.bytes / source:.1%} of the {mb(source)} source)" if source else ""
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
        f"(mean {per['mean']})"
        + (", untyped samples counted as 0" if about.with_untyped_objects else ""),
        f"  on disk      {mb(about.bytes)} in {files(len(about.shards), about.sharded)}{ratio}",
    ]
    if about.sharded:
        lines += [
            f"    {s.file}  {s.samples} samples"
            + (f" ({s.records - s.samples} retired)" if s.records > s.samples else "")
            + f"  {mb(s.bytes)}"
            for s in about.shards
        ]
    if about.retired:
        lines.append(
            f"  retired      {about.retired} records replaced or dropped by appends (their "
            "bytes stay until the next full pack)"
        )
    if about.skipped:
        lines.append(f"  skipped      {len(about.skipped)} samples at pack time")
    if about.with_untyped_objects:
        lines.append(
            f"  untyped      {about.with_untyped_objects} samples whose objects have no box "
            "rows (target_format='tv_tensors' raises for them)"
        )
    if about.with_unparsed_annotation:
        lines.append(
            f"  unparsed     {about.with_unparsed_annotation} segmentation-only samples whose "
            "annotation XML did not parse (stored as the files' bytes, no target)"
        )
    if about.history:
        lines.append("  history")
        lines += [f"    {_history_line(entry)}" for entry in about.history]
    if about.classes:
        lines.append("  classes      (objects in all samples)")
        top = max(about.classes.values())
        width = max(len(name) for name in about.classes)
        for name, count in about.classes.items():
            bar = "#" * max(1, round(30 * count / top))
            lines.append(f"    {name:<{width}} {count:>7}  {bar}")
    say(*lines)
    return EXIT_OK


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


def _part(part: Any, as_json: bool) -> int:
    """``info`` of one shard or catalog file of a shard folder (``summary.PartInfo``)."""
    shard = part.role == fmt.ROLE_SHARD
    if as_json:
        where = (
            {"shard_of": part.folder, "shard": part.shard, "num_shards": part.num_shards}
            if shard
            else {"catalog_of": part.folder}
        )
        fields = {"current": part.current, "records": part.records, "bytes": part.bytes}
        print(json.dumps({"path": part.path, **where, **fields}, indent=1, ensure_ascii=False))
        return EXIT_OK
    whole = f"{PROG} info {part.folder}" if part.folder else "the folder with its manifest.json"
    say(
        part.path,
        f"  is {part.description}; holds {part.records} records, {mb(part.bytes)}",
        f"The dataset is the whole folder: {whole}",
    )
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from ..summary import describe_error, verify

    try:
        report = verify(args.path, **remote(args))
    except (TorchSerializedError, OSError) as exc:  # the file cannot be opened: name it
        message = describe_error(exc)
        if str(args.path) not in message:
            raise ValueError(f"cannot open {args.path}: {message}") from exc
        raise
    where = f"{report.path} ({report.records} records in "
    where += f"{files(report.num_shards, report.sharded)})"
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
        lines += [f"FAILED {where}: VOC readers refuse it", f"  {_one_line(report.voc_error)}"]
    if report.damaged_shards:
        lines.append(f"FAILED {where}: {len(report.damaged_shards)} damaged shard(s)")
        lines += [f"  {_one_line(message)}" for message in report.damaged_shards]
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


def _one_line(message: str) -> str:
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
        f"exported {len(pack.live)} samples and {len(pack.files())} list files to {folder} in "
        f"{seconds:.2f} s; torchvision reads it with root={str(args.out_root)!r}, "
        f"year={pack.year!r}"
    )
    return EXIT_OK


# -- bench, demo --------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    from ..tools import run_benchmark

    options = {
        "year": args.year,
        "num_images": args.num_images,
        "repeats": args.repeats,
        "workers": args.workers,
        "work_dir": args.work_dir,
        "scenarios": args.scenarios.split(",") if args.scenarios else None,
    }
    given = {name: value for name, value in options.items() if value is not None}
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
