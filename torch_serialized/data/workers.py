"""DataLoader workers: their setup, and how their batches reach the main process.

Readers reopen their memory maps by themselves in a new process, so ``worker_init_fn`` is
optional: it maps the files up front in each worker (so the first batch does not pay for it)
and is idempotent. ``share_batch`` puts a batch's tensors in one block of shared memory, so
handing them to the main process costs one segment per batch, not one per tensor. Which
worker and rank a process is: see ``topology``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import get_worker_info
from torchvision import tv_tensors

__all__ = [
    "SharedBlock",
    "worker_init_fn",
    "reopen_dataset",
    "in_worker",
    "share_batch",
    "share_as_made",
    "SHARED_RUN",
]

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


def in_worker() -> bool:
    """Whether this process is a ``DataLoader`` worker."""
    return get_worker_info() is not None


#: Tensor types that hold nothing but their data: a copy viewed as the same type is the same
#: value. ``BoundingBoxes`` carries a format and a canvas size, so it is not one of them.
_PLAIN = (torch.Tensor, tv_tensors.Image, tv_tensors.Mask, tv_tensors.Video)

#: Byte alignment of each tensor inside the shared block (as an allocator's, for SIMD loads).
_ALIGN = 64


def share_batch(samples: list[Any], *, borrowed: int | None = None) -> list[Any]:
    """Move the tensors of a batch's samples (the items of each sample tuple) into one block
    of shared memory, as views of it with the same values, type, shape and strides.

    A ``DataLoader`` worker hands every tensor to the main process through shared memory,
    and torch moves each tensor not yet there into a segment of its own: a file, a map and a
    copy per tensor, ~0.5 ms for a 100 KB image, thirty times the read. ``default_collate``
    avoids that by stacking a batch into one shared tensor; detection batches are lists
    (image sizes differ), so the batch is put in one block here, one copy per tensor.
    A tensor that cannot be viewed in place (not dense, requires grad, already shared, not
    on the CPU, a subclass with metadata) is left as it is, and so are the other items. A
    tensor found in several places (a transform that returns it twice) is copied once, and
    every place gets the same view, as the main process would get the same object.

    ``borrowed``: the position in each sample of a tensor that may be a read-only view of a
    map, read so that the copy into the block is its only copy; one left out of the block
    (a batch of one tensor, no shared memory here) is copied instead, never handed on.
    """
    picks = [
        (i, j, item)
        for i, sample in enumerate(samples)
        if type(sample) is tuple
        for j, item in enumerate(sample)
        if _movable(item)
    ]
    distinct = {id(item): item for *_, item in picks}  # a tensor in two places moves once
    if len(distinct) < 2:  # one tensor is shared as cheaply by torch itself
        return _owned(samples, borrowed)
    block = SharedBlock.of(item.numel() * item.element_size() for item in distinct.values())
    if block is None:  # no shared memory here: torch shares them itself
        return _owned(samples, borrowed)
    moved = {key: block.put(item) for key, item in distinct.items()}
    out: list[Any] = [list(sample) if type(sample) is tuple else sample for sample in samples]
    for i, j, item in picks:
        out[i][j] = moved[id(item)]
    shared = [tuple(new) if type(old) is tuple else new for old, new in zip(samples, out)]
    return _owned(shared, borrowed, samples)


class SharedBlock:
    """One block of shared memory that tensors are copied into, each returned as a view of
    it with the same values, type, shape and strides (see ``share_batch``).

    A worker that knows a batch's sizes before making its tensors (decoded images: the
    pack's columns give them) copies each one in as soon as it is made, so only one private
    tensor is alive at a time instead of the whole batch, which glibc would keep as its
    high-water mark; ``share_batch`` then leaves them where they are."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self._storage = storage
        self._offset = 0

    @classmethod
    def of(cls, sizes: Iterable[int]) -> SharedBlock | None:
        """A block with room for tensors of these sizes in bytes (each aligned), or None
        where there is no shared memory (torch then shares each tensor itself)."""
        try:
            return cls(torch.UntypedStorage._new_shared(sum(_room(n) for n in sizes)))
        except (AttributeError, RuntimeError, OverflowError):  # OverflowError: past int64
            return None

    def put(self, item: Any) -> Any:
        """``item`` copied into the block, as a view of it; ``item`` itself when it cannot be
        viewed in place (``_movable``) or does not fit in what is left."""
        if not isinstance(item, torch.Tensor) or not _movable(item):
            return item
        nbytes = item.numel() * item.element_size()
        if self._offset + nbytes > self._storage.nbytes():
            return item
        # a dense tensor's own strides lay its elements out in exactly numel() places
        view = torch.empty(0, dtype=item.dtype).set_(
            self._storage, self._offset // item.element_size(), item.shape, item.stride()
        )
        view.copy_(item)
        self._offset += _room(nbytes)
        return view if type(item) is torch.Tensor else view.as_subclass(type(item))


