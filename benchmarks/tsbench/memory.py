"""The ``memory`` scenario: DataLoader worker memory, measured in a fresh child process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tsbench.context import Bench
from tsbench.core import IMAGE_SET, MMAP_ENV, Row, Stat
from tsbench.loader import make_loader, run_epoch, shutdown_loader, worker_pids
from tsbench.system import smaps

PARALLEL_RUNS = 3  # child processes measured at once


def memory_child(config: dict[str, Any]) -> dict[str, list[dict[str, float]]]:
    """Worker memory over two epochs of one loader, measured in a fresh process.

    Runs in a child interpreter so the parent the workers fork from holds only what a
    training script would: the imports, the dataset and the loader. Returns one ``smaps``
    dict per worker after the first batch (``start``), at the end of epoch 1 (``epoch1``)
    and at the end of epoch 2 (``last``).
    """
    from torchvision.datasets import VOCDetection
    from torchvision.transforms.functional import pil_to_tensor

    from torch_serialized import VOCSerializedDataset

    if config["variant"] == "tv":
        root, year = config["root"], config["year"]
        ds: Any = VOCDetection(root, year=year, image_set=IMAGE_SET, transform=pil_to_tensor)
    elif config["variant"] == "pil":  # the drop-in: the same decode as torchvision's
        ds = VOCSerializedDataset(config["pack"], image_set=IMAGE_SET, transform=pil_to_tensor)
    else:
        ds = VOCSerializedDataset(config["pack"], image_set=IMAGE_SET, decode="tensor")
    loader = make_loader(ds, config["workers"])
    try:
        iterator = iter(loader)
        next(iterator)  # the workers are up and have touched the dataset
        pids = worker_pids(iterator)
        memory = {"start": [smaps(p) for p in pids]}
        for _batch in iterator:
            pass
        memory["epoch1"] = [smaps(p) for p in pids]
        del iterator
        run_epoch(loader)()
        memory["last"] = [smaps(p) for p in pids]
    finally:
        shutdown_loader(loader)
    return memory


def _memory_run(
    b: Bench, variant: str, env: dict[str, str] | None = None
) -> dict[str, list[dict[str, float]]]:
    config = {
        "variant": variant,
        "root": str(b.tv_root),
        "year": b.year,
        "pack": str(b.packed()),
        "workers": b.workers,
    }
    code = (
        "import json, sys\n"
        "from tsbench.memory import memory_child\n"
        "print(json.dumps(memory_child(json.loads(sys.argv[1]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(config)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {}), "PYTHONPATH": _with_tsbench()},
    )
    result: dict[str, list[dict[str, float]]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _with_tsbench() -> str:
    """``PYTHONPATH`` with the folder holding tsbench first: a child started with ``-c``
    gets none of this process's ``sys.path`` (``python benchmarks/run.py`` adds it)."""
    here = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)


def _growth(runs: list[dict[str, list[dict[str, float]]]], key: str, a: str, z: str) -> Stat:
    """Per run, the largest per-worker growth of ``key`` from moment ``a`` to ``z``."""
    return Stat.of(
        [max(e[key] - s[key] for s, e in zip(run[a], run[z])) for run in runs if run[a]]
        or [math.nan]
    )


