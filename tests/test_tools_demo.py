"""The demo (``torch-serialized demo``): generates, packs, checks against torchvision, races."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo(tmp_path: Path) -> None:
    args = ["demo", "--num-images", "24", "--dir", str(tmp_path / "demo"), "--batch-size", "4"]
    done = subprocess.run(
        [sys.executable, "-m", "torch_serialized", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "[1/4] Generating the built-in sample: 24 synthetic VOC2012 images" in out
    assert "5 of 5 samples identical" in out
    assert re.search(r"torchvision VOCDetection \(folder\)\s+24\s+6\s", out)
    assert re.search(r"torch_serialized \(pack, drop-in PIL\)\s+24\s+6\s", out)
    assert re.search(r"speed-up over torchvision: \d+\.\d\dx drop-in", out)
    assert re.search(r"warm cache, zero_copy=True: torchvision \d+ us, torch_serialized", out)
    assert (tmp_path / "demo" / "voc2012.tser").is_file()
    assert "Traceback" not in done.stderr
