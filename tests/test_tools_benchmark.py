"""The benchmark runs end to end on tiny data and reports every scenario (no timing checks)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from torch_serialized.tools.benchmark import SCENARIOS, main, run_benchmark


def _numbers(row: dict[str, Any]) -> list[float]:
    values = []
    for side in ("baseline", "ours"):
        if row[side] is not None:
            values += [row[side]["median"], row[side]["min"], row[side]["max"]]
    return values


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench-out")
    result = run_benchmark(quick=True, out_dir=str(out), progress=False)
    return result, out


@pytest.mark.slow
def test_every_scenario_has_positive_measurements(quick: tuple[dict[str, Any], Path]) -> None:
    result, _ = quick
    assert list(result["scenarios"]) == list(SCENARIOS)
    for name, scenario in result["scenarios"].items():
        rows = scenario["rows"]
        assert rows, name
        assert any(row["ours"] is not None for row in rows), name
        for row in rows:
            for value in _numbers(row):
                assert math.isfinite(value), (name, row["name"])
                # growth of memory may be zero or negative; everything else is positive
                if row["unit"] != "MB" or row["key"] in ("pack_size", "memory_uss_total"):
                    assert value > 0, (name, row["name"], value)
            if row["ratio"] is not None and row["kind"] in ("rate", "cost"):
                assert row["ratio"] > 0


@pytest.mark.slow
def test_correctness_checks_inside_the_benchmark(quick: tuple[dict[str, Any], Path]) -> None:
    result, _ = quick
    scenarios = result["scenarios"]
    assert scenarios["pack"]["details"]["outputs_identical"] is True
    assert scenarios["bytes"]["details"]["same_output_as_torchvision"] is True
    cold = scenarios["cold"]["details"]
    if cold["fadvise_supported"] and cold["mincore_check"]:
        assert cold["worst_resident_after_evict"] < 0.05


@pytest.mark.slow
def test_files_and_environment(quick: tuple[dict[str, Any], Path]) -> None:
    result, out = quick
    saved = json.loads((out / "results.json").read_text())
    assert saved["config"]["num_images"] == 64
    for key in ("date", "torch", "torchvision", "numpy", "pillow", "cpu_count", "python"):
        assert saved["environment"][key], key
    table = (out / "results.md").read_text()
    assert "| scenario |" in table and "bytes + dict target" in table
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the chart is optional (the "bench" extra); the rest must not need it
        assert result["chart"] is None and not (out / "results.png").exists()
    else:
        assert (out / "results.png").stat().st_size > 0
        assert result["chart"] == str(out / "results.png")


def test_scenario_subset_through_main(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main(["--quick", "--scenarios", "bytes", "--out-dir", str(out), "--workers", "1"])
    assert code == 0
    saved = json.loads((out / "results.json").read_text())
    assert list(saved["scenarios"]) == ["bytes"]


def test_unknown_scenario_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown scenarios"):
        run_benchmark(quick=True, out_dir=str(tmp_path), scenarios=["nope"], progress=False)
