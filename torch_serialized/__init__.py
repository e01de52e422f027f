"""torch_serialized: pack Pascal VOC once, then read it fast through mmap.

The public API; everything else is internal.
"""

from ._version import __version__
from .datasets import SerializedDataset, VOCSerializedDataset, VOCSerializedSegmentation
from .errors import (
    ChecksumError,
    CorruptFileError,
    FileChangedError,
    FormatError,
    SourceDataError,
    TorchSerializedError,
    TruncatedFileError,
    UnsupportedVersionError,
    WriteError,
)
from .iterable import VOCSerializedIterableDataset
from .reader import PackReader, open_pack
from .samplers import BlockShuffleSampler
from .voc.packer import PackResult, Serializer, SkippedSample, pack_voc
from .workers import worker_init_fn

__all__ = [
    "__version__",
    "pack_voc",
    "PackResult",
    "SkippedSample",
    "Serializer",
    "VOCSerializedDataset",
    "VOCSerializedSegmentation",
    "SerializedDataset",
    "VOCSerializedIterableDataset",
    "BlockShuffleSampler",
    "worker_init_fn",
    "open_pack",
    "PackReader",
    "TorchSerializedError",
    "FormatError",
    "CorruptFileError",
    "TruncatedFileError",
    "UnsupportedVersionError",
    "ChecksumError",
    "FileChangedError",
    "WriteError",
    "SourceDataError",
]
