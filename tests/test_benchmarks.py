"""The full benchmark (``benchmarks/tsbench``, development tooling run from a checkout) runs
end to end on tiny data and reports every scenario (no timing checks)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torchvision.datasets import VOCDetection
from tsbench import SCENARIOS, Row, Stat, lmdb_store, main, run_benchmark, system
from tsbench.access import tv_bytes_getter
from tsbench.context import Bench
from tsbench.gpu import NO_BATCHED_DECODE, batched_decode, decode_epochs, scenario_gpu
from tsbench.report import SMALL_SET, render_markdown
from tsbench.system import SEQUENTIAL_READERS
from vocfactory import Sample, jpeg, obj, voc_xml, write_voc

from torch_serialized import SourceDataError, VOCSerializedDataset

#: benchmarks/ of this checkout (tsbench is imported from there, as ``benchmarks/run.py`` does)
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


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
        if name == "gpu" and rows[0]["ours"] is None:  # no CUDA here: the row says so
            assert rows[0]["missing"] == "n/a (no GPU)"
            continue
        assert any(row["ours"] is not None for row in rows), name
        for row in rows:
            if row["peer"] is not None:
                assert row["peer"]["median"] > 0 and row["peer_ratio"] > 0, row["name"]
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
    assert scenarios["bytes"]["details"]["lmdb_same_output_as_torchvision"] is True
    assert scenarios["attributes"]["details"]["same_paths_as_torchvision"] is True
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


def test_a_set_too_small_to_time_is_flagged_above_the_table() -> None:
    """Below ``SMALL_SET`` images the table says it is a smoke test and, as the targets do
    not apply, marks no row MISSED and lists no missed targets."""
    from dataclasses import asdict

    from tsbench.core import Row, Stat

    slow = Row(
        key="k",
        scenario="bytes",
        name="a row",
        unit="samples/s",
        kind="rate",
        baseline=Stat.of([100.0]),
        ours=Stat.of([150.0]),
        target=8.0,
    ).finish()

    def table(num_images: int) -> str:
        environment = {"cpus_usable": 2, "cpu_model": "cpu", "torch": "t", "torchvision": "tv"}
        environment |= {"pillow": "p", "read_ahead_kb": 128, "date": "today"}
        config = {"num_images": num_images, "data": "synthetic", "repeats": 1}
        scenarios = {"bytes": {"rows": [asdict(slow)]}}
        misses = ["a row: 1.50x vs target ≥ 8x"]
        result = {
            "environment": environment,
            "config": config,
            "scenarios": scenarios,
            "misses": misses,
        }
        return render_markdown(result)

    assert slow.met is False
    small, enough = table(SMALL_SET - 1), table(SMALL_SET)
    assert f"Only {SMALL_SET - 1} images: read this table as a smoke test" in small
    assert small.index("smoke test") < small.index("| scenario |")
    assert "MISSED" not in small and "Missed targets" not in small
    assert "smoke test" not in enough and "| scenario |" in enough
    assert "**MISSED**" in enough and "Missed targets" in enough


def test_scenario_subset_through_main(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main(["--quick", "--scenarios", "bytes", "--out-dir", str(out), "--workers", "1"])
    assert code == 0
    saved = json.loads((out / "results.json").read_text())
    assert list(saved["scenarios"]) == ["bytes"]


def test_unknown_scenario_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown scenarios.*choose from pack, append, bytes"):
        run_benchmark(quick=True, out_dir=str(tmp_path), scenarios=["nope"], progress=False)


def test_without_out_dir_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only figures measured in this run, printed; no file in the current folder."""
    monkeypatch.chdir(tmp_path)
    result = run_benchmark(quick=True, scenarios=["bytes"], workers=0, progress=True)
    assert result["chart"] is None and list(tmp_path.iterdir()) == []
    table = capsys.readouterr().out
    assert "| scenario |" in table and "peer" not in table.lower()
    for row in result["scenarios"]["bytes"]["rows"]:
        assert "peer_best" not in row and row["ours"] is not None


def test_a_custom_2007_root_runs_without_year_or_classes(tmp_path: Path) -> None:
    """The issue's failure: no year detection, then classes outside VOC's 20."""
    root = tmp_path / "cells"
    samples = [
        Sample(f"{i:06d}", jpeg(48, 40, seed=i), voc_xml(f"{i:06d}.jpg", 48, 40, [obj(n, box)]))
        for i, (n, box) in enumerate(
            [("cellbody", (1, 2, 30.5, 20))] * 5 + [("nucleus", (3, 3, 9, 9))]
        )
    ]
    ids = [s.id for s in samples]
    write_voc(root, "2007", samples, {"Main": {"train": ids[:4], "val": ids[4:], "trainval": ids}})
    result = run_benchmark(root, quick=True, scenarios=["bytes"], workers=0, progress=False)
    assert result["config"]["year"] == "2007" and result["config"]["num_images"] == 6
    assert result["scenarios"]["bytes"]["details"]["same_output_as_torchvision"] is True


