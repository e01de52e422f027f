"""The demo (``torch-serialized demo``): generates, packs, checks against torchvision, and
measures both sides with medians, ranges and an honest word for noise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torch_serialized.tools.bench import _image_set, _torchvision_root
from torch_serialized.tools.measure import Comparison, spread


def test_spread_is_median_and_range_of_rates() -> None:
    assert spread([100.0, 50.0, 200.0]) == "100/s (50-200)"
    assert spread([1500.0]) == "1,500/s"  # one run has no range


def test_one_run_claims_nothing() -> None:
    """``bench --quick`` runs each variant once: no range, no "faster"."""
    assert Comparison("bytes", [100.0], [500.0]).verdict == "5.00x, one run"


def test_overlapping_ranges_are_within_noise_and_said_so() -> None:
    tv = [90.0, 100.0, 110.0]
    noisy = Comparison("epoch", tv, [105.0, 120.0, 130.0])  # ranges overlap at 105-110
    clear = Comparison("bytes", tv, [450.0, 500.0, 520.0])
    slower = Comparison("cold", tv, [45.0, 50.0, 60.0])
    assert noisy.within_noise and noisy.verdict == "1.20x, within noise"
    assert not clear.within_noise and clear.verdict == "5.00x faster"
    assert slower.verdict == "0.50x slower"


def test_bench_says_what_torchvision_cannot_read(tmp_path: Path) -> None:
    """bench compares with VOCDetection: data it cannot read is refused, saying why."""
    voc = tmp_path / "VOCdevkit" / "VOC2007"
    (voc / "ImageSets" / "Segmentation").mkdir(parents=True)
    with pytest.raises(ValueError, match="lists none of trainval, train, val, test"):
        _image_set(voc)
    assert _torchvision_root(voc, "2007") == tmp_path
    with pytest.raises(ValueError, match="reads VOC2007 from ROOT/VOCdevkit/VOC2007"):
        _torchvision_root(tmp_path / "data" / "VOC2007", "2007")


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
    assert "Generating 24 synthetic VOC2012 images" in out
    assert "Packed 24 samples of VOC2012" in out
    assert "Checked against torchvision: identical" in out
    assert "median of 5 runs (warm reads) or 3 (the rest) with (min-max)" in out
    spread = r"[\d,]+/s \([\d,]+-[\d,]+\)"
    for row in ("bytes + dict, warm", "PIL image + dict (drop-in)", "DataLoader epoch, 2 workers"):
        line = rf"{re.escape(row)} +{spread} +{spread} +\d+\.\d\dx( faster| slower|, within noise)"
        assert re.search(line, out), (row, out)
    assert "cold" not in out.split("Demo time")[0]  # no cache state is claimed
    assert "python benchmarks/run.py" in out
    assert (tmp_path / "demo" / "bench.tser").is_file()
    assert f"try: torch-serialized info {tmp_path / 'demo' / 'bench.tser'}" in out
    assert "Traceback" not in done.stderr


def test_bench_in_process_writes_what_it_printed(tmp_path: Path) -> None:
    """A quick bench on generated data: every scenario asked for is timed against
    torchvision, those of the full benchmark are said not to run, and --out-dir holds
    exactly what was printed plus every figure."""
    import json

    from torch_serialized.tools.bench import run_benchmark

    printed: list[str] = []
    result = run_benchmark(
        num_images=12,
        quick=True,
        workers=0,
        scenarios=["pack", "bytes", "decoded", "dataloader", "remote"],
        out_dir=tmp_path / "out",
        progress=False,
        out=printed.append,
    )
    text = "\n".join(printed)
    assert "Not measured here: remote" in text
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    asked = ["pack", "bytes", "decoded", "dataloader"]
    assert saved["config"]["scenarios"] == result["config"]["scenarios"] == asked
    assert saved["pack"]["num_samples"] == 12 and saved["rows"]
    assert all(row["ratio"] > 0 for row in saved["rows"])
    summary = (tmp_path / "out" / "results.txt").read_text()
    assert summary.strip() and summary.strip() in text
    with pytest.raises(ValueError, match="unknown scenarios nope"):
        run_benchmark(scenarios=["nope"], out=printed.append)
