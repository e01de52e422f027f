"""Side-by-side benchmark: torch_serialized against ``torchvision.datasets.VOCDetection``.

Both read the same data (a generated synthetic VOCdevkit, or a real one), in the same process,
in the same run, with the same index order; every figure is the median of ``repeats``
measurements (min and max kept) and every claim is a ratio to torchvision measured alongside,
so a noisy machine moves both sides together. The variants of one scenario are interleaved
within each repeat. Scenarios (``SCENARIOS``):

- ``pack``: pack time with 1 and ``workers`` processes (outputs must be byte-identical) and
  size on disk against the source folder.
- ``bytes``: warm random access without image decode: torchvision's open + read + ``ET.parse``
  + ``parse_voc_xml`` against ``decode="none"`` (dict target, and ``"tv_tensors"`` target).
- ``decoded``: warm random access to PIL images, against ``VOCDetection`` and against a bare
  PIL decode of in-memory bytes (our overhead over the decode itself).
- ``tensor``: CHW uint8 tensors: ``VOCDetection`` + ``pil_to_tensor`` against
  ``decode="tensor"`` on the original JPEGs and on a raw-pixel pack.
- ``dataloader``: epochs of a ``DataLoader`` (``workers`` workers, batch 32, list collate).
- ``cold``: page cache evicted (``posix_fadvise(DONTNEED)``, checked with ``mincore``) before
  each run: map-style random access including opening, and one shuffled iterable epoch.
- ``memory``: USS/PSS/anonymous memory of each DataLoader worker from ``smaps_rollup`` at the
  start and end of its first epoch.

Results go to ``out_dir``: ``results.md`` (the table), ``results.json`` (everything, with the
environment) and ``results.png`` (ratios; needs matplotlib, imported only here). Run it with
``python benchmarks/run.py`` or ``torch-serialized bench``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import gc
import hashlib
import io
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SCENARIOS", "PEER_BEST", "run_benchmark", "main"]

#: Scenario names, in the order they run.
SCENARIOS: tuple[str, ...] = (
    "pack",
    "bytes",
    "decoded",
    "tensor",
    "cold",
    "dataloader",
    "memory",
)

#: Best peer per row, from /work/shared/PEERS.md (2,000 synthetic images, 2 cores): the ratio to
#: torchvision (or, for packing, samples/s) and who reached it. For reference only.
PEER_BEST: dict[str, tuple[float, str]] = {
    "pack_1": (3581.0, "LMDB"),
    "bytes_random_dict": (5.3, "FFCV format"),
    "bytes_sequential_dict": (5.7, "FFCV format"),
    "decoded_pil": (1.09, "FFCV format"),
    "dataloader_tensor": (1.04, "HF datasets"),
    "cold_random": (3.6, "LMDB"),
    "cold_iterable": (5.6, "FFCV format"),
}

_IMAGE_SET = "trainval"
_MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
_BATCH_SIZE = 32
_SEED = 0
_MB = 1e6
_MIB = 1 << 20


# -- measurements ------------------------------------------------------------------------------
@dataclass
class Stat:
    """Median, minimum and maximum of repeated measurements of one quantity."""

    median: float
    min: float
    max: float
    values: list[float]

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        vals = [float(v) for v in values]
        return cls(float(np.median(vals)), min(vals), max(vals), vals)


@dataclass
class Row:
    """One line of the results table.

    ``kind`` says how ``torchvision`` (the baseline) and ``ours`` compare:
    ``"rate"`` (higher is better, ratio = ours / baseline, target = minimum ratio),
    ``"cost"`` (lower is better, ratio = baseline / ours, target = minimum ratio),
    ``"overhead"`` (ratio = ours / baseline - 1, target = maximum overhead),
    ``"limit"`` (no ratio; target = maximum value of ``ours``),
    ``"info"`` (no ratio, no target).
    """

    key: str
    scenario: str
    name: str
    unit: str
    kind: str
    baseline: Stat | None
    ours: Stat | None
    target: float | None = None
    note: str = ""
    ratio: float | None = None
    met: bool | None = None
    peer_best: tuple[float, str] | None = None
    reason: str = ""  # why the target is missed, when it is

    def finish(self) -> Row:
        self.peer_best = PEER_BEST.get(self.key)
        b = self.baseline.median if self.baseline else None
        o = self.ours.median if self.ours else None
        if self.ratio is not None:  # set by the scenario (e.g. a median of paired ratios)
            pass
        elif self.kind == "rate" and b and o:
            self.ratio = o / b
        elif self.kind == "cost" and b and o:
            self.ratio = b / o
        elif self.kind == "overhead" and b and o:
            self.ratio = o / b - 1.0
        if self.target is not None and self.met is None:
            if self.kind in ("rate", "cost") and self.ratio is not None:
                self.met = self.ratio >= self.target
            elif self.kind == "overhead" and self.ratio is not None:
                self.met = self.ratio <= self.target
            elif self.kind == "limit" and o is not None:
                self.met = o < self.target
        return self


def _interleaved(
    variants: dict[str, Callable[[], Any]], repeats: int
) -> dict[str, tuple[list[float], list[float]]]:
    """Run each variant once per repeat, in turn; wall and CPU seconds of every run."""
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            wall0, cpu0 = time.perf_counter(), time.process_time()
            fn()
            times[name][0].append(time.perf_counter() - wall0)
            times[name][1].append(time.process_time() - cpu0)
    return times


def _rates(n: int, seconds: Sequence[float]) -> Stat:
    return Stat.of([n / s for s in seconds])


def _per_sample_us(n: int, seconds: Sequence[float]) -> Stat:
    return Stat.of([s / n * 1e6 for s in seconds])


def _loop(get: Callable[[int], Any], indices: Sequence[int], passes: int = 1) -> Callable[[], None]:
    def run() -> None:
        for _ in range(passes):
            for i in indices:
                get(i)

    return run


# -- page cache ---------------------------------------------------------------------------------
class PageCache:
    """Evict files from the page cache and count their resident pages (Linux)."""

    def __init__(self) -> None:
        self.fadvise = hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")
        self._libc: Any = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_long,
            ]
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            self._libc = libc
        except (OSError, AttributeError):
            self._libc = None

    @property
    def can_check(self) -> bool:
        return self._libc is not None and sys.platform.startswith("linux")

    def evict(self, paths: Iterable[str]) -> None:
        """Write back dirty pages, then drop every file's cached pages."""
        if not self.fadvise:
            return
        os.sync()  # DONTNEED leaves dirty pages in place
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def resident(self, paths: Iterable[str]) -> float | None:
        """Fraction of the files' pages in the page cache (``mincore``), or None if unknown."""
        if not self.can_check:
            return None
        libc, page = self._libc, os.sysconf("SC_PAGE_SIZE")
        total = cached = 0
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                if size == 0:
                    continue
                addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                try:
                    pages = (size + page - 1) // page
                    vec = (ctypes.c_ubyte * pages)()
                    if libc.mincore(addr, size, vec) != 0:
                        return None
                    cached += sum(v & 1 for v in bytes(vec))
                    total += pages
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
        return cached / total if total else 0.0