def test_a_failed_run_keeps_the_files_its_error_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # read TMPDIR again
    try:
        root = tmp_path / "bad"
        write_voc(root, "2007", [], {"Main": {"train": ["missing"]}})
        with pytest.raises(SourceDataError) as failure:
            run_benchmark(root, quick=True, scenarios=["bytes"], workers=0, progress=False)
    finally:
        tempfile.tempdir = None
    kept = capsys.readouterr().err
    assert "benchmark data kept in" in kept
    folder = Path(kept.split("kept in ")[1].split(" (")[0])
    assert folder.is_dir() and folder.parent == tmp_path
    assert str(root) in str(failure.value)  # the error names the source, which exists


@pytest.mark.slow
def test_lmdb_columns_in_the_table(quick: tuple[dict[str, Any], Path]) -> None:
    """LMDB is measured in the same run on the rows the issue compares, with a ratio."""
    result, out = quick
    rows = {r["key"]: r for s in result["scenarios"].values() for r in s["rows"]}
    for key in (
        "pack_1",
        "bytes_random_dict",
        "bytes_storage_order",
        "decoded_pil",
        "dataloader_pil",
        "cold_random",
        "cold_sampler",
        "cold_iterable",
        "cold_iterable_in_order",
    ):
        assert rows[key]["peer"] is not None and rows[key]["peer_ratio"] > 0, key
    for key in ("disk_sequential", "disk_random"):
        assert rows[key]["unit"] == "MB/s" and rows[key]["ours"]["median"] > 0
    table = (out / "results.md").read_text()
    assert "| torchvision | LMDB | torch_serialized | ×tv | ×LMDB |" in table


def test_without_lmdb_the_rows_say_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lmdb", None)  # import lmdb now raises ImportError
    result = run_benchmark(quick=True, out_dir=str(tmp_path), scenarios=["bytes"], progress=False)
    row = result["scenarios"]["bytes"]["rows"][0]
    assert row["peer"] is None and row["peer_missing"] == lmdb_store.MISSING
    assert f"| {lmdb_store.MISSING} |" in (tmp_path / "results.md").read_text()


def test_lmdb_store_holds_torchvision_samples(
    synthetic_devkit: Path, synthetic_packs: Any, tmp_path: Path
) -> None:
    pytest.importorskip("lmdb")
    tv = VOCDetection(str(synthetic_devkit), year="2007", image_set="trainval")
    lmdb_store.build(tv, tmp_path / "store")
    store = lmdb_store.Store(tmp_path / "store")
    try:
        expected = [tv_bytes_getter(tv)(i) for i in range(len(tv))]
        assert len(store) == len(tv)
        assert [store.get(i) for i in range(len(tv))] == expected
        assert list(store.walk()) == expected  # key order is list order
        # the "as ours" variants: the same image as a uint8 tensor owning its bytes
        ours = VOCSerializedDataset(synthetic_packs.single, image_set="trainval", decode="none")
        for i, (image, target) in enumerate(store.walk(store.split_tensor)):
            assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8
            assert image.numpy().flags.writeable
            assert torch.equal(image, ours[i][0]) and target == expected[i][1] == ours[i][1]
            assert torch.equal(store.get_tensor(i)[0], image)
    finally:
        store.close()


def test_gpu_scenario_without_cuda_and_its_loop_on_the_cpu(
    synthetic_devkit: Path, synthetic_packs: Any, tmp_path: Path
) -> None:
    """The GPU rows need CUDA; the loop they time (DataLoader of stored bytes, one batched
    decode_jpeg per batch) runs on any device, so it is checked here on the CPU."""
    bench = Bench(synthetic_devkit, "2007", tmp_path, repeats=1, quick=True, workers=0)
    bench.pack = synthetic_packs.single
    if not torch.cuda.is_available():
        (row,) = scenario_gpu(bench)
        assert row.ours is None and row.missing == "n/a (no GPU)"
    if not batched_decode():  # the package's oldest torchvision (0.16): the row says why
        if torch.cuda.is_available():
            (row,) = scenario_gpu(bench)
            assert row.ours is None and row.missing == NO_BATCHED_DECODE
        pytest.skip("decode_jpeg takes a list from torchvision 0.19 on")
    seconds = decode_epochs(bench, torch.device("cpu"), epochs=1)
    assert len(seconds) == 1 and seconds[0] > 0


