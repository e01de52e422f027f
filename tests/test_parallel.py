"""Writing with several processes: reserved records copied in, and pack_voc(workers=N).

A record reserved in the output and copied in from a scratch file must give the same bytes as
one added in place, and a parallel pack the same bytes as a one-process pack.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _container_helpers import (
    PACK_ID,
    TOKEN,
    no_pack_output,
    pack_file_bytes,
    pinned_identity,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import datasets, limits
from vocfactory import (
    TRUNCATED_JPEG,
    tiny_devkit,
)

import torch_serialized as ts
from torch_serialized.container.parallel import copy_range
from torch_serialized.container.shardwriter import PackWriter


@pytest.mark.parametrize("form", ["single", "shards"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=datasets(),
    limit=limits,
    reserved=st.lists(st.booleans(), min_size=1, max_size=12),
    copy_file_range=st.booleans(),
)
def test_reserved_records_copied_in_equal_added_ones(form, data, limit, reserved, copy_file_range):
    """Parallel packing: records laid out by another writer, ``reserve``d and copied in with
    ``copy_range`` before each file is finished, give the same bytes as ``add`` (padding
    holes, shard limits and the pread/pwrite fallback included)."""
    from unittest import mock

    from torch_serialized.container.writer import ContainerWriter

    limit = limit if form == "shards" else {}
    rows = data["rows"]
    with tempfile.TemporaryDirectory() as tmp:

        def write(out: Path, **extra: Any) -> PackWriter:
            w = PackWriter(
                out,
                data["fields"],
                columns=data["columns"],
                pack_id=PACK_ID,
                token=TOKEN,
                **limit,
                **extra,
            )
            return w

        plain = write(Path(tmp) / "plain")
        for i, record in enumerate(data["records"]):
            plain.add(record, None if rows is None else rows[i])
        for name, array in data["arrays"].items():
            plain.add_array(name, array)
        plain.close(data["user"])

        spill_path = Path(tmp) / "spill"
        with open(spill_path, "wb") as f:
            spill = ContainerWriter(f, data["fields"])
            for record in data["records"]:
                spill.add(record)
        entries = [spill.entries(i) for i in range(spill.num_records)]
        pending: list[tuple[np.ndarray, Path, int]] = []

        def copy_pending() -> None:
            with open(spill_path, "rb") as source:
                for row_entries, target, at in pending:
                    start = int(row_entries["offset"][0])
                    end = int(row_entries["offset"][-1] + row_entries["length"][-1])
                    with open(target, "r+b") as out:
                        copy_range(source.fileno(), start, out.fileno(), at, end - start)
            pending.clear()

        unsupported = OSError(errno.EXDEV, "cross-device")
        patch = mock.patch.object(os, "copy_file_range", side_effect=unsupported, create=True)
        with contextlib.ExitStack() as stack:
            if not copy_file_range:
                stack.enter_context(patch)
            mixed = write(Path(tmp) / "mixed", before_finish=copy_pending)
            for i, record in enumerate(data["records"]):
                row = None if rows is None else rows[i]
                if reserved[i % len(reserved)]:
                    index, target, at = mixed.reserve(entries[i], row)
                    assert index == i
                    pending.append((entries[i], target, at))
                else:
                    assert mixed.add(record, row) == i
            for name, array in data["arrays"].items():
                mixed.add_array(name, array)
            mixed.close(data["user"])
        assert pack_file_bytes(Path(tmp) / "mixed") == pack_file_bytes(Path(tmp) / "plain")


def test_reserve_refuses_a_foreign_layout(tmp_path):
    from torch_serialized.container.writer import ContainerWriter

    with open(tmp_path / "x", "wb") as f:
        w = ContainerWriter(f, ["a", "b"])
        w.add([b"abc", b"de"])
        entries = w.entries(0)
        with pytest.raises(ValueError, match="fields"):
            w.reserve(entries[:1])
        shifted = entries.copy()
        shifted["offset"] += 8
        with pytest.raises(ValueError, match="alignment"):
            w.reserve(shifted)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_samples_per_shard": 5},  # shard ends inside worker chunks
        {"max_shard_bytes": 400_000},
        {"image_storage": "raw", "max_size": 64},
        {"on_error": "skip", "check_images": True},
    ],
    ids=["file", "shards-by-count", "shards-by-size", "raw-resized", "skip"],
)
def test_parallel_pack_is_byte_identical(
    synthetic_devkit: Path, tmp_path: Path, options: dict[str, Any]
) -> None:
    """Workers lay records out in scratch files and copy them into holes the writer leaves:
    every byte, padding and shard boundaries included, must equal a one-process pack (given
    the same pack id and file-name token, which are otherwise random)."""
    if options.get("on_error") == "skip":  # a bad sample in the middle of a worker chunk
        source = tmp_path / "src"
        shutil.copytree(synthetic_devkit, source)
        jpegs = sorted((source / "VOCdevkit/VOC2007/JPEGImages").iterdir())
        jpegs[len(jpegs) // 2].write_bytes(TRUNCATED_JPEG)
        synthetic_devkit = source
    with pinned_identity():
        one = ts.pack_voc(synthetic_devkit, tmp_path / "one", year="2007", **options)
    assert bool(one.skipped) == ("on_error" in options)
    for workers in (2, 3):
        with pinned_identity():
            many = ts.pack_voc(
                synthetic_devkit, tmp_path / f"w{workers}", year="2007", workers=workers, **options
            )
        assert pack_file_bytes(many.path) == pack_file_bytes(one.path)
        assert many.skipped == one.skipped
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_parallel_pack_fails_cleanly(tmp_path: Path) -> None:
    ids = [f"{i:03d}" for i in range(40)]
    root = tiny_devkit(tmp_path / "src", ids)
    (root / "VOCdevkit/VOC2007/JPEGImages/027.jpg").unlink()
    with pytest.raises(ts.SourceDataError) as info:
        ts.pack_voc(root, tmp_path / "out.tser", year="2007", workers=2)
    assert "027.jpg" in str(info.value) and "train.txt line 28" in str(info.value)
    no_pack_output(tmp_path)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_failed_copy_into_the_output_is_a_write_error(tmp_path: Path, monkeypatch) -> None:
    from torch_serialized.container import parallel

    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(parallel, "copy_range", full)
    root = tiny_devkit(tmp_path / "src", [f"{i:03d}" for i in range(8)])
    with pytest.raises(ts.WriteError, match="free disk space") as info:
        ts.pack_voc(root, tmp_path / "out.tser", year="2007", workers=2)
    assert info.value.errno == errno.ENOSPC
    no_pack_output(tmp_path)


def test_workers_from_standard_input_are_refused_before_any_work(tmp_path: Path) -> None:
    """`python -` (a script read from standard input) cannot spawn pack processes: each one
    runs the main script again from its file. Refused up front, saying why and what to do,
    instead of a `FileNotFoundError: '<stdin>'` per process and a `BrokenProcessPool`; no
    output is written. From a script file the same call packs (the other tests here)."""
    import subprocess
    import sys

    root = tiny_devkit(tmp_path / "src", [f"{i:03d}" for i in range(8)])
    out = tmp_path / "out.tser"
    script = f"import torch_serialized as ts\nts.pack_voc({str(root)!r}, {str(out)!r}, workers=2)\n"
    done = subprocess.run(
        [sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert "ValueError: workers=2 starts pack processes" in done.stderr
    assert "'<stdin>', not a file" in done.stderr and "workers=1" in done.stderr
    assert "BrokenProcessPool" not in done.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
