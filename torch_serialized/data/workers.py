"""DataLoader workers: ``worker_init_fn`` (optional: readers remap in a new process by
themselves) and ``share_batch``, one shared-memory segment per batch, not one per tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import get_worker_info
from torchvision import tv_tensors


def reopen_dataset(dataset: Any, _depth: int = 0) -> int:
    """Reopen the maps of every torch_serialized dataset inside ``dataset`` (through wrappers
    with ``dataset``/``datasets``/``_dataset``, at most 16 deep); return how many."""
    if callable(getattr(type(dataset), "reopen", None)) and hasattr(dataset, "pack"):
        dataset.reopen()
        return 1
    attributes = getattr(dataset, "__dict__", {})
    inner = [attributes.get("_dataset"), attributes.get("dataset")]
    inner += attributes.get("datasets") or ()
    if _depth >= 16:
        return 0
    return sum(reopen_dataset(d, _depth + 1) for d in inner if d is not None and d is not dataset)


def worker_init_fn(worker_id: int) -> None:
    """Pass as ``DataLoader(worker_init_fn=...)``: maps the packed files in each worker."""
    info = get_worker_info()
    if info is not None:
        reopen_dataset(info.dataset)


def in_worker() -> bool:
    """Whether this process is a ``DataLoader`` worker."""
    return get_worker_info() is not None


#: Tensor types that hold nothing but their data (``BoundingBoxes`` also has a format and size).
_PLAIN = (torch.Tensor, tv_tensors.Image, tv_tensors.Mask, tv_tensors.Video)

#: Byte alignment of each tensor inside the shared block (as an allocator's, for SIMD loads).
_ALIGN = 64

#: Samples of a stream put in one shared block: a typical batch.
SHARED_RUN = 32


def share_batch(samples: Iterable[Any], *, borrowed: int | None = None) -> list[Any]:
    """The samples with the ``_movable`` tensors of their tuples moved (once each) into one
    block of shared memory, as views with the same values, type, shape and strides: torch
    would give each tensor a worker hands on a segment of its own (~0.5 ms for 100 KB), and
    detection batches are lists, not stacked. ``borrowed``: the position of a tensor that may
    be a view of a map; if not moved, it is copied, never handed on."""
    samples = list(samples)
    tuples = [sample for sample in samples if type(sample) is tuple]
    distinct = {id(item): item for sample in tuples for item in sample if _movable(item)}
    moved: dict[int, Any] = {}
    storage = None
    if len(distinct) > 1:  # one tensor is shared as cheaply by torch itself
        room = sum(_aligned(item) for item in distinct.values())
        with contextlib.suppress(AttributeError, RuntimeError, OverflowError):  # torch shares
            storage = torch.UntypedStorage._new_shared(room)
    if storage is not None:
        offset = 0
        for key, item in distinct.items():
            view = torch.empty(0, dtype=item.dtype).set_(
                storage, offset // item.element_size(), item.shape, item.stride()
            )
            view.copy_(item)
            offset += _aligned(item)
            moved[key] = view if type(item) is torch.Tensor else view.as_subclass(type(item))
    out = []
    for sample in samples:
        if type(sample) is tuple:
            new = [moved.get(id(item), item) for item in sample]  # ids of live objects
            if borrowed is not None and len(new) > borrowed:
                kept = new[borrowed]
                if isinstance(kept, torch.Tensor) and kept is sample[borrowed]:
                    new[borrowed] = kept.clone()  # not moved: a copy, never the view
            sample = tuple(new)
        out.append(sample)
    return out


def _aligned(item: torch.Tensor) -> int:
    """Bytes ``item`` takes in the block."""
    return -(-item.numel() * item.element_size() // _ALIGN) * _ALIGN


def _movable(item: Any) -> bool:
    """A plain CPU tensor filling its memory without gaps (a permuted contiguous one), not
    needing grad, not already shared."""
    if type(item) not in _PLAIN:
        return False
    if (
        item.device.type != "cpu"
        or item.layout is not torch.strided
        or item.requires_grad
        or item.is_quantized
        or item.numel() == 0
        or item.is_shared()
    ):
        return False
    order = sorted(range(item.dim()), key=lambda d: -item.stride(d))
    return bool(item.permute(order).is_contiguous())
