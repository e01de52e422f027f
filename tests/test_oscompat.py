"""Platforms: a clear error where os.pread is missing."""

from __future__ import annotations

import subprocess
import sys


def test_without_pread_the_reader_says_which_platforms_work() -> None:
    code = "import os; del os.pread; import torch_serialized.container.reader"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1
    assert "ImportError: torch_serialized reads packs with positional reads (os.pread)" in (
        done.stderr
    )
    assert "Linux and macOS (on Windows, use WSL2)" in done.stderr
