"""The ``gpu`` scenario: JPEGs decoded on the GPU, a batch per call, workers doing I/O only.

``decode="none"`` + ``zero_copy=True`` samples go through a ``DataLoader`` (``workers``
workers, batch 32, list collate) and the main process hands each batch's list of byte tensors
to one ``torchvision.io.decode_jpeg(..., device="cuda")`` call (nvJPEG). Where CUDA is absent
the row says "n/a (no GPU)"; ``decode_epochs`` runs the same loop on any device (the tests
run it on the CPU).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from tsbench.context import Bench
from tsbench.core import IMAGE_SET, Row, Stat
from tsbench.loader import make_loader, shutdown_loader

NO_GPU = "n/a (no GPU)"
NO_BATCHED_DECODE = "n/a (torchvision < 0.19: decode_jpeg takes no list)"
#: Decoded samples/s on the GPU the target asks for, as a multiple of the CPU drop-in epoch.
TARGET_VS_CPU = 10.0


def batched_decode() -> bool:
    """Whether ``torchvision.io.decode_jpeg`` takes a list of images (torchvision 0.19 on):
    the one call per batch this scenario times."""
    import torchvision

    major, minor = (int(part) for part in torchvision.__version__.split(".")[:2])
    return (major, minor) >= (0, 19)


def decode_epochs(b: Bench, device: Any, epochs: int) -> list[float]:
    """Seconds of ``epochs`` timed epochs (after one warm-up epoch) of batched decoding."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    from torch_serialized import VOCSerializedDataset

    ds = VOCSerializedDataset(b.packed(), image_set=IMAGE_SET, decode="none", zero_copy=True)
    loader = make_loader(ds, b.workers)

    def epoch() -> int:
        count = 0
        with warnings.catch_warnings():  # torchvision 0.29 announces a move to TorchCodec
            warnings.simplefilter("ignore", DeprecationWarning)
            for data, _targets in loader:
                count += len(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return count

    try:
        epoch()
        seconds = []
        for _ in range(epochs):
            start = time.perf_counter()
            epoch()
            seconds.append(time.perf_counter() - start)
    finally:
        shutdown_loader(loader)
    return seconds


def scenario_gpu(b: Bench) -> list[Row]:
    import torch

    name = f"GPU decode: DataLoader ({b.workers} workers, I/O only) + batched decode_jpeg"
    missing = (
        NO_GPU if not torch.cuda.is_available() else None if batched_decode() else NO_BATCHED_DECODE
    )
    if missing is not None:
        return [Row("gpu_decode", "gpu", name, "samples/s", "info", None, None, missing=missing)]
    device = torch.device("cuda")
    n = len(b.tv())
    seconds = decode_epochs(b, device, b.repeats)
    ours = Stat.of([n / s for s in seconds])
    cpu = b.details.get("dataloader", {}).get("pil_rate")
    row = Row(
        "gpu_decode",
        "gpu",
        name,
        "samples/s",
        "info",
        None,
        ours,
        note=f"{torch.cuda.get_device_name(device)}; decode='none', zero_copy=True; decoded "
        "samples/s, warm cache, after one warm-up epoch",
    )
    if cpu:
        ratio = ours.median / cpu
        row.note += f"; {ratio:.1f}x the CPU drop-in DataLoader epoch of this run ({cpu:,.0f}/s)"
        row.met = ratio >= TARGET_VS_CPU
        if not row.met:
            row.reason = f"{ratio:.1f}x the CPU drop-in epoch (target ≥ {TARGET_VS_CPU:g}x)"
    return [row]
