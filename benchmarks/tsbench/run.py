"""Entry points: ``run_benchmark`` runs the chosen scenarios and writes the reports; ``main``."""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torch_serialized.voc.layout import find_voc_root
from tsbench.access import scenario_bytes
from tsbench.appending import scenario_append
from tsbench.attributes import scenario_attributes
from tsbench.cold import scenario_cold
from tsbench.context import Bench
from tsbench.core import IMAGE_SET, OPTIONAL_SCENARIOS, SCENARIOS, SEED, Row
from tsbench.decoded import scenario_decoded, scenario_tensor
from tsbench.gpu import scenario_gpu
from tsbench.loader import scenario_dataloader
from tsbench.memory import scenario_memory
from tsbench.packing import scenario_pack
from tsbench.remote import scenario_remote
from tsbench.report import json_default, miss_text, plot_chart, render_markdown, row_from_dict
from tsbench.sources import scenario_sources
from tsbench.system import environment, files_under, read_all

_RUNNERS: dict[str, Callable[[Bench], list[Row]]] = {
    "pack": scenario_pack,
    "append": scenario_append,
    "bytes": scenario_bytes,
    "attributes": scenario_attributes,
    "decoded": scenario_decoded,
    "tensor": scenario_tensor,
    "cold": scenario_cold,
    "dataloader": scenario_dataloader,
    "gpu": scenario_gpu,
    "memory": scenario_memory,
    "remote": scenario_remote,
    "sources": scenario_sources,
}


def run_benchmark(
    root: str | os.PathLike[str] | None = None,
    *,
    year: str | None = None,
    num_images: int = 2000,
    repeats: int = 3,
    out_dir: str | os.PathLike[str] | None = None,
    scenarios: Sequence[str] | None = None,
    quick: bool = False,
    workers: int = 2,
    work_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the scenarios; print the table and, with ``out_dir``, write ``results.md``,
    ``results.json`` and ``results.png`` there (nothing is written without it).

    ``root`` is torchvision's VOC root (any VOC-format dataset, custom classes included);
    ``year=None`` detects its year as ``pack_voc`` does. Without ``root``, ``num_images``
    synthetic VOC2012 images are generated (in ``work_dir``, or a temporary folder removed
    afterwards; kept, and named, when the run fails). ``quick`` uses 64 images and one repeat
    (for tests). ``workers`` is both the pack processes and the DataLoader workers (the
    memory scenario uses at least one). ``progress`` prints each scenario as it starts and the
    table at the end. Returns what ``results.json`` holds (plus ``chart``, the PNG or None).
    """
    chosen = list(SCENARIOS if scenarios is None else scenarios)
    known = SCENARIOS + OPTIONAL_SCENARIOS
    unknown = [s for s in chosen if s not in known]
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}; choose from {', '.join(known)}")
    chosen = [s for s in known if s in chosen]
    if quick:
        num_images, repeats = min(num_images, 64), 1
    if repeats < 1 or num_images < 1 or workers < 0:
        raise ValueError("repeats and num_images must be at least 1, workers at least 0")
    if root is not None:  # the year rule of pack_voc, before anything is generated or packed
        voc_root, year = find_voc_root(root, year)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    temp = None if work_dir else tempfile.mkdtemp(prefix="tser-bench-")
    work = Path(work_dir or temp)  # type: ignore[arg-type]
    work.mkdir(parents=True, exist_ok=True)
    say = print if progress else (lambda *a, **k: None)
    failed = True
    try:
        if root is None:
            from torch_serialized.tools.synthetic import make_synthetic_voc

            year = year or "2012"
            say(f"generating {num_images} synthetic VOC{year} images in {work / 'voc'} ...")
            tv_root = make_synthetic_voc(work / "voc", num_images, year=year, seed=SEED)
            data = "synthetic"
        else:
            tv_root, data = Path(root), f"VOC{year} at {root}"
            say(f"benchmarking {voc_root} (VOC{year})")
        assert year is not None
        bench = Bench(tv_root, year, work, repeats, quick, workers)
        if "pack" not in chosen:
            bench.packed()
        read_all(files_under(bench.voc_root))  # a warm start for the warm scenarios
        scenario_results: dict[str, Any] = {}
        started = time.perf_counter()
        for name in chosen:
            say(f"[{time.perf_counter() - started:6.1f}s] {name} ...")
            t0 = time.perf_counter()
            rows = [r.finish() for r in _RUNNERS[name](bench)]
            gc.collect()
            scenario_results[name] = {
                "rows": [asdict(r) for r in rows],
                "details": bench.details.get(name, {}),
                "seconds": time.perf_counter() - t0,
            }
        all_rows = [row_from_dict(r) for s in scenario_results.values() for r in s["rows"]]
        result: dict[str, Any] = {
            "environment": environment(work),
            "config": {
                "data": data,
                "num_images": len(bench.tv()),
                "year": year,
                "image_set": IMAGE_SET,
                "repeats": repeats,
                "workers": workers,
                "quick": quick,
                "scenarios": chosen,
            },
            "scenarios": scenario_results,
            "misses": [miss_text(r) for r in all_rows if r.met is False],
            "seconds": time.perf_counter() - started,
        }
        failed = False
    finally:
        if temp is not None and not failed:
            shutil.rmtree(temp, ignore_errors=True)
        elif temp is not None:  # errors may name files in it: keep them for the reader
            print(f"benchmark data kept in {temp} (remove it when done)", file=sys.stderr)
    markdown = render_markdown(result)
    result["chart"] = None
    if out is not None:
        (out / "results.md").write_text(markdown, encoding="utf-8")
        (out / "results.json").write_text(json.dumps(result, indent=1, default=json_default) + "\n")
        if plot_chart(result, out / "results.png"):
            result["chart"] = str(out / "results.png")
    say(markdown)
    return result


def main(
    argv: Sequence[str] | None = None, *, default_out_dir: str | os.PathLike[str] | None = None
) -> int:
    """Command line (``python benchmarks/run.py``, whose results go beside it by default, or
    ``python -m tsbench``, which writes files only with --out-dir)."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/run.py",
        description="Benchmark torch_serialized against torchvision's VOCDetection.",
    )
    parser.add_argument("--root", help="torchvision's VOC root (default: generate synthetic VOC)")
    parser.add_argument("--year", help="VOC year of --root (default: found in its folders)")
    parser.add_argument("--num-images", type=int, default=2000, help="synthetic images")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--out-dir",
        default=default_out_dir,
        help="write results.md/.json/.png here"
        + (f" (default: {default_out_dir})" if default_out_dir else " (default: print only)"),
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)} (default: all), or "
        f"{','.join(OPTIONAL_SCENARIOS)} (only when asked)",
    )
    parser.add_argument("--workers", type=int, default=2, help="pack and DataLoader processes")
    parser.add_argument("--work-dir", help="keep generated data and packs here")
    parser.add_argument("--quick", action="store_true", help="64 images, 1 repeat")
    args = parser.parse_args(argv)
    result = run_benchmark(
        args.root,
        year=args.year,
        num_images=args.num_images,
        repeats=args.repeats,
        out_dir=args.out_dir,
        scenarios=[s.strip() for s in args.scenarios.split(",") if s.strip()],
        quick=args.quick,
        workers=args.workers,
        work_dir=args.work_dir,
        progress=True,
    )
    return 0 if result["config"]["scenarios"] else 1
