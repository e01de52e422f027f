"""``torch-serialized demo`` and ``bench``'s measurements: torchvision's ``VOCDetection`` and a
pack timed on the same samples. Each figure is a median with its range (min-max); a row
whose two ranges overlap says "within noise", never a speed-up."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import statistics
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision.datasets import VOCDetection, wrap_dataset_for_transforms_v2
from torchvision.transforms import v2
from torchvision.transforms.functional import pil_to_tensor

from .. import VOCSerializedDataset, VOCSerializedIterableDataset

__all__ = ["run_demo", "Comparison", "Spread", "Measurements", "check_against_torchvision"]

_NUM_CHECKED = 5
#: Above this share of pages still cached after eviction, cold figures are not cold.
_COLD_LIMIT = 0.05
ROW = "      {:<34} {:>25} {:>26}   {}"


@dataclass(frozen=True)
class Spread:
    """Samples per second over several runs: median, minimum and maximum."""

    median: float
    low: float
    high: float
    runs: int = 3

    @classmethod
    def of_rates(cls, samples: int, seconds: Sequence[float]) -> Spread:
        rates = [samples / max(s, 1e-9) for s in seconds]
        return cls(statistics.median(rates), min(rates), max(rates), len(rates))

    def __str__(self) -> str:
        if self.runs < 2:  # one run has no range
            return f"{self.median:,.0f}/s"
        return f"{self.median:,.0f}/s ({self.low:,.0f}-{self.high:,.0f})"


@dataclass(frozen=True)
class Comparison:
    """One measurement, torchvision's ``VOCDetection`` against the pack."""

    name: str
    torchvision: Spread
    ours: Spread

    @property
    def ratio(self) -> float:
        return self.ours.median / self.torchvision.median

    @property
    def within_noise(self) -> bool:
        """The two ranges overlap: the runs cannot tell the two apart."""
        return self.ours.low <= self.torchvision.high and self.torchvision.low <= self.ours.high

    @property
    def once(self) -> bool:
        """Measured once: no range says what is noise."""
        return min(self.ours.runs, self.torchvision.runs) < 2

    @property
    def verdict(self) -> str:
        if self.once:
            return f"{self.ratio:.2f}x, one run"
        if self.within_noise:
            return f"{self.ratio:.2f}x, within noise"
        return f"{self.ratio:.2f}x {'faster' if self.ratio > 1 else 'slower'}"


