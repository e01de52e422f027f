"""DataLoader workers: their setup, and how their batches reach the main process.

Readers map their files again by themselves in a new process (the container reader's own
fork check), so ``worker_init_fn`` is optional: it maps the files up front in each worker (so
the first batch does not pay for it) and is idempotent. ``share_batch`` puts a batch's
tensors in one block of shared memory, so handing them to the main process costs one segment
per batch, not one per tensor. Which worker and rank a process is: see ``topology``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import get_worker_info
from torchvision import tv_tensors


def reopen_dataset(dataset: Any, _depth: int = 0) -> int:
    """Reopen the maps of every torch_serialized dataset inside ``dataset``; return how many.

    Looks through the usual wrappers (``Subset``, ``ConcatDataset``, torchvision's
    transforms-v2 wrapper: any object with ``dataset``/``datasets``/``_dataset``), at most 16
    deep.
    """
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


#: Tensor types that hold nothing but their data: a copy viewed as the same type is the same
#: value. ``BoundingBoxes`` carries a format and a canvas size, so it is not one of them.
_PLAIN = (torch.Tensor, tv_tensors.Image, tv_tensors.Mask, tv_tensors.Video)

#: Byte alignment of each tensor inside the shared block (as an allocator's, for SIMD loads).
_ALIGN = 64

#: Samples of a stream put in one shared block (``share_batch``): a typical batch, so a batch
#: of the DataLoader spans one or two blocks and holds at most two alive in the main process.
SHARED_RUN = 32


class SharedBlock:
    """One block of shared memory that tensors are copied into, each returned as a view of
    it with the same values, type, shape and strides (see ``share_batch``)."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self._storage = storage
        self._offset = 0

    @classmethod
    def of(cls, sizes: Iterable[int]) -> SharedBlock | None:
        """A block with room for tensors of these sizes in bytes (each aligned), or None
        where there is no shared memory (torch then shares each tensor itself)."""
        room = sum(-(-n // _ALIGN) * _ALIGN for n in sizes)
        try:
            return cls(torch.UntypedStorage._new_shared(room))
        except (AttributeError, RuntimeError, OverflowError):  # OverflowError: past int64
            return None

    def put(self, item: Any) -> Any:
        """``item`` copied into the block, as a view of it; ``item`` itself when it cannot be
        viewed in place (``_movable``) or does not fit in what is left."""
        if not _movable(item):
            return item
        nbytes = item.numel() * item.element_size()
        if self._offset + nbytes > self._storage.nbytes():
            return item
        # a dense tensor's own strides lay its elements out in exactly numel() places
        view = torch.empty(0, dtype=item.dtype).set_(
            self._storage, self._offset // item.element_size(), item.shape, item.stride()
        )
        view.copy_(item)
        self._offset += -(-nbytes // _ALIGN) * _ALIGN
        return view if type(item) is torch.Tensor else view.as_subclass(type(item))


def share_batch(
    samples: Iterable[Any], sizes: Sequence[int] | None = None, *, borrowed: int | None = None
) -> list[Any]:
    """Move the tensors of a batch's samples (the items of each sample tuple) into one block
    of shared memory, as views of it with the same values, type, shape and strides.

    A worker hands every tensor to the main process through shared memory, torch moving each
    one into a segment of its own (~0.5 ms for a 100 KB image, thirty times the read);
    ``default_collate`` avoids that by stacking a batch, but detection batches are lists, so
    the batch goes into one block here. Tensors that cannot be viewed in place
    (``_movable``) stay as they are; a tensor found in several places is copied once.

    ``sizes``: the bytes of each sample's first item, known before it is made (decoded
    images, from the pack's columns). The block is then made first and each first item
    copied in as soon as its sample is made (``samples`` may be a generator), so one private
    image is alive at a time, not the batch, which glibc would keep as the worker's heap
    (49-65 -> 25-29 MB per worker, benchmarks/README.md); the rest of each sample stays.

    ``borrowed``: the position in each sample of a tensor that may be a read-only view of a
    map; one left out of the block (a batch of one tensor, no shared memory here) is
    copied instead, never handed on.
    """
    block = SharedBlock.of(sizes) if sizes is not None and len(sizes) > 1 else None
    if block is not None:
        shared = []
        for first, *rest in samples:
            shared.append((block.put(first), *rest))
            del first  # the private copy goes now, not when the next sample has been made
        _release_freed()
        return shared
    samples = list(samples)
    picks = [
        (i, j, item)
        for i, sample in enumerate(samples)
        if type(sample) is tuple
        for j, item in enumerate(sample)
        if _movable(item)
    ]
    distinct = {id(item): item for *_, item in picks}  # a tensor in two places moves once
    block = None
    if len(distinct) > 1:  # one tensor is shared as cheaply by torch itself
        block = SharedBlock.of(item.numel() * item.element_size() for item in distinct.values())
    out: list[Any] = [list(sample) if type(sample) is tuple else sample for sample in samples]
    if block is not None:  # else no shared memory here: torch shares them itself
        moved = {key: block.put(item) for key, item in distinct.items()}
        for i, j, item in picks:
            out[i][j] = moved[id(item)]
    if borrowed is not None:
        for new, old in zip(out, samples):
            if type(old) is tuple and len(old) > borrowed:
                item = new[borrowed]
                if isinstance(item, torch.Tensor) and item is old[borrowed]:
                    new[borrowed] = item.clone()  # not moved: a copy, never the view
    return [tuple(new) if type(old) is tuple else new for old, new in zip(samples, out)]


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None (musl, macOS), looked up among the process's symbols
    (``CDLL(None)``: no library search, which would run ``ldconfig`` in every worker)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def _release_freed() -> None:
    """Hand the pages of freed decode buffers back to the kernel (``malloc_trim``).

    Freed decoded images (~0.5 MB each) stay in a worker's heap as its high-water mark:
    10-13 MB per worker in some runs of the benchmark's memory scenario, -1.9 to 0.5 MB of
    growth with the trim. Once per batch: ~150 µs for a batch of 32, under 0.3% of its
    decoding (benchmarks/README.md)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _movable(item: Any) -> bool:
    """Whether ``item`` is a plain CPU tensor (or a tv_tensor without metadata) whose elements
    fill its memory without gaps or overlap (contiguous, or a permutation of contiguous), not
    needing grad, not already shared."""
    if type(item) not in _PLAIN:
        return False
    if (
        item.device.type != "cpu"
        or item.layout is not torch.strided
        or item.requires_grad
        or item.is_quantized
        or item.is_conj()
        or item.is_neg()
        or item.numel() == 0
        or item.is_shared()
    ):
        return False
    order = sorted(range(item.dim()), key=lambda d: -item.stride(d))
    return bool(item.permute(order).is_contiguous())
