"""The ``dataloader`` scenario and the ``DataLoader`` helpers the memory scenario shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .context import _Bench
from .core import _BATCH_SIZE, _SEED, Row, _interleaved, _rates


def _keep_lists(batch: list[tuple[Any, Any]]) -> tuple[list[Any], list[Any]]:
    """Detection collate: images and targets as two lists (sizes differ, nothing stacked)."""
    images, targets = zip(*batch)
    return list(images), list(targets)


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
