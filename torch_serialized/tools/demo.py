"""``torch-serialized demo``: generate the built-in sample, pack it, check it, measure it.

Everything runs offline in well under a minute on 2 cores: a deterministic synthetic VOC set
is written (``make_synthetic_voc``) and packed, a few samples are compared with torchvision's
``VOCDetection`` pixel for pixel and key for key, then the pack and ``VOCDetection`` are timed
side by side on the same samples, where a pack can win and where it cannot: bytes-level
access, a cold-cache epoch (both sides' files dropped from the page cache first, checked with
``mincore``), decoded images (PIL, the drop-in, and ``decode="tensor"``) and DataLoader epochs
with warm workers. Every figure is the median of several runs with its range (min-max), and a
comparison whose two ranges overlap is reported as within noise, never as a speed-up.
"""

# More than 400 lines: the four steps, the measurements and the words that report them, kept
# together so that every printed claim sits beside the code that measures it.

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision.datasets import VOCDetection, wrap_dataset_for_transforms_v2
from torchvision.transforms import v2
from torchvision.transforms.functional import pil_to_tensor

from .. import VOCSerializedDataset, VOCSerializedIterableDataset, pack_voc
from .pagecache import PageCache, files_under
from .synthetic import make_synthetic_voc

__all__ = ["run_demo", "list_collate", "Comparison", "Spread", "Measurements"]

_YEAR = "2012"
_IMAGE_SET = "trainval"
_NUM_CHECKED = 5
#: Runs per measurement: warm reads without decoding (cheap), and the rest (cold reads
#: evict the page cache before each run; decoding runs take seconds).
_FAST_RUNS, _RUNS = 5, 3
#: Above this fraction of pages still cached after eviction, cold figures are not cold.
_COLD_LIMIT = 0.05


