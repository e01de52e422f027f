"""The ``pack`` scenario: pack time with 1 and N processes, and size on disk."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tsbench import lmdb_store
from tsbench.context import Bench
from tsbench.core import MB, PEER, Row, Stat, rates
from tsbench.system import files_under, pack_file_paths


def scenario_pack(b: Bench) -> list[Row]:
    from torch_serialized import pack_voc

    widths = sorted({1, max(1, b.workers)})
    seconds: dict[int, list[float]] = {w: [] for w in widths}
    # CPU seconds of the writing process and of its pack processes: with enough cores the writer's
    # share per sample is the ceiling of a parallel pack (2 cores cannot show the scaling).
    cpu: dict[int, dict[str, list[float]]] = {
        w: {"writer": [], "pack_processes": []} for w in widths
    }
    digests: set[str] = set()
    result: Any = None
    for r in range(b.repeats):
        for w in widths:
            out = b.work / f"pack-r{r}-w{w}.tser"
            before = _cpu_seconds()
            result = pack_voc(b.tv_root, out, year=b.year, workers=w)
            after = _cpu_seconds()
            seconds[w].append(result.seconds)
            for k in ("writer", "pack_processes"):
                cpu[w][k].append((after[k] - before[k]) / max(1, result.num_samples))
            digests.add(_sha256(result.path))
            if b.pack is None:
                b.pack = result.path
            elif result.path != b.pack:
                result.path.unlink()
        if b.lmdb_missing is None:  # the LMDB baseline, written in the same repeat
            written = b.work / f"lmdb-r{r}"
            b.lmdb_seconds.append(lmdb_store.build(b.tv(), written))
            if b.lmdb_path is None:
                b.lmdb_path = written
            else:
                shutil.rmtree(written)
    identical = len(digests) == 1
    # The same with every image decoded (check_images=True): per-sample work is then CPU-bound,
    # which shows how packing scales with processes even on a machine with 2 cores.
    checked: dict[int, list[float]] = {w: [] for w in widths} if len(widths) > 1 else {}
    for r in range(b.repeats if checked else 0):
        for w in widths:
            out = b.work / f"pack-checked-r{r}-w{w}.tser"
            done = pack_voc(b.tv_root, out, year=b.year, workers=w, check_images=True)
            checked[w].append(done.seconds)
            done.path.unlink()
    startup = _import_seconds("torch_serialized.voc.pack") if b.workers > 1 else None
    n = result.num_samples
    pack_size = result.num_bytes
    source_files = files_under(b.voc_root)
    source_apparent = sum(os.stat(p).st_size for p in source_files)
    source_allocated = sum(os.stat(p).st_blocks * 512 for p in source_files)
    pack_allocated = sum(os.stat(p).st_blocks * 512 for p in pack_file_paths(b.packed()))
    store = b.lmdb_path
    lmdb_allocated = (
        sum(os.stat(p).st_blocks * 512 for p in lmdb_store.store_files(store)) if store else 0
    )
    b.details["pack"] = {
        "num_samples": n,
        "pack_processes": widths,
        "seconds": {str(w): s for w, s in seconds.items()},
        "cpu_seconds_per_sample": {str(w): c for w, c in cpu.items()},
        "check_images_seconds": {str(w): s for w, s in checked.items()},
        "outputs_identical": identical,
        "pack_process_import_seconds": startup,
        "pack_bytes": pack_size,
        "pack_allocated_bytes": pack_allocated,
        "source_bytes_packed": result.source_bytes,
        "source_folder_bytes": source_apparent,
        "source_folder_allocated_bytes": source_allocated,
        "source_files": len(source_files),
    }
    rows = []
    for w in widths:
        mbps = Stat.of([pack_size / s / MB for s in seconds[w]])
        writer_us = Stat.of(cpu[w]["writer"]).median * 1e6
        processes_us = Stat.of(cpu[w]["pack_processes"]).median * 1e6
        share = (
            f"; CPU per sample: {writer_us:.0f} µs in the writing process (with enough cores "
            f"at most ~{1e6 / writer_us:,.0f} samples/s), {processes_us:.0f} µs in the pack "
            "processes"
            if w > 1 and writer_us > 0
            else ""
        )
        rows.append(
            Row(
                f"pack_{w}",
                "pack",
                f"pack, {w} process{'es' if w > 1 else ''}",
                "samples/s",
                "info",
                None,
                rates(n, seconds[w]),
                peer=rates(n, b.lmdb_seconds) if w == 1 and b.lmdb_seconds else None,
                peer_missing=b.lmdb_missing or "",
                note=f"{mbps.median:.0f} MB/s written"
                + (
                    f"; {PEER}: read files, parse XML as torchvision, put, sync"
                    if w == 1 and b.lmdb_seconds
                    else ""
                )
                + (
                    ""
                    if w == 1
                    else f"; output identical to 1 process: {identical}; a spawned pack process "
                    f"needs {startup:.1f} s to import torch_serialized.voc.pack"
                )
                + share,
            )
        )
    main_row = rows[-1]
    for w, times in checked.items():
        speedup = float(np.median(checked[1])) / float(np.median(times))
        rows.append(
            Row(
                f"pack_checked_{w}",
                "pack",
                f"pack with check_images=True, {w} process{'es' if w > 1 else ''}",
                "samples/s",
                "info",
                None,
                rates(n, times),
                note="every image decoded at pack time: CPU-bound work"
                + (f"; {speedup:.2f}x the 1-process rate" if w > 1 else ""),
            )
        )
    rows.append(
        Row(
            "pack_size",
            "pack",
            "size on disk (allocated)",
            "MB",
            "cost",
            Stat.of([source_allocated / MB]),
            Stat.of([pack_allocated / MB]),
            peer=Stat.of([lmdb_allocated / MB]) if lmdb_allocated else None,
            peer_missing=b.lmdb_missing or "",
            note=f"source folder: {len(source_files)} files, {source_apparent / MB:.1f} MB "
            f"apparent; pack adds parsed targets and object arrays",
        )
    )
    if not identical:
        main_row.met = False
        main_row.reason = "packs written with 1 and N processes differ: a determinism bug"
    return rows


def _cpu_seconds() -> dict[str, float]:
    """User + system CPU seconds of this process and of its ended children so far."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return {
        "writer": own.ru_utime + own.ru_stime,
        "pack_processes": children.ru_utime + children.ru_stime,
    }


def _import_seconds(module: str) -> float:
    """Seconds a fresh interpreter takes to import ``module`` (a spawned pack process's start)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    return time.perf_counter() - start


def _sha256(path: Path) -> str:
    """A digest of what a pack holds, identical for packs of the same records whatever their
    random pack id, file-name token and packing time (each container's bytes before its
    metadata, and the metadata without its ``pack`` binding and history times; the manifest
    only restates those)."""
    from torch_serialized.container import spec as fmt

    digest = hashlib.sha256()
    for part in sorted(pack_file_paths(path)):
        if os.path.basename(part) == fmt.MANIFEST_NAME:
            continue
        data = Path(part).read_bytes()
        footer = fmt.unpack_footer(data[-fmt.FOOTER_SIZE :], str(part))
        meta = json.loads(data[footer["meta_offset"] : -fmt.FOOTER_SIZE])
        meta.pop("pack", None)
        for entry in meta.get("user", {}).get("history", []):
            entry.pop("at", None)  # when it was packed: the only byte a clock decides
        digest.update(os.path.basename(part).split("-")[0].encode())
        digest.update(data[: footer["meta_offset"]])
        digest.update(json.dumps(meta, sort_keys=True).encode())
    return digest.hexdigest()