def scenario_memory(b: Bench) -> list[Row]:
    if b.workers < 1:
        b.details["memory"] = {"skipped": "needs DataLoader workers (workers >= 1)"}
        note = "not measured: workers=0"
        return [
            Row(
                "memory_heap_growth", "memory", "worker memory", "MB", "info", None, None, note=note
            )
        ]
    variants = ["tv", "pil", "tensor"]
    # Diagnostic: glibc's dynamic mmap threshold keeps freed large buffers (decoded images)
    # in the heap; a fixed threshold returns them to the system at once.
    fixed_env = {MMAP_ENV: str(128 * 1024)}
    jobs = [(v, None) for _ in range(b.repeats) for v in variants] + [("tensor", fixed_env)]
    # Memory, not time, is measured: the children run side by side (each needs a torch import
    # and a loader; one after the other they took most of a quick run).
    with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
        done = list(pool.map(lambda job: _memory_run(b, *job), jobs))
    runs = {v: done[i : len(jobs) - 1 : len(variants)] for i, v in enumerate(variants)}
    fixed = done[-1:]
    b.details["memory"] = {"workers": b.workers, "per_worker_mb": runs, "fixed_threshold": fixed}
    tv, pil, tensor = runs["tv"], runs["pil"], runs["tensor"]
    fixed_growth = _growth(fixed, "heap", "start", "epoch1")
    fixed_later = _growth(fixed, "heap", "epoch1", "last")
    first = "largest worker's growth from after its first batch to the end of epoch 1"
    later = "largest worker's growth over epoch 2"
    fresh = "; each run in a fresh process (parent = imports + dataset + loader)"
    glibc = (
        f"with {MMAP_ENV}=131072 decode='tensor' grows {{:.1f}} MB: glibc keeping freed "
        "decode buffers (torchvision.io.decode_jpeg's output) is "
    )

    def cause(growth: float) -> str:
        return glibc.format(growth) + ("the cause" if growth < 5.0 else "not the whole cause")

    heap = "worker heap growth (private anonymous: heap + copy-on-write)"
    return [
        Row(
            "memory_heap_growth",
            "memory",
            f"{heap}, epoch 1, drop-in (decode='pil' + pil_to_tensor, as tv)",
            "MB",
            "limit",
            _growth(tv, "heap", "start", "epoch1"),
            _growth(pil, "heap", "start", "epoch1"),
            target=5.0,
            note=first + fresh,
            reason="memory written by the worker: allocator caching or copy-on-write of the "
            "parent's objects (run by the garbage collector)",
        ),
        Row(
            "memory_heap_growth_tensor",
            "memory",
            f"{heap}, epoch 1, decode='tensor'",
            "MB",
            "limit",
            _growth(tv, "heap", "start", "epoch1"),
            _growth(tensor, "heap", "start", "epoch1"),
            target=5.0,
            note=first + fresh,
            reason=cause(fixed_growth.median),
        ),
        Row(
            "memory_heap_fixed",
            "memory",
            f"epoch-1 heap growth, decode='tensor' with {MMAP_ENV}=131072 (diagnostic, 1 run)",
            "MB",
            "info",
            None,
            fixed_growth,
            note="a fixed glibc mmap threshold: large freed buffers go back to the system "
            "(it costs decode throughput: see README)",
        ),
        Row(
            "memory_heap_later",
            "memory",
            "worker heap growth, epoch 2, drop-in",
            "MB",
            "limit",
            _growth(tv, "heap", "epoch1", "last"),
            _growth(pil, "heap", "epoch1", "last"),
            target=5.0,
            note=later,
            reason="memory kept from epoch to epoch",
        ),
        Row(
            "memory_heap_later_tensor",
            "memory",
            "worker heap growth, epoch 2, decode='tensor'",
            "MB",
            "limit",
            _growth(tv, "heap", "epoch1", "last"),
            _growth(tensor, "heap", "epoch1", "last"),
            target=5.0,
            note=later,
            reason="memory kept from epoch to epoch; with "
            f"{MMAP_ENV}=131072 decode='tensor' grows {fixed_later.median:.1f} MB in epoch 2",
        ),
        Row(
            "memory_uss_growth",
            "memory",
            "worker USS growth, epoch 1, drop-in",
            "MB",
            "info",
            _growth(tv, "uss", "start", "epoch1"),
            _growth(pil, "uss", "start", "epoch1"),
            note=first + "; USS also counts pack pages mapped by this worker alone, and "
            "batches in flight in shared memory",
        ),
        Row(
            "memory_pss_growth",
            "memory",
            "worker PSS growth, epoch 1, drop-in",
            "MB",
            "info",
            _growth(tv, "pss", "start", "epoch1"),
            _growth(pil, "pss", "start", "epoch1"),
            note=first + "; for ours mostly the worker's share of the mapped pack (page cache)",
        ),
        Row(
            "memory_uss_total",
            "memory",
            f"Σ USS of the {b.workers} workers at the end of epoch 2, drop-in",
            "MB",
            "cost",
            Stat.of([sum(w["uss"] for w in run["last"]) for run in tv]),
            Stat.of([sum(w["uss"] for w in run["last"]) for run in pil]),
            note="USS counts the pack pages each worker mapped (page cache, shared and "
            "reclaimable); heap growth above is what a worker allocated",
        ),
    ]