def _files_under(folder: Path) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(folder) for f in files]


def _pack_files(path: Path) -> list[str]:
    return _files_under(path) if path.is_dir() else [str(path)]


def _read_all(paths: Iterable[str], chunk: int = 4 * _MIB) -> None:
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(chunk):
                pass


# -- memory -------------------------------------------------------------------------------------
def _smaps(pid: int) -> dict[str, float]:
    """Memory of a process in MB: USS, PSS, RSS, anonymous (``smaps_rollup``) and ``heap``.

    ``heap`` is the private dirty memory of anonymous mappings (heap, stacks, anonymous
    mmaps), from ``/proc/PID/smaps``: what the process allocated or copied on write from its
    parent. It leaves out file mappings (the pack) and shared memory (``/dev/shm`` segments of
    batches in flight to the main process), both of which move USS and PSS.
    """
    kb: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                kb[parts[0][:-1]] = int(parts[1])
    heap = 0
    anonymous = False
    with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as f:
        for line in f:
            first = line.split(maxsplit=6)
            if first and not first[0].endswith(":"):  # a mapping's header line
                name = first[5].strip() if len(first) > 5 else ""
                anonymous = not name or (name.startswith("[") and name != "[vvar]")
            elif anonymous and first[0] == "Private_Dirty:":
                heap += int(first[1])
    return {
        "uss": (kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)) * 1024 / _MB,
        "pss": kb.get("Pss", 0) * 1024 / _MB,
        "rss": kb.get("Rss", 0) * 1024 / _MB,
        "anon": kb.get("Anonymous", 0) * 1024 / _MB,
        "heap": heap * 1024 / _MB,
    }


def _keep_lists(batch: list[tuple[Any, Any]]) -> tuple[list[Any], list[Any]]:
    """Detection collate: images and targets as two lists (sizes differ, nothing stacked)."""
    images, targets = zip(*batch)
    return list(images), list(targets)


# -- the run ------------------------------------------------------------------------------------
@dataclass
class _Bench:
    tv_root: Path
    year: str
    work: Path
    repeats: int
    quick: bool
    workers: int
    pack: Path | None = None
    raw_pack: Path | None = None
    raw_pack_seconds: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    cache: PageCache = field(default_factory=PageCache)

    # Datasets are built on demand and not kept: a live dataset would pin its mmap, and
    # mapped pages cannot be evicted by the cold-cache scenario.
    def tv(self, **kwargs: Any) -> Any:
        from torchvision.datasets import VOCDetection

        return VOCDetection(str(self.tv_root), year=self.year, image_set=_IMAGE_SET, **kwargs)

    def ours(self, path: Path | None = None, **kwargs: Any) -> Any:
        from .datasets import VOCSerializedDataset

        return VOCSerializedDataset(path or self.packed(), _IMAGE_SET, **kwargs)

    def packed(self) -> Path:
        if self.pack is None:
            from .voc.packer import pack_voc

            self.pack = pack_voc(self.tv_root, self.work / "voc.tser", year=self.year).path
        return self.pack

    def raw_packed(self) -> Path:
        if self.raw_pack is None:
            from .voc.packer import pack_voc

            result = pack_voc(
                self.tv_root, self.work / "voc-raw.tser", year=self.year, image_storage="raw"
            )
            self.raw_pack, self.raw_pack_seconds = result.path, result.seconds
        return self.raw_pack

    @property
    def voc_root(self) -> Path:
        from .voc.layout import find_voc_root

        return find_voc_root(self.tv_root, self.year)[0]

    def indices(self, n: int, limit: int | None = None) -> list[int]:
        """A fixed random order over ``n`` samples (the first ``limit`` of it)."""
        perm = np.random.default_rng(_SEED).permutation(n)
        return [int(i) for i in perm[:limit]]


