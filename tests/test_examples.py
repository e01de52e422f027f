"""Each script in examples/ runs on a generated sample and prints what it promises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# (script, arguments that keep the run small, lines the output must contain)
CASES = [
    (
        "batched_decode.py",
        ["--num-images", "24", "--batch-size", "8"],
        ["24 samples on", "last batch (8, 3, 224, 224)", "equals decode='tensor': True"],
    ),
    (
        "pack_and_iterate.py",
        ["--num-images", "24"],
        ["packed 24 samples", "identical to torchvision: True", "iterable: epoch 1: 12 samples"],
    ),
    (
        "train_detection.py",
        ["--num-images", "16", "--steps", "2", "--batch-size", "2"],
        ["step 2: loss", "trained 2 steps"],
    ),
    ("ddp_iterable.py", ["--num-images", "24", "--epochs", "1"], ["rank 1/2 epoch 0: 6 samples"]),
    (
        "segmentation.py",
        ["--num-images", "32", "--steps", "2", "--batch-size", "2", "--crop", "128"],
        ["a VOCSegmentation: True", "step 2: loss", "trained 2 steps"],
    ),
]


def test_every_example_is_tested() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(c[0] for c in CASES)


@pytest.mark.slow
@pytest.mark.parametrize(("script", "args", "expected"), CASES, ids=[c[0] for c in CASES])
def test_example_runs(script: str, args: list[str], expected: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "error::DeprecationWarning", "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for line in expected:
        assert line in done.stdout, done.stdout
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tser-")], "temp data left"
