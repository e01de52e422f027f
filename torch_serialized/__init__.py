"""torch_serialized: pack Pascal VOC once, then read it fast through mmap.

The public API; everything else is internal. Names are imported on first use (PEP 562), so
processes that only pack or read files (e.g. ``pack_voc``'s pack processes) never import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from ._version import __version__
from .errors import *  # noqa: F403  (the exception tree, ``errors.__all__``)

if TYPE_CHECKING:
    from .container.shards import PackReader, open_pack
    from .data.datasets import VOCSerializedDataset, VOCSerializedSegmentation
    from .data.iterable import VOCSerializedIterableDataset
    from .data.samplers import BlockShuffleSampler
    from .data.state import merge_states
    from .data.workers import worker_init_fn
    from .legacy import SerializedDataset, Serializer
    from .remote.cache import clear_cache, list_cache
    from .remote.upload import prune_remote
    from .summary import PackInfo, VerifyReport, info, verify
    from .voc.append import append_voc
    from .voc.export import export_voc
    from .voc.pack import PackResult, SkippedSample, pack_voc

#: module -> the public names it defines
_LAZY = {
    ".voc.pack": ("pack_voc", "PackResult", "SkippedSample"),
    ".voc.append": ("append_voc",),
    ".voc.export": ("export_voc",),
    ".legacy": ("Serializer", "SerializedDataset"),
    ".data.datasets": ("VOCSerializedDataset", "VOCSerializedSegmentation"),
    ".data.iterable": ("VOCSerializedIterableDataset",),
    ".data.samplers": ("BlockShuffleSampler",),
    ".data.state": ("merge_states",),
    ".data.workers": ("worker_init_fn",),
    ".container.shards": ("open_pack", "PackReader"),
    ".summary": ("info", "verify", "PackInfo", "VerifyReport"),
    ".remote.upload": ("prune_remote",),
    ".remote.cache": ("list_cache", "clear_cache"),
}

__all__ = [
    "__version__",
    "pack_voc",
    "append_voc",
    "PackResult",
    "SkippedSample",
    "Serializer",
    "export_voc",
    "VOCSerializedDataset",
    "VOCSerializedSegmentation",
    "SerializedDataset",
    "VOCSerializedIterableDataset",
    "BlockShuffleSampler",
    "merge_states",
    "worker_init_fn",
    "open_pack",
    "PackReader",
    "info",
    "verify",
    "PackInfo",
    "VerifyReport",
    "prune_remote",
    "list_cache",
    "clear_cache",
]
__all__ += errors.__all__


def __getattr__(name: str) -> Any:
    module = next((m for m, names in _LAZY.items() if name in names), None)
    if module is None:
        raise AttributeError(f"module 'torch_serialized' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