def _scenario_pack(b: _Bench) -> list[Row]:
    from .voc.packer import pack_voc

    widths = sorted({1, max(1, b.workers)})
    seconds: dict[int, list[float]] = {w: [] for w in widths}
    digests: set[str] = set()
    result: Any = None
    for r in range(b.repeats):
        for w in widths:
            out = b.work / f"pack-r{r}-w{w}.tser"
            result = pack_voc(b.tv_root, out, year=b.year, workers=w)
            seconds[w].append(result.seconds)
            digests.add(_sha256(result.path))
            if b.pack is None:
                b.pack = result.path
            elif result.path != b.pack:
                result.path.unlink()
    identical = len(digests) == 1
    startup = _import_seconds("torch_serialized.voc.packer") if b.workers > 1 else None
    n = result.num_samples
    pack_size = result.num_bytes
    source_files = _files_under(b.voc_root)
    source_apparent = sum(os.stat(p).st_size for p in source_files)
    source_allocated = sum(os.stat(p).st_blocks * 512 for p in source_files)
    pack_allocated = sum(os.stat(p).st_blocks * 512 for p in _pack_files(b.packed()))
    b.details["pack"] = {
        "num_samples": n,
        "workers": widths,
        "seconds": {str(w): s for w, s in seconds.items()},
        "outputs_identical": identical,
        "pack_worker_import_seconds": startup,
        "pack_bytes": pack_size,
        "pack_allocated_bytes": pack_allocated,
        "source_bytes_packed": result.source_bytes,
        "source_folder_bytes": source_apparent,
        "source_folder_allocated_bytes": source_allocated,
        "source_files": len(source_files),
    }
    rows = []
    for w in widths:
        mbps = Stat.of([pack_size / s / _MB for s in seconds[w]])
        rows.append(
            Row(
                f"pack_{w}",
                "pack",
                f"pack, {w} process{'es' if w > 1 else ''}",
                "samples/s",
                "info",
                None,
                _rates(n, seconds[w]),
                note=f"{mbps.median:.0f} MB/s written"
                + (
                    ""
                    if w == 1
                    else f"; output identical to 1 process: {identical}; a spawned worker "
                    f"needs {startup:.1f} s to import torch_serialized.voc.packer"
                ),
            )
        )
    rows.append(
        Row(
            "pack_size",
            "pack",
            "size on disk (allocated)",
            "MB",
            "cost",
            Stat.of([source_allocated / _MB]),
            Stat.of([pack_allocated / _MB]),
            note=f"source folder: {len(source_files)} files, {source_apparent / _MB:.1f} MB "
            f"apparent; pack adds parsed targets and object arrays",
        )
    )
    if not identical:
        rows[-2].met = False
        rows[-2].reason = "packs written with 1 and N processes differ: a determinism bug"
    return rows


def _import_seconds(module: str) -> float:
    """Seconds a fresh interpreter takes to import ``module`` (a spawned pack worker's start)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    return time.perf_counter() - start


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    for part in sorted(_pack_files(path)):
        digest.update(os.path.relpath(part, path).encode() if path.is_dir() else b"")
        with open(part, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def _tv_bytes_getter(tv: Any) -> Callable[[int], Any]:
    """What ``VOCDetection.__getitem__`` does, minus the decode: read bytes, parse the XML."""
    from torchvision.datasets.voc import ET_parse

    images, annotations, parse = tv.images, tv.annotations, tv.parse_voc_xml

    def get(i: int) -> Any:
        with open(images[i], "rb") as f:
            data = f.read()
        return data, parse(ET_parse(annotations[i]).getroot())

    return get


def _check_same(b: _Bench, tv: Any, ours: Any, count: int = 50) -> bool:
    """Ours returns torchvision's bytes and target for a sample of indices."""
    get = _tv_bytes_getter(tv)
    for i in b.indices(len(tv), count):
        data, target = get(i)
        mine, my_target = ours[i]
        if bytes(mine.numpy()) != data or my_target != target:
            return False
    return True


def _scenario_bytes(b: _Bench) -> list[Row]:
    from .voc import codec

    tv = b.tv()
    dict_ds = b.ours(decode="none")
    fast_ds = b.ours(decode="none", target_format="tv_tensors")
    n = len(tv)
    order = b.indices(n)
    sequential = list(range(n))
    passes = 1 if b.quick else 3
    same = _check_same(b, tv, dict_ds)
    tv_get = _tv_bytes_getter(tv)
    pack, records = dict_ds.pack, dict_ds.records

    # Floors: the two steps any copying decode="none" + dict target must take.
    def copy_image(i: int) -> Any:
        return np.frombuffer(pack.field(int(records[i]), codec.IMAGE), np.uint8).copy()

    def parse_target(i: int) -> Any:
        return json.loads(bytes(pack.field(int(records[i]), codec.TARGET)))

    for get in (tv_get, dict_ds.__getitem__, fast_ds.__getitem__):  # warm caches and maps
        _loop(get, sequential)()
    times = _interleaved(
        {
            "tv": _loop(tv_get, order, passes),
            "dict": _loop(dict_ds.__getitem__, order, passes),
            "fast": _loop(fast_ds.__getitem__, order, passes),
            "tv_seq": _loop(tv_get, sequential, passes),
            "dict_seq": _loop(dict_ds.__getitem__, sequential, passes),
            "copy_image": _loop(copy_image, order, passes),
            "json_target": _loop(parse_target, order, passes),
        },
        b.repeats,
    )
    count = n * passes
    wall = {k: _per_sample_us(count, v[0]).median for k, v in times.items()}
    cpu = {k: _per_sample_us(count, v[1]).median for k, v in times.items()}
    b.details["bytes"] = {
        "same_output_as_torchvision": same,
        "passes": passes,
        "samples": n,
        "wall_us_per_sample": wall,
        "cpu_us_per_sample": cpu,
    }
    note_us = "µs/sample (wall, CPU): tv {:.0f}, {:.0f}; ours {:.1f}, {:.1f}"
    floor = wall["copy_image"] + wall["json_target"]

    def why(key: str, target: float) -> str:
        budget = wall["tv"] / target
        text = (
            f"{target:g}x needs ≤ {budget:.1f} µs/sample, ours takes {wall[key]:.1f}; copying the "
            f"~{_mean_image_kb(pack, records):.0f} KB image alone takes {wall['copy_image']:.1f} µs"
        )
        if key == "dict":
            text += f" and json.loads of the target {wall['json_target']:.1f} µs ({floor:.1f})"
        else:
            rest = wall[key] - wall["copy_image"]
            text += f"; building the tv_tensors target and the rest takes {rest:.1f} µs"
        return text

    rows = [
        Row(
            "bytes_random_dict",
            "bytes",
            "bytes + dict target, random, warm",
            "samples/s",
            "rate",
            _rates(count, times["tv"][0]),
            _rates(count, times["dict"][0]),
            target=8.0,
            note=note_us.format(wall["tv"], cpu["tv"], wall["dict"], cpu["dict"])
            + f"; same output as tv: {same}",
            reason=why("dict", 8.0),
        ),
        Row(
            "bytes_random_fast",
            "bytes",
            "bytes + tv_tensors target, random, warm",
            "samples/s",
            "rate",
            _rates(count, times["tv"][0]),
            _rates(count, times["fast"][0]),
            target=20.0,
            note=note_us.format(wall["tv"], cpu["tv"], wall["fast"], cpu["fast"]),
            reason=why("fast", 20.0),
        ),
        Row(
            "bytes_sequential_dict",
            "bytes",
            "bytes + dict target, sequential, warm",
            "samples/s",
            "rate",
            _rates(count, times["tv_seq"][0]),
            _rates(count, times["dict_seq"][0]),
            note=note_us.format(wall["tv_seq"], cpu["tv_seq"], wall["dict_seq"], cpu["dict_seq"]),
        ),
    ]
    if not same:
        rows[0].met = False
        rows[0].reason = "ours did not return torchvision's bytes and target: a correctness bug"
    return rows