def list_collate(batch: Sequence[tuple[Any, Any]]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``(images, targets)`` as tuples: detection images differ in size, so no stacking."""
    images, targets = zip(*batch)
    return images, targets


def detection_transforms() -> v2.Compose:
    """A detection training pipeline for the workers (boxes flipped with the image).

    Images stay uint8 until the training step converts them (on the GPU in real training):
    float32 images are four times larger to send from the workers to the main process.
    """
    return v2.Compose([v2.ToImage(), v2.RandomHorizontalFlip(p=0.5)])


@dataclass(frozen=True)
class Spread:
    """Samples per second over several runs: median, minimum and maximum."""

    median: float
    low: float
    high: float

    @classmethod
    def of_rates(cls, samples: int, seconds: Sequence[float]) -> Spread:
        rates = [samples / max(s, 1e-9) for s in seconds]
        return cls(statistics.median(rates), min(rates), max(rates))

    def __str__(self) -> str:
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
    def verdict(self) -> str:
        if self.within_noise:
            return f"{self.ratio:.2f}x, within noise"
        return f"{self.ratio:.2f}x {'faster' if self.ratio > 1 else 'slower'}"


def _time_runs(
    variants: Mapping[str, Callable[[], object]],
    runs: int,
    before: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds of each variant's runs, the variants taking turns within each round;
    ``before`` runs untimed before every run (e.g. to empty the page cache)."""
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(runs):
        for name, run in variants.items():
            if before is not None:
                before()
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    return seconds


def _each(get: Callable[[int], object], order: Sequence[int]) -> Callable[[], None]:
    """A run that fetches every index of ``order``."""

    def run() -> None:
        for i in order:
            get(i)

    return run


def _read_bytes_and_target(tv: VOCDetection, i: int) -> None:
    """What torchvision does for a sample, minus decoding: open, read, parse the XML."""
    with open(tv.images[i], "rb") as f:
        f.read()
    tv.parse_voc_xml(ET.parse(tv.annotations[i]).getroot())


class Measurements:
    """The data of one run (the demo's, or ``bench``'s) and the measurements over it:
    ``limit`` samples of ``image_set`` in random order (default all), ``runs`` runs of the
    warm reads without decoding and ``slow_runs`` of the rest."""

    def __init__(
        self,
        tv_root: Path,
        pack: Path,
        workers: int,
        batch_size: int,
        *,
        year: str = _YEAR,
        image_set: str = _IMAGE_SET,
        runs: int = _FAST_RUNS,
        slow_runs: int = _RUNS,
        limit: int | None = None,
    ) -> None:
        self.root, self.pack, self.year, self.image_set = tv_root, pack, year, image_set
        self.workers, self.batch_size = workers, batch_size
        self.runs, self.slow_runs = runs, slow_runs
        self.tv = self.torchvision()
        order = np.random.default_rng(0).permutation(len(self.tv))[:limit]
        self.order = order.tolist()
        self.n = len(self.order)
        self.cache = PageCache()

    def torchvision(self, **kwargs: Any) -> VOCDetection:
        return VOCDetection(str(self.root), year=self.year, image_set=self.image_set, **kwargs)

    def ours(self, **kwargs: Any) -> VOCSerializedDataset:
        return VOCSerializedDataset(self.pack, self.image_set, **kwargs)

    def compare(
        self, name: str, tv: Callable[[], None], ours: Callable[[], None], runs: int
    ) -> Comparison:
        seconds = _time_runs({"tv": tv, "ours": ours}, runs)
        return Comparison(
            name, Spread.of_rates(self.n, seconds["tv"]), Spread.of_rates(self.n, seconds["ours"])
        )

    def bytes_level(self) -> list[Comparison]:
        """Image bytes + target dict in random order, warm cache, in this process."""
        plain = self.ours(decode="none")
        views = self.ours(decode="none", zero_copy=True)
        tv = _each(lambda i: _read_bytes_and_target(self.tv, i), self.order)
        return [
            self.compare(name, tv, _each(ds.__getitem__, self.order), self.runs)
            for name, ds in (
                ("bytes + dict, warm", plain),
                ("bytes + dict, warm, zero_copy=True", views),
            )
        ]

    def cold(self) -> tuple[list[Comparison], str]:
        """One epoch of image bytes + target dict after both sides' files left the cache."""
        if not self.cache.fadvise:
            return [], "not measured: dropping files from the page cache needs posix_fadvise"
        source = files_under(Path(self.tv.images[0]).parents[1]) if self.n else []
        pack = [str(self.pack)]
        resident: list[float] = []

        def evict() -> None:
            gc.collect()  # no dataset of an earlier run may still map the pack
            self.cache.evict([*source, *pack])
            left = self.cache.resident([*source, *pack])
            if left is not None:
                resident.append(left)

        def tv_run() -> None:
            tv = self.torchvision()
            for i in self.order:
                _read_bytes_and_target(tv, i)

        def map_run() -> None:
            dataset = self.ours(decode="none")
            for i in self.order:
                dataset[i]

        def stream_run() -> None:  # every sample of the set: the stream has no subset
            stream = VOCSerializedIterableDataset(
                self.pack, self.image_set, shuffle=True, decode="none"
            )
            for _ in stream:
                pass

        runs = {"tv": tv_run, "map": map_run, "stream": stream_run}
        seconds = _time_runs(runs, self.slow_runs, before=evict)
        tv = Spread.of_rates(self.n, seconds["tv"])
        stream = Spread.of_rates(len(self.tv), seconds["stream"])
        rows = [
            Comparison(
                "bytes + dict, cold, map-style", tv, Spread.of_rates(self.n, seconds["map"])
            ),
            Comparison("bytes + dict, cold, iterable", tv, stream),
        ]
        if not resident:
            return rows, "page cache dropped with posix_fadvise; mincore unavailable, not checked"
        worst = max(resident)
        if worst > _COLD_LIMIT:
            return rows, (
                f"NOT COLD: up to {worst:.0%} of the files stayed cached after eviction, so "
                "these are not cold-cache figures"
            )
        return rows, f"page cache dropped before each run; mincore: at most {worst:.1%} left"

    def decoded(self) -> list[Comparison]:
        """Decoded PIL images in this process: the drop-in against ``VOCDetection``."""
        drop_in = self.ours()
        return [
            self.compare(
                "PIL image + dict (drop-in)",
                _each(self.tv.__getitem__, self.order),
                _each(drop_in.__getitem__, self.order),
                self.slow_runs,
            )
        ]

    def tensors(self) -> list[Comparison]:
        """uint8 CHW tensors: ``VOCDetection`` + ``pil_to_tensor`` against
        ``decode="tensor"``."""
        tensors = self.ours(decode="tensor")
        return [
            self.compare(
                "uint8 tensor, decode='tensor'",
                _each(lambda i: pil_to_tensor(self.tv[i][0]), self.order),
                _each(tensors.__getitem__, self.order),
                self.slow_runs,
            )
        ]

    def dataloader(self) -> list[Comparison]:
        """Epochs of the drop-in through a DataLoader with transforms v2 and warm
        (persistent) workers: the training loop as it is, JPEG decoding included."""
        transforms = detection_transforms()
        theirs = wrap_dataset_for_transforms_v2(
            self.torchvision(transforms=transforms), target_keys={"boxes", "labels"}
        )
        ours = self.ours(transforms=transforms, target_format="tv_tensors")
        epochs = {"tv": _epoch(self._loader(theirs)), "ours": _epoch(self._loader(ours))}
        for epoch in epochs.values():  # worker start-up happens here, outside the timing
            epoch()
        seconds = _time_runs(epochs, self.slow_runs)
        return [
            Comparison(
                "DataLoader epoch, drop-in",
                Spread.of_rates(self.n, seconds["tv"]),
                Spread.of_rates(self.n, seconds["ours"]),
            )
        ]

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


def _epoch(loader: DataLoader) -> Callable[[], None]:
    def run() -> None:
        for images, targets in loader:
            if len(images) != len(targets):
                raise RuntimeError(f"a batch has {len(images)} images, {len(targets)} targets")

    return run


def compare_with_torchvision(
    pack: Path,
    root: Path,
    count: int = _NUM_CHECKED,
    *,
    year: str = _YEAR,
    image_set: str = _IMAGE_SET,
) -> list[str]:
    """Check ``count`` evenly spaced samples against torchvision; return the mismatches."""
    ours = VOCSerializedDataset(pack, image_set)
    theirs = VOCDetection(str(root), year=year, image_set=image_set)
    ours_tv = VOCSerializedDataset(pack, image_set, target_format="tv_tensors")
    theirs_tv = wrap_dataset_for_transforms_v2(theirs, target_keys={"boxes", "labels"})
    tensors = VOCSerializedDataset(pack, image_set, decode="tensor")
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
    return problems


ROW = "      {:<34} {:>25} {:>26}   {}"


def print_table(out: Callable[[str], None], title: str | None, rows: Sequence[Comparison]) -> None:
    """``rows`` under ``title``, one line each: both sides' spread and the verdict."""
    if title:
        out(f"      {title}")
    for row in rows:
        out(ROW.format(row.name, str(row.torchvision), str(row.ours), row.verdict))


def run_demo(
    *,
    num_images: int = 200,
    workers: int = 2,
    directory: str | os.PathLike[str] | None = None,
    batch_size: int = 16,
    out: Callable[[str], None] = print,
) -> list[Comparison]:
    """Run the demo, printing what happens; return every comparison it measured."""
    started = time.perf_counter()
    with ExitStack() as stack:
        if directory is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tser-demo-")))
        else:
            root = Path(directory)
            root.mkdir(parents=True, exist_ok=True)
        out(f"[1/4] Generating the built-in sample: {num_images} synthetic VOC{_YEAR} images")
        out(f"      (deterministic JPEGs, XML and masks) in {root}")
        step = time.perf_counter()
        make_synthetic_voc(root, num_images, year=_YEAR, progress=True)
        out(f"      done in {time.perf_counter() - step:.1f} s")

        out("[2/4] Packing it into one file")
        result = pack_voc(root, root / "voc2012.tser", progress=True)
        seconds = max(result.seconds, 1e-9)
        out(
            f"      {result.num_samples} samples of VOC{result.year}, "
            f"{result.num_bytes / 1e6:.1f} MB ({result.num_bytes / result.source_bytes:.1%} of "
            f"the source) in {result.seconds:.2f} s: {result.num_samples / seconds:,.0f} "
            f"samples/s -> {result.path}"
        )

        out(f"[3/4] Checking samples against torchvision's VOCDetection ({_IMAGE_SET})")
        problems = compare_with_torchvision(result.path, root)
        if problems:
            for problem in problems:
                out(f"      MISMATCH {problem}")
            raise RuntimeError(f"{len(problems)} mismatches with torchvision (see above)")
        out(
            f"      {_NUM_CHECKED} of {_NUM_CHECKED} samples identical: image pixels, target "
            "dict, decode='tensor' pixels, tv_tensors boxes and labels"
        )

        demo = Measurements(root, result.path, workers, batch_size)
        out(
            f"[4/4] Speed on the same {demo.n} samples, torchvision's VOCDetection beside the "
            "pack: samples/s,"
        )
        out(
            f"      median of {_FAST_RUNS} runs (warm reads) or {_RUNS} (the rest) with (min-max); "
            "overlapping ranges are reported as within noise"
        )
        out(ROW.format("", "torchvision", "torch_serialized", "ratio"))
        comparisons = demo.bytes_level()
        print_table(
            out,
            "Image bytes + target dict, random order, in this process, no decoding:",
            comparisons,
        )
        cold, how = demo.cold()
        if cold:
            print_table(
                out, "The same, one epoch each after dropping both sides' files from cache:", cold
            )
        out(f"        ({how})")
        comparisons += cold
        decoded = demo.decoded() + demo.tensors()
        print_table(
            out,
            "Decoded images, random order, in this process (torchvision's PIL image, then "
            "pil_to_tensor for the tensor row):",
            decoded,
        )
        comparisons += decoded
        loader = demo.dataloader()
        print_table(
            out,
            f"DataLoader(batch_size={batch_size}, num_workers={workers}, shuffle=True), "
            "transforms v2 (flip), tv_tensors targets, warm workers:",
            loader,
        )
        comparisons += loader
        for line in summarize(comparisons):
            out(f"      {line}")
        out(
            f"      Demo time {time.perf_counter() - started:.0f} s. On your own data: "
            "`torch-serialized bench ROOT`."
        )
        if directory is not None:
            out(f"Data kept in {root}; try: torch-serialized info {result.path}")
        return comparisons
    raise AssertionError("unreachable")  # pragma: no cover - mypy: ExitStack may swallow


def summarize(comparisons: Sequence[Comparison]) -> list[str]:
    """Plain words: where the pack wins beyond noise, and what is within noise."""
    wins = [f"{c.name} {c.ratio:.1f}x" for c in comparisons if not c.within_noise and c.ratio > 1]
    noise = [c.name for c in comparisons if c.within_noise]
    losses = [
        f"{c.name} {c.ratio:.2f}x" for c in comparisons if not c.within_noise and c.ratio <= 1
    ]
    text = []
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
