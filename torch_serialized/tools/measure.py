"""The measurements of ``torch-serialized bench`` and ``demo``: torchvision's ``VOCDetection``
and a pack timed on the same samples, taking turns. Each figure is a median with its range
(min-max); a row whose two ranges overlap says "within noise", never a speed-up."""

from __future__ import annotations

import statistics
import time
import xml.etree.ElementTree as ET
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision.datasets import VOCDetection, wrap_dataset_for_transforms_v2
from torchvision.transforms import v2
from torchvision.transforms.functional import pil_to_tensor

from .. import VOCSerializedDataset

__all__ = ["Comparison", "Measurements", "spread"]

ROW = "      {:<28} {:>24} {:>24}   {}"


def spread(rates: Sequence[float]) -> str:
    """Samples/s over runs: the median, and its range (min-max) when there are several."""
    median = f"{statistics.median(rates):,.0f}/s"
    return median if len(rates) < 2 else f"{median} ({min(rates):,.0f}-{max(rates):,.0f})"


@dataclass(frozen=True)
class Comparison:
    """One measurement: samples/s of each run, torchvision's ``VOCDetection`` and the pack."""

    name: str
    torchvision: list[float]
    ours: list[float]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ours) / statistics.median(self.torchvision)

    @property
    def within_noise(self) -> bool:
        """The two ranges overlap: the runs cannot tell the two apart."""
        return min(self.ours) <= max(self.torchvision) and min(self.torchvision) <= max(self.ours)

    @property
    def verdict(self) -> str:
        if min(len(self.ours), len(self.torchvision)) < 2:
            return f"{self.ratio:.2f}x, one run"
        if self.within_noise:
            return f"{self.ratio:.2f}x, within noise"
        return f"{self.ratio:.2f}x {'faster' if self.ratio > 1 else 'slower'}"


def _compare(
    name: str, samples: int, runs: int, tv: Callable[[], object], ours: Callable[[], object]
) -> Comparison:
    """``tv`` and ``ours``, each a pass over ``samples`` samples, timed ``runs`` times in turns."""
    seconds: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        for side, run in zip(seconds, (tv, ours)):
            started = time.perf_counter()
            run()
            side.append(time.perf_counter() - started)
    return Comparison(name, *([samples / max(t, 1e-9) for t in side] for side in seconds))


def _read_bytes_and_target(tv: VOCDetection, i: int) -> None:
    """What torchvision does for a sample, minus decoding: open, read, parse the XML."""
    with open(tv.images[i], "rb") as f:
        f.read()
    tv.parse_voc_xml(ET.parse(tv.annotations[i]).getroot())


def list_collate(batch: Sequence[tuple[Any, Any]]) -> tuple[tuple[Any, ...], ...]:
    """``(images, targets)`` as tuples: detection images differ in size, so no stacking."""
    return tuple(zip(*batch))


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

    def torchvision(self, **kwargs: Any) -> VOCDetection:
        return VOCDetection(str(self.root), year=self.year, image_set=self.image_set, **kwargs)

    def ours(self, **kwargs: Any) -> VOCSerializedDataset:
        return VOCSerializedDataset(self.pack, image_set=self.image_set, **kwargs)

    def table(self, out: Callable[[str], None], scenarios: Sequence[str]) -> list[Comparison]:
        """Time the ``scenarios`` measured here, print their rows and the notes."""
        out(ROW.format("", "torchvision", "torch_serialized", "ratio"))
        rows: list[Comparison] = []
        measures = (
            ("bytes", self.time_bytes),
            ("decoded", self.time_decoded),
            ("dataloader", self.time_dataloader),
        )
        for name, measure in [(n, m) for n, m in measures if n in scenarios]:
            try:
                row = measure()
            except ValueError as exc:  # e.g. float box coordinates in torchvision's v2 wrapper
                why = str(exc).strip().splitlines()[-1]  # a worker's: the traceback, then this
                self.notes.append(f"{name}: not measured, torchvision cannot read the data: {why}")
                continue
            out(ROW.format(row.name, spread(row.torchvision), spread(row.ours), row.verdict))
            rows.append(row)
        for note in self.notes:
            out(f"      {note}")
        return rows

    def _each(self, get: Callable[[int], object]) -> Callable[[], object]:
        return lambda: deque(map(get, self.order), maxlen=0)

    def time_bytes(self) -> Comparison:
        """Image bytes + target dict in random order, warm cache, in this process."""
        tv = self._each(lambda i: _read_bytes_and_target(self.tv, i))
        ours = self._each(self.ours(decode="none").__getitem__)
        return _compare("bytes + dict, warm", self.n, self.runs, tv, ours)

    def time_decoded(self) -> Comparison:
        """Decoded PIL images in this process: the drop-in against ``VOCDetection``."""
        tv, ours = self._each(self.tv.__getitem__), self._each(self.ours().__getitem__)
        return _compare("PIL image + dict (drop-in)", self.n, self.slow_runs, tv, ours)

    def time_dataloader(self) -> Comparison:
        """Epochs of the drop-in through a DataLoader, transforms v2, persistent workers."""
        # uint8 images until the training step: float32 ones cost four times more to send
        flip = v2.Compose([v2.ToImage(), v2.RandomHorizontalFlip(p=0.5)])
        theirs = self.torchvision(transforms=flip)
        tv = self._loader(wrap_dataset_for_transforms_v2(theirs, target_keys={"boxes", "labels"}))
        ours = self._loader(self.ours(transforms=flip, target_format="tv_tensors"))
        for loader in (tv, ours):  # worker start-up happens here, outside the timing
            deque(loader, maxlen=0)
        epochs = (lambda: deque(tv, maxlen=0), lambda: deque(ours, maxlen=0))
        name = f"DataLoader epoch, {self.workers} workers"
        return _compare(name, self.n, self.slow_runs, *epochs)

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

    def check(self, count: int = 5) -> None:
        """Check ``count`` evenly spaced samples against torchvision's: pixels (PIL and
        ``decode="tensor"``), target dicts, and ``target_format="tv_tensors"`` boxes and labels."""
        ours, theirs = self.ours(), self.tv
        ours_tv, tensors = self.ours(target_format="tv_tensors"), self.ours(decode="tensor")
        theirs_tv = wrap_dataset_for_transforms_v2(theirs, target_keys={"boxes", "labels"})
        problems = [] if len(ours) == len(theirs) else [f"length {len(ours)}, not {len(theirs)}"]
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
            if not all(
                torch.equal(tv_target[k].as_subclass(torch.Tensor), ref_tv[k]) for k in ref_tv
            ):
                problems.append(f"sample {i}: tv_tensors boxes or labels differ")
        if problems:
            why = "; ".join(problems)
            raise RuntimeError(f"{self.pack} differs from torchvision's VOCDetection: {why}")
