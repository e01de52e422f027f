"""What a new user meets first (issue #34): a VOC root given where a pack goes and the reverse,
a shard folder named like a file, counts of one, URLs echoed as typed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import Packed
from vocfactory import tiny_devkit

import torch_serialized as ts
from torch_serialized import FormatError, SourceDataError
from torch_serialized.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_a_voc_root_where_a_pack_goes_says_to_pack_it(
    synthetic_devkit: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    voc = synthetic_devkit / "VOCdevkit"
    for path in (synthetic_devkit, voc, voc / "VOC2007"):
        with pytest.raises(FormatError, match="is a VOC root .*`torch-serialized pack`") as caught:
            ts.VOCSerializedDataset(path)
        assert str(path) in str(caught.value)
        for command in ("info", "verify"):
            status, out, err = run(capsys, command, path)
            assert status == 2 and out == "" and f"{path} is a VOC root" in err
            assert "pack it first with `torch-serialized pack`" in err


def test_a_pack_where_a_voc_root_goes_says_how_it_is_read(
    synthetic_packs: Packed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for pack, what in ((synthetic_packs.single, ".tser file"), (synthetic_packs.shards, "folder")):
        with pytest.raises(SourceDataError, match=f"is a pack .*{what}.*VOCSerializedDataset"):
            ts.pack_voc(pack, tmp_path / "again.tser")
        status, out, err = run(capsys, "pack", pack, tmp_path / "again.tser", "-q")
        assert status == 2 and f"{pack} is a pack" in err and "VOCSerializedDataset" in err
    assert not (tmp_path / "again.tser").exists()
    copy = tmp_path / "copy.tser"  # appending from a pack: the same advice
    ts.pack_voc(synthetic_packs.root, copy)
    with pytest.raises(SourceDataError, match="is a pack .*VOCSerializedDataset"):
        ts.append_voc(synthetic_packs.single, copy)


def test_export_to_a_url_is_refused_by_the_library(synthetic_packs: Packed, tmp_path: Path) -> None:
    """export_voc writes a local folder: a URL would become a folder named "https:"."""
    with pytest.raises(ValueError, match=r"https://host/x is a URL"):
        ts.export_voc(synthetic_packs.single, "https://host/x")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "limit", [{"num_shards": 3}, {"max_samples_per_shard": 5}, {"max_shard_bytes": 10**6}]
)
def test_a_shard_folder_named_like_a_file_is_refused(
    synthetic_devkit: Path, tmp_path: Path, limit: dict[str, int]
) -> None:
    out = tmp_path / "out.tser"
    with pytest.raises(ValueError, match=r"out\.tser.*drop the \.tser suffix"):
        ts.pack_voc(synthetic_devkit, out, **limit)  # type: ignore[arg-type]
    assert not out.exists()


def test_info_shows_the_shard_count_asked_for(
    synthetic_devkit: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run(capsys, "pack", synthetic_devkit, tmp_path / "out.tser", "--shards", "3")
    assert status == 2 and "drop the .tser suffix" in err and not (tmp_path / "out.tser").exists()
    assert run(capsys, "pack", synthetic_devkit, tmp_path / "out", "--shards", "3", "-q")[0] == 0
    assert ts.info(tmp_path / "out").options["num_shards"] == 3
    assert "num_shards=3" in run(capsys, "info", tmp_path / "out")[1]


def test_counts_of_one_are_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tiny_devkit(tmp_path / "one", ["a"])
    pack = tmp_path / "p"
    said = [
        run(capsys, "pack", root, pack, "--shards", "3", "-q")[1],
        run(capsys, "info", pack)[1],
        run(capsys, "verify", pack)[1],
        run(capsys, "export", pack, tmp_path / "out", "-q")[1],
    ]
    text = "\n".join(said)
    assert "packed 1 sample of" in text and "only 1 sample packed" in text
    assert "(1 record in 1 shard)" in text and "exported 1 sample and" in text
    assert not re.search(r"(?<![\d,.])1 (samples|records|list files)\b", text), text


@pytest.mark.parametrize("command", [["pack", "https://host/x", "out.tser"], ["export", "PACK"]])
def test_a_url_is_echoed_as_typed(
    synthetic_packs: Packed,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: list[str],
) -> None:
    """Never ``https:/host/x`` (a Path of the URL), nor a local folder named ``https:``."""
    monkeypatch.chdir(tmp_path)
    argv = [synthetic_packs.single, "https://host/x"] if command[1] == "PACK" else command[1:]
    status, out, err = run(capsys, command[0], *argv)
    assert status == 2 and "https://host/x is a URL" in err
    assert list(tmp_path.iterdir()) == []


def test_the_default_run_says_why_tests_skip() -> None:
    """A fresh clone without the real data sees why those tests skip, without ``-rs``."""
    import tomllib

    config = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "-rs" in config["tool"]["pytest"]["ini_options"]["addopts"]


def test_a_missing_shard_is_named_when_the_dataset_opens(
    synthetic_packs: Packed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not at sample 1,844 of an epoch hours later, as a raw FileNotFoundError (issue #34)."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(synthetic_packs.shards, copy)
    shard = sorted(copy.glob("shard-*.tser"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{re.escape(str(shard))} is missing"):
        ts.VOCSerializedDataset(copy)
    status, out, err = run(capsys, "info", copy)
    assert status != 0 and f"{shard} is missing" in err
