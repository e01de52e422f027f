"""``torch-serialized bench``: a short measurement on your own data, from an installed wheel.

ROOT (any VOC-format dataset; without it, a generated synthetic VOC set) is packed into a
temporary folder, a few samples are checked against torchvision's ``VOCDetection``, then both
are timed side by side with the demo's measurements (``tools/demo.py``): bytes-level reads,
reads with the page cache dropped, decoded images and DataLoader epochs. Every figure is the
median of several runs with its range; a comparison whose ranges overlap is within noise.
It prints a few lines of ratios; ``out_dir`` receives them (``results.txt``) and every figure
(``results.json``).

The full benchmark (an LMDB peer, appends, memory per worker, GPU decoding, remote reads,
targets and verdicts) is development tooling: ``python benchmarks/run.py`` in a checkout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["run_benchmark", "SCENARIOS", "FULL_ONLY"]

#: What ``bench`` measures (``--scenarios`` picks some), in the order measured.
SCENARIOS = ("pack", "bytes", "cold", "decoded", "tensor", "dataloader")
#: Scenarios of the full benchmark (``python benchmarks/run.py``): accepted, not run here.
FULL_ONLY = ("append", "attributes", "gpu", "memory", "remote")
#: The image sets ``bench`` reads, the first one the data lists (torchvision's names).
_IMAGE_SETS = ("trainval", "train", "val", "test")
_SYNTHETIC_YEAR = "2012"
#: Fewer samples than this make a note that the figures are dominated by per-epoch costs.
_FEW = 50


def run_benchmark(
    root: str | os.PathLike[str] | None = None,
    *,
    year: str | None = None,
    num_images: int | None = None,
    repeats: int | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    scenarios: Sequence[str] | None = None,
    quick: bool = False,
    workers: int = 2,
    work_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    out: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Pack ``root`` (torchvision's VOC root; ``year=None`` finds its year as ``pack_voc``
    does) or ``num_images`` generated synthetic images (default 200), check it against
    torchvision, time both and print a summary; return what ``results.json`` holds.

    ``num_images`` with ``root``: time that many samples, drawn at random (default all).
    ``repeats``: runs per measurement (default 5 for warm reads, 3 for the rest).
    ``scenarios``: a subset of ``SCENARIOS`` (names of ``FULL_ONLY`` are accepted and said to
    run only in the full benchmark). ``quick``: at most 48 samples and one run each.
    ``workers``: DataLoader workers. ``work_dir`` keeps the data and the pack (default: a
    temporary folder, removed). ``out_dir``: write ``results.txt`` (what was printed) and
    ``results.json`` there. ``progress``: show progress bars while generating and packing.
    """
    chosen = [s.strip() for s in (SCENARIOS if scenarios is None else scenarios) if s.strip()]
    unknown = [s for s in chosen if s not in SCENARIOS + FULL_ONLY]
    if unknown:
        raise ValueError(
            f"unknown scenarios {', '.join(unknown)}; choose from {', '.join(SCENARIOS)} "
            f"(or {', '.join(FULL_ONLY)}, which only the full benchmark runs)"
        )
    if workers < 0 or (repeats is not None and repeats < 1):
        raise ValueError("workers must be at least 0 and repeats at least 1")
    printed: list[str] = []

    def say(line: str) -> None:
        printed.append(line)
        out(line)

    with tempfile.TemporaryDirectory(prefix="tser-bench-") as temp:
        work = Path(work_dir) if work_dir is not None else Path(temp)
        work.mkdir(parents=True, exist_ok=True)
        result = _run(root, year, num_images, repeats, chosen, quick, workers, work, progress, say)
    if out_dir is not None:
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.json").write_text(json.dumps(result, indent=1) + "\n")
        (folder / "results.txt").write_text("\n".join(printed) + "\n", encoding="utf-8")
        out(f"Saved in {folder}: results.txt (this summary) and results.json (every figure).")
    return result