def _time_runs(
    variants: Mapping[str, Callable[[], object]],
    runs: int,
    before: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds of each variant's runs, taking turns; ``before`` runs untimed before each."""
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(runs):
        for name, run in variants.items():
            if before is not None:
                before()
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    return seconds


def _each(get: Callable[[int], object], order: Sequence[int]) -> Callable[[], object]:
    return lambda: deque(map(get, order), maxlen=0)


def _read_bytes_and_target(tv: VOCDetection, i: int) -> None:
    """What torchvision does for a sample, minus decoding: open, read, parse the XML."""
    with open(tv.images[i], "rb") as f:
        f.read()
    tv.parse_voc_xml(ET.parse(tv.annotations[i]).getroot())


def list_collate(batch: Sequence[tuple[Any, Any]]) -> tuple[tuple[Any, ...], ...]:
    """``(images, targets)`` as tuples: detection images differ in size, so no stacking."""
    return tuple(zip(*batch))


def _evict(paths: Iterable[str]) -> float | None:
    """Drop the files from the page cache; the share of pages still cached (None: not Linux)."""
    os.sync()  # DONTNEED leaves dirty pages in place
    pages = cached = 0
    for path in paths:
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            size = os.fstat(f.fileno()).st_size
            if size == 0 or sys.platform != "linux":
                continue
            vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mapped:
                address = np.frombuffer(mapped, np.uint8).ctypes.data  # no view outlives this
                failed = ctypes.CDLL(None).mincore(
                    ctypes.c_void_p(address), ctypes.c_size_t(size), vec
                )
        if failed:
            return None
        pages += len(vec)
        cached += sum(v & 1 for v in vec)
    return cached / pages if pages else None


@dataclass(kw_only=True)
class Measurements:
    """``VOCDetection`` at ``root`` and ``pack`` timed on ``limit`` samples of ``image_set`` in
    random order (default all): ``runs`` runs of warm undecoded reads, ``slow_runs`` of the rest."""

    root: Path
    pack: Path
    year: str
    image_set: str
    workers: int = 2
    batch_size: int = 16
    runs: int = 5
    slow_runs: int = 3
    limit: int | None = None
    notes: list[str] = field(default_factory=list)  # printed under the table

    def __post_init__(self) -> None:
        self.tv = self.torchvision()
        self.order = np.random.default_rng(0).permutation(len(self.tv))[: self.limit].tolist()
        self.n = len(self.order)

    @property
    def how(self) -> str:
        if (self.runs, self.slow_runs) == (1, 1):
            return "one run each"
        return (
            f"median of {self.runs} runs (warm reads) or {self.slow_runs} (the rest) with (min-max)"
        )

    def torchvision(self, **kwargs: Any) -> VOCDetection:
        return VOCDetection(str(self.root), year=self.year, image_set=self.image_set, **kwargs)

    def ours(self, **kwargs: Any) -> VOCSerializedDataset:
        return VOCSerializedDataset(self.pack, image_set=self.image_set, **kwargs)

    def table(
        self, out: Callable[[str], None], scenarios: Sequence[str] | None = None
    ) -> list[Comparison]:
        """Time ``scenarios`` (default all), print their rows, a summary and the notes."""
        measures = {
            "bytes": self.time_bytes,
            "cold": self.time_cold,
            "decoded": self.time_decoded,
            "tensor": self.time_tensor,
            "dataloader": self.time_dataloader,
        }
        out(ROW.format("", "torchvision", "torch_serialized", "ratio"))
        rows: list[Comparison] = []
        for name, measure in measures.items():
            if scenarios is not None and name not in scenarios:
                continue
            try:
                found = measure()
            except ValueError as exc:  # e.g. float box coordinates in torchvision's v2 wrapper
                why = str(exc).strip().splitlines()[-1]  # a worker's: the traceback, then this
                self.notes.append(
                    f"{name}: not measured, torchvision cannot read the data so: {why}"
                )
                continue
            for row in found:
                out(ROW.format(row.name, str(row.torchvision), str(row.ours), row.verdict))
            rows += found
        for line in summarize(rows) + [part for n in self.notes for part in textwrap.wrap(n, 94)]:
            out(f"      {line}")
        return rows

    def _compare(
        self, name: str, runs: int, tv: Callable[[int], object], ours: Callable[[int], object]
    ) -> Comparison:
        """Both sides getting every sample of ``order`` in turns, ``runs`` times."""
        seconds = _time_runs({"tv": _each(tv, self.order), "ours": _each(ours, self.order)}, runs)
        rates = (Spread.of_rates(self.n, seconds[side]) for side in ("tv", "ours"))
        return Comparison(name, *rates)

    def time_bytes(self) -> list[Comparison]:
        """Image bytes + target dict in random order, warm cache, in this process."""
        tv = partial(_read_bytes_and_target, self.tv)
        return [
            self._compare(name, self.runs, tv, self.ours(decode="none", **options).__getitem__)
            for name, options in (
                ("bytes + dict, warm", {}),
                ("bytes + dict, warm, zero_copy=True", {"zero_copy": True}),
            )
        ]

    def time_cold(self) -> list[Comparison]:
        """One epoch of image bytes + target dict after both sides' files left the page cache."""
        if not hasattr(os, "posix_fadvise"):
            self.notes.append("cold reads: not measured, dropping files needs posix_fadvise")
            return []
        voc = Path(self.tv.images[0]).parents[1]
        files = [*(str(p) for p in voc.rglob("*") if p.is_file()), str(self.pack)]
        left: list[float] = []

        def evict() -> None:
            gc.collect()  # no dataset of an earlier run may still map the pack
            share = _evict(files)
            if share is not None:
                left.append(share)

        stream = partial(  # every sample of the set: the stream has no subset
            VOCSerializedIterableDataset, self.pack, self.image_set, shuffle=True, decode="none"
        )
        runs = {  # each run opens its datasets anew
            "tv": lambda: _each(partial(_read_bytes_and_target, self.torchvision()), self.order)(),
            "map": lambda: _each(self.ours(decode="none").__getitem__, self.order)(),
            "stream": lambda: deque(stream(), maxlen=0),
        }
        seconds = _time_runs(runs, self.slow_runs, before=evict)
        if not left:
            how = "page cache dropped with posix_fadvise; mincore unavailable, not checked"
        elif max(left) > _COLD_LIMIT:
            how = f"NOT COLD: up to {max(left):.0%} of the files stayed cached after eviction"
        else:
            how = f"page cache dropped before each run; mincore: at most {max(left):.1%} left"
        self.notes.append(f"cold reads: {how}")
        tv = Spread.of_rates(self.n, seconds["tv"])
        map_style = Spread.of_rates(self.n, seconds["map"])
        stream_rate = Spread.of_rates(len(self.tv), seconds["stream"])
        return [
            Comparison("bytes + dict, cold, map-style", tv, map_style),
            Comparison("bytes + dict, cold, iterable", tv, stream_rate),
        ]

    def time_decoded(self) -> list[Comparison]:
        """Decoded PIL images in this process: the drop-in against ``VOCDetection``."""
        tv, ours = self.tv.__getitem__, self.ours().__getitem__
        return [self._compare("PIL image + dict (drop-in)", self.slow_runs, tv, ours)]

    def time_tensor(self) -> list[Comparison]:
        """uint8 CHW tensors: ``VOCDetection`` + ``pil_to_tensor`` against ``decode="tensor"``."""
        tv, ours = lambda i: pil_to_tensor(self.tv[i][0]), self.ours(decode="tensor").__getitem__
        return [self._compare("uint8 tensor, decode='tensor'", self.slow_runs, tv, ours)]

    def time_dataloader(self) -> list[Comparison]:
        """Epochs of the drop-in through a DataLoader, transforms v2, persistent workers."""
        # uint8 images until the training step: float32 ones cost four times more to send
        flip = v2.Compose([v2.ToImage(), v2.RandomHorizontalFlip(p=0.5)])
        theirs = self.torchvision(transforms=flip)
        loaders = {
            "tv": self._loader(
                wrap_dataset_for_transforms_v2(theirs, target_keys={"boxes", "labels"})
            ),
            "ours": self._loader(self.ours(transforms=flip, target_format="tv_tensors")),
        }
        epochs: dict[str, Callable[[], object]] = {
            side: partial(deque, loader, 0) for side, loader in loaders.items()
        }
        for epoch in epochs.values():  # worker start-up happens here, outside the timing
            epoch()
        seconds = _time_runs(epochs, self.slow_runs)
        rates = (Spread.of_rates(self.n, seconds[side]) for side in ("tv", "ours"))
        return [Comparison("DataLoader epoch, drop-in", *rates)]

    def _loader(self, dataset: Dataset) -> DataLoader:
        return DataLoader(
            dataset if self.n == len(self.tv) else Subset(dataset, self.order),
            batch_size=self.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
            num_workers=self.workers,
            persistent_workers=self.workers > 0,
            collate_fn=list_collate,
        )


def summarize(comparisons: Sequence[Comparison]) -> list[str]:
    """Plain words: where the pack wins beyond noise, and what is within noise."""
    once = [f"{c.name} {c.ratio:.2f}x" for c in comparisons if c.once]
    comparisons = [c for c in comparisons if not c.once]
    wins = [f"{c.name} {c.ratio:.1f}x" for c in comparisons if not c.within_noise and c.ratio > 1]
    noise = [c.name for c in comparisons if c.within_noise]
    losses = [
        f"{c.name} {c.ratio:.2f}x" for c in comparisons if not c.within_noise and c.ratio <= 1
    ]
    text = [f"Measured once, so nothing is claimed: {'; '.join(once)}."] if once else []
    if wins:
        text.append(f"Faster beyond noise: {'; '.join(wins)}.")
    if noise:
        text.append(
            f"Within noise, so no speed-up is claimed: {'; '.join(noise)} (where JPEG "
            "decoding dominates, both sides pay the same for it)."
        )
    if losses:
        text.append(f"Slower: {'; '.join(losses)}.")
    return [line for paragraph in text for line in textwrap.wrap(paragraph, 94)]


def check_against_torchvision(
    pack: Path, root: Path, year: str, image_set: str, count: int = _NUM_CHECKED
) -> None:
    """Check ``count`` evenly spaced samples against torchvision's (pixels, dicts, boxes)."""
    ours = VOCSerializedDataset(pack, image_set=image_set)
    theirs = VOCDetection(str(root), year=year, image_set=image_set)
    ours_tv = VOCSerializedDataset(pack, image_set=image_set, target_format="tv_tensors")
    theirs_tv = wrap_dataset_for_transforms_v2(theirs, target_keys={"boxes", "labels"})
    tensors = VOCSerializedDataset(pack, image_set=image_set, decode="tensor")
    problems = []
    if len(ours) != len(theirs):
        problems.append(f"length {len(ours)} != torchvision's {len(theirs)}")
    indices = np.linspace(0, min(len(ours), len(theirs)) - 1, num=count).round().astype(int)
    for i in sorted(set(indices.tolist())):
        (img, target), (ref_img, ref_target) = ours[i], theirs[i]
        if img.size != ref_img.size or not np.array_equal(np.asarray(img), np.asarray(ref_img)):
            problems.append(f"sample {i}: image pixels differ")
        if target != ref_target:
            problems.append(f"sample {i}: target dict differs")
        if not torch.equal(tensors[i][0], pil_to_tensor(ref_img)):
            problems.append(f"sample {i}: decode='tensor' pixels differ")
        try:
            ref_tv = theirs_tv[i][1]
        except ValueError:  # torchvision's v2 wrapper reads no float coordinates: no reference
            continue
        tv_target = ours_tv[i][1]
        for key in ("boxes", "labels"):
            if not torch.equal(tv_target[key].as_subclass(torch.Tensor), ref_tv[key]):
                problems.append(f"sample {i}: tv_tensors {key} differ")
    if problems:
        raise RuntimeError(f"{pack} differs from torchvision's VOCDetection: {'; '.join(problems)}")


def run_demo(
    *,
    num_images: int = 200,
    workers: int = 2,
    directory: str | os.PathLike[str] | None = None,
    batch_size: int = 16,
    out: Callable[[str], None] = print,
) -> list[Comparison]:
    """``bench`` on ``num_images`` generated VOC2012 images (kept in ``directory``); its results."""
    from .bench import run_benchmark

    started = time.perf_counter()
    out("The built-in sample: deterministic synthetic JPEGs, XML and masks, packed into one file")
    result = run_benchmark(
        num_images=num_images, workers=workers, work_dir=directory, batch_size=batch_size, out=out
    )
    out(
        f"      Demo time {time.perf_counter() - started:.0f} s. On your own data: "
        "`torch-serialized bench ROOT`."
    )
    if directory is not None:
        out(f"Data kept in {directory}; try: torch-serialized info {result['config']['pack']}")
    return [
        Comparison(row["name"], Spread(**row["torchvision"]), Spread(**row["ours"]))
        for row in result["rows"]
    ]
