"""``torch-serialized demo``: generate the built-in sample, pack it, race torchvision.

Everything runs offline on a laptop in well under two minutes: a deterministic synthetic VOC
set is written (``make_synthetic_voc``), packed with progress, and then one epoch is read
through a ``DataLoader`` with a torchvision transforms v2 pipeline, once from the pack and once
through torchvision's own ``VOCDetection`` on the source folder. A few samples are compared
with torchvision's, pixel for pixel and key for key.
"""

from __future__ import annotations

import os
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import VOCDetection, wrap_dataset_for_transforms_v2
from torchvision.transforms import v2

from torch_serialized import VOCSerializedDataset, pack_voc

from .synthetic import make_synthetic_voc

__all__ = ["run_demo", "list_collate", "EpochResult"]

_YEAR = "2012"
_IMAGE_SET = "trainval"
_NUM_CHECKED = 5


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
class EpochResult:
    """One pass over a dataset through a DataLoader."""

    name: str
    samples: int
    batches: int
    seconds: float

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("inf")


def run_epoch(
    name: str, dataset: Dataset, *, workers: int, batch_size: int, seed: int = 0
) -> EpochResult:
    """Time one shuffled epoch (worker start-up included, as a training loop pays it)."""
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=generator,
        num_workers=workers,
        collate_fn=list_collate,
    )
    samples = batches = 0
    started = time.perf_counter()
    for images, targets in loader:
        if len(images) != len(targets):
            raise RuntimeError(f"{name}: a batch has {len(images)} images, {len(targets)} targets")
        samples += len(images)
        batches += 1
    return EpochResult(name, samples, batches, time.perf_counter() - started)


def _race(root: Path, pack: Path, *, workers: int, batch_size: int) -> list[EpochResult]:
    """Epochs over torchvision's folder reader, the drop-in pack reader, and ``decode="tensor"``."""
    transforms = detection_transforms()
    theirs = wrap_dataset_for_transforms_v2(
        VOCDetection(str(root), year=_YEAR, image_set=_IMAGE_SET, transforms=transforms),
        target_keys={"boxes", "labels"},
    )
    ours = VOCSerializedDataset(pack, _IMAGE_SET, transforms=transforms, target_format="tv_tensors")
    ours_tensor = VOCSerializedDataset(
        pack, _IMAGE_SET, transforms=transforms, target_format="tv_tensors", decode="tensor"
    )
    named = [
        ("torchvision VOCDetection (folder)", theirs),
        ("torch_serialized (pack, drop-in PIL)", ours),
        ("torch_serialized (pack, decode='tensor')", ours_tensor),
    ]
    return [
        run_epoch(name, dataset, workers=workers, batch_size=batch_size) for name, dataset in named
    ]


def _access_us(
    root: Path, pack: Path, *, cold: bool, zero_copy: bool = False
) -> tuple[float, float]:
    """Microseconds per sample to fetch image bytes and target dict, no decode:
    ``(torchvision, torch_serialized)``, optionally after evicting the files from the cache."""
    theirs = VOCDetection(str(root), year=_YEAR, image_set=_IMAGE_SET)
    if cold:
        _evict([*theirs.images, *theirs.annotations, str(pack)])
    order = np.random.default_rng(0).permutation(len(theirs)).tolist()
    started = time.perf_counter()
    for i in order:
        with open(theirs.images[i], "rb") as f:
            f.read()
        theirs.parse_voc_xml(ET.parse(theirs.annotations[i]).getroot())
    tv = (time.perf_counter() - started) / len(order) * 1e6
    started = time.perf_counter()
    ours = VOCSerializedDataset(pack, _IMAGE_SET, decode="none", zero_copy=zero_copy)
    for i in order:
        ours[i]
    return tv, (time.perf_counter() - started) / len(order) * 1e6


