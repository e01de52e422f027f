"""The ``dataloader`` scenario and the ``DataLoader`` helpers the memory scenario shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tsbench import lmdb_store
from tsbench.access import tv_bytes_getter
from tsbench.context import Bench
from tsbench.core import BATCH_SIZE, IMAGE_SET, PEER, SEED, Row, interleaved, rates


def _keep_lists(batch: list[tuple[Any, Any]]) -> tuple[list[Any], list[Any]]:
    """Detection collate: images and targets as two lists (sizes differ, nothing stacked)."""
    images, targets = zip(*batch)
    return list(images), list(targets)


class TVBytesDataset:
    """``VOCDetection`` minus the decode (``access.tv_bytes_getter``) as a map-style dataset:
    the JPEG file's bytes and the parsed XML (the bytes travel to the main process pickled,
    the cheapest way for ``bytes``)."""

    def __init__(self, tv: Any) -> None:
        self._len = len(tv)
        self._get = tv_bytes_getter(tv)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[bytes, Any]:
        return self._get(index)  # type: ignore[no-any-return]


def make_loader(ds: Any, workers: int, *, shuffle: bool = True) -> Any:
    import torch
    from torch.utils.data import DataLoader

    return DataLoader(
        ds,
        batch_size=BATCH_SIZE,
        shuffle=shuffle,
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

    The loaders of each group (decoding, then I/O only) keep their persistent workers alive
    side by side (idle ones sleep).
    """
    return _decoding_rows(b) + _io_only_rows(b)


def _epochs(datasets: dict[str, Any], workers: int, repeats: int) -> dict[str, Any]:
    """One warm-up epoch per loader, then timed epochs interleaved across them."""
    from torch.utils.data import IterableDataset

    loaders = {
        k: make_loader(ds, workers, shuffle=not isinstance(ds, IterableDataset))
        for k, ds in datasets.items()
    }
    try:
        for loader in loaders.values():
            run_epoch(loader)()
        return interleaved({k: run_epoch(v) for k, v in loaders.items()}, repeats)
    finally:
        for loader in loaders.values():
            shutdown_loader(loader)


def _decoding_rows(b: Bench) -> list[Row]:
    """Epochs of decoded CHW tensors: the drop-in (PIL + ``pil_to_tensor``) and
    ``decode="tensor"``, against torchvision and LMDB doing the same decode."""
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
    times = _epochs(datasets, b.workers, b.repeats)
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


def _io_only_rows(b: Bench) -> list[Row]:
    """Epochs whose workers only read (``decode="none"``): what feeds a GPU decode, and where
    handing samples to the main process costs more than reading them."""
    from torch_serialized import VOCSerializedIterableDataset
    from torch_serialized.data.workers import SHARED_RUN as shared_run

    datasets: dict[str, Any] = {
        "tv": TVBytesDataset(b.tv()),
        "map": b.ours(decode="none"),
        "iterable": VOCSerializedIterableDataset(b.packed(), IMAGE_SET, decode="none", seed=SEED),
    }
    path = b.lmdb()
    if path is not None:
        datasets["lmdb"] = lmdb_store.LMDBDataset(path, decode=False)
    n = len(datasets["tv"])
    times = _epochs(datasets, b.workers, b.repeats)
    tv = rates(n, times["tv"][0])
    peer: dict[str, Any] = (
        {"peer": rates(n, times["lmdb"][0]), "peer_target": 1.0}
        if "lmdb" in times
        else {"peer_missing": b.lmdb_missing or ""}
    )
    note = (
        "I/O-only workers (what feeds a GPU decode); tv: VOCDetection minus the decode (file "
        f"bytes + parsed XML); {PEER}: get (bytes + target); bytes travel pickled, our uint8 "
        "tensors in one shared-memory block per batch (workers.share_batch)"
    )
    return [
        Row(
            "dataloader_none",
            "dataloader",
            f"DataLoader epoch, {b.workers} workers, bs {BATCH_SIZE}, decode='none'",
            "samples/s",
            "rate",
            tv,
            rates(n, times["map"][0]),
            note=note + "; map-style, shuffled, __getitems__",
            **peer,
        ),
        Row(
            "dataloader_none_iterable",
            "dataloader",
            f"DataLoader epoch, {b.workers} workers, bs {BATCH_SIZE}, iterable, decode='none'",
            "samples/s",
            "rate",
            tv,
            rates(n, times["iterable"][0]),
            note=note + "; VOCSerializedIterableDataset(shuffle=True), runs of "
            f"{shared_run} samples per block",
            **peer,
        ),
    ]