def _mean_image_kb(pack: Any, records: np.ndarray) -> float:
    from .voc import codec

    sample = records[:: max(1, len(records) // 100)]
    return float(np.mean([len(pack.field(int(r), codec.IMAGE)) for r in sample])) / 1e3


def _scenario_decoded(b: _Bench) -> list[Row]:
    from PIL import Image

    tv = b.tv()
    ours = b.ours(decode="pil")
    n = len(tv)
    order = b.indices(n)
    payloads = []
    for i in order:
        with open(tv.images[i], "rb") as f:
            payloads.append(f.read())

    def pure() -> None:
        for data in payloads:
            Image.open(io.BytesIO(data)).convert("RGB")

    _loop(tv.__getitem__, order[:32])()
    _loop(ours.__getitem__, order[:32])()
    times = _interleaved(
        {"tv": _loop(tv.__getitem__, order), "ours": _loop(ours.__getitem__, order), "pure": pure},
        b.repeats,
    )
    b.details["decoded"] = {
        "samples": n,
        "ms_per_sample": {k: _per_sample_us(n, v[0]).median / 1e3 for k, v in times.items()},
    }
    pure_ms = Stat.of([s / n * 1e3 for s in times["pure"][0]])
    ours_ms = Stat.of([s / n * 1e3 for s in times["ours"][0]])
    # Paired per repeat (the two ran back to back), so slow spells of the machine cancel.
    paired = [o / p - 1.0 for o, p in zip(times["ours"][0], times["pure"][0])]
    b.details["decoded"]["overhead_per_repeat"] = paired
    return [
        Row(
            "decoded_pil",
            "decoded",
            "PIL image + dict target, random, 1 process",
            "samples/s",
            "rate",
            _rates(n, times["tv"][0]),
            _rates(n, times["ours"][0]),
            note="decode-bound: the JPEG decode is the same libjpeg call on both sides",
        ),
        Row(
            "decoded_overhead",
            "decoded",
            "overhead over a bare PIL decode (tv col: bare decode)",
            "ms/sample",
            "overhead",
            pure_ms,
            ours_ms,
            target=0.05,
            ratio=float(np.median(paired)),
            note="bare decode = Image.open(BytesIO(bytes)).convert('RGB') of preloaded bytes; "
            "overhead = median over repeats of ours / bare decode - 1 (paired)",
            reason=f"ours {ours_ms.median:.2f} ms vs bare decode {pure_ms.median:.2f} ms per "
            f"sample; run-to-run spread of the bare decode alone is "
            f"{(pure_ms.max - pure_ms.min) / pure_ms.median:.0%}",
        ),
    ]


def _scenario_tensor(b: _Bench) -> list[Row]:
    from torchvision.transforms.functional import pil_to_tensor

    tv = b.tv(transform=pil_to_tensor)
    ours = b.ours(decode="tensor")
    raw = b.ours(b.raw_packed(), decode="tensor")
    n = len(tv)
    order = b.indices(n)
    for ds in (tv, ours, raw):
        _loop(ds.__getitem__, order[:32])()
    times = _interleaved(
        {
            "tv": _loop(tv.__getitem__, order),
            "ours": _loop(ours.__getitem__, order),
            "raw": _loop(raw.__getitem__, order),
        },
        b.repeats,
    )
    raw_bytes = sum(os.path.getsize(p) for p in _pack_files(b.raw_packed()))
    b.details["tensor"] = {
        "samples": n,
        "raw_pack_bytes": raw_bytes,
        "raw_pack_seconds": b.raw_pack_seconds,
    }
    return [
        Row(
            "tensor_jpeg",
            "tensor",
            "CHW uint8 tensor, random (decode_jpeg)",
            "samples/s",
            "rate",
            _rates(n, times["tv"][0]),
            _rates(n, times["ours"][0]),
            target=1.3,
            note="tv: PIL decode + convert + pil_to_tensor; ours: torchvision.io.decode_jpeg",
            reason="decode_jpeg (libjpeg-turbo in torchvision) is decode-bound like PIL; the gain "
            "is only the skipped PIL->tensor conversion",
        ),
        Row(
            "tensor_raw",
            "tensor",
            "CHW uint8 tensor, random, raw-pixel pack",
            "samples/s",
            "rate",
            _rates(n, times["tv"][0]),
            _rates(n, times["raw"][0]),
            target=4.0,
            note=f"raw pack: {raw_bytes / _MB:.0f} MB on disk",
            reason="copying ~0.5 MB of pixels per sample bounds it (memory bandwidth)",
        ),
    ]


def _iterable_class() -> tuple[Any, str | None]:
    """The iterable dataset class, or None and why it cannot be imported."""
    try:
        from .iterable import VOCSerializedIterableDataset
    except Exception as exc:  # missing, or broken while it is being written
        return None, f"{type(exc).__name__}: {exc}"
    return VOCSerializedIterableDataset, None


def _scenario_cold(b: _Bench) -> list[Row]:
    cache = b.cache
    pack = b.packed()
    source = _files_under(b.voc_root)
    pack_files = _pack_files(pack)
    n = len(b.tv())
    order = b.indices(n)
    gc.collect()
    iterable_cls, iterable_error = _iterable_class()

    def tv_run() -> int:
        get = _tv_bytes_getter(b.tv())
        for i in order:
            get(i)
        return len(order)

    def ours_run() -> int:
        ds = b.ours(decode="none")
        get = ds.__getitem__
        for i in order:
            get(i)
        return len(order)

    def iterable_run() -> int:
        ds = iterable_cls(pack, _IMAGE_SET, shuffle=True, seed=_SEED, decode="none")
        return sum(1 for _ in ds)

    variants: dict[str, tuple[list[str], Callable[[], int]]] = {
        "tv": (source, tv_run),
        "ours": (pack_files, ours_run),
    }
    if iterable_cls is not None:
        variants["iterable"] = (pack_files, iterable_run)

    def ceiling_run() -> int:
        _read_all(pack_files, chunk=_MIB)
        return len(order)

    # A block-shuffled reader (the iterable) cannot read in file order: its ceiling is the
    # same bytes read in chunks of one block (64 records) taken in random order.
    block_bytes = 64 * max(1, sum(os.path.getsize(p) for p in pack_files) // max(1, n))

    def shuffled_blocks_run() -> int:
        chunks = [(p, o) for p in pack_files for o in range(0, os.path.getsize(p), block_bytes)]
        for k in np.random.default_rng(_SEED).permutation(len(chunks)):
            path, offset = chunks[int(k)]
            fd = os.open(path, os.O_RDONLY)
            try:
                os.pread(fd, block_bytes, offset)
            finally:
                os.close(fd)
        return len(order)

    variants["ceiling"] = (pack_files, ceiling_run)
    variants["ceiling_blocks"] = (pack_files, shuffled_blocks_run)
    seconds: dict[str, list[float]] = {k: [] for k in variants}
    counts: dict[str, int] = {}
    residency: dict[str, dict[str, list[float | None]]] = {
        k: {"before": [], "after_evict": [], "after_run": []} for k in variants
    }
    for _ in range(b.repeats):
        for name, (files, run) in list(variants.items()):
            gc.collect()  # no dataset of ours may keep the pack mapped: mapped pages stay
            residency[name]["before"].append(cache.resident(files))
            cache.evict(files)
            residency[name]["after_evict"].append(cache.resident(files))
            start = time.perf_counter()
            try:
                counts[name] = run()
            except Exception as exc:  # a broken iterable must not hide the other results
                if name != "iterable":
                    raise
                iterable_error = f"{type(exc).__name__}: {exc}"
                del variants[name]
                continue
            seconds[name].append(time.perf_counter() - start)
            residency[name]["after_run"].append(cache.resident(files))
    if iterable_error is not None:
        iterable_cls = None
    evicted = [r for v in residency.values() for r in v["after_evict"] if r is not None]
    worst = max(evicted) if evicted else None
    b.details["cold"] = {
        "fadvise_supported": cache.fadvise,
        "mincore_check": cache.can_check,
        "resident_fraction": residency,
        "worst_resident_after_evict": worst,
        "read_ahead_kb": _read_ahead_kb(b.work),
        "samples": counts,
    }
    if not cache.fadvise:
        state = "NOT COLD: posix_fadvise unsupported"
    elif worst is None:
        state = "eviction not checked (no mincore)"
    elif worst > 0.05:
        state = f"NOT FULLY COLD: {worst:.0%} of pages still cached after eviction"
    else:
        state = f"evicted (≤{worst:.1%} resident, mincore)"
    tv_rate = float(np.median([counts["tv"] / t for t in seconds["tv"]]))
    pack_mb = sum(os.path.getsize(p) for p in pack_files) / _MB

    def why(name: str, target: float, limit: str) -> str:
        ceiling = float(np.median([counts[limit] / t for t in seconds[limit]])) / tv_rate
        how = {
            "ceiling": "a plain sequential read()",
            "ceiling_blocks": "reading shuffled 64-record chunks",
        }
        moved = (
            f"ours moved {pack_mb / float(np.median(seconds[name])):.0f} MB/s, "
            f"{how[limit]} {pack_mb / float(np.median(seconds[limit])):.0f} MB/s"
        )
        if ceiling < target:
            return f"the disk caps {how[limit]} of this pack at {ceiling:.1f}x tv; {moved}"
        return f"{how[limit]} reaches {ceiling:.1f}x tv, so the reader is the limit; {moved}"

    rows = [
        Row(
            "cold_random",
            "cold",
            "cold cache, bytes + dict target, random, incl. open",
            "samples/s",
            "rate",
            _rates(counts["tv"], seconds["tv"]),
            _rates(counts["ours"], seconds["ours"]),
            target=5.0,
            note=state,
            reason=why("ours", 5.0, "ceiling"),
        )
    ]
    iterable_note = state
    if iterable_error is not None:
        iterable_note = f"torch_serialized.iterable failed, not measured: {iterable_error}"
    rows.append(
        Row(
            "cold_iterable",
            "cold",
            "cold cache, iterable epoch (shuffle) vs tv random, incl. open",
            "samples/s",
            "rate",
            _rates(counts["tv"], seconds["tv"]),
            _rates(counts["iterable"], seconds["iterable"]) if iterable_cls else None,
            target=8.0,
            note=iterable_note,
            reason=why("iterable", 8.0, "ceiling_blocks") if iterable_cls else "",
        )
    )
    rows.append(
        Row(
            "cold_ceiling",
            "cold",
            "cold cache, plain read() of the whole pack (I/O ceiling)",
            "samples/s",
            "rate",
            _rates(counts["tv"], seconds["tv"]),
            _rates(counts["ceiling"], seconds["ceiling"]),
            note="sequential 1 MiB reads, no parsing: the most any reader of this file can do",
        )
    )
    rows.append(
        Row(
            "cold_ceiling_blocks",
            "cold",
            "cold cache, read() of the pack in shuffled 64-record chunks (I/O ceiling)",
            "samples/s",
            "rate",
            _rates(counts["tv"], seconds["tv"]),
            _rates(counts["ceiling_blocks"], seconds["ceiling_blocks"]),
            note=f"{block_bytes / _MB:.1f} MB preads in random order: the most a reader that "
            "shuffles 64-record blocks (the iterable's default) can do",
        )
    )
    return rows


def _read_ahead_kb(path: Path) -> int | None:
    """Read-ahead of the block device holding ``path`` (None where unknown, e.g. overlayfs)."""
    dev = os.stat(path).st_dev
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for candidate in (base / "queue" / "read_ahead_kb", base / ".." / "queue" / "read_ahead_kb"):
        try:
            return int(candidate.read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def _loader(ds: Any, workers: int) -> Any:
    import torch
    from torch.utils.data import DataLoader

    return DataLoader(
        ds,
        batch_size=_BATCH_SIZE,
        shuffle=True,
        num_workers=workers,
        collate_fn=_keep_lists,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(_SEED),
    )


def _epoch(loader: Any) -> Callable[[], None]:
    def run() -> None:
        for _images, _targets in loader:
            pass

    return run


def _shutdown(loader: Any) -> None:
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None


def _worker_pids(iterator: Any) -> list[int]:
    return [int(p.pid) for p in getattr(iterator, "_workers", []) if p.pid]


def _scenario_dataloader(b: _Bench) -> list[Row]:
    """One warm-up epoch per variant, then timed epochs interleaved across the variants.

    The three loaders keep their persistent workers alive side by side (idle ones sleep).
    """
    from torchvision.transforms.functional import pil_to_tensor

    datasets = {
        "tv": b.tv(transform=pil_to_tensor),
        "tensor": b.ours(decode="tensor"),
        "pil": b.ours(decode="pil", transform=pil_to_tensor),
    }
    n = len(datasets["tv"])
    loaders = {k: _loader(ds, b.workers) for k, ds in datasets.items()}
    try:
        for loader in loaders.values():
            _epoch(loader)()
        times = _interleaved({k: _epoch(v) for k, v in loaders.items()}, b.repeats)
    finally:
        for loader in loaders.values():
            _shutdown(loader)
    b.details["dataloader"] = {"samples": n, "workers": b.workers, "batch_size": _BATCH_SIZE}
    tv = _rates(n, times["tv"][0])
    return [
        Row(
            "dataloader_tensor",
            "dataloader",
            f"DataLoader epoch, {b.workers} workers, bs {_BATCH_SIZE}, decode='tensor'",
            "samples/s",
            "rate",
            tv,
            _rates(n, times["tensor"][0]),
            note="tv: VOCDetection + pil_to_tensor; after one warm-up epoch, persistent workers",
        ),
        Row(
            "dataloader_pil",
            "dataloader",
            f"DataLoader epoch, {b.workers} workers, bs {_BATCH_SIZE}, decode='pil' + to tensor",
            "samples/s",
            "rate",
            tv,
            _rates(n, times["pil"][0]),
            note="same decode as tv: shows the loader overhead alone",
        ),
    ]


def _memory_child(config: dict[str, Any]) -> dict[str, list[dict[str, float]]]:
    """Worker memory over two epochs of one loader, measured in a fresh process.

    Runs in a child interpreter so the parent the workers fork from holds only what a
    training script would: the imports, the dataset and the loader. Returns one ``_smaps``
    dict per worker after the first batch (``start``), at the end of epoch 1 (``epoch1``)
    and at the end of epoch 2 (``last``).
    """
    from torchvision.datasets import VOCDetection
    from torchvision.transforms.functional import pil_to_tensor

    from .datasets import VOCSerializedDataset

    if config["variant"] == "tv":
        root, year = config["root"], config["year"]
        ds: Any = VOCDetection(root, year=year, image_set=_IMAGE_SET, transform=pil_to_tensor)
    else:
        ds = VOCSerializedDataset(config["pack"], _IMAGE_SET, decode="tensor")
    loader = _loader(ds, config["workers"])
    try:
        iterator = iter(loader)
        next(iterator)  # the workers are up and have touched the dataset
        pids = _worker_pids(iterator)
        memory = {"start": [_smaps(p) for p in pids]}
        for _batch in iterator:
            pass
        memory["epoch1"] = [_smaps(p) for p in pids]
        del iterator
        _epoch(loader)()
        memory["last"] = [_smaps(p) for p in pids]
    finally:
        _shutdown(loader)
    return memory


def _memory_run(
    b: _Bench, variant: str, env: dict[str, str] | None = None
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
        "from torch_serialized.benchmark import _memory_child\n"
        "print(json.dumps(_memory_child(json.loads(sys.argv[1]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(config)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    result: dict[str, list[dict[str, float]]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _growth(runs: list[dict[str, list[dict[str, float]]]], key: str, a: str, z: str) -> Stat:
    """Per run, the largest per-worker growth of ``key`` from moment ``a`` to ``z``."""
    return Stat.of(
        [max(e[key] - s[key] for s, e in zip(run[a], run[z])) for run in runs if run[a]]
        or [math.nan]
    )


def _scenario_memory(b: _Bench) -> list[Row]:
    if b.workers < 1:
        b.details["memory"] = {"skipped": "needs DataLoader workers (workers >= 1)"}
        note = "not measured: workers=0"
        return [
            Row(
                "memory_heap_growth", "memory", "worker memory", "MB", "info", None, None, note=note
            )
        ]
    runs: dict[str, list[dict[str, list[dict[str, float]]]]] = {"tv": [], "tensor": []}
    for _ in range(b.repeats):
        for variant, got in runs.items():
            got.append(_memory_run(b, variant))
    # Diagnostic: glibc's dynamic mmap threshold keeps freed large buffers (decoded images)
    # in the heap; a fixed threshold returns them to the system at once.
    fixed = [_memory_run(b, "tensor", {_MMAP_ENV: str(128 * 1024)})]
    b.details["memory"] = {"workers": b.workers, "per_worker_mb": runs, "fixed_threshold": fixed}
    tv, ours = runs["tv"], runs["tensor"]
    fixed_growth = _growth(fixed, "heap", "start", "epoch1")
    fixed_later = _growth(fixed, "heap", "epoch1", "last")
    first = "largest worker's growth from after its first batch to the end of epoch 1"
    later = "largest worker's growth over epoch 2"
    fresh = "; each run in a fresh process (parent = imports + dataset + loader)"
    return [
        Row(
            "memory_heap_growth",
            "memory",
            "worker heap growth (private anonymous: heap + copy-on-write), epoch 1",
            "MB",
            "limit",
            _growth(tv, "heap", "start", "epoch1"),
            _growth(ours, "heap", "start", "epoch1"),
            target=5.0,
            note=first + fresh,
            reason="memory written by the worker: allocator caching or copy-on-write of the "
            "parent's objects (run by the garbage collector); with "
            f"{_MMAP_ENV}=131072 ours grows {fixed_growth.median:.1f} MB (next rows): glibc "
            "keeping freed decode buffers is "
            + ("the cause" if fixed_growth.median < 5.0 else "not the whole cause"),
        ),
        Row(
            "memory_heap_fixed",
            "memory",
            f"epoch-1 heap growth, ours with {_MMAP_ENV}=131072 (diagnostic, 1 run)",
            "MB",
            "info",
            None,
            fixed_growth,
            note="a fixed glibc mmap threshold: large freed buffers go back to the system",
        ),
        Row(
            "memory_heap_later",
            "memory",
            "worker heap growth, epoch 2",
            "MB",
            "limit",
            _growth(tv, "heap", "epoch1", "last"),
            _growth(ours, "heap", "epoch1", "last"),
            target=5.0,
            note=later,
            reason="memory kept from epoch to epoch; with "
            f"{_MMAP_ENV}=131072 ours grows {fixed_later.median:.1f} MB in epoch 2",
        ),
        Row(
            "memory_uss_growth",
            "memory",
            "worker USS growth, epoch 1",
            "MB",
            "info",
            _growth(tv, "uss", "start", "epoch1"),
            _growth(ours, "uss", "start", "epoch1"),
            note=first + "; USS also counts pack pages mapped by this worker alone, and "
            "batches in flight in shared memory",
        ),
        Row(
            "memory_pss_growth",
            "memory",
            "worker PSS growth, epoch 1",
            "MB",
            "info",
            _growth(tv, "pss", "start", "epoch1"),
            _growth(ours, "pss", "start", "epoch1"),
            note=first + "; for ours mostly the worker's share of the mapped pack (page cache)",
        ),
        Row(
            "memory_uss_total",
            "memory",
            f"Σ USS of the {b.workers} workers at the end of epoch 2",
            "MB",
            "cost",
            Stat.of([sum(w["uss"] for w in run["last"]) for run in tv]),
            Stat.of([sum(w["uss"] for w in run["last"]) for run in ours]),
            note="peers: tv 208, FFCV format 255, Mosaic 230 MB",
        ),
    ]


_RUNNERS: dict[str, Callable[[_Bench], list[Row]]] = {
    "pack": _scenario_pack,
    "bytes": _scenario_bytes,
    "decoded": _scenario_decoded,
    "tensor": _scenario_tensor,
    "cold": _scenario_cold,
    "dataloader": _scenario_dataloader,
    "memory": _scenario_memory,
}


# -- environment and reports ---------------------------------------------------------------------
def _environment(work: Path) -> dict[str, Any]:
    import PIL
    import torch
    import torchvision
    from PIL import features

    from ._version import __version__

    cpu_model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu_model = next((ln.split(":", 1)[1].strip() for ln in f if "model name" in ln), None)
    except OSError:
        pass
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = None
    try:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        memory_gb = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_serialized": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "numpy": np.__version__,
        "pillow": PIL.__version__,
        "libjpeg_turbo": features.version("libjpeg_turbo"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "cpu_model": cpu_model,
        "memory_gb": round(memory_gb, 1) if memory_gb else None,
        "read_ahead_kb": _read_ahead_kb(work),
        "torch_threads": torch.get_num_threads(),
    }


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "–"
    if unit == "ms/sample":
        return f"{value:.2f}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}"


def _cell(stat: Stat | None, unit: str) -> str:
    if stat is None:
        return "–"
    if stat.min == stat.max:
        return _fmt(stat.median, unit)
    return f"{_fmt(stat.median, unit)} ({_fmt(stat.min, unit)}–{_fmt(stat.max, unit)})"


def _ratio_cell(row: Row) -> str:
    if row.ratio is None:
        return "–"
    if row.kind == "overhead":
        return f"{row.ratio:+.1%}"
    return f"{row.ratio:.2f}x"


def _target_cell(row: Row) -> str:
    if row.target is None:
        return "–"
    if row.kind == "overhead":
        return f"≤ {row.target:+.0%}"
    if row.kind == "limit":
        return f"< {row.target:g} {row.unit}"
    return f"≥ {row.target:g}x"


def _peer_cell(row: Row) -> str:
    if row.peer_best is None:
        return "–"
    value, who = row.peer_best
    return f"{value:,.0f}/s {who}" if row.key.startswith("pack") else f"{value:g}x {who}"


def _verdict(row: Row) -> str:
    return {True: "met", False: "**MISSED**", None: "–"}[row.met]


def render_markdown(result: dict[str, Any]) -> str:
    """The results table (with environment line and misses) as Markdown."""
    env, cfg = result["environment"], result["config"]
    lines = [
        "# torch_serialized vs torchvision VOCDetection",
        "",
        f"{cfg['num_images']} images ({cfg['data']}), image set {_IMAGE_SET!r}, "
        f"{cfg['repeats']} repeat(s), median (min–max); {env['cpus_usable']} usable CPUs "
        f"({env['cpu_model']}), torch {env['torch']}, torchvision {env['torchvision']}, "
        f"Pillow {env['pillow']}, read-ahead {env['read_ahead_kb']} KiB; {env['date']}.",
        "",
        "| scenario | unit | torchvision | torch_serialized | ×tv | target | peer best | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = [r for s in result["scenarios"].values() for r in s["rows"]]
    for r in rows:
        row = _row_from_dict(r)
        lines.append(
            f"| {row.name} | {row.unit} | {_cell(row.baseline, row.unit)} | "
            f"{_cell(row.ours, row.unit)} | {_ratio_cell(row)} | {_target_cell(row)} | "
            f"{_peer_cell(row)} | {_verdict(row)} |"
        )
    notes = [f"- {r['name']}: {r['note']}" for r in rows if r["note"]]
    if notes:
        lines += ["", "Notes:", "", *notes]
    if result["misses"]:
        lines += ["", "Missed targets:", "", *[f"- {m}" for m in result["misses"]]]
    return "\n".join(lines) + "\n"


def _row_from_dict(d: dict[str, Any]) -> Row:
    stats = {k: Stat(**d[k]) if d[k] else None for k in ("baseline", "ours")}
    peer = tuple(d["peer_best"]) if d["peer_best"] else None
    return Row(**{**d, **stats, "peer_best": peer})  # type: ignore[arg-type]


def _miss_text(row: Row) -> str:
    value = _ratio_cell(row) if row.ratio is not None else _cell(row.ours, row.unit)
    return f"{row.name}: {value} vs target {_target_cell(row)}: {row.reason or 'see details'}"


def _plot(result: dict[str, Any], path: Path) -> bool:
    """Bar chart of the ratios to torchvision with targets and peer bests; False without mpl."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [
        _row_from_dict(r)
        for s in result["scenarios"].values()
        for r in s["rows"]
        if r["kind"] in ("rate", "cost") and r["ratio"] is not None
    ]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    y = np.arange(len(rows))[::-1]
    colours = [{True: "#2a7", False: "#d55", None: "#89a"}[r.met] for r in rows]
    ratios = [float(r.ratio or 0.0) for r in rows]
    ax.barh(y, ratios, color=colours)
    for yi, r, ratio in zip(y, rows, ratios):
        ax.text(ratio * 1.03, yi, f"{ratio:.2f}x", va="center", fontsize=8)
        if r.target is not None:
            ax.plot([r.target], [yi], "k|", markersize=14)
        if r.peer_best is not None and not r.key.startswith("pack"):
            ax.plot([r.peer_best[0]], [yi], "bx", markersize=6)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_yticks(y, [r.name for r in rows], fontsize=8)
    ax.set_xlabel("ratio to torchvision VOCDetection (log; | target, x peer best)")
    ax.set_title(f"torch_serialized, {result['config']['num_images']} images")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- entry points --------------------------------------------------------------------------------
def run_benchmark(
    root: str | None = None,
    *,
    year: str = "2012",
    num_images: int = 2000,
    repeats: int = 3,
    out_dir: str = "benchmarks/out",
    scenarios: Sequence[str] | None = None,
    quick: bool = False,
    workers: int = 2,
    work_dir: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the scenarios and write ``results.md``, ``results.json`` and ``results.png``.

    ``root`` is torchvision's VOC root; without it ``num_images`` synthetic images are generated
    (in ``work_dir``, or a temporary folder removed afterwards). ``quick`` uses 64 images and one
    repeat (for tests). ``workers`` is both the pack processes and the DataLoader workers (the
    memory scenario uses at least one). ``progress`` prints each scenario as it starts and the
    table at the end. Returns what ``results.json`` holds (plus ``chart``, the PNG or None).
    """
    chosen = list(SCENARIOS if scenarios is None else scenarios)
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}; choose from {list(SCENARIOS)}")
    chosen = [s for s in SCENARIOS if s in chosen]
    if quick:
        num_images, repeats = min(num_images, 64), 1
    if repeats < 1 or num_images < 1 or workers < 0:
        raise ValueError("repeats and num_images must be at least 1, workers at least 0")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    temp = None if work_dir else tempfile.mkdtemp(prefix="tser-bench-")
    work = Path(work_dir or temp)  # type: ignore[arg-type]
    work.mkdir(parents=True, exist_ok=True)
    say = print if progress else (lambda *a, **k: None)
    try:
        if root is None:
            from .voc.synthetic import make_synthetic_voc

            say(f"generating {num_images} synthetic VOC images in {work / 'voc'} ...")
            tv_root = make_synthetic_voc(work / "voc", num_images, year=year, seed=_SEED)
            data = "synthetic"
        else:
            tv_root, data = Path(root), f"VOC at {root}"
        bench = _Bench(tv_root, year, work, repeats, quick, workers)
        if "pack" not in chosen:
            bench.packed()
        _read_all(_files_under(bench.voc_root))  # a warm start for the warm scenarios
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
        all_rows = [_row_from_dict(r) for s in scenario_results.values() for r in s["rows"]]
        result: dict[str, Any] = {
            "environment": _environment(work),
            "config": {
                "data": data,
                "num_images": len(bench.tv()),
                "year": year,
                "image_set": _IMAGE_SET,
                "repeats": repeats,
                "workers": workers,
                "quick": quick,
                "scenarios": chosen,
            },
            "scenarios": scenario_results,
            "misses": [_miss_text(r) for r in all_rows if r.met is False],
            "seconds": time.perf_counter() - started,
        }
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    markdown = render_markdown(result)
    (out / "results.md").write_text(markdown, encoding="utf-8")
    (out / "results.json").write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    result["chart"] = str(out / "results.png") if _plot(result, out / "results.png") else None
    say(markdown)
    return result


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    raise TypeError(f"cannot serialise {type(value).__name__}")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python benchmarks/run.py --num-images 2000 --out-dir benchmarks/out``."""
    parser = argparse.ArgumentParser(
        prog="torch-serialized bench",
        description="Benchmark torch_serialized against torchvision's VOCDetection.",
    )
    parser.add_argument("--root", help="torchvision's VOC root (default: generate synthetic VOC)")
    parser.add_argument("--year", default="2012")
    parser.add_argument("--num-images", type=int, default=2000, help="synthetic images")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", default="benchmarks/out")
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)}",
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


if __name__ == "__main__":
    sys.exit(main())