def test_a_row_is_judged_against_torchvision_and_lmdb() -> None:
    def row(ours: float, peer: float | None, **kw: Any) -> Row:
        return Row(
            "k",
            "s",
            "n",
            "samples/s",
            "rate",
            Stat.of([10.0]),
            Stat.of([ours]),
            peer=Stat.of([peer]) if peer else None,
            **kw,
        ).finish()

    assert row(100, 50, target=8.0, peer_target=1.1).met is True
    slow = row(100, 95, target=8.0, peer_target=1.1)
    assert slow.met is False and slow.peer_ratio == pytest.approx(100 / 95)
    assert "LMDB in the same run" in slow.reason
    assert row(50, 10, target=8.0, peer_target=1.1).met is False  # behind torchvision's target
    assert row(100, None, peer_target=1.1).met is None  # no LMDB: not judged on it


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_remote_scenario_runs_only_when_asked_and_measures_every_row(tmp_path: Path) -> None:
    pytest.importorskip("moto")
    result = run_benchmark(quick=True, scenarios=["remote"], progress=False, work_dir=tmp_path)
    assert list(result["scenarios"]) == ["remote"]
    rows = {row["key"]: row for row in result["scenarios"]["remote"]["rows"]}
    assert set(rows) == {
        "remote_cap_mbps",
        "remote_cap_pil",
        "remote_latency_none",
        "remote_latency_pil",
        "remote_vs_tv",
        "remote_bytes_2x2",
        "remote_proxy_mbps",
    }
    for row in rows.values():
        assert row["ours"]["median"] > 0, row["key"]
    assert rows["remote_bytes_2x2"]["ours"]["median"] < 1.02  # each shard downloaded once
    details = result["scenarios"]["remote"]["details"]
    assert all(n == details["pack_bytes"] for n in details["bytes_per_epoch"]["cap_none"])


@pytest.mark.slow
def test_the_sources_scenario_compares_two_packs_with_one(tmp_path: Path) -> None:
    result = run_benchmark(quick=True, scenarios=["sources"], progress=False, work_dir=tmp_path)
    rows = {row["key"]: row for row in result["scenarios"]["sources"]["rows"]}
    assert set(rows) == {"sources_warm", "sources_cold", "sources_loader"}
    for row in rows.values():
        assert row["ours"]["median"] > 0 and row["ratio"] > 0, row["key"]


@pytest.mark.parametrize("method", sorted(SEQUENTIAL_READERS))
def test_each_sequential_reader_reads_every_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """The disk's sequential row is the best of these readers: each must read the whole file
    (a reader that skipped bytes would overstate the disk), and cope with an empty file."""
    data = bytes(range(256)) * (3 * 4096 + 7)  # not a multiple of a page or a chunk
    path = tmp_path / "file"
    path.write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    seen = bytearray(len(data))
    preadv, frombuffer = os.preadv, np.frombuffer
    walked: list[int] = []  # sizes of the maps walked

    def logged_preadv(fd: int, buffers: list[Any], offset: int, *flags: int) -> int:
        got = preadv(fd, buffers, offset, *flags)
        seen[offset : offset + got] = bytes(memoryview(buffers[0])[:got])
        return got

    def logged_frombuffer(buffer: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        walked.append(len(memoryview(buffer)))
        return frombuffer(buffer, *args, **kwargs)

    monkeypatch.setattr(system.os, "preadv", logged_preadv)
    monkeypatch.setattr(system.np, "frombuffer", logged_frombuffer)
    SEQUENTIAL_READERS[method][1]([str(path), str(tmp_path / "empty")])
    if method == "map":  # every page of the whole map is touched (a strided sum)
        assert walked == [len(data)]
    else:
        assert bytes(seen) == data


def test_importing_the_benchmark_does_not_import_torch() -> None:
    """A spawned pack process re-imports ``benchmarks/run.py``'s imports: a module-level import
    of torch there (one crept in with a note's constant) costs every such process a torch
    import, and the 2-process pack row fell from ~3,000 to ~600 samples/s."""
    code = "import sys, tsbench.run; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=BENCHMARKS
    )
    assert out.stdout.strip() == "False"


def test_the_benchmark_runs_from_a_checkout_as_its_readme_says() -> None:
    """``python benchmarks/run.py`` finds tsbench beside it, without pytest's pythonpath."""
    done = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--help"],
        capture_output=True,
        text=True,
        cwd=BENCHMARKS.parent,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python benchmarks/run.py")
    assert "--scenarios" in done.stdout


def test_the_chart_says_what_its_colours_mean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bars are coloured by their target (met, missed, none): the legend says so (issue #34)."""
    pytest.importorskip("matplotlib")
    import matplotlib.axes
    from tsbench import report

    def row(name: str, ratio: float, met: bool | None) -> dict[str, Any]:
        target = None if met is None else 2.0
        return dict(key=name, scenario="s", name=name, unit="/s", kind="rate", baseline=None,
                    ours=None, target=target, ratio=ratio, met=met)  # fmt: skip

    labels: list[str] = []
    legend = matplotlib.axes.Axes.legend

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        labels.extend(h.get_label() for h in kwargs["handles"])
        return legend(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "legend", spy)
    rows = [row("a", 3.0, True), row("b", 1.5, False), row("c", 1.1, None)]
    result = {"scenarios": {"s": {"rows": rows}}, "config": {"num_images": 8}}
    assert report.plot_chart(result, tmp_path / "chart.png")
    assert labels == ["target met", "target missed", "no target"]
