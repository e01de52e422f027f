"""The ``dataloader`` scenario and the ``DataLoader`` helpers the memory scenario shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import lmdb_store
from .context import Bench
from .core import BATCH_SIZE, PEER, SEED, Row, interleaved, rates


def _keep_lists(batch: list[tuple[Any, Any]]) -> tuple[list[Any], list[Any]]:
    """Detection collate: images and targets as two lists (sizes differ, nothing stacked)."""
    images, targets = zip(*batch)
    return list(images), list(targets)


def make_loader(ds: Any, workers: int) -> Any:
    import torch
    from torch.utils.data import DataLoader

    return DataLoader(
        ds,
        batch_size=BATCH_SIZE,
        shuffle=True,
        num_workers=workers,
        collate_fn=_keep_lists,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(SEED),
    )


def run_epoch(loader: Any) -> Callable[[], None]:
    def run() -> None:
        for _images, _targets in loader:
            pass

    return run


def shutdown_loader(loader: Any) -> None:
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None


def worker_pids(iterator: Any) -> list[int]:
    return [int(p.pid) for p in getattr(iterator, "_workers", []) if p.pid]


def scenario_dataloader(b: Bench) -> list[Row]:
    """One warm-up epoch per variant, then timed epochs interleaved across the variants.

    The three loaders keep their persistent workers alive side by side (idle ones sleep).
    """
    from torchvision.transforms.functional import pil_to_tensor

    datasets = {
        "tv": b.tv(transform=pil_to_tensor),
        "tensor": b.ours(decode="tensor"),
        "pil": b.ours(decode="pil", transform=pil_to_tensor),
    }
    path = b.lmdb()
    if path is not None:
        datasets["lmdb"] = lmdb_store.LMDBDataset(path, transform=pil_to_tensor)
    n = len(datasets["tv"])
    loaders = {k: make_loader(ds, b.workers) for k, ds in datasets.items()}
    try:
        for loader in loaders.values():
            run_epoch(loader)()
        times = interleaved({k: run_epoch(v) for k, v in loaders.items()}, b.repeats)
    finally:
        for loader in loaders.values():
            shutdown_loader(loader)
    b.details["dataloader"] = {
        "samples": n,
        "workers": b.workers,
        "batch_size": BATCH_SIZE,
        "pil_rate": rates(n, times["pil"][0]).median,
    }
    tv = rates(n, times["tv"][0])
    peer: dict[str, Any] = (
        {"peer": rates(n, times["lmdb"][0])}
        if "lmdb" in times
        else {"peer_missing": b.lmdb_missing or ""}
    )
    return [
        Row(
            "dataloader_tensor",
            "dataloader",
            f"DataLoader epoch, {b.workers} workers, bs {BATCH_SIZE}, decode='tensor'",
            "samples/s",
            "rate",
            tv,
            rates(n, times["tensor"][0]),
            note="tv: VOCDetection + pil_to_tensor; after one warm-up epoch, persistent workers"
            + f"; {PEER}: get + PIL decode + pil_to_tensor",
            **peer,
        ),
        Row(
            "dataloader_pil",
            "dataloader",
            f"DataLoader epoch, {b.workers} workers, bs {BATCH_SIZE}, decode='pil' + to tensor",
            "samples/s",
            "rate",
            tv,
            rates(n, times["pil"][0]),
            note="same decode as tv (the drop-in); the DataLoader fetches each batch with "
            "__getitems__",
            peer_target=1.0 if "peer" in peer else None,
            **peer,
        ),
    ]
