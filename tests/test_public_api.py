"""The public surface: ``__all__`` is exactly what users get, and light paths stay light."""

from __future__ import annotations

import subprocess
import sys

import torch_serialized as ts


def test_all_names_resolve_and_are_documented() -> None:
    for name in ts.__all__:
        value = getattr(ts, name)
        if name != "__version__":
            assert value.__doc__, f"{name} has no docstring"
    assert sorted(ts.__all__) == sorted(set(ts.__all__))


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
    # pack workers and format tools must stay light: they are spawned processes.
    code = (
        "import sys, torch_serialized, torch_serialized.voc.pack, torch_serialized.reader;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
