"""Platforms: the scatter read without os.preadv (macOS builds), a clear error without pread."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from torch_serialized import VOCSerializedDataset, VOCSerializedIterableDataset
from torch_serialized.container import fileio


def test_preadv_by_pread_fills_buffers_like_preadv(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)) * 4)
    sizes = [3, 0, 100, 7, 2000]  # the last one runs past the end of the file
    expected = [np.zeros(n, np.uint8) for n in sizes]
    actual = [np.zeros(n, np.uint8) for n in sizes]
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "preadv"):
            assert os.preadv(fd, [a.data for a in expected], 10) == 1014
        else:  # the reference by hand
            data = path.read_bytes()[10:]
            for a, start in zip(expected, np.cumsum([0, *sizes[:-1]])):
                chunk = data[start : start + len(a)]
                a[: len(chunk)] = np.frombuffer(chunk, np.uint8)
        assert fileio.preadv_by_pread(fd, [a.data for a in actual], 10) == 1014
    finally:
        os.close(fd)
    for a, b in zip(actual, expected):
        assert np.array_equal(a, b)


def test_the_iterable_reads_the_same_without_preadv(
    stream_packs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fileio, "preadv", fileio.preadv_by_pread)
    for layout in ("single", "shards"):
        path = stream_packs[layout]
        stream = VOCSerializedIterableDataset(path, "trainval", decode="none")
        direct = VOCSerializedDataset(path, "trainval", decode="none")
        streamed = [(bytes(image.numpy()), target) for image, target in stream]
        assert streamed == [(bytes(direct[i][0].numpy()), direct[i][1]) for i in range(len(direct))]


def test_without_pread_the_reader_says_which_platforms_work() -> None:
    code = "import os; del os.pread; import torch_serialized.container.reader"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1
    assert "ImportError: torch_serialized reads packs with positional reads (os.pread)" in (
        done.stderr
    )
    assert "Linux and macOS (on Windows, use WSL2)" in done.stderr