def _evict(paths: Sequence[str]) -> None:
    """Drop files from the page cache (best effort: needs posix_fadvise)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (files just written) cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _per_sample_ms(root: Path, pack: Path) -> dict[str, float]:
    """Mean milliseconds of ``dataset[i]`` over one pass, in this process."""
    datasets = {
        "torchvision": VOCDetection(str(root), year=_YEAR, image_set=_IMAGE_SET),
        "torch_serialized": VOCSerializedDataset(pack, _IMAGE_SET),
        "decode='tensor' + tv_tensors": VOCSerializedDataset(
            pack, _IMAGE_SET, decode="tensor", target_format="tv_tensors"
        ),
    }
    costs = {}
    for name, dataset in datasets.items():
        started = time.perf_counter()
        for i in range(len(dataset)):
            dataset[i]
        costs[name] = (time.perf_counter() - started) * 1e3 / max(len(dataset), 1)
    return costs


def compare_with_torchvision(pack: Path, root: Path, count: int = _NUM_CHECKED) -> list[str]:
    """Check ``count`` evenly spaced samples against torchvision; return the mismatches."""
    ours = VOCSerializedDataset(pack, _IMAGE_SET)
    theirs = VOCDetection(str(root), year=_YEAR, image_set=_IMAGE_SET)
    ours_tv = VOCSerializedDataset(pack, _IMAGE_SET, target_format="tv_tensors")
    theirs_tv = wrap_dataset_for_transforms_v2(theirs, target_keys={"boxes", "labels"})
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
        (_, tv_target), (_, ref_tv) = ours_tv[i], theirs_tv[i]
        for key in ("boxes", "labels"):
            if not torch.equal(tv_target[key].as_subclass(torch.Tensor), ref_tv[key]):
                problems.append(f"sample {i}: tv_tensors {key} differ")
    return problems


def run_demo(
    *,
    num_images: int = 200,
    workers: int = 2,
    directory: str | os.PathLike[str] | None = None,
    batch_size: int = 16,
    out: Callable[[str], None] = print,
) -> list[EpochResult]:
    """Run the demo, printing what happens; return the timed epochs (torchvision first)."""
    with ExitStack() as stack:
        if directory is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tser-demo-")))
        else:
            root = Path(directory)
            root.mkdir(parents=True, exist_ok=True)
        out(f"[1/4] Generating the built-in sample: {num_images} synthetic VOC{_YEAR} images")
        out(f"      (deterministic JPEGs, XML and masks) in {root}")
        started = time.perf_counter()
        make_synthetic_voc(root, num_images, year=_YEAR, progress=True)
        out(f"      done in {time.perf_counter() - started:.1f} s")

        out("[2/4] Packing it into one file")
        result = pack_voc(root, root / "voc2012.tser", year=_YEAR, progress=True)
        seconds = max(result.seconds, 1e-9)
        out(
            f"      {result.num_samples} samples, {result.num_bytes / 1e6:.1f} MB "
            f"({result.num_bytes / result.source_bytes:.1%} of the source) in "
            f"{result.seconds:.2f} s: {result.num_samples / seconds:,.0f} samples/s, "
            f"{result.num_bytes / seconds / 1e6:,.0f} MB/s -> {result.path}"
        )

        out(f"[3/4] Checking samples against torchvision's VOCDetection ({_IMAGE_SET})")
        problems = compare_with_torchvision(result.path, root)
        if problems:
            for problem in problems:
                out(f"      MISMATCH {problem}")
            raise RuntimeError(f"{len(problems)} mismatches with torchvision (see above)")
        out(
            f"      {_NUM_CHECKED} of {_NUM_CHECKED} samples identical: image pixels, target "
            "dict, tv_tensors boxes and labels"
        )

        pipeline = "ToImage -> RandomHorizontalFlip (uint8; ToDtype belongs in the step)"
        out(
            f"[4/4] One epoch each: DataLoader(batch_size={batch_size}, num_workers={workers}, "
            "shuffle=True, list collate)"
        )
        out(f"      transforms v2: {pipeline}; targets as tv_tensors (boxes flip too)")
        runs = _race(root, result.path, workers=workers, batch_size=batch_size)
        base = runs[0].samples_per_second
        header = f"{'reader':<40}{'samples':>8}{'batches':>8}{'time':>8}{'samples/s':>10}"
        out(f"      {header}{'ratio':>9}")
        for run in runs:
            out(
                f"      {run.name:<40}{run.samples:>8}{run.batches:>8}{run.seconds:>7.2f}s"
                f"{run.samples_per_second:>10.1f}{run.samples_per_second / base:>8.2f}x"
            )
        out(
            f"      speed-up over torchvision: {runs[1].samples_per_second / base:.2f}x drop-in, "
            f"{runs[2].samples_per_second / base:.2f}x with decode='tensor'"
        )
        costs = _per_sample_ms(root, result.path)
        out(
            "      read + decode per sample in this process (no DataLoader, no transforms): "
            + ", ".join(f"{name} {ms:.2f} ms" for name, ms in costs.items())
        )
        out(
            "      The epochs above are bound by JPEG decoding, which both readers share.\n"
            "      What the pack removes is the file opens and XML parsing around it:"
        )
        cases = [(False, False, "warm cache"), (False, True, "warm cache, zero_copy=True")]
        if hasattr(os, "posix_fadvise"):
            cases.append((True, False, "cold cache (files evicted)"))
        for cold, zero_copy, label in cases:
            tv_us, our_us = _access_us(root, result.path, cold=cold, zero_copy=zero_copy)
            out(
                f"      image bytes + target dict, random order, {label}: torchvision "
                f"{tv_us:.0f} us, torch_serialized {our_us:.0f} us per sample "
                f"({tv_us / our_us:.1f}x)"
            )
        out("      Full-size measurements: `torch-serialized bench` (see benchmarks/README.md).")
        if directory is not None:
            out(f"Data kept in {root}; try: torch-serialized info {result.path}")
        return runs
    raise AssertionError("unreachable")  # pragma: no cover - mypy: ExitStack may swallow
