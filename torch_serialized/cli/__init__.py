"""The ``torch-serialized`` command line (also ``python -m torch_serialized``): the argument
parser and ``main``; ``commands`` holds one function per command. An error prints one line on
stderr and exits 2 (``--debug``: the traceback); ``verify`` exits 1 when it finds damage."""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from .._version import __version__
from ..container import spec as fmt
from ..errors import TorchSerializedError
from . import commands
from .commands import EXIT_ERROR, PROG, one_line, printable

__all__ = ["main", "parse_size"]

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for ``ls | head``

#: a number, then B, or k/M/G/T alone or with B (powers of 1000) or iB (of 1024)
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(ib|b)?|b)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in ``"256MB"``, ``"1.5GiB"``, ``"4096"``: kB/MB/GB are powers of 1000, KiB/MiB/GiB
    of 1024 (``K``/``M``/``G`` alone mean kB/MB/GB)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use a number with an optional unit, e.g. 256MB or 1GiB"
        )
    number, prefix, binary = match.groups()
    base = 1024 if (binary or "").lower() == "ib" else 1000
    size = int(float(number) * base ** ("kmgt".index(prefix.lower()) + 1 if prefix else 0))
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


_positive_int = functools.partial(_int_at_least, 1)


def _output(text: str) -> str:
    """``-`` is no pipe here: a pack is written to disk, mapped and renamed into place."""
    if text == "-":
        raise argparse.ArgumentTypeError("'-' is not standard output here: name the pack, e.g. ./-")
    return text


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


def _flags(parser: argparse.ArgumentParser, **helps: str) -> None:
    """On/off options: ``dry_run="..."`` adds ``--dry-run`` (``quiet``: ``-q`` too)."""
    for dest, help in helps.items():
        names = ["-q"] if dest == "quiet" else []
        parser.add_argument(*names, "--" + dest.replace("_", "-"), action="store_true", help=help)


_QUIET = "no progress bar (shown only on a terminal)"
_N: dict[str, Any] = {"type": _positive_int, "metavar": "N"}
_WORKERS: dict[str, Any] = {"type": functools.partial(_int_at_least, 0), "metavar": "N"}


def _parser() -> argparse.ArgumentParser:
    from ..tools.bench import FULL_ONLY, SCENARIOS

    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG)
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Pack a Pascal VOC devkit into one file (or shards) and read it fast.",
        epilog=f"Run '{PROG} COMMAND --help' for the options of a command.",
    )
    version = f"{PROG} {__version__} (file format {fmt.FORMAT_MAJOR}.{fmt.FORMAT_MINOR})"
    parser.add_argument("--version", action="version", version=version)
    parser.add_argument("--debug", action="store_true", help=_DEBUG)
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub: dict[str, argparse.ArgumentParser] = {}
    for name, (help, description) in _COMMANDS.items():
        description = description or help[0].upper() + help[1:] + "."
        sub[name] = subcommands.add_parser(
            name, help=help, description=description, parents=[debug]
        )
        sub[name].set_defaults(run=getattr(commands, f"cmd_{name}"))
        if name in ("info", "verify", "export"):
            sub[name].add_argument("path", help="a .tser file or shard folder, or its URL")
        if name in ("pack", "info", "verify", "export", "prune"):
            _remote_options(sub[name], cache=name != "prune")

    pack = sub["pack"]
    pack.add_argument("root", help="torchvision's root (holding VOCdevkit/) or VOC20xx itself")
    pack.add_argument("output", type=_output, help="the .tser file or shard folder, or a URL")
    pack.add_argument("--year", help="VOC year, e.g. 2007 (needed when ROOT holds several)")
    limit = pack.add_mutually_exclusive_group()
    limit.add_argument("--shards", **_N, help="write N shards of even sample counts")
    limit.add_argument(
        "--shard-size", type=parse_size, metavar="SIZE", help="shards of at most SIZE (e.g. 1GiB)"
    )
    limit.add_argument("--samples-per-shard", **_N, help="at most N samples a shard")
    pack.add_argument("--workers", **_N, default=1, help="processes reading the source (default 1)")
    storage = "original: the JPEG bytes, byte-exact (default); raw: decoded RGB pixels"
    pack.add_argument("--image-storage", choices=("original", "raw"), help=storage)
    shrink = "shrink images whose longer side exceeds PX (boxes scaled; not byte-exact)"
    pack.add_argument("--max-size", type=_positive_int, metavar="PX", help=shrink)
    pack.add_argument(
        "--max-file-size", type=parse_size, metavar="SIZE", help="refuse larger sources (1GiB)"
    )
    _flags(
        pack,
        check_images="decode every image while packing",
        skip_bad="leave out unreadable samples (listed in OUTPUT.skipped.json)",
        overwrite="replace OUTPUT if it exists (a pack only)",
        append="bring the existing pack OUTPUT up to date with ROOT (docs/updating.md)",
        replace_changed="with --append: store new versions of packed ids whose files changed",
        checksum="with --append: compare packed files by content, not only sizes and times",
        retire_all="with --append: accept a ROOT that lists none of the pack's ids",
        quiet=_QUIET,
    )
    _flags(sub["info"], json="print one JSON object instead")
    export = sub["export"]
    export.add_argument("out_root", help="folder to write into (torchvision's root)")
    _flags(export, overwrite="replace files that exist in OUT_ROOT", quiet=_QUIET)

    bench = sub["bench"]
    bench.add_argument("root", nargs="?", help="torchvision's VOC root (default: synthetic data)")
    bench.add_argument("--year", help="VOC year of ROOT (needed when ROOT holds several)")
    bench.add_argument("--num-images", **_N, help="images to generate (200) or time (all)")
    bench.add_argument("--repeats", **_N, help="runs per measurement (default 5/3)")
    bench.add_argument("--workers", **_WORKERS, help="DataLoader workers (default 2)")
    _flags(bench, quick="a small, fast run: 48 samples, one run each")
    bench.add_argument("--out-dir", metavar="DIR", help="write results.txt and results.json here")
    bench.add_argument("--work-dir", metavar="DIR", help="keep the data and the pack here")
    bench.add_argument(
        "--scenarios",
        metavar="A,B",
        help=f"comma-separated subset of: {', '.join(SCENARIOS)} (default: all); "
        f"{', '.join(FULL_ONLY)} are accepted, run only by python benchmarks/run.py",
    )

    cache = sub["cache"]
    cache.add_argument("action", choices=("list", "clear"))
    cache.add_argument("--cache-dir", metavar="DIR", help=_CACHE_DIR)
    cache.add_argument("--url", help="clear: only the packs of this URL")
    _flags(cache, json="print JSON instead")

    sub["prune"].add_argument("url", help="the shard folder's URL")
    _flags(sub["prune"], dry_run="list, delete nothing")

    demo = sub["demo"]
    demo.add_argument("--num-images", **_N, default=200, help="default 200")
    demo.add_argument("--workers", **_WORKERS, default=2, help="DataLoader workers")
    demo.add_argument("--batch-size", **_N, default=16)
    demo.add_argument("--dir", metavar="DIR", help="keep the data here (default: a temp folder)")
    return parser


