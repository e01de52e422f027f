"""torch_serialized: pack Pascal VOC once, then read it fast through mmap.

The public API; everything else is internal. Names are imported on first use (PEP 562), so
processes that only pack or read files (e.g. ``pack_voc``'s pack processes) never import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    CacheLimitWarning,
    ChecksumError,
    CorruptFileError,
    FileChangedError,
    FormatError,
    ImageTooLargeError,
    RemoteAccessError,
    RemoteError,
    RemoteNotFoundError,
    SourceDataError,
    SourceNotFoundError,
    TorchSerializedError,
    TruncatedFileError,
    UnsupportedVersionError,
    UntypedObjectsWarning,
    WriteError,
)

if TYPE_CHECKING:
    from .container.shards import PackReader, open_pack
    from .data.datasets import VOCSerializedDataset, VOCSerializedSegmentation
    from .data.iterable import VOCSerializedIterableDataset
    from .data.samplers import BlockShuffleSampler
    from .data.workers import worker_init_fn
    from .legacy import SerializedDataset, Serializer
    from .remote.cache import clear_cache, list_cache
    from .remote.upload import prune_remote
    from .summary import PackInfo, VerifyReport, info, verify
    from .voc.append import append_voc
    from .voc.export import export_voc
    from .voc.pack import PackResult, SkippedSample, pack_voc

#: public name -> module that defines it
_LAZY = {
    "pack_voc": ".voc.pack",
    "append_voc": ".voc.append",
    "PackResult": ".voc.pack",
    "SkippedSample": ".voc.pack",
    "Serializer": ".legacy",
    "export_voc": ".voc.export",
    "VOCSerializedDataset": ".data.datasets",
    "VOCSerializedSegmentation": ".data.datasets",
    "SerializedDataset": ".legacy",
    "VOCSerializedIterableDataset": ".data.iterable",
    "BlockShuffleSampler": ".data.samplers",
    "worker_init_fn": ".data.workers",
    "open_pack": ".container.shards",
    "PackReader": ".container.shards",
    "info": ".summary",
    "verify": ".summary",
    "PackInfo": ".summary",
    "VerifyReport": ".summary",
    "prune_remote": ".remote.upload",
    "list_cache": ".remote.cache",
    "clear_cache": ".remote.cache",
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
    "TorchSerializedError",
    "FormatError",
    "CorruptFileError",
    "TruncatedFileError",
    "UnsupportedVersionError",
    "ChecksumError",
    "ImageTooLargeError",
    "FileChangedError",
    "WriteError",
    "SourceDataError",
    "SourceNotFoundError",
    "RemoteError",
    "RemoteNotFoundError",
    "RemoteAccessError",
    "CacheLimitWarning",
    "UntypedObjectsWarning",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_serialized' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
