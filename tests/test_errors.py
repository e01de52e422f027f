"""The exception tree: every class subclasses a built-in, so existing handlers keep working."""

from __future__ import annotations

import pytest

import torch_serialized as ts
from torch_serialized import errors

#: class -> the built-in it must also be
BUILTIN = {
    "FormatError": ValueError,
    "CorruptFileError": ValueError,
    "TruncatedFileError": ValueError,
    "IncompletePackError": FileNotFoundError,
    "UnsupportedVersionError": ValueError,
    "ChecksumError": ValueError,
    "ImageTooLargeError": ValueError,
    "SourceDataError": ValueError,
    "SourceNotFoundError": FileNotFoundError,
    "FileChangedError": OSError,
    "WriteError": OSError,
    "RemoteError": OSError,
    "RemoteNotFoundError": FileNotFoundError,
    "RemoteAccessError": PermissionError,
}


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_each_error_is_ours_and_a_builtin(name: str) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, errors.TorchSerializedError) and issubclass(cls, BUILTIN[name])
    assert getattr(ts, name) is cls and cls.__doc__


def test_the_tree() -> None:
    assert issubclass(errors.TruncatedFileError, errors.CorruptFileError)
    assert issubclass(errors.ChecksumError, errors.CorruptFileError)
    assert issubclass(errors.CorruptFileError, errors.FormatError)
    assert issubclass(errors.UnsupportedVersionError, errors.FormatError)
    assert issubclass(errors.RemoteNotFoundError, errors.RemoteError)
    assert issubclass(errors.ImageTooLargeError, errors.FormatError)
    assert issubclass(errors.IncompletePackError, errors.CorruptFileError)
    # missing source data is still a SourceDataError (what callers catch) and a ValueError
    assert issubclass(errors.SourceNotFoundError, errors.SourceDataError)
    assert issubclass(errors.SourceNotFoundError, ValueError)
    assert issubclass(errors.RemoteAccessError, errors.RemoteError)
    assert sorted(errors.__all__) == sorted(
        ["TorchSerializedError", "CacheLimitWarning", "UntypedObjectsWarning", *BUILTIN]
    )


def test_cache_limit_is_a_warning_not_an_error() -> None:
    assert issubclass(errors.CacheLimitWarning, UserWarning)
    assert not issubclass(errors.CacheLimitWarning, errors.TorchSerializedError)
    assert ts.CacheLimitWarning is errors.CacheLimitWarning


def test_os_errors_keep_errno_and_message() -> None:
    exc = errors.WriteError(28, "disk full")
    assert exc.errno == 28 and exc.strerror == "disk full"
    with pytest.raises(OSError):
        raise exc
