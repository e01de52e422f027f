"""The ``torch-serialized`` command line (also ``python -m torch_serialized``).

A thin layer over the public API: ``pack`` (``pack_voc``; ``append_voc`` with ``--append``),
``info`` and ``verify`` (``torch_serialized.info`` and ``verify``), ``export``
(``export_voc``), ``cache`` (``list_cache``, ``clear_cache``), ``prune`` (``prune_remote``),
``bench`` and ``demo`` (``torch_serialized.tools``); the only part of the package that imports
``tools``. This module holds the argument parser (``_parser``) and ``main``; ``commands`` one
function per command. Errors of torch_serialized, bad paths and bad values print one line on
stderr and exit with status 2 (``--debug`` shows the traceback instead); ``verify`` exits 1
when it finds damage.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .._version import __version__
from ..container import spec as fmt
from ..errors import TorchSerializedError
from . import commands
from .commands import EXIT_ERROR, PROG, printable
from .pack import cmd_pack

__all__ = ["main", "parse_size"]

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


def _output(text: str) -> str:
    """OUTPUT ``-`` means standard output to many tools, but a pack is written to disk, mapped
    and renamed into place, so it cannot go to a pipe (a file named ``-``: ``./-``)."""
    if text == "-":
        raise argparse.ArgumentTypeError(
            "'-' is not standard output here: a pack cannot be written to a pipe. Pass the "
            ".tser file (or shard folder) to write; for a file named '-' in this folder, ./-"
        )
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
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(
        name: str,
        help: str,
        description: str,
        run: Callable[[argparse.Namespace], int],
        *,
        url: bool = False,
        cache: bool = True,
    ) -> argparse.ArgumentParser:
        """A command that ``run`` carries out; ``url``: it takes URLs (``--storage-options``),
        and with ``cache`` reads them through the cache (``--cache-dir``, ``--cache-limit``)."""
        parser = subcommands.add_parser(name, help=help, description=description, parents=[common])
        parser.set_defaults(run=run)
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
        "brought up to date with ROOT at the cost of what changed (docs/updating.md). "
        "OUTPUT may be a URL (s3://bucket/prefix/voc): the pack is written to a temporary "
        "folder, then uploaded with its manifest last; with --append only its new files go "
        "up, then the manifest (https:// URLs are read-only).",
        cmd_pack,
        url=True,
    )
    pack.add_argument("root", help="torchvision's root (holding VOCdevkit/) or VOC20xx itself")
    pack.add_argument(
        "output", type=_output, help="the .tser file (or shard folder) to write, or a URL"
    )
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

    info = command(
        "info",
        "describe a pack",
        "Show format version, packing options, samples per image set, class histogram, "
        "image size range, bytes on disk and shards of a pack.",
        commands.cmd_info,
        url=True,
    )
    info.add_argument("path", help="a .tser file or shard folder, or its URL")
    info.add_argument("--json", action="store_true", help="print one JSON object instead")

    verify = command(
        "verify",
        "check every checksum of a pack",
        "Check header, footer, metadata, index, arrays and the checksum of every field of "
        "every record. Exit status: 0 when all is well, 1 when records are damaged (each "
        "is named), 2 when the file cannot be opened at all. A URL is downloaded into the "
        "cache (each file checked in full before it enters the cache).",
        commands.cmd_verify,
        url=True,
    )
    verify.add_argument("path", help="a .tser file or shard folder, or its URL")

    export = command(
        "export",
        "rebuild the VOCdevkit folder from a pack",
        "Write OUT_ROOT/VOCdevkit/VOC20xx/ (images, annotations, masks, ImageSets lists) "
        "byte for byte as packed. Only packs with --image-storage original and no "
        "--max-size can be exported. Existing files are replaced only with --overwrite "
        "(as pack).",
        commands.cmd_export,
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

    from ..tools.bench import FULL_ONLY, SCENARIOS

    bench = command(
        "bench",
        "time your own VOC data against torchvision's VOCDetection",
        "Pack ROOT (any VOC-format dataset; without it, a generated synthetic VOC set) into "
        "a temporary folder, check samples against torchvision's VOCDetection, then time both: "
        "bytes-level reads, reads with the page cache dropped, decoded images and DataLoader "
        "epochs (medians of repeated runs with their range). Prints a few lines of ratios; "
        "--out-dir receives every figure. The full benchmark (LMDB peer, appends, memory, GPU, "
        "remote reads) is `python benchmarks/run.py` in a checkout of the repository.",
        commands.cmd_bench,
    )
    bench.add_argument("root", nargs="?", help="torchvision's VOC root (default: synthetic data)")
    bench.add_argument(
        "--year", help="VOC year of ROOT (default: the one VOC<year> folder under ROOT)"
    )
    bench.add_argument(
        "--num-images",
        type=_positive_int,
        metavar="N",
        help="synthetic images to generate (default 200); with ROOT, samples to time, drawn "
        "at random (default all)",
    )
    bench.add_argument(
        "--repeats", type=_positive_int, metavar="N", help="runs per measurement (default 5/3)"
    )
    bench.add_argument(
        "--workers", type=_non_negative_int, metavar="N", help="DataLoader workers (default 2)"
    )
    bench.add_argument(
        "--quick", action="store_true", help="a small, fast run: 48 samples, one run each"
    )
    bench.add_argument(
        "--out-dir", metavar="DIR", help="write results.txt and results.json here (default: none)"
    )
    bench.add_argument(
        "--work-dir", metavar="DIR", help="keep the data and the pack here (default: a temp folder)"
    )
    bench.add_argument(
        "--scenarios",
        metavar="A,B",
        help=f"comma-separated subset to run, of: {', '.join(SCENARIOS)} (default: all); "
        f"{', '.join(FULL_ONLY)} are accepted but only the full benchmark runs them",
    )

    cache = command(
        "cache",
        "list or clear the local cache of remote packs",
        "list: every pack in the cache (URL, identity, files, bytes, last use, files in use). "
        "clear: delete cached packs (only those of --url if given); files some process reads "
        "or downloads right now are left.",
        commands.cmd_cache,
    )
    cache.add_argument("action", choices=("list", "clear"))
    cache.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="the cache folder (default: $TORCH_SERIALIZED_CACHE, else ~/.cache/torch_serialized)",
    )
    cache.add_argument("--url", help="clear: only the packs of this URL")
    cache.add_argument("--json", action="store_true", help="print JSON instead")

    prune = command(
        "prune",
        "delete the files earlier packs left at a URL",
        "A pack written to a URL over an earlier one leaves the earlier shards and catalog in "
        "place, so readers that opened it keep working. Delete the shard and catalog files "
        "that the current manifest does not name, once no reader of an earlier pack is left. "
        "A pack at a local path needs none: a re-pack replaces its files.",
        commands.cmd_prune,
        url=True,
        cache=False,
    )
    prune.add_argument("url", help="the shard folder's URL")
    prune.add_argument("--dry-run", action="store_true", help="list, delete nothing")

    demo = command(
        "demo",
        "generate a sample, pack it, check it and time it against torchvision (start here)",
        "Generate the built-in synthetic VOC sample, pack it, check samples against "
        "torchvision's VOCDetection, then time both side by side: bytes-level reads (warm "
        "and with the page cache dropped), decoded images (the PIL drop-in and "
        "decode='tensor') and DataLoader epochs with warm workers. Medians of repeated runs "
        "with their range; overlapping ranges are reported as within noise. Under a "
        "minute on 2 cores.",
        commands.cmd_demo,
    )
    demo.add_argument(
        "--num-images", type=_positive_int, default=200, metavar="N", help="default 200"
    )
    demo.add_argument(
        "--workers", type=_non_negative_int, default=2, metavar="N", help="DataLoader workers"
    )
    demo.add_argument("--batch-size", type=_positive_int, default=16, metavar="N")
    demo.add_argument("--dir", metavar="DIR", help="keep the data here (default: a temp folder)")
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
        from ..summary import describe_error

        _error(describe_error(exc))
        return EXIT_ERROR
    return status
