"""The public surface: ``__all__`` is exactly what users get, and light paths stay light."""

from __future__ import annotations

import subprocess
import sys

import pytest

import torch_serialized as ts


def test_all_names_resolve_and_are_documented() -> None:
    for name in ts.__all__:
        value = getattr(ts, name)
        if name != "__version__":
            assert value.__doc__, f"{name} has no docstring"
    assert sorted(ts.__all__) == sorted(set(ts.__all__))


#: The public surface, exactly: a change here is a change of the API (and of CHANGELOG.md).
PUBLIC = [
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


def test_public_surface_is_exactly_this() -> None:
    assert ts.__all__ == PUBLIC
    assert set(PUBLIC) <= set(dir(ts))


def test_tools_entry_points_are_exactly_these() -> None:
    import torch_serialized.tools as tools

    assert tools.__all__ == ["make_synthetic_voc", "run_benchmark", "run_demo"]
    for name in tools.__all__:
        assert callable(getattr(tools, name)) and getattr(tools, name).__doc__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tools.nope  # noqa: B018


def test_contract_names_exist() -> None:
    for name in (
        "pack_voc",
        "VOCSerializedDataset",
        "VOCSerializedSegmentation",
        "VOCSerializedIterableDataset",
        "worker_init_fn",
        "Serializer",
        "SerializedDataset",
    ):
        assert name in ts.__all__


def test_unknown_attribute_raises_attribute_error() -> None:
    try:
        ts.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_packing_and_reading_files_never_import_torch() -> None:
    # pack workers and format tools must stay light: they are spawned processes; info,
    # verify and the command line's start need no torch either.
    light = [
        "container.spec",
        "container.writer",
        "container.reader",
        "container.parallel",
        "voc.layout",
        "voc.xml",
        "voc.schema",
        "voc.source",
        "voc.images",
        "voc.pack",
        "voc.packed",
        "voc.export",
        "summary",
        "cli",
    ]
    imports = ", ".join(f"torch_serialized.{name}" for name in light)
    code = f"import sys, torch_serialized, {imports}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