def _room(nbytes: int) -> int:
    """Bytes a tensor of ``nbytes`` takes in a block: rounded up to ``_ALIGN``."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _owned(samples: list[Any], borrowed: int | None, before: list[Any] | None = None) -> list[Any]:
    """``samples`` with each tensor at position ``borrowed`` that is still the one in
    ``before`` (default: ``samples``), i.e. not moved into shared memory, replaced by a copy."""
    if borrowed is None:
        return samples
    out = []
    for new, old in zip(samples, before or samples):
        item = new[borrowed] if type(new) is tuple and len(new) > borrowed else None
        if isinstance(item, torch.Tensor) and item is old[borrowed]:
            new = (*new[:borrowed], item.clone(), *new[borrowed + 1 :])
        out.append(new)
    return out


def share_as_made(
    samples: Iterable[tuple[Any, ...]],
    sizes: Sequence[int] | None,
    *,
    borrowed: int | None = None,
) -> list[Any]:
    """``share_batch`` of ``samples``, which are made as they are taken. With ``sizes`` (the
    bytes of each sample's first item, known before it is made: decoded images, from the
    pack's columns) the block is made first and each first item copied into it as soon as
    its sample is made (``SharedBlock``), so one private image is alive at a time, not the
    batch; without, the samples are made, then shared (``borrowed`` as in ``share_batch``)."""
    block = SharedBlock.of(sizes) if sizes is not None and len(sizes) > 1 else None
    if block is None:
        return share_batch(list(samples), borrowed=borrowed)
    shared = []
    for first, *rest in samples:
        shared.append((block.put(first), *rest))
        del first  # the private copy goes now, not when the next sample has been made
    _release_freed()
    return shared


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS). Looked
    up among the symbols the process already has (``CDLL(None)``): no library search, which
    would run ``ldconfig`` at every import, in every spawned worker."""
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def _release_freed() -> None:
    """Hand the pages of freed decode buffers back to the kernel (``malloc_trim``).

    A decoded image (~0.5 MB) is above glibc's first threshold for mapping an allocation
    apart, but freeing one raises that threshold, so the next ones come from the heap, where
    freed space between live objects stays in the worker as its high-water mark: 10-13 MB
    per worker in some runs of the benchmark's memory scenario. Once per batch, after its
    images went into the shared block: ~150 µs for a batch of 32, under 0.3% of its
    decoding (benchmarks/README.md)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


#: Samples of a stream put in one shared block (``share_as_made``): a typical batch, so a batch
#: of the DataLoader spans one or two blocks and holds at most two alive in the main process.
SHARED_RUN = 32


def _movable(item: Any) -> bool:
    """Whether ``item`` is a plain CPU tensor (or a tv_tensor without metadata) whose elements
    fill its memory without gaps or overlap (contiguous, or a permutation of contiguous)."""
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
