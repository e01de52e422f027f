"""``torch-serialized bench`` and ``demo``: pack a VOC root (``demo``: generated images), check
it against torchvision's ``VOCDetection`` and time both (``measure``). The full benchmark is
``python benchmarks/run.py`` in a checkout. Imports no torch until a run starts."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["run_benchmark", "run_demo", "SCENARIOS", "FULL_ONLY"]

#: What ``bench`` measures (``--scenarios`` picks some), in the order measured.
SCENARIOS = ("pack", "bytes", "decoded", "dataloader")
#: Scenarios of the full benchmark (``python benchmarks/run.py``): accepted, not run here.
FULL_ONLY = ("append", "attributes", "cold", "gpu", "memory", "remote", "tensor")
_IMAGE_SETS = ("trainval", "train", "val", "test")  #: ``bench`` reads the first one listed


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
    batch_size: int = 16,
    work_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    out: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Pack ``root`` (torchvision's VOC root) or ``num_images`` synthetic images (default 200),
    check it against torchvision, time both, print a summary; return ``results.json``'s data.

    ``num_images`` with ``root``: random samples timed (default all). ``repeats``: runs per
    measurement (default 5 warm, 3 others). ``scenarios``: of ``SCENARIOS``. ``quick``: at most
    48 samples, one run each. ``work_dir`` keeps data and pack; ``out_dir`` gets the results."""
    chosen = [s.strip() for s in (SCENARIOS if scenarios is None else scenarios) if s.strip()]
    unknown = [s for s in chosen if s not in SCENARIOS + FULL_ONLY]
    if unknown:
        known = ", ".join(SCENARIOS + FULL_ONLY)
        raise ValueError(f"unknown scenarios {', '.join(unknown)}; choose from {known}")
    from .. import pack_voc
    from ..voc.layout import find_source
    from .measure import Measurements
    from .synthetic import make_synthetic_voc

    started = time.perf_counter()
    printed: list[str] = []

    def say(line: str) -> None:
        printed.append(line)
        out(line)

    runs = (1, 1) if quick else (repeats or 5, repeats or 3)
    with tempfile.TemporaryDirectory(prefix="tser-bench-") as temp:
        work = Path(temp if work_dir is None else work_dir)
        work.mkdir(parents=True, exist_ok=True)
        limit = min(num_images or 48, 48) if quick else num_images
        if root is None:
            year, limit = year or "2012", None
            count = min(num_images or 200, 48) if quick else num_images or 200
            say(f"Generating {count} synthetic VOC{year} images in {work}")
            root = make_synthetic_voc(work / "voc", count, year=year, progress=progress)
        voc_root, year = find_source(root, year)
        tv_root, image_set = _torchvision_root(voc_root, year), _image_set(voc_root)
        # an earlier run's pack in the same work_dir is replaced
        packed = pack_voc(voc_root, work / "bench.tser", year=year, progress=progress)
        say(
            f"Packed {_samples(packed.num_samples)} of VOC{year} ({voc_root}): "
            f"{packed.num_bytes / 1e6:,.1f} MB in {packed.seconds:.2f} s"
        )
        demo = Measurements(
            root=tv_root,
            pack=packed.path,
            year=year,
            image_set=image_set,
            workers=workers,
            batch_size=batch_size,
            runs=runs[0],
            slow_runs=runs[1],
            limit=limit,
        )
        demo.check()
        how = f"median of {runs[0]} runs (warm reads) or {runs[1]} (the rest) with (min-max)"
        say(
            f"Checked against torchvision: identical. Timing {_samples(demo.n)} of "
            f"{image_set!r}, samples/s, {'one run each' if runs == (1, 1) else how}:"
        )
        if demo.n < 50:
            demo.notes.append(f"Only {_samples(demo.n)}: per-epoch costs weigh on every figure.")
        rows = demo.table(say, chosen)
    skipped = [s for s in chosen if s in FULL_ONLY]
    if skipped:
        say(
            f"      Not measured here: {', '.join(skipped)} (python benchmarks/run.py, a checkout)."
        )
    result = {
        "config": {
            "data": str(voc_root),
            "pack": None if work_dir is None else str(packed.path),  # a temporary one is gone
            "year": year,
            "image_set": image_set,
            "samples_timed": demo.n,
            "runs": list(runs),
            "workers": workers,
            "batch_size": batch_size,
            "quick": quick,
            "scenarios": [s for s in chosen if s in SCENARIOS],
        },
        "pack": {
            k: getattr(packed, k) for k in ("num_samples", "num_bytes", "source_bytes", "seconds")
        },
        "rows": [
            {**dataclasses.asdict(r), "ratio": r.ratio, "within_noise": r.within_noise}
            for r in rows
        ],
        "notes": demo.notes,
        "seconds": time.perf_counter() - started,
    }
    if out_dir is not None:
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.json").write_text(json.dumps(result, indent=1) + "\n")
        (folder / "results.txt").write_text("\n".join(printed) + "\n", encoding="utf-8")
        out(f"Saved in {folder}: results.txt (this summary) and results.json (every figure).")
    return result


def run_demo(
    *,
    num_images: int = 200,
    workers: int = 2,
    directory: str | os.PathLike[str] | None = None,
    batch_size: int = 16,
    out: Callable[[str], None] = print,
) -> dict[str, Any]:
    """``run_benchmark`` on ``num_images`` generated VOC2012 images (kept in ``directory``)."""
    started = time.perf_counter()
    result = run_benchmark(
        num_images=num_images, workers=workers, work_dir=directory, batch_size=batch_size, out=out
    )
    out(
        f"Demo time {time.perf_counter() - started:.0f} s. Cold-cache, remote and GPU reads: "
        "`python benchmarks/run.py` in a checkout; your own data: `torch-serialized bench ROOT`."
    )
    if directory is not None:
        out(f"Data kept in {directory}; try: torch-serialized info {result['config']['pack']}")
    return result


def _samples(count: int) -> str:
    return f"{count} sample{'s' * (count != 1)}"


def _torchvision_root(voc_root: Path, year: str) -> Path:
    """The root ``VOCDetection`` reads ``voc_root`` from (ROOT may be ``VOC20xx`` itself)."""
    from ..voc.layout import base_dir

    base = Path(base_dir(year))  # torchvision's, 2011's TrainVal/ included
    tv_root = voc_root.parents[len(base.parts) - 1]
    if (tv_root / base).resolve() != voc_root.resolve():
        raise ValueError(
            f"torchvision's VOCDetection reads VOC{year} from ROOT/{base.as_posix()}: "
            f"move {voc_root} there to compare"
        )
    return tv_root


def _image_set(voc_root: Path) -> str:
    lists = voc_root / "ImageSets" / "Main"
    for name in _IMAGE_SETS:
        if (lists / f"{name}.txt").is_file():
            return name
    raise ValueError(f"{lists} lists none of {', '.join(_IMAGE_SETS)}: bench reads one of these")
