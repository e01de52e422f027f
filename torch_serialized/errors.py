"""The exception tree of torch_serialized. Every class also subclasses a built-in, so existing
``except ValueError`` / ``except OSError`` handlers keep working."""

from __future__ import annotations

__all__ = [
    "TorchSerializedError",
    "FormatError",
    "CorruptFileError",
    "TruncatedFileError",
    "IncompletePackError",
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


class TorchSerializedError(Exception):
    """Base class of every error raised by torch_serialized."""


class FormatError(TorchSerializedError, ValueError):
    """A file is not a valid torch_serialized file (bad content, not an I/O failure)."""


class CorruptFileError(FormatError):
    """A torch_serialized file is damaged: bad header, footer, metadata or index."""


class TruncatedFileError(CorruptFileError):
    """A torch_serialized file is shorter than it claims: an interrupted copy or write."""


class IncompletePackError(CorruptFileError, FileNotFoundError):
    """A local shard folder lacks files its manifest lists, or holds them at another size."""


class UnsupportedVersionError(FormatError):
    """A file was written in a newer format version than this package can read."""


class ChecksumError(CorruptFileError):
    """A record's bytes fail the checksum stored with them; ``path``, ``record`` and ``field``
    name where, when a record's read raised it."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        record: int | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.path, self.record, self.field = path, record, field


class ImageTooLargeError(FormatError):
    """A stored image or mask over twice Pillow's ``MAX_IMAGE_PIXELS``, refused unallocated."""


class FileChangedError(TorchSerializedError, OSError):
    """A packed file was replaced on disk while a dataset still referred to it."""


class WriteError(TorchSerializedError, OSError):
    """Writing a packed file failed (disk full, permissions...); no partial output was left."""


class SourceDataError(TorchSerializedError, ValueError):
    """The VOC source is missing, malformed or unsafe, or a packed sample cannot give what is
    asked (a ``tv_tensors`` target without boxes)."""


class SourceNotFoundError(SourceDataError, FileNotFoundError):
    """A VOC source folder or file that must exist does not (as torchvision raises)."""


class RemoteError(TorchSerializedError, OSError):
    """Reading or writing a pack at a URL failed (network, server or permissions)."""


class RemoteNotFoundError(RemoteError, FileNotFoundError):
    """The object at a URL does not exist (HTTP 404, no such key or bucket); never retried."""


class RemoteAccessError(RemoteError, PermissionError):
    """The server refused access to a URL (HTTP 401/403, bad credentials); never retried."""


class UntypedObjectsWarning(UserWarning):
    """Packed objects lack a box or name: dict targets work, ``tv_tensors`` ones raise."""


class CacheLimitWarning(UserWarning):
    """The local cache had to exceed ``cache_limit_bytes``: what is in use alone is larger."""