def _run(
    root: str | os.PathLike[str] | None,
    year: str | None,
    num_images: int | None,
    repeats: int | None,
    chosen: list[str],
    quick: bool,
    workers: int,
    work: Path,
    progress: bool,
    out: Callable[[str], None],
) -> dict[str, Any]:
    from .. import pack_voc
    from ..voc.layout import find_voc_root
    from .demo import (
        ROW,
        Comparison,
        Measurements,
        compare_with_torchvision,
        print_table,
        summarize,
    )
    from .synthetic import make_synthetic_voc

    started = time.perf_counter()
    if root is None:
        year = year or _SYNTHETIC_YEAR
        count = min(num_images or 200, 48) if quick else num_images or 200
        out(f"Generating {count} synthetic VOC{year} images in {work}")
        root = make_synthetic_voc(work / "voc", count, year=year, progress=progress)
        limit = None
    else:
        limit = min(num_images or 48, 48) if quick else num_images
    voc_root, year = find_voc_root(root, year)
    tv_root = _torchvision_root(voc_root, year)
    pack = work / "bench.tser"  # an earlier run's, in the same --work-dir, is replaced
    packed = pack_voc(voc_root, pack, year=year, progress=progress)
    image_set = _image_set(voc_root)
    seconds = max(packed.seconds, 1e-9)
    out(
        f"Packed {packed.num_samples} samples of VOC{year} ({voc_root}): "
        f"{packed.num_bytes / 1e6:,.1f} MB, {packed.num_bytes / packed.source_bytes:.0%} of "
        f"the source, in {packed.seconds:.2f} s ({packed.num_samples / seconds:,.0f} samples/s)"
    )
    problems = compare_with_torchvision(pack, tv_root, year=year, image_set=image_set)
    if problems:
        raise RuntimeError(f"the pack differs from torchvision's VOCDetection: {problems}")
    runs = (1, 1) if quick else (repeats or 5, repeats or 3)
    demo = Measurements(
        tv_root,
        pack,
        workers,
        16,
        year=year,
        image_set=image_set,
        runs=runs[0],
        slow_runs=runs[1],
        limit=limit,
    )
    notes: list[str] = []
    how = "one run each" if runs == (1, 1) else f"median of {runs[0]} runs (warm reads) or "
    how += "" if runs == (1, 1) else f"{runs[1]} (the rest) with (min-max)"
    out(
        f"Checked against torchvision: identical. Timing {demo.n} samples of {image_set!r}, "
        f"samples/s, {how}:"
    )
    if demo.n < _FEW:
        notes.append(
            f"only {demo.n} samples: costs paid once an epoch (opening files, starting a "
            "stream) weigh on every figure; time more samples for figures that transfer"
        )

    def cold() -> list[Comparison]:
        rows, how = demo.cold()
        notes.append(f"cold reads: {how}")
        return rows

    measures = {
        "bytes": demo.bytes_level,
        "cold": cold,
        "decoded": demo.decoded,
        "tensor": demo.tensors,
        "dataloader": demo.dataloader,
    }
    rows: list[Comparison] = []
    out(ROW.format("", "torchvision", "torch_serialized", "ratio"))
    for name, measure in measures.items():
        if name not in chosen:
            continue
        try:
            found = measure()
        except ValueError as exc:  # e.g. float box coordinates in torchvision's v2 wrapper
            why = str(exc).strip().splitlines()[-1]  # a worker's: the traceback, then this
            notes.append(f"{name}: not measured, torchvision cannot read the data so: {why}")
            continue
        print_table(out, None, found)
        rows += found
    for line in summarize(rows) + [part for n in notes for part in textwrap.wrap(n, 94)]:
        out(f"      {line}")
    skipped = [s for s in chosen if s in FULL_ONLY]
    if skipped:
        out(
            f"      Not measured here: {', '.join(skipped)} (python benchmarks/run.py, a checkout)."
        )
    return {
        "config": {
            "data": str(voc_root),
            "year": year,
            "image_set": image_set,
            "samples_timed": demo.n,
            "runs": list(runs),
            "workers": workers,
            "quick": quick,
            "scenarios": [s for s in chosen if s in SCENARIOS],
        },
        "pack": {
            "samples": packed.num_samples,
            "bytes": packed.num_bytes,
            "source_bytes": packed.source_bytes,
            "seconds": packed.seconds,
        },
        "rows": [
            {**dataclasses.asdict(r), "ratio": r.ratio, "within_noise": r.within_noise}
            for r in rows
        ],
        "notes": notes,
        "seconds": time.perf_counter() - started,
    }


def _torchvision_root(voc_root: Path, year: str) -> Path:
    """The root ``VOCDetection`` reads ``voc_root`` from (ROOT may be ``VOC20xx`` itself)."""
    from torchvision.datasets.voc import DATASET_YEAR_DICT

    if year not in DATASET_YEAR_DICT:
        raise ValueError(f"torchvision's VOCDetection reads no VOC{year}: bench compares with it")
    base = Path(DATASET_YEAR_DICT[year]["base_dir"])
    tv_root = voc_root.parents[len(base.parts) - 1]
    if (tv_root / base).resolve() != voc_root.resolve():
        raise ValueError(
            f"torchvision's VOCDetection reads VOC{year} from ROOT/{base.as_posix()}, and "
            f"{voc_root} is not laid out so: move it there to compare"
        )
    return tv_root


def _image_set(voc_root: Path) -> str:
    lists = voc_root / "ImageSets" / "Main"
    for name in _IMAGE_SETS:
        if (lists / f"{name}.txt").is_file():
            return name
    raise ValueError(
        f"{lists} lists none of {', '.join(_IMAGE_SETS)}: bench reads detection samples of "
        "one of these image sets"
    )
