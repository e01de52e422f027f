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
from torch_serialized.tools.demo import Comparison, Spread, _evict, summarize


def test_spread_is_median_and_range_of_rates() -> None:
    spread = Spread.of_rates(100, [1.0, 0.5, 2.0])
    assert (spread.median, spread.low, spread.high) == (100.0, 50.0, 200.0)
    assert str(spread) == "100/s (50-200)"


def test_one_run_claims_nothing() -> None:
    """``bench --quick`` runs each variant once: no range, no "faster beyond noise"."""
    once = Comparison("bytes", Spread(100, 100, 100, runs=1), Spread(500, 500, 500, runs=1))
    assert str(once.ours) == "500/s" and once.verdict == "5.00x, one run"
    text = " ".join(summarize([once]))
    assert "Measured once, so nothing is claimed: bytes 5.00x" in text and "beyond" not in text


def test_overlapping_ranges_are_within_noise_and_said_so() -> None:
    tv = Spread(100, 90, 110)
    noisy = Comparison("epoch", tv, Spread(120, 105, 130))  # ranges overlap at 105-110
    clear = Comparison("bytes", tv, Spread(500, 450, 520))
    slower = Comparison("cold", tv, Spread(50, 45, 60))
    assert noisy.within_noise and noisy.verdict == "1.20x, within noise"
    assert not clear.within_noise and clear.verdict == "5.00x faster"
    assert slower.verdict == "0.50x slower"
    text = " ".join(summarize([noisy, clear, slower]))
    assert "Faster beyond noise: bytes 5.0x." in text
    assert "Within noise, so no speed-up is claimed: epoch" in text
    assert "Slower: cold 0.50x." in text


def test_bench_says_what_torchvision_cannot_read(tmp_path: Path) -> None:
    """bench compares with VOCDetection: data it cannot read is refused, saying why."""
    voc = tmp_path / "VOCdevkit" / "VOC2007"
    (voc / "ImageSets" / "Segmentation").mkdir(parents=True)
    with pytest.raises(ValueError, match="lists none of trainval, train, val, test"):
        _image_set(voc)
    assert _torchvision_root(voc, "2007") == tmp_path
    with pytest.raises(ValueError, match="reads no VOC2020"):
        _torchvision_root(voc, "2020")
    with pytest.raises(ValueError, match="reads VOC2007 from ROOT/VOCdevkit/VOC2007"):
        _torchvision_root(tmp_path / "data" / "VOC2007", "2007")


@pytest.mark.skipif(sys.platform != "linux", reason="mincore is read on Linux only")
def test_evict_reports_the_share_of_pages_left_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cold rows say how cold they were: ``mincore`` counts the pages eviction left."""
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(1 << 16))
    (tmp_path / "empty").touch()
    path.read_bytes()
    monkeypatch.setattr(os, "posix_fadvise", lambda *args: None)  # eviction that drops nothing
    assert _evict([str(path), str(tmp_path / "empty")]) == 1.0
    assert _evict([str(tmp_path / "empty")]) is None  # no page to count


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
    assert "Checked against torchvision: identical" in out and "decode='tensor'" in out
    assert "median of 5 runs (warm reads) or 3 (the rest) with (min-max)" in out
    spread = r"[\d,]+/s \([\d,]+-[\d,]+\)"
    for row in (
        "bytes + dict, warm",
        "bytes + dict, warm, zero_copy=True",
        "bytes + dict, cold, map-style",
        "bytes + dict, cold, iterable",
        "PIL image + dict (drop-in)",
        "uint8 tensor, decode='tensor'",
        "DataLoader epoch, drop-in",
    ):
        line = rf"{re.escape(row)} +{spread} +{spread} +\d+\.\d\dx( faster| slower|, within noise)"
        assert re.search(line, out), (row, out)
    assert re.search(r"mincore: at most \d+\.\d% left", out) or "NOT COLD" in out
    assert "Faster beyond noise" in out or "Within noise" in out
    assert "speed-up over torchvision" not in out  # no single-run headline
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
    assert saved["pack"]["samples"] == 12 and saved["rows"]
    assert all(row["ratio"] > 0 for row in saved["rows"])
    summary = (tmp_path / "out" / "results.txt").read_text()
    assert summary.strip() and summary.strip() in text
    with pytest.raises(ValueError, match="unknown scenarios nope"):
        run_benchmark(scenarios=["nope"], out=printed.append)
