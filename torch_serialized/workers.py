"""DataLoader worker setup.

Readers reopen their memory maps by themselves in a new process, so ``worker_init_fn`` is
optional: it maps the files up front in each worker (so the first batch does not pay for it)
and is idempotent. Which worker and rank a process is: see ``topology``.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import get_worker_info

__all__ = ["worker_init_fn", "reopen_dataset"]

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
