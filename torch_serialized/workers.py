"""DataLoader worker setup and discovery of this process's rank and worker.

Readers reopen their memory maps by themselves in a new process, so ``worker_init_fn`` is
optional: it maps the files up front in each worker (so the first batch does not pay for it)
and is idempotent.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.utils.data import get_worker_info

__all__ = ["worker_init_fn", "reopen_dataset", "distributed_info", "worker_split"]

_MAX_DEPTH = 16


def reopen_dataset(dataset: Any, _depth: int = 0) -> int:
    """Reopen the maps of every torch_serialized dataset inside ``dataset``; return how many.

    Looks through the usual wrappers: ``Subset``, ``ConcatDataset``, torchvision's
    transforms-v2 wrapper, and any object with ``dataset``/``datasets``/``_dataset``.
    """
    if _depth > _MAX_DEPTH:
        return 0
    reopen = getattr(type(dataset), "reopen", None)
    if callable(reopen) and hasattr(dataset, "pack"):
        dataset.reopen()
        return 1
    found = 0
    for name in ("_dataset", "dataset"):
        inner = getattr(dataset, "__dict__", {}).get(name)
        if inner is not None and inner is not dataset:
            found += reopen_dataset(inner, _depth + 1)
    for inner in getattr(dataset, "__dict__", {}).get("datasets", ()) or ():
        found += reopen_dataset(inner, _depth + 1)
    return found


def worker_init_fn(worker_id: int) -> None:
    """Pass as ``DataLoader(worker_init_fn=...)``: maps the packed files in each worker."""
    info = get_worker_info()
    if info is not None:
        reopen_dataset(info.dataset)


def distributed_info(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: the arguments if given, else torch.distributed's, else (0, 1)."""
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


def worker_split() -> tuple[int, int]:
    """``(worker_id, num_workers)`` of this DataLoader worker, ``(0, 1)`` in the main process."""
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)
