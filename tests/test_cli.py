"""The ``torch-serialized`` command line: every command, its help, exit codes and outputs."""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from _container_helpers import Contents, rebuild_pack
from conftest import SYNTHETIC_YEAR, Packed
from PIL import Image
from vocfactory import Sample, jpeg, obj, voc_xml, write_voc

import torch_serialized
from torch_serialized import FormatError, __version__, pack_voc
from torch_serialized.cli import main, parse_size
from torch_serialized.container import spec as fmt
from torch_serialized.summary import DamagedRecord, part_info
from torch_serialized.voc import schema
from torch_serialized.voc.packed import VOCPackReader

COMMANDS = ("pack", "info", "verify", "export", "bench", "demo")
SCRIPT = Path(sys.executable).with_name("torch-serialized")


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    """``main(argv)`` in this process: (exit status, stdout, stderr)."""
    try:
        status = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def cli(
    *argv: object, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """The installed console script in a child process."""
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "torch_serialized"]
    return subprocess.run(
        [*command, *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )


def tree(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def voc_folder(packed: Packed) -> Path:
    return packed.root / "VOCdevkit" / f"VOC{packed.year}"


# -- help, version, sizes -----------------------------------------------------------------------
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(capsys: pytest.CaptureFixture[str], command: str) -> None:
    status, out, _ = run(capsys, command, "--help")
    assert status == 0
    assert out.startswith(f"usage: torch-serialized {command}")
    assert "--debug" in out


def test_top_level_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "--help")
    assert status == 0 and all(c in out for c in COMMANDS)
    status, out, _ = run(capsys, "--version")
    assert (
        status == 0
        and out.strip()
        == f"torch-serialized {__version__} (file format {fmt.FORMAT_MAJOR}.{fmt.FORMAT_MINOR})"
    )
    status, _, err = run(capsys)
    assert status == 2 and "required" in err


def test_the_module_entry_point_runs_the_command_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m torch_serialized`` in this process: its exit status is the command's."""
    monkeypatch.setattr(sys, "argv", ["torch-serialized", "--version"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("torch_serialized", run_name="__main__")
    assert exited.value.code == 0 and __version__ in capsys.readouterr().out


def test_console_script_and_module_entry_points() -> None:
    assert SCRIPT.exists(), "pip install -e . creates the torch-serialized script"
    done = cli("--version")
    assert done.returncode == 0 and __version__ in done.stdout
    done = subprocess.run(
        [sys.executable, "-m", "torch_serialized", "info", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: torch-serialized info")


@pytest.mark.parametrize(
    ("text", "size"),
    [("4096", 4096), ("256MB", 256 * 10**6), ("1GiB", 2**30), ("1.5k", 1500), (" 2 mib ", 2 << 20)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MB", "12XB", "-1MB", "0", "1e3"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


# -- pack -> info -> verify -> export -------------------------------------------------------------
def test_pack_info_verify_export_round_trip(
    capsys: pytest.CaptureFixture[str], synthetic_devkit: Path, tmp_path: Path
) -> None:
    pack = tmp_path / "voc.tser"
    status, out, err = run(capsys, "pack", synthetic_devkit, pack)
    assert status == 0, err
    assert "packing" not in err  # no progress bar: stderr is not a terminal here
    assert re.search(r"packed 24 samples of .*VOC2007\n", out)
    assert "  year     2007 (found in the folder names; --year picks another)" in out
    assert re.search(r"time .* samples/s, .* MB/s", out)
    assert "1 file" in out and "% of the" in out

    status, out, _ = run(capsys, "info", pack)
    assert status == 0
    for key in (
        "format ",
        f"torch_serialized {fmt.FORMAT_MAJOR}.{fmt.FORMAT_MINOR}",
        "image sets",
        "Main: train",
        "image size",
    ):
        assert key in out
    assert "person" in out

    status, out, _ = run(capsys, "verify", pack)
    assert status == 0 and out.startswith("OK ") and "(24 records in 1 file)" in out
    assert f"and all {24 * len(schema.FIELDS)} field checksums match" in out  # per field

    status, out, err = run(capsys, "export", pack, tmp_path / "restored")
    assert status == 0, err
    restored = tmp_path / "restored" / "VOCdevkit" / "VOC2007"
    assert f"to {restored}" in out
    assert tree(restored) == tree(synthetic_devkit / "VOCdevkit" / "VOC2007")

    status, _, err = run(capsys, "export", pack, tmp_path / "restored")
    assert status == 2 and "already exists" in err and "Traceback" not in err
    status, _, err = run(capsys, "export", "--overwrite", "-q", pack, tmp_path / "restored")
    assert status == 0, err


def test_progress_bars_only_on_a_terminal(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    synthetic_devkit: Path,
    tmp_path: Path,
) -> None:
    """In a log or CI (stderr a pipe) every bar update was one more ``\\r`` line."""
    logged = cli("pack", synthetic_devkit, tmp_path / "piped.tser")
    assert logged.returncode == 0, logged.stderr
    assert "\r" not in logged.stderr and "packing" not in logged.stderr
    logged = cli("export", tmp_path / "piped.tser", tmp_path / "out")
    assert logged.returncode == 0, logged.stderr
    assert "\r" not in logged.stderr and "exporting" not in logged.stderr

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # capsys's stream, as a terminal
    status, _, err = run(capsys, "pack", synthetic_devkit, tmp_path / "tty.tser")
    assert status == 0 and "packing" in err
    status, _, err = run(capsys, "pack", "-q", synthetic_devkit, tmp_path / "quiet.tser")
    assert status == 0 and "packing" not in err
    status, _, err = run(capsys, "export", tmp_path / "tty.tser", tmp_path / "out2")
    assert status == 0 and "exporting" in err


def test_cache_clear_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``cache clear --json`` took the flag and printed plain text."""
    status, out, err = run(capsys, "cache", "clear", "--cache-dir", tmp_path, "--json")
    assert status == 0, err
    assert json.loads(out) == {
        "packs_removed": 0,
        "objects_removed": 0,
        "bytes_freed": 0,
        "objects_in_use": 0,
    }


def test_cache_commands_refuse_a_file_and_call_a_missing_folder_empty(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``cache list --cache-dir FILE`` said "FILE/v1: Not a directory"; ``cache clear``
    reported "removed 0 pack(s) ... from FILE"."""
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    for action in ("list", "clear"):
        status, out, err = run(capsys, "cache", action, "--cache-dir", file)
        assert status == 2 and out == "", out
        assert f"{file} is not a folder" in err and "/v1" not in err
    assert file.read_text() == "mine"
    status, out, err = run(capsys, "cache", "list", "--cache-dir", tmp_path / "none")
    assert status == 0, err
    assert out.startswith(f"{tmp_path / 'none'}: 0 pack(s)") and "nothing cached" in out
    assert not (tmp_path / "none").exists()


def test_info_json_matches_the_source(
    capsys: pytest.CaptureFixture[str], synthetic_packs: Packed
) -> None:
    status, out, _ = run(capsys, "info", "--json", synthetic_packs.shards)
    assert status == 0
    info = json.loads(out)
    source = voc_folder(synthetic_packs)
    images = sorted((source / "JPEGImages").iterdir())
    names = Counter(
        obj.findtext("name")
        for xml in (source / "Annotations").iterdir()
        for obj in ET.parse(xml).getroot().iter("object")
    )
    sizes = []
    for path in images:
        with Image.open(path) as image:
            sizes.append(image.size)
    assert info["format_version"] == f"{fmt.FORMAT_MAJOR}.{fmt.FORMAT_MINOR}"
    assert info["year"] == SYNTHETIC_YEAR
    assert info["num_samples"] == len(images)
    assert info["classes"] == dict(names) and info["num_objects"] == sum(names.values())
    assert info["width"] == {"min": min(w for w, _ in sizes), "max": max(w for w, _ in sizes)}
    assert info["height"] == {"min": min(h for _, h in sizes), "max": max(h for _, h in sizes)}
    main_lists = {p.stem: len(p.read_text().split()) for p in (source / "ImageSets/Main").iterdir()}
    assert info["image_sets"]["Main"] == main_lists
    assert info["options"]["image_storage"] == "original"
    assert info["sharded"] and len(info["shards"]) == -(-len(images) // 5)
    assert sum(s["records"] for s in info["shards"]) == len(images)
    assert info["bytes"] == sum(p.stat().st_size for p in synthetic_packs.shards.iterdir())


@pytest.mark.parametrize(
    ("option", "shards"), [(["--shards", "3"], 3), (["--samples-per-shard", "10"], 3)]
)
def test_pack_shard_options(
    capsys: pytest.CaptureFixture[str],
    synthetic_devkit: Path,
    tmp_path: Path,
    option: list[str],
    shards: int,
) -> None:
    status, out, err = run(capsys, "pack", "-q", synthetic_devkit, tmp_path / "s", *option)
    assert status == 0, err
    assert f"({shards} shards)" in out
    assert len(list((tmp_path / "s").glob("shard-*.tser"))) == shards


def test_pack_shard_size(
    capsys: pytest.CaptureFixture[str], synthetic_devkit: Path, tmp_path: Path
) -> None:
    status, _, err = run(
        capsys, "pack", "-q", synthetic_devkit, tmp_path / "s", "--shard-size", "1MB"
    )
    assert status == 0, err
    files = list((tmp_path / "s").glob("*.tser"))
    assert len(files) > 1 and all(f.stat().st_size <= 10**6 + 200_000 for f in files)


def test_pack_options_reach_the_packer(
    capsys: pytest.CaptureFixture[str], synthetic_devkit: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "broken"
    shutil.copytree(synthetic_devkit, bad)
    victim = sorted((bad / "VOCdevkit/VOC2007/JPEGImages").iterdir())[3]
    victim.write_bytes(victim.read_bytes()[:300])
    status, _, err = run(capsys, "pack", "-q", bad, tmp_path / "a.tser", "--check-images")
    assert status == 2 and "not a readable image" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    status, out, err = run(
        capsys, "pack", "-q", bad, tmp_path / "a.tser", "--check-images", "--skip-bad",
        "--max-size", "200", "--year", "2007",
    )  # fmt: skip
    assert status == 0, err
    assert "skipped  1 sample;" in out and ".skipped.json" in out
    pack = VOCPackReader(tmp_path / "a.tser")
    assert pack.meta["max_size"] == 200 and len(pack) == 23
    assert int(pack.columns["width"].max()) <= 200
    status, _, err = run(
        capsys, "pack", "-q", synthetic_devkit, tmp_path / "r.tser", "--image-storage", "raw"
    )
    assert status == 0, err
    assert VOCPackReader(tmp_path / "r.tser").image_storage == "raw"
    status, _, err = run(capsys, "export", tmp_path / "r.tser", tmp_path / "out")
    assert status == 2 and "byte for byte" in err


def test_pack_usage_errors(
    capsys: pytest.CaptureFixture[str], synthetic_devkit: Path, tmp_path: Path
) -> None:
    out = tmp_path / "x"
    status, _, err = run(
        capsys, "pack", synthetic_devkit, out, "--shards", "2", "--shard-size", "1MB"
    )
    assert status == 2 and "not allowed with" in err
    status, _, err = run(capsys, "pack", synthetic_devkit, out, "--shard-size", "12XB")
    assert status == 2 and "invalid size" in err
    status, _, err = run(capsys, "pack", synthetic_devkit, out, "--workers", "0")
    assert status == 2 and ">= 1" in err
    status, _, err = run(capsys, "pack", tmp_path, out)
    assert status == 2 and "No Pascal VOC folder" in err and "Traceback" not in err


@pytest.mark.parametrize("option", [["--cache-dir", "c"], ["--cache-limit", "1GB"]])
def test_cache_options_are_refused_where_they_would_do_nothing(
    capsys: pytest.CaptureFixture[str], synthetic_packs: Packed, tmp_path: Path, option: list[str]
) -> None:
    # only an append to a URL stages through the cache: a pack, or an append to a local
    # path, would ignore them; prune reads no pack through the cache
    root = synthetic_packs.root
    status, _, err = run(capsys, "pack", root, tmp_path / "p.tser", "-q", *option)
    assert status == 2 and option[0] in err and "--append to a URL" in err
    assert not (tmp_path / "p.tser").exists()
    grown = tmp_path / "grown.tser"
    shutil.copyfile(synthetic_packs.single, grown)
    status, _, err = run(capsys, "pack", root, grown, "--append", "-q", *option)
    assert status == 2 and option[0] in err and "--append to a URL" in err
    status, _, err = run(capsys, "prune", "s3://bucket/voc", *option)
    assert status == 2 and "unrecognized arguments" in err


@pytest.mark.parametrize("append", [[], ["--append"], ["--overwrite"]])
def test_pack_to_an_https_url_is_refused_up_front(
    capsys: pytest.CaptureFixture[str], synthetic_devkit: Path, append: list[str]
) -> None:
    # port 9 (discard): nothing listens; a refusal that asked the server would retry first
    url = "https://127.0.0.1:9/voc"
    status, _, err = run(capsys, "pack", synthetic_devkit, url, "-q", *append)
    assert status == 2 and url in err and "read-only" in err and "s3://" in err


@pytest.mark.parametrize("append", [[], ["--append"]])
def test_pack_refuses_an_empty_or_dash_output(
    capsys: pytest.CaptureFixture[str],
    synthetic_devkit: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    append: list[str],
) -> None:
    """``pack ROOT ""`` said ". already exists; pass --overwrite"; ``pack ROOT -`` wrote a file
    named ``-``, where many tools would write to standard output, which a pack cannot be."""
    monkeypatch.chdir(tmp_path)
    status, _, err = run(capsys, "pack", "-q", synthetic_devkit, "", *append)
    assert status == 2 and "empty" in err and "already exists" not in err
    assert ".tser file (or shard folder)" in err
    status, _, err = run(capsys, "pack", "-q", synthetic_devkit, "-", *append)
    assert status == 2 and "standard output" in err and "./-" in err, err
    assert list(tmp_path.iterdir()) == []
    if not append:  # ./- is a file named "-", as asked
        status, out, err = run(capsys, "pack", "-q", synthetic_devkit, "./-")
        assert status == 0 and (tmp_path / "-").is_file(), err


def test_prune_on_a_local_path_says_what_prune_is_for(
    capsys: pytest.CaptureFixture[str], synthetic_packs: Packed, tmp_path: Path
) -> None:
    """``prune o.tser`` said "'o.tser' is not a URL (a local path is read without
    RemoteStore)": internal terms, and nothing on what to do."""
    for path in (synthetic_packs.single, synthetic_packs.shards, tmp_path / "none.tser"):
        status, out, err = run(capsys, "prune", path)
        assert status == 2 and out == "", err
        text = " ".join(err.split())
        assert f"{path} is a local path" in text and "RemoteStore" not in text
        assert "files that earlier packs left at a URL" in text
        assert "A local pack needs no pruning: a re-pack replaces its files" in text
        assert ("written through a file:// URL" in text) == path.is_dir()
    # the URL it suggests for a folder is one prune takes (nothing to delete there)
    url = synthetic_packs.shards.absolute().as_uri()
    assert url in " ".join(run(capsys, "prune", synthetic_packs.shards)[2].split())
    status, out, err = run(capsys, "prune", url, "--dry-run")
    assert status == 0 and "would delete 0 file(s)" in out, err


def test_pack_says_which_year_and_where_several_need_one(
    capsys: pytest.CaptureFixture[str], synthetic_devkit: Path, tmp_path: Path
) -> None:
    status, out, err = run(
        capsys, "pack", "-q", synthetic_devkit, tmp_path / "a.tser", "--year", "2007"
    )
    assert status == 0, err
    assert "  year     2007 (as asked)" in out
    status, _, err = run(
        capsys, "pack", "-q", synthetic_devkit, tmp_path / "c.tser", "--year", 2012
    )
    assert status == 2 and "No Pascal VOC 2012 folder found" in err
    assert "Found VOC2007" in err and "--year" in err  # the year there is, and the option
    both = tmp_path / "both"
    shutil.copytree(synthetic_devkit / "VOCdevkit" / "VOC2007", both / "VOCdevkit" / "VOC2007")
    shutil.copytree(synthetic_devkit / "VOCdevkit" / "VOC2007", both / "VOCdevkit" / "VOC2012")
    status, _, err = run(capsys, "pack", "-q", both, tmp_path / "b.tser")
    assert status == 2 and "several VOC folders" in err and "--year" in err
    assert not (tmp_path / "b.tser").exists()
    status, out, err = run(capsys, "pack", "-q", both, tmp_path / "b.tser", "--year", "2012")
    assert status == 0 and "VOC2012" in out, err


def test_pack_and_export_replace_output_only_with_overwrite(
    capsys: pytest.CaptureFixture[str], synthetic_devkit: Path, voc8: Path, tmp_path: Path
) -> None:
    """The same rule for both commands, said in both --help texts."""
    pack = tmp_path / "voc.tser"
    assert run(capsys, "pack", "-q", synthetic_devkit, pack)[0] == 0
    before = pack.read_bytes()
    status, _, err = run(capsys, "pack", "-q", voc8, pack)
    assert status == 2 and str(pack) in err and "--overwrite" in err
    assert pack.read_bytes() == before
    status, _, err = run(capsys, "pack", "-q", "--overwrite", voc8, pack)
    assert status == 0, err
    assert len(VOCPackReader(pack)) == 8
    assert run(capsys, "export", "-q", pack, tmp_path / "out")[0] == 0
    status, _, err = run(capsys, "export", "-q", pack, tmp_path / "out")
    assert status == 2 and "--overwrite" in err
    assert run(capsys, "export", "-q", "--overwrite", pack, tmp_path / "out")[0] == 0
    for command in ("pack", "export"):
        status, out, _ = run(capsys, command, "--help")
        assert status == 0 and "--overwrite" in out
        assert "replaced only with --overwrite" in " ".join(out.split())


def test_bad_source_data_points_cli_users_at_skip_bad(
    capsys: pytest.CaptureFixture[str], synthetic_devkit: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "broken"
    shutil.copytree(synthetic_devkit, bad)
    next((bad / "VOCdevkit/VOC2007/JPEGImages").iterdir()).unlink()
    status, _, err = run(capsys, "pack", "-q", bad, tmp_path / "a.tser")
    assert status == 2 and "is missing" in err and "--skip-bad" in err
    assert not (tmp_path / "a.tser").exists()


def test_pack_summary_and_progress_agree_with_info(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    synthetic_devkit: Path,
    tmp_path: Path,
) -> None:
    """One size (the files on disk) and one rate (those bytes over the whole pack)."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # show the bar
    for output, options in (("one.tser", []), ("shards", ["--shards", "3"])):
        status, out, err = run(capsys, "pack", synthetic_devkit, tmp_path / output, *options)
        assert status == 0, err
        packed = re.search(r"size +([\d.,]+ MB), ([\d.]+%) of the", out)
        rate = re.search(r"samples/s, ([\d,]+ MB/s)", out)
        assert packed and rate, out
        assert err.rstrip().endswith("]") and f"{rate[1]}]" in err.splitlines()[-1].split("\r")[-1]
        status, info_out, _ = run(capsys, "info", tmp_path / output)
        assert f"{packed[1]} in" in info_out and f"({packed[2]} of the" in info_out


def test_pack_info_and_verify_count_one_shard_as_a_shard(
    capsys: pytest.CaptureFixture[str], voc8: Path, tmp_path: Path
) -> None:
    """A folder of one shard is "1 shard" in every summary: it read "1 file" in pack and
    verify (as a .tser) and "1 shards" in info."""
    folder = tmp_path / "pack"
    status, out, err = run(capsys, "pack", "--samples-per-shard", "100", voc8, folder)
    assert status == 0 and f"output   {folder} (1 shard)" in out, out + err
    status, out, err = run(capsys, "info", folder)
    assert status == 0 and " in 1 shard (" in out and "shards" not in out.split("on disk")[1]
    status, out, err = run(capsys, "verify", folder)
    assert status == 0 and "(8 records in 1 shard)" in out, out + err
    status, out, err = run(capsys, "pack", voc8, tmp_path / "one.tser")
    assert status == 0 and "(1 file)" in out, out + err


@pytest.mark.parametrize("member", ["shard", "catalog"])
def test_pack_never_replaces_one_file_of_a_shard_folder(
    capsys: pytest.CaptureFixture[str], voc8: Path, tmp_path: Path, member: str
) -> None:
    """A shard or catalog is no pack: --overwrite does not replace it, the error names the
    folder to pass instead, and the folder still verifies."""
    folder = tmp_path / "pack"
    assert run(capsys, "pack", "-q", "--samples-per-shard", "3", voc8, folder)[0] == 0
    target = sorted(folder.glob(f"{member}-*.tser"))[-1]
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for flags in ((), ("--overwrite",), ("--overwrite", "--samples-per-shard", "2")):
        status, _, err = run(capsys, "pack", "-q", *flags, voc8, target)
        assert status == 2 and f"pass the folder {folder}" in err, err
        assert "of the pack at" in err and "pass --overwrite" not in err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    status, out, err = run(capsys, "verify", folder)
    assert status == 0 and out.startswith("OK ") and "(8 records in 3 shards)" in out, out + err


@pytest.mark.parametrize(
    ("name", "what", "where"),
    [("shard-*.tser", "shard 2 of 5", {"shard": 1, "num_shards": 5, "records": 5}),
     ("catalog-*.tser", "the catalog", {"records": 0})],
)  # fmt: skip
def test_info_and_verify_on_one_file_of_a_folder_name_the_folder(
    capsys: pytest.CaptureFixture[str],
    synthetic_packs: Packed,
    name: str,
    what: str,
    where: dict[str, int],
) -> None:
    folder = synthetic_packs.shards
    path = sorted(folder.glob(name))[where.get("shard", 0)]
    status, out, err = run(capsys, "info", path)
    assert status == 0, err
    assert f"is {what} of the pack at {folder}" in out and f"info {folder}" in out
    status, out, _ = run(capsys, "info", "--json", path)
    info = json.loads(out)
    assert {key: info[key] for key in where} == where and info["current"]
    assert str(folder) in (info.get("shard_of"), info.get("catalog_of"))
    status, out, _ = run(capsys, "verify", path)
    assert status == 0 and out.startswith("OK "), out
    assert f"This file is {what} of the pack at {folder}; " in out
    assert f"verify {folder} checks the whole pack" in out


def test_info_on_the_catalog_an_append_kept_says_it_is_an_earlier_version(
    capsys: pytest.CaptureFixture[str], voc8: Path, tmp_path: Path
) -> None:
    # README: info and verify take the catalog file of a shard folder; an append keeps the
    # previous generation's for the readers that opened it, and verify took it already
    folder = tmp_path / "shards"
    assert run(capsys, "pack", voc8, folder, "--samples-per-shard", 3, "-q")[0] == 0
    first = next(folder.glob("catalog-*.tser"))
    edit = next((voc8 / "VOCdevkit" / "VOC2007" / "ImageSets" / "Main").glob("train.txt"))
    root = tmp_path / "src"
    shutil.copytree(voc8, root)
    (root / edit.relative_to(voc8)).write_text("")  # a list changed: a new catalog is written
    assert run(capsys, "pack", root, folder, "--append", "-q")[0] == 0
    assert first.exists() and len(list(folder.glob("catalog-*.tser"))) == 2
    status, out, err = run(capsys, "info", first)
    assert status == 0, err
    assert f"is a catalog of an earlier version of the pack at {folder}" in out
    assert f"info {folder}" in out
    status, out, _ = run(capsys, "info", "--json", first)
    info = json.loads(out)
    assert (info["catalog_of"], info["records"], info["current"]) == (str(folder), 0, False)
    status, out, _ = run(capsys, "verify", first)
    assert status == 0 and "an earlier version" in out


@pytest.mark.parametrize(
    ("member", "what"), [("shard", "shard 5 of 5"), ("catalog", "the catalog")]
)
def test_export_and_append_on_one_file_of_a_folder_name_the_folder(
    capsys: pytest.CaptureFixture[str],
    synthetic_packs: Packed,
    tmp_path: Path,
    member: str,
    what: str,
) -> None:
    folder = synthetic_packs.shards
    path = sorted(folder.glob(f"{member}-*.tser"))[-1]
    for argv in (
        ("export", "-q", path, tmp_path / "out"),
        ("pack", "-q", "--append", synthetic_packs.root, path),
    ):
        status, out, err = run(capsys, *argv)
        assert status == 2, out + err
        assert f"{path} is {what} of the pack at {folder}, not a pack by itself; " in err
        assert f"pass the folder {folder}" in err and "re-pack" not in err


# -- verify ---------------------------------------------------------------------------------------
def damage(pack: Path, source_file: Path, out: Path) -> None:
    """Copy ``pack`` to ``out`` with one byte flipped inside ``source_file``'s stored bytes."""
    data = bytearray(pack.read_bytes())
    at = data.find(source_file.read_bytes())
    assert at > 0
    data[at + 200] ^= 0x55
    out.write_bytes(bytes(data))


def test_verify_names_the_damaged_sample(
    capsys: pytest.CaptureFixture[str], synthetic_packs: Packed, tmp_path: Path
) -> None:
    pack = VOCPackReader(synthetic_packs.single)
    record = 7
    image_id = pack.id(record)
    jpeg = voc_folder(synthetic_packs) / "JPEGImages" / f"{image_id}.jpg"
    damage(synthetic_packs.single, jpeg, tmp_path / "bad.tser")
    status, out, _ = run(capsys, "verify", tmp_path / "bad.tser")
    assert status == 1
    assert out.startswith("FAILED ") and "1 damaged record" in out
    assert f"record {record} (id {image_id!r}): field(s) image fail" in out


def test_verify_shards_names_shard_and_field(
    capsys: pytest.CaptureFixture[str], synthetic_packs: Packed, tmp_path: Path
) -> None:
    folder = tmp_path / "shards"
    shutil.copytree(synthetic_packs.shards, folder)
    pack = VOCPackReader(folder)
    flags = pack.columns["flags"]
    record = max(i for i in range(len(pack)) if flags[i] & 2)  # has a mask: in a later shard
    image_id = pack.id(record)
    mask = voc_folder(synthetic_packs) / "SegmentationClass" / f"{image_id}.png"
    shard, local = pack.reader.locate(record)
    damage(Path(shard.path), mask, Path(shard.path))
    status, out, _ = run(capsys, "verify", folder)
    assert status == 1
    expected = f"record {record} (id {image_id!r}) [{Path(shard.path).name} record {local}]"
    assert f"{expected}: field(s) mask fail" in out


def test_verify_names_a_shard_that_is_not_the_manifests_and_goes_on(
    capsys: pytest.CaptureFixture[str], synthetic_packs: Packed, tmp_path: Path
) -> None:
    """A shard swapped for another pack's, or missing, is damage (exit 1) named with its
    manifest; the other shards are still verified."""
    folder = tmp_path / "shards"
    shutil.copytree(synthetic_packs.shards, folder)
    other = pack_voc(synthetic_packs.root, tmp_path / "other", year="2007", max_samples_per_shard=5)
    names = sorted(p.name for p in folder.glob("shard-*"))
    shutil.copyfile(sorted(other.path.glob("shard-*"))[1], folder / names[1])
    (folder / names[3]).unlink()
    status, out, _ = run(capsys, "verify", folder)
    assert status == 1
    assert "2 damaged shard(s)" in out and f"{folder / names[1]} does not match" in out
    assert f"{folder / names[3]}: shard 3" in out and "missing" in out
    assert "damaged record" not in out  # the other shards are intact


@pytest.mark.parametrize("form", ["single", "shards"])
def test_verify_fails_a_pack_that_every_voc_reader_refuses(
    capsys: pytest.CaptureFixture[str], synthetic_packs: Packed, tmp_path: Path, form: str
) -> None:
    """Every checksum matches, but the append bookkeeping is invalid (retired records stored
    as int32): the VOC readers refuse the pack at open, so verify fails it (exit 1), naming
    the file and the field."""

    def edit(contents: Contents) -> None:
        contents.arrays[schema.RETIRED_ARRAY] = np.array([0, 3], dtype="<i4")
        contents.user["schema_version"] = schema.RETIRED_SCHEMA_VERSION

    src = synthetic_packs.single if form == "single" else synthetic_packs.shards
    limits = {"max_records_per_shard": 5} if form == "shards" else {}
    path = rebuild_pack(src, tmp_path / "bad", edit, **limits)
    status, out, _ = run(capsys, "verify", path)
    assert status == 1
    assert out.startswith(f"FAILED {path}") and "VOC readers refuse it" in out
    assert f"{path}: VOC metadata field {schema.RETIRED_ARRAY!r}" in out
    assert "damaged record" not in out and "damaged shard" not in out
    if form == "shards":  # the manifest's path stands for the whole pack, as the folder's
        status, out, _ = run(capsys, "verify", str(Path(path) / "manifest.json"))
        assert status == 1 and "VOC readers refuse it" in out
    status, out, _ = run(capsys, "verify", src)  # the pack it was rebuilt from is well
    assert status == 0 and "VOC metadata" in out


def test_info_and_verify_answer_in_python_what_the_commands_print(
    synthetic_packs: Packed, tmp_path: Path
) -> None:
    """``torch_serialized.info`` and ``verify`` return dataclasses; the commands format them."""
    about = torch_serialized.info(synthetic_packs.shards)
    assert isinstance(about, torch_serialized.PackInfo) and about.cached_in is None
    assert about.num_samples == 24 and about.sharded and about.year == SYNTHETIC_YEAR
    assert [(s.records, s.samples) for s in about.shards] == [(5, 5)] * 4 + [(4, 4)]
    shard = sorted(synthetic_packs.shards.glob("shard-*.tser"))[1]
    with pytest.raises(FormatError, match=f"pass the folder {synthetic_packs.shards}"):
        torch_serialized.info(shard)
    part = part_info(shard)
    assert part is not None and part.records == 5
    assert (part.member.index, part.member.num_shards) == (1, 5)
    assert part_info(synthetic_packs.single) is None

    report = torch_serialized.verify(synthetic_packs.single)
    assert isinstance(report, torch_serialized.VerifyReport) and report.ok and report.voc
    assert (report.records, report.checksums) == (24, 24 * len(schema.FIELDS))
    report = torch_serialized.verify(shard)
    assert report.ok and not report.voc and report.folder == str(synthetic_packs.shards)
    image_id = VOCPackReader(synthetic_packs.single).id(7)
    jpeg = voc_folder(synthetic_packs) / "JPEGImages" / f"{image_id}.jpg"
    damage(synthetic_packs.single, jpeg, tmp_path / "bad.tser")
    report = torch_serialized.verify(tmp_path / "bad.tser")
    assert not report.ok and report.damaged_shards == [] and report.voc_error is None
    assert report.damaged_records == [DamagedRecord(7, image_id, "bad.tser", 7, ["image"])]


@pytest.mark.parametrize("kind", ["missing", "truncated", "not a pack"])
def test_verify_unopenable_exits_2(
    capsys: pytest.CaptureFixture[str], synthetic_packs: Packed, tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "x.tser"
    if kind == "truncated":
        path.write_bytes(synthetic_packs.single.read_bytes()[:5000])
    elif kind == "not a pack":
        path.write_bytes(b"hello world" * 100)
    status, out, err = run(capsys, "verify", path)
    assert status == 2 and out == ""
    assert err.startswith("torch-serialized: error: ") and len(err.strip().splitlines()) == 1
    assert str(path) in err


def test_errors_are_one_line_unless_debug(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, _, err = run(capsys, "info", tmp_path / "missing.tser")
    assert status == 2 and len(err.strip().splitlines()) == 1 and "does not exist" in err
    with pytest.raises(FileNotFoundError):
        main(["info", str(tmp_path / "missing.tser"), "--debug"])
    with pytest.raises(FileNotFoundError):
        main(["--debug", "info", str(tmp_path / "missing.tser")])


def test_a_missing_backend_is_one_line_unless_debug(tmp_path: Path) -> None:
    """``info s3://...`` without s3fs: the library's ImportError as one line, exit 2."""
    code = (
        "import sys; sys.modules['s3fs'] = None; from torch_serialized.cli import main; "
        "sys.exit(main(sys.argv[2:] + ['info', 's3://bucket/voc', '--cache-dir', sys.argv[1]]))"
    )
    command = [sys.executable, "-c", code, str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith("torch-serialized: error: ") and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "s3://bucket/voc" in done.stderr
    debug = subprocess.run([*command, "--debug"], capture_output=True, text=True)
    assert debug.returncode == 1 and "ImportError" in debug.stderr.splitlines()[-1]


# -- bench: a short measurement that works from the wheel (tools/bench.py) ---------------------
def test_bench_help_names_what_it_measures_and_the_full_benchmark(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from torch_serialized.tools.bench import FULL_ONLY, SCENARIOS

    status, out, _ = run(capsys, "bench", "--help")
    text = " ".join(out.split())
    assert status == 0 and ", ".join(SCENARIOS) in text and ", ".join(FULL_ONLY) in text
    assert "python benchmarks/run.py" in text


@pytest.mark.slow
@pytest.mark.parametrize("data", ["root", "voc folder", "synthetic"])
def test_bench_prints_a_short_summary_and_writes_details_only_when_asked(
    tmp_path: Path, data: str
) -> None:
    """ROOT a custom-class VOC2007 set (torchvision's root, or its VOC2007 folder), no year
    given, or generated data: a few lines of ratios (issue #34: 106 lines with internal
    targets and rows that did not apply)."""
    synthetic = data == "synthetic"
    root = tmp_path / "custom"
    samples = [
        Sample(
            f"{i:03d}",
            jpeg(40, 30, seed=i),
            voc_xml(f"{i:03d}.jpg", 40, 30, [obj("cellbody", (1, 2, 20.5, 20))]),
        )
        for i in range(6)
    ]
    ids = [s.id for s in samples]
    write_voc(root, "2007", samples, {"Main": {"train": ids[:4], "val": ids[4:], "trainval": ids}})
    work = tmp_path / "cwd"
    work.mkdir()
    where = {
        "root": [root],
        "voc folder": [root / "VOCdevkit" / "VOC2007"],
        "synthetic": ["--num-images", "12"],
    }[data]
    out = tmp_path / "out"
    done = cli(
        "bench", *where, "--quick", "--scenarios", "bytes,memory", "--workers", "0",
        *(["--out-dir", out] if synthetic else []), timeout=290, cwd=work,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) < 15, done.stdout
    assert ("of VOC2012" if synthetic else f"of VOC2007 ({root}") in done.stdout
    assert "bytes + dict, warm" in done.stdout and "identical" in done.stdout
    assert "cold" not in done.stdout and "target" not in done.stdout.lower()
    assert "Not measured here: memory (python benchmarks/run.py" in done.stdout
    assert list(work.iterdir()) == []
    if synthetic:
        results = json.loads((out / "results.json").read_text())
        assert results["config"]["scenarios"] == ["bytes"]
        assert [r["name"] for r in results["rows"]][0] == "bytes + dict, warm"
        assert "bytes + dict, warm" in (out / "results.txt").read_text()
    else:
        assert "nothing saved: --out-dir DIR" in done.stdout


def test_bench_refuses_an_unknown_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "bench", "--scenarios", "bytes,nope")
    assert status == 2 and out == "" and "nope" in err and "bytes" in err


# -- issue #11 item 8: what info prints of a pack is escaped; a closed pipe ends quietly -------
EVIL = "dog\x1b[2J\x1b]0;pwned\x07\u202etac\u2028\x9b"


def test_info_escapes_terminal_control_characters(
    tmp_path: Path, tiny_packs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Metadata is untrusted: a class name (or any string in it) could clear the screen, set
    the window title or reverse the text around it when info printed it unescaped."""

    def rename(contents: Contents) -> None:
        user = contents.user
        user["classes"] = [EVIL if c == "dog" else c for c in user["classes"]]
        for counts in user["class_counts"].values():
            if "dog" in counts:
                counts[EVIL] = counts.pop("dog")
        user["packed_by"] = "me\x1b[31m"

    path = rebuild_pack(tiny_packs["single"], tmp_path / "evil.tser", rename)
    status, out, _ = run(capsys, "info", path)
    assert status == 0
    assert not any(c in out for c in "\x1b\x07\u202e\u2028\x9b")
    assert "dog\\x1b[2J\\x1b]0;pwned\\x07\\u202etac\\u2028\\x9b" in out and "me\\x1b[31m" in out
    status, out, _ = run(capsys, "info", "--json", path)
    assert status == 0 and not any(c in out for c in "\x1b\x07\u202e\u2028\x9b")
    info = json.loads(out)
    assert EVIL in info["classes"] and info["packed_by"] == "me\x1b[31m"


def test_errors_are_escaped_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x\x1b[2J.tser"
    path.write_bytes(b"junk")
    status, _, err = run(capsys, "info", path)
    assert status == 2 and "\x1b" not in err and "x\\x1b[2J.tser" in err


@pytest.mark.parametrize("command", [["info"], ["info", "--json"], ["verify"]])
def test_a_closed_pipe_ends_quietly(synthetic_packs: Packed, command: list[str]) -> None:
    """``torch-serialized info x.tser | head`` ended with 'error: Broken pipe' on stderr."""
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the first line is written
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torch_serialized", *command, str(synthetic_packs.shards)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONWARNINGS": "error"},
        )
    finally:
        os.close(write)
    assert proc.stderr == "" and proc.returncode == 141


@pytest.mark.parametrize(("asked", "written"), [(10, 10), (7, 7), (24, 24), (30, 24)])
def test_pack_shards_n_writes_n_shards_of_even_sizes(
    capsys: pytest.CaptureFixture[str],
    synthetic_devkit: Path,
    tmp_path: Path,
    asked: int,
    written: int,
) -> None:
    # 24 samples: --shards 10 used to give 8 shards of 3 (ceil(24 / ceil(24 / 10)))
    out_dir = tmp_path / "s"
    status, out, err = run(capsys, "pack", "-q", synthetic_devkit, out_dir, "--shards", asked)
    assert status == 0, err
    assert f"({written} shards)" in out
    reader = VOCPackReader(out_dir).reader
    sizes = [len(reader.shard(s)) for s in range(reader.num_shards)]
    assert len(sizes) == written and sum(sizes) == 24 and max(sizes) - min(sizes) <= 1
    assert ("only 24 samples" in out) == (asked > 24)


def test_export_and_info_count_live_samples_not_retired_records(
    capsys: pytest.CaptureFixture[str], voc8: Path, tmp_path: Path
) -> None:
    root = tmp_path / "src"
    shutil.copytree(voc8, root)
    pack = tmp_path / "shards"
    assert run(capsys, "pack", root, pack, "--samples-per-shard", 3, "-q")[0] == 0
    reader = VOCPackReader(pack)
    gone = {reader.id(r) for r in range(3)}  # every sample of the first shard
    for listed in (root / "VOCdevkit" / "VOC2007" / "ImageSets").rglob("*.txt"):
        lines = listed.read_text().splitlines(keepends=True)
        listed.write_text("".join(ln for ln in lines if ln.split(" ")[0].strip() not in gone))
    assert run(capsys, "pack", root, pack, "--append", "-q")[0] == 0
    status, out, _ = run(capsys, "export", pack, tmp_path / "out", "-q")
    images = list((tmp_path / "out").rglob("*.jpg"))
    assert status == 0 and len(images) == 5 and out.startswith("exported 5 samples")
    status, out, _ = run(capsys, "info", pack)
    first = next(line for line in out.splitlines() if "shard-00000" in line)
    assert status == 0 and " 0 samples (3 retired)" in first
    assert "  samples      5 " in out
    status, out, _ = run(capsys, "info", pack, "--json")
    shards = json.loads(out)["shards"]
    assert [(s["records"], s["samples"]) for s in shards] == [(3, 0), (3, 3), (2, 2)]


def test_an_interrupt_exits_130_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Ctrl-C: status 130 (128 + SIGINT, as a shell reports it) and one line, no traceback;
    ``--debug`` lets the ``KeyboardInterrupt`` through."""
    from torch_serialized.cli import commands

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "cmd_info", interrupted)
    status, out, err = run(capsys, "info", tmp_path / "x.tser")
    assert (status, out, err) == (130, "", "torch-serialized: error: interrupted\n")
    with pytest.raises(KeyboardInterrupt):
        main(["--debug", "info", str(tmp_path / "x.tser")])