_DEBUG = "show the full traceback of an error"
_CACHE_DIR = "the cache folder (default: $TORCH_SERIALIZED_CACHE, else ~/.cache/torch_serialized)"
#: name -> (one-line help, description if more); ``commands.cmd_<name>`` carries it out
_COMMANDS: dict[str, tuple[str, str | None]] = {
    "pack": (
        "pack a VOCdevkit into a .tser file or a shard folder",
        "Pack every id ImageSets lists into OUTPUT; an existing pack is replaced only with "
        "--overwrite, or brought up to date with ROOT by --append.",
    ),
    "info": ("describe a pack: format, options, samples, classes, image sizes, shards", None),
    "verify": (
        "check every checksum of a pack",
        "Check header, footer, metadata, index, arrays and every record's checksums. Exit "
        "status 0: all is well, 1: records are damaged, 2: it cannot be opened.",
    ),
    "export": (
        "rebuild the VOCdevkit folder from a pack",
        "Write OUT_ROOT/VOCdevkit/VOC20xx/ byte for byte as packed (packs of original images "
        "only); existing files are replaced only with --overwrite.",
    ),
    "bench": (
        "time your own VOC data against torchvision's VOCDetection",
        "Pack ROOT (default: generated data), check it against VOCDetection and time both.",
    ),
    "cache": ("list or clear the local cache of remote packs (clear leaves files in use)", None),
    "prune": ("delete the files earlier packs left at a URL, once none of them is read", None),
    "demo": ("generate a sample, pack it, check it and time it against torchvision", None),
}


def _remote_options(parser: argparse.ArgumentParser, *, cache: bool = True) -> None:
    """``--storage-options``, and with ``cache`` the cache's options (read by ``remote``)."""
    group = parser.add_argument_group("packs at URLs (s3://, gs://, https://...)")
    group.add_argument(
        "--storage-options",
        type=_storage_options,
        metavar="JSON",
        help='fsspec options as a JSON object, e.g. \'{"endpoint_url": "http://..."}\'',
    )
    if cache:
        group.add_argument("--cache-dir", metavar="DIR", help=_CACHE_DIR)
        group.add_argument(
            "--cache-limit",
            type=parse_size,
            metavar="SIZE",
            help="bound the cache (e.g. 20GB); least recently used files no process reads go first",
        )


def _error(message: str) -> None:
    print(f"{PROG}: error: {printable(one_line(message))}", file=sys.stderr)


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
    except (TorchSerializedError, OSError, ValueError, ImportError) as exc:  # e.g. no s3fs
        if args.debug:
            raise
        from ..summary import describe_error

        _error(describe_error(exc))
        return EXIT_ERROR
    return status
