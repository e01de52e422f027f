"""DataLoader workers: their setup, and how batches reach the main process. ``worker_init_fn`` is
optional (readers remap by themselves) and maps files up front; ``share_batch`` puts a batch's
tensors in one shared-memory block: one segment per batch, not per tensor."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import get_worker_info
from torchvision import tv_tensors


def reopen_dataset(dataset: Any, _depth: int = 0) -> int:
    """Reopen the maps of every torch_serialized dataset inside ``dataset``; return how many.
    Looks through wrappers (``dataset``/``datasets``/``_dataset`` attributes), at most 16 deep."""
    if callable(getattr(type(dataset), "reopen", None)) and hasattr(dataset, "pack"):
        dataset.reopen()
        return 1
    if _depth >= 16:
        return 0
    attributes = getattr(dataset, "__dict__", {})
    inner = [attributes.get("_dataset"), attributes.get("dataset")]
    inner += attributes.get("datasets") or ()
    return sum(reopen_dataset(d, _depth + 1) for d in inner if d is not None and d is not dataset)


def worker_init_fn(worker_id: int) -> None:
    """Pass as ``DataLoader(worker_init_fn=...)``: maps the packed files in each worker."""
    info = get_worker_info()
    if info is not None:
        reopen_dataset(info.dataset)


def in_worker() -> bool:
    return get_worker_info() is not None


#: Types that hold only their data (not ``BoundingBoxes``: it has a format and canvas size).
_PLAIN = (torch.Tensor, tv_tensors.Image, tv_tensors.Mask, tv_tensors.Video)

_ALIGN = 64  #: Alignment in the shared block (as an allocator's, for SIMD loads).

SHARED_RUN = 32  #: stream samples per shared block: a batch spans at most two

#: glibc's ``malloc_trim``, called once a ``decode="tensor"`` batch is in its block: freed ~0.5 MB
#: decode buffers otherwise stay as the worker's heap (benchmarks/README.md). From the process's
#: own symbols (``CDLL(None)``: no library search, which would run ``ldconfig`` in every worker).
try:
    _MALLOC_TRIM: Any = ctypes.CDLL(None).malloc_trim
except (OSError, AttributeError):
    _MALLOC_TRIM = None


class SharedBlock:
    """Shared memory that tensors are copied into, each returned as an equal view of it."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self._storage = storage
        self._offset = 0

    @classmethod
    def of(cls, sizes: Iterable[int]) -> SharedBlock | None:
        """A block for tensors of these byte sizes, or None without shared memory (torch shares)."""
        room = sum(-(-n // _ALIGN) * _ALIGN for n in sizes)
        try:
            return cls(torch.UntypedStorage._new_shared(room))
        except (AttributeError, RuntimeError, OverflowError):  # OverflowError: past int64
            return None

    def put(self, item: Any) -> Any:
        """``item`` copied into the block as a view; itself if not ``_movable`` or too big."""
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
    """Move the tensors of a batch's samples into one shared-memory block, as views of it.

    Torch moves each tensor a worker hands on into a segment of its own (~0.5 ms for a 100 KB
    image, thirty times the read); ``default_collate`` stacks, but detection batches are lists.
    Tensors not ``_movable`` stay; one found in several places is copied once.

    ``sizes``: the bytes of each sample's first item, known up front (decoded images): the block
    is made first and each first item copied in as its sample is made, so one private image is
    alive at a time, not the batch glibc would keep as heap (benchmarks/README.md).
    ``borrowed``: the position of a tensor that may be a read-only view of a map; if left out of
    the block it is copied, never handed on."""
    block = SharedBlock.of(sizes) if sizes is not None and len(sizes) > 1 else None
    if block is not None:
        shared = []
        for first, *rest in samples:
            shared.append((block.put(first), *rest))
            del first  # the private copy goes now, not when the next sample has been made
        if _MALLOC_TRIM is not None:  # freed decode buffers' pages back to the kernel
            _MALLOC_TRIM(0)
        return shared
    samples = list(samples)
    tensors = {id(x): x for s in samples if type(s) is tuple for x in s if _movable(x)}
    moved: dict[int, Any] = {}
    if len(tensors) > 1:  # one tensor is shared as cheaply by torch itself
        block = SharedBlock.of(x.numel() * x.element_size() for x in tensors.values())
        if block is not None:  # else no shared memory here: torch shares them itself
            moved = {key: block.put(x) for key, x in tensors.items()}

    def placed(sample: tuple[Any, ...]) -> tuple[Any, ...]:
        new = [moved.get(id(x), x) for x in sample]
        if borrowed is not None and len(new) > borrowed:
            kept = new[borrowed]
            if isinstance(kept, torch.Tensor) and kept is sample[borrowed]:
                new[borrowed] = kept.clone()  # not moved: a copy, never the view
        return tuple(new)

    return [placed(s) if type(s) is tuple else s for s in samples]


def _movable(item: Any) -> bool:
    """A plain CPU tensor (or metadata-free tv_tensor) whose elements fill its memory without
    gaps or overlap, not needing grad, not already shared."""
    if (
        type(item) not in _PLAIN
        or item.device.type != "cpu"
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
