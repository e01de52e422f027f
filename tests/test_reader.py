"""ContainerReader and PackReader: shapes, damage detection, processes, memory, concurrency.

Damage is single, deliberate faults (one flipped byte, cuts at fixed points, edited
manifests); random damage is in test_reader_fuzz.py.
"""

from __future__ import annotations

import errno
import gc
import json
import multiprocessing as mp
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import tracemalloc
import zlib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _container_helpers import (
    FORMS,
    SHARDED,
    FieldBytes,
    assert_bad_content,
    catalog_file,
    check_pack,
    container_files,
    copy_pack,
    edit_manifest,
    flip,
    ignore_fork_warning,
    parse_container,
    payload,
    pinned_identity,
    read_all_pickled,
    read_contents,
    read_error,
    record_spans,
    rewrite_container,
    size_of,
    write_contents,
    write_pack,
)
from _reliability_helpers import (
    PACK_FORMS,
    crc_reader,
    dead_pid,
    out_name,
    read_pickled,
    read_records,
    run_child,
)

import torch_serialized
from torch_serialized.container import spec as fmt
from torch_serialized.container.reader import ContainerReader
from torch_serialized.container.shards import PackReader, open_pack
from torch_serialized.container.shardwriter import PackWriter
from torch_serialized.errors import (
    ChecksumError,
    CorruptFileError,
    FileChangedError,
    FormatError,
    TruncatedFileError,
    UnsupportedVersionError,
)
from torch_serialized.voc.pack import pack_voc


def test_manifest_path_and_reader_shapes(container_packs):
    reader = open_pack(container_packs["shards"] / fmt.MANIFEST_NAME)
    assert reader.path == str(container_packs["shards"])
    assert [e.num_records for e in reader.entries] == [7, 7, 7, 7, 2]
    assert [e.first_record for e in reader.entries] == [0, 7, 14, 21, 28]
    assert reader.starts.tolist() == [0, 7, 14, 21, 28, 30]
    check_pack(reader, 30)
    assert reader.arrays()["records"]["id"].tolist() == list(range(30))
    assert reader.nbytes == sum(f.stat().st_size for f in container_packs["shards"].iterdir())
    assert reader.field_index("target") == 1
    with pytest.raises(KeyError, match="nope"):
        reader.field_index("nope")


@pytest.mark.parametrize("position", [0, 8, 9, 12, 16, 20, 30, 59, 60, 63])
def test_corrupted_header_byte(tmp_path, container_packs, position):
    path = copy_pack(container_packs["single"], tmp_path)
    flip(path, position)
    with pytest.raises(CorruptFileError) as info:
        open_pack(path)
    assert_bad_content(info.value, path)


def test_wrong_magic(tmp_path, container_packs):
    path = copy_pack(container_packs["single"], tmp_path)
    with open(path, "r+b") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(CorruptFileError, match="not a torch_serialized file") as info:
        open_pack(path)
    assert_bad_content(info.value, path)


def test_not_a_pack_at_all(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"hello world\n" * 100)
    with pytest.raises(FormatError) as info:
        open_pack(path)
    assert_bad_content(info.value, path)


@pytest.mark.parametrize("cut", [0, 7, 64, 100, 127, 128, 0.5, -65, -64, -63, -8, -1])
def test_truncated_file(tmp_path, container_packs, cut):
    path = copy_pack(container_packs["single"], tmp_path)
    size = path.stat().st_size
    keep = int(size * cut) if isinstance(cut, float) else cut % size if cut < 0 else cut
    os.truncate(path, keep)
    with pytest.raises(TruncatedFileError) as info:
        open_pack(path)
    assert_bad_content(info.value, path)


def test_metadata_checksum_mismatch_says_what_to_do(tmp_path, container_packs):
    path = copy_pack(container_packs["single"], tmp_path)
    flip(path, path.stat().st_size - fmt.FOOTER_SIZE - 2)  # inside the metadata JSON
    with pytest.raises(CorruptFileError, match="metadata checksum mismatch.*re-pack") as info:
        open_pack(path)
    assert_bad_content(info.value, path)


@pytest.mark.parametrize("extra", [b"\x00", bytes(4096)])
def test_appended_bytes(tmp_path, container_packs, extra):
    path = copy_pack(container_packs["single"], tmp_path)
    data = path.read_bytes()
    path.write_bytes(data + extra + data[-64:])  # ends like a footer, but the size is wrong
    with pytest.raises(TruncatedFileError, match=r"file_size says \d+: appended to") as info:
        open_pack(path)
    assert_bad_content(info.value, path)


def patch_version(path: Path, major: int, minor: int) -> None:
    """Set the version in the header, the footer and the metadata (they must agree)."""
    rewrite_container(
        path,
        header_version=(major, minor),
        footer_version=(major, minor),
        meta=lambda meta: meta.update(format_version=[major, minor]),
    )


def test_newer_major_version(tmp_path, container_packs):
    path = copy_pack(container_packs["single"], tmp_path)
    patch_version(path, fmt.FORMAT_MAJOR + 1, 0)
    with pytest.raises(UnsupportedVersionError, match="newer") as info:
        open_pack(path)
    assert_bad_content(info.value, path)


def test_newer_minor_version_is_read(tmp_path, container_packs):
    path = copy_pack(container_packs["single"], tmp_path)
    patch_version(path, fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR + 3)
    reader = open_pack(path)
    assert reader.version == (fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR + 3)
    check_pack(reader, 30)


@pytest.mark.parametrize("form", FORMS)
def test_flipped_record_bytes(tmp_path, container_packs, form):
    path = copy_pack(container_packs[form], tmp_path)
    spans = record_spans(path)
    damaged = sorted({spans[0][0], spans[len(spans) // 2][0], spans[-1][0]})
    for record, file, offset, length in spans:
        if record in damaged:
            flip(file, offset + length // 2)
    reader = open_pack(path)  # record bytes are not read at open
    assert reader.verify() == damaged  # global ids
    if form == "shards":
        assert len({reader.locate(i)[0].path for i in damaged}) == 3
    intact = [i for i in range(30) if i not in damaged]
    for i in intact:
        assert bytes(reader.field(i, 0)) == payload(i, 0, size_of(i, 0))
    checked = open_pack(path, checked=True)
    for i in intact:
        for k in range(2):
            assert bytes(checked.field(i, k)) == payload(i, k, size_of(i, k))
    for i in damaged:
        shard, local = checked.locate(i)
        with pytest.raises(ChecksumError, match=f"record {i} ") as info:  # the pack's number
            for k in range(2):
                checked.field(i, k)
        assert_bad_content(info.value, Path(shard.path))


def test_missing_path(tmp_path):
    path = tmp_path / "nope.tser"
    with pytest.raises(FileNotFoundError, match="nope.tser"):
        open_pack(path)
    with pytest.raises(FileNotFoundError, match="nope.tser"):
        ContainerReader(path)


def test_folder_without_manifest(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(FormatError, match="manifest") as info:
        open_pack(tmp_path / "d")
    assert_bad_content(info.value, tmp_path / "d")


def test_a_missing_or_cut_shard_is_named_at_open(tmp_path, container_packs):
    """Not hours later, when a reader reaches it (issue #34): one stat per listed file."""
    path = copy_pack(container_packs["shards"], tmp_path)
    missing, cut = container_files(path)[2], container_files(path)[3]
    missing.unlink()
    with pytest.raises(FileNotFoundError, match="incomplete") as info:
        open_pack(path)
    message = str(info.value)
    assert isinstance(info.value, CorruptFileError) and not isinstance(info.value, FileChangedError)
    assert f"{missing} is missing" in message and fmt.MANIFEST_NAME in message
    assert str(cut) not in message and "copy the pack again" in message
    os.truncate(cut, cut.stat().st_size - 10)
    with pytest.raises(CorruptFileError, match="re-pack") as info:
        open_pack(path)
    assert f"{missing} is missing" in str(info.value) and f"{cut} has " in str(info.value)
    assert PackReader(path).shard(0) is not None  # unless asked (a staged partial copy)


def test_shard_from_another_pack_is_refused(tmp_path, container_packs):
    path = copy_pack(container_packs["shards"], tmp_path)
    other = write_pack(tmp_path / "other", 30, seed=100, **SHARDED)
    target = container_files(path)[1]
    shutil.copyfile(container_files(other)[1], target)
    with pytest.raises(CorruptFileError, match="another size") as info:
        open_pack(path)  # its size differs: refused at open
    assert f"{target} has " in str(info.value)
    reader = PackReader(path)  # unchecked at open: refused when the shard is opened
    for i in range(7):  # shard 0 is intact
        assert bytes(reader.field(i, 0)) == payload(i, 0, size_of(i, 0))
    with pytest.raises(CorruptFileError, match="does not match") as info:
        reader.field(7, 0)
    assert_bad_content(info.value, target)
    assert str(path / fmt.MANIFEST_NAME) in str(info.value)


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (lambda m: "{not json", CorruptFileError, "not valid JSON"),
        (
            lambda m: {**m, "format": "zip"},
            CorruptFileError,
            "not a torch_serialized shard manifest",
        ),
        (lambda m: {**m, "version": fmt.MANIFEST_VERSION + 1}, UnsupportedVersionError, "newer"),
        (lambda m: {**m, "shards": []}, CorruptFileError, "no shards"),
        (
            lambda m: {**m, "shards": [{**m["shards"][0], "file": "../s.tser"}]},
            CorruptFileError,
            "invalid",
        ),
        (
            lambda m: {**m, "shards": [{**m["shards"][0], "file": "/etc/passwd"}]},
            CorruptFileError,
            "invalid",
        ),
        (  # the next shard no longer starts where this one ends
            lambda m: {**m, "shards": [{**m["shards"][0], "num_records": 8}, *m["shards"][1:]]},
            CorruptFileError,
            "invalid",
        ),
    ],
)
def test_damaged_manifest(tmp_path, container_packs, edit, error, message):
    path = copy_pack(container_packs["shards"], tmp_path)
    edit_manifest(path, edit)
    with pytest.raises(error, match=message) as info:
        open_pack(path)
    assert isinstance(info.value, ValueError)
    assert str(path) in str(info.value)


def test_checked_reader_reports_damaged_record(tmp_path, container_packs):
    path = copy_pack(container_packs["single"], tmp_path)
    record, file, offset, length = record_spans(path)[4]
    flip(file, offset)
    reader = open_pack(path, checked=True)
    with pytest.raises(ChecksumError, match=f"record {record} ") as info:
        for k in range(2):
            reader.field(record, k)
    assert_bad_content(info.value, path)


@ignore_fork_warning
@pytest.mark.parametrize(
    ("context", "persistent"),
    [
        ("fork", False),
        ("fork", True),
        pytest.param("spawn", True, marks=pytest.mark.slow),
        pytest.param("forkserver", True, marks=pytest.mark.slow),
    ],
)
def test_dataloader_workers(container_packs, context, persistent):
    from torch.utils.data import DataLoader

    readers = [open_pack(container_packs["single"]), open_pack(container_packs["shards"])]
    dataset = FieldBytes(readers)
    expected = [dataset[i][2] for i in range(len(dataset))]  # mapped here before the workers start
    assert expected[3][0] == [payload(3, k, size_of(3, k)) for k in range(2)]
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=2,
        persistent_workers=persistent,
        multiprocessing_context=context,
    )
    epochs = [list(loader) for _ in range(2 if persistent else 1)]
    for got in epochs:
        assert [data for _, _, data in got] == expected
        assert all(mapped_here for _, mapped_here, _ in got)
    pids = [{pid for pid, _, _ in got} for got in epochs]
    assert os.getpid() not in pids[0] and len(pids[0]) == 2
    assert all(p == pids[0] for p in pids)  # persistent workers served both epochs


@ignore_fork_warning
def test_pickled_reader_reopens_in_another_process(container_packs):
    blobs, expected = [], []
    for form in FORMS:
        reader = open_pack(container_packs[form])
        reader.arrays()  # mapped and cached here; none of it may travel
        blob = pickle.dumps(reader)
        assert len(blob) < 64 << 10
        blobs.append(blob)
        data = [[bytes(reader.field(i, k)) for k in range(2)] for i in range(len(reader))]
        expected.append((data, {name: a.tobytes() for name, a in reader.arrays().items()}))
        assert read_all_pickled(blob)[1:] == expected[-1]  # same process, fresh map
    # spawn and forkserver workers unpickle readers in test_dataloader_workers; fork is cheap
    with ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
        results = list(pool.map(read_all_pickled, blobs))
    for (pid, data, arrays), want in zip(results, expected):
        assert pid != os.getpid() and (data, arrays) == want


@ignore_fork_warning
@pytest.mark.parametrize("form", FORMS)
def test_file_replaced_after_open_raises_file_changed(tmp_path, form):
    out = write_pack(tmp_path / "out", 30, **FORMS[form])
    reader = open_pack(out)
    unread = open_pack(out)  # opens the catalog only: its shards are opened on first use
    check_pack(reader, 30)  # every shard opened (fewer than max_open_shards)
    blob = pickle.dumps(reader)
    write_pack(out, 30, seed=7, **FORMS[form])  # replaced atomically by a new pack

    check_pack(reader, 30)  # this process keeps reading the files it validated
    if form == "shards":  # a shard not opened before is not read from the new pack
        with pytest.raises(FileChangedError, match="replaced") as info:
            unread.field(0, 0)
        assert str(out) in str(info.value)
    with pytest.raises(FileChangedError) as info:
        pickle.loads(blob).field(0, 0)
    assert isinstance(info.value, OSError) and str(out) in str(info.value)

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=read_error, args=(reader, child))
    proc.start()
    child.close()
    assert parent.poll(60), "the forked child sent nothing"
    result = parent.recv()
    proc.join()
    assert result is not None, "a forked child read a replaced file without noticing"
    name, is_oserror, message = result
    assert name == "FileChangedError" and is_oserror and str(out) in message


def test_a_pack_replaced_between_its_manifest_and_catalog_raises_file_changed(
    tmp_path, monkeypatch
):
    """Opening a shard folder while it is re-packed: the manifest read names a catalog the
    new pack removed. That raised a bare ``FileNotFoundError`` naming the catalog (20 of
    ~1,400 opens under a re-pack loop); shards already said ``FileChangedError``."""
    from torch_serialized.container import shards as shards_module

    out = write_pack(tmp_path / "out", 30, **SHARDED)
    locate = shards_module.find

    def late(*args: Any, **kwargs: Any) -> Any:
        located = locate(*args, **kwargs)  # the old manifest's bytes
        write_pack(out, 30, seed=7, **SHARDED)  # replaced before its catalog is opened
        return located

    monkeypatch.setattr(shards_module, "find", late)
    with pytest.raises(FileChangedError, match="replaced after it was opened") as info:
        open_pack(out)
    assert str(out) in str(info.value) and "catalog-" in str(info.value)
    monkeypatch.setattr(shards_module, "find", locate)
    check_pack(open_pack(out), 30, seed=7)

    catalog_file(out).unlink()  # the manifest unchanged: an incomplete pack, not a replaced one
    with pytest.raises(FileNotFoundError, match="catalog-.* is missing") as missing:
        open_pack(out)
    assert not isinstance(missing.value, FileChangedError)


def test_an_open_mid_swap_opens_a_pack_or_says_it_is_being_replaced(tmp_path, monkeypatch):
    """A re-pack swaps a shard folder with two renames (the old one aside, the new one in).
    An open in between said "... does not exist; pack a VOC dataset first" or "... is a
    folder without manifest.json" (2 of ~9,000 opens under a re-pack loop,
    t4_open_during_rename.py): now it looks again a few ms later and opens the pack there,
    or says the pack is being replaced."""
    from torch_serialized.container import locate as locate_module
    from torch_serialized.container.fileio import temp_sibling

    out = write_pack(tmp_path / "out", 30, **SHARDED)
    new = write_pack(tmp_path / "new", 30, seed=7, **SHARDED)
    pauses: list[float] = []

    def swap_in(seconds: float) -> None:  # the writer's second rename, while the reader waits
        pauses.append(seconds)
        if new.exists():
            os.replace(new, out)

    monkeypatch.setattr(locate_module, "_pause", swap_in)
    aside = temp_sibling(out, "old")
    os.replace(out, aside)  # between the two renames: no folder at the path
    check_pack(open_pack(out), 30, seed=7)
    assert len(pauses) == 1
    shutil.rmtree(aside)

    # the folder moved aside while its manifest is read: looked up again, the new one opens
    new = write_pack(tmp_path / "new", 30, seed=3, **SHARDED)
    read = locate_module.read_regular_file

    def moved_while_read(path: Any, *args: Any) -> bytes:
        if Path(path).parent == out and not aside.exists():
            os.replace(out, aside)
        return read(path, *args)

    monkeypatch.setattr(locate_module, "read_regular_file", moved_while_read)
    check_pack(open_pack(out), 30, seed=3)
    assert len(pauses) == 2
    monkeypatch.setattr(locate_module, "read_regular_file", read)
    shutil.rmtree(aside)

    # nothing comes: a writer killed between its renames (or a very slow one)
    os.replace(out, aside)
    with pytest.raises(FileChangedError, match="is being replaced") as info:
        open_pack(out)
    message = str(info.value)
    assert str(out) in message and aside.name in message and "open it again" in message
    assert "pack a VOC dataset first" not in message
    assert len(pauses) == 2 + len(locate_module._SWAP_PAUSES)

    # no swap: a missing path and a folder that is no pack are said so at once
    os.replace(aside, out)
    with pytest.raises(FileNotFoundError, match="does not exist") as missing:
        open_pack(tmp_path / "none")
    assert not isinstance(missing.value, FileChangedError)
    (tmp_path / "plain").mkdir()
    with pytest.raises(FormatError, match="folder without manifest.json"):
        open_pack(tmp_path / "plain")
    assert len(pauses) == 2 + len(locate_module._SWAP_PAUSES)
    check_pack(open_pack(out), 30, seed=3)


def test_an_open_beside_a_pack_an_interrupted_re_pack_moved_aside(tmp_path, monkeypatch):
    """A re-pack killed between its two renames leaves no pack at the path and the previous
    one under ``.NAME.old-PID-*``. An open then said "is being replaced ... open it again",
    also when the user had since deleted the pack on purpose. With the writer's process not
    running here it still looks again for a while (the writer may run on another machine of
    a shared file system, and its new pack then opens), then says that the path does not
    exist and which pack is beside it (a link: beside its target) to rename back."""
    from torch_serialized.container import locate as locate_module

    (tmp_path / "real").mkdir()
    out = write_pack(tmp_path / "real" / "out", 30, **SHARDED)
    link = tmp_path / "link"
    link.symlink_to(out)
    new = write_pack(tmp_path / "new", 30, seed=7, **SHARDED)
    aside = out.parent / f".out.old-{dead_pid()}-0123abcd"
    os.replace(out, aside)

    def swap_in(seconds: float) -> None:  # another machine's writer renames its new pack in
        if new.exists():
            os.replace(new, out)

    monkeypatch.setattr(locate_module, "_pause", swap_in)
    check_pack(open_pack(out), 30, seed=7)
    shutil.rmtree(out)  # then deleted on purpose: only the old pack is left, aside
    monkeypatch.setattr(locate_module, "_pause", lambda seconds: None)
    for given in (out, link):
        with pytest.raises(FileNotFoundError) as info:
            open_pack(given)
        message = str(info.value)
        assert not isinstance(info.value, FileChangedError)
        assert message.startswith(f"{given} does not exist")
        assert f"{aside} holds the pack" in message and f"rename it to {out}" in message
    huge = out.parent / ".out.old-99999999999-0123abcd"  # no pid is that large
    os.replace(aside, huge)
    with pytest.raises(FileNotFoundError, match=r"process 99999999999\) moved"):
        open_pack(out)
    os.replace(huge, out)
    check_pack(open_pack(link), 30)


def test_an_open_through_a_link_mid_swap_and_a_denied_folder(tmp_path, monkeypatch):
    """Review of the swap retry: a link to a shard folder being swapped said "[Errno 2] No
    such file or directory" (its manifest.json: "does not exist; pack a VOC dataset
    first"), since the moved-aside folder was looked for beside the link; and a folder that
    may not be searched (EACCES) was said not to exist instead of raising PermissionError."""
    from torch_serialized.container import locate as locate_module
    from torch_serialized.container.fileio import temp_sibling

    (tmp_path / "real").mkdir()
    out = write_pack(tmp_path / "real" / "out", 30, **SHARDED)
    link = tmp_path / "link"
    link.symlink_to(out)
    monkeypatch.setattr(locate_module, "_pause", lambda seconds: None)
    aside = temp_sibling(out, "old")
    os.replace(out, aside)
    for given in (link, link / fmt.MANIFEST_NAME):
        with pytest.raises(FileChangedError, match="is being replaced") as info:
            open_pack(given)
        assert f"rename {aside} back to {out}" in str(info.value)
    os.replace(aside, out)
    check_pack(open_pack(link), 30)
    check_pack(open_pack(link / fmt.MANIFEST_NAME), 30)

    real_stat = os.stat

    def denied(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(path) == str(out):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(locate_module.os, "stat", denied)
    with pytest.raises(PermissionError, match="Permission denied"):
        open_pack(out)


@pytest.mark.parametrize("form", FORMS)
def test_a_deleted_pack_is_reported_removed_not_replaced_by_a_new_one(tmp_path, form):
    """A shard folder deleted under an open reader said "was replaced ... to read the new
    pack": there is none. Both forms now say it was removed or replaced."""
    out = write_pack(tmp_path / "out", 30, **FORMS[form])
    reader = open_pack(out)
    blob = pickle.dumps(reader)  # maps nothing: the file is opened again where it is read
    shutil.rmtree(out) if out.is_dir() else out.unlink()
    for gone in (reader, pickle.loads(blob)) if form == "shards" else (pickle.loads(blob),):
        with pytest.raises(FileChangedError, match="removed or replaced") as info:
            gone.field(29, 0)
        message = str(info.value)
        assert str(out) in message and "new pack" not in message
        assert "re-pack it if it was deleted" in message


def smaps() -> dict[str, int]:
    values = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        values[key] = int(value.split()[0]) * 1024
    return values


@pytest.mark.parametrize("leak", [False, True], ids=["reads", "a-leak-is-caught"])
@pytest.mark.parametrize("form", FORMS)
def test_reading_every_record_does_not_grow_private_memory(tmp_path, form, leak):
    """Reads copy nothing that stays: a second pass over 20,000 records leaves neither objects
    (traced by ``tracemalloc``) nor private pages (``smaps``) worth a quarter of the bytes it
    read, which is what one leaked copy per read would hold (the ``a-leak-is-caught`` case
    keeps every copy and must exceed it, so the margin is no blanket).

    Issue #11 item 9: measured from the first pass, this failed once on a busy machine:
    the first pass also pays for the allocator's arenas, numpy's caches and (shards) the
    maps of each shard. A warm-up pass absorbs those; the margin comes from the bytes read,
    not a fixed guess.
    """
    if not Path("/proc/self/smaps_rollup").exists():
        pytest.skip("needs /proc/self/smaps_rollup (Linux >= 4.14)")
    n = 20_000
    out = tmp_path / "many"
    limits = {"max_records_per_shard": 5000} if form == "shards" else {}
    with PackWriter(out, ["a", "b"], **limits) as w:
        for i in range(n):
            w.add([payload(i, 0, 50 + i % 300), payload(i, 1, i % 40)])
        w.close()
    reader = open_pack(out)
    kept: list[bytes] = []

    def read_all() -> int:
        total = 0
        for i in range(n):
            a, b = bytes(reader.field(i, 0)), bytes(reader.field(i, 1))
            total += len(a) + len(b)
            if leak:
                kept.extend((a, b))
        return total

    total = read_all()  # warm-up: maps, arenas and caches settle
    assert total == sum(50 + i % 300 + i % 40 for i in range(n))
    gc.collect()
    before = smaps()
    tracemalloc.start()
    try:
        assert read_all() == total
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]  # Python and numpy objects still alive
    finally:
        tracemalloc.stop()
    after = smaps()
    margin = total // 4  # 1.1 MB here; a copy kept per read holds 4.4 MB and more
    if leak:
        assert held > margin, (held, margin)
        return
    # The heap's own figure, exact whatever the allocator recycles; the process's anonymous and
    # dirty pages as an upper bound (arenas reused from earlier tests can hide growth there,
    # never invent it). Not Private_Clean: those are the pack's own file pages, which the
    # kernel may drop and map again between passes (it did under CI's side-by-side runs:
    # +1.4 MB), never a copy.
    grown = {
        "traced": held,
        "Anonymous": after["Anonymous"] - before["Anonymous"],
        "Private_Dirty": after["Private_Dirty"] - before["Private_Dirty"],
    }
    assert all(value < margin for value in grown.values()), (grown, margin)


@pytest.mark.parametrize("content", [b"", b"tiny", b"x" * 200])
def test_file_replaced_by_junk_raises_file_changed(tmp_path, content):
    out = write_pack(tmp_path / "out.tser", 5)
    reader = open_pack(out)
    blob = pickle.dumps(reader)
    junk = tmp_path / "junk"
    junk.write_bytes(content)
    os.replace(junk, out)  # a new inode: the map held by `reader` stays valid
    with pytest.raises(FileChangedError, match="removed or replaced"):
        pickle.loads(blob).field(0, 0)
    check_pack(reader, 5)


@pytest.mark.parametrize("form", FORMS)
def test_every_read_path_reads_the_mapped_file_after_a_replace(tmp_path, form):
    """The ``pread`` paths (scatter reads, read hints, cache probes) use the descriptor of the
    file that was mapped, as views do: they once opened the path on first use and raised
    ``FileChangedError`` once the path named a new pack (while ``field`` worked)."""
    out = write_pack(tmp_path / "out", 30, **FORMS[form])
    reader = open_pack(out)
    shards = [reader.shard(s) for s in range(reader.num_shards)]  # mapped, nothing read yet
    write_pack(out, 30, seed=7, **FORMS[form])  # replaced atomically by a new pack
    start = 0
    for shard in shards:
        records = list(range(len(shard)))
        shard.prefetch(records)
        rows = shard.read_records(records, [1, 0])
        expected = [[payload(start + i, k, size_of(start + i, k)) for k in (1, 0)] for i in records]
        assert [[row[0].tobytes(), row[1].tobytes()] for row in rows] == expected
        start += len(shard)
    check_pack(reader, 30)


def index_crcs(path: Path) -> dict[tuple[int, int], int]:
    """(global record, field) -> CRC32 stored in the index, read by the independent parser."""
    files = [path]
    if path.is_dir():
        manifest = json.loads((path / fmt.MANIFEST_NAME).read_text())
        files = [path / s["file"] for s in manifest["shards"]]
    out, start = {}, 0
    for file in files:
        meta, index = parse_container(file)
        for i in range(index.shape[0]):
            for k in range(index.shape[1]):
                out[(start + i, k)] = int(index[i, k]["crc32"])
        start += meta["num_records"]
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("form", PACK_FORMS)
def test_six_spawned_readers_at_once_read_identical_bytes(voc40_packs, form):
    path = voc40_packs[form]
    expected = index_crcs(path)
    parent = open_pack(path)
    assert {
        (i, k): zlib.crc32(b)
        for i, row in enumerate(read_records(parent))
        for k, b in enumerate(row)
    } == expected

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(6), ctx.Queue()
    procs = [
        ctx.Process(target=crc_reader, args=(str(path), rank, 3, barrier, results))
        for rank in range(6)
    ]
    for proc in procs:
        proc.start()
    try:
        reports = [results.get(timeout=180) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=60)
    assert [proc.exitcode for proc in procs] == [0] * 6
    assert sorted(rank for rank, *_ in reports) == list(range(6))
    assert len({pid for _, pid, *_ in reports}) == 6
    for rank, _, crcs, changed, torch_loaded in reports:
        assert crcs == expected, f"reader {rank} read different bytes"
        assert changed == 0
        assert not torch_loaded, "reading a pack imported torch"


def fingerprints(dataset: Any) -> list[tuple[bytes, str]]:
    """Each sample of a decode="none" dataset: its stored image bytes and its target."""
    out = []
    for i in range(len(dataset)):
        image, target = dataset[i]
        out.append((image.numpy().tobytes(), json.dumps(target, sort_keys=True)))
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("form", PACK_FORMS)
def test_reader_keeps_old_data_while_another_process_repacks(tmp_path, voc40, voc8, form):
    options = PACK_FORMS[form]
    out = tmp_path / out_name(form)
    pack_voc(voc40, out, year="2007", **options)
    reference = tmp_path / "ref"
    reference.mkdir()
    new_path = pack_voc(voc8, reference / out.name, year="2007", **options).path

    reader = open_pack(out)
    dataset = torch_serialized.VOCSerializedDataset(out, image_set="trainval", decode="none")
    old_records, old_samples = read_records(reader), fingerprints(dataset)
    blob = pickle.dumps(reader)

    proc = run_child("repack", str(voc8), str(out), json.dumps(options), "4")
    assert proc.stdout is not None
    assert proc.stdout.readline() == "started\n", proc.stderr.read() if proc.stderr else ""
    rounds = 0
    while proc.poll() is None:  # the path is being replaced under our feet, four times
        assert read_records(reader) == old_records
        assert fingerprints(dataset) == old_samples
        rounds += 1
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert rounds > 0
    assert read_records(reader) == old_records, "the open reader changed after the re-pack"
    assert fingerprints(dataset) == old_samples

    assert read_records(open_pack(out)) == read_records(open_pack(new_path))
    fresh = torch_serialized.VOCSerializedDataset(out, image_set="trainval", decode="none")
    expected = torch_serialized.VOCSerializedDataset(new_path, image_set="trainval", decode="none")
    assert fingerprints(fresh) == fingerprints(expected) != old_samples

    # the old reader sent to a new process: refused, never a mix of old index and new bytes
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        result = pool.submit(read_pickled, blob).result(timeout=180)
    assert result[:3] == ("error", "FileChangedError", True), result
    assert str(out) in result[3]


# --- the datasets' and iterable's read paths: record, views, prefetch -----------------------------


@pytest.mark.parametrize("form", list(FORMS))
def test_record_and_views_return_what_field_returns(container_packs, form):
    reader = open_pack(container_packs[form])
    for shard in (reader.shard(s) for s in range(reader.num_shards)):
        n = len(shard)
        fields = [1, 0]
        expected = [[bytes(shard.field(i, k)) for k in fields] for i in range(n)]
        assert [[bytes(v) for v in shard.record(i, fields)] for i in range(n)] == expected
        order = list(range(n))[::-1]
        got = shard.views(order, fields)
        assert [[bytes(v) for v in row] for row in got] == [expected[i] for i in order]
        for bad in (n, -1):
            with pytest.raises(IndexError):
                shard.views([0, bad], fields)
        with pytest.raises(IndexError):
            shard.record(n, fields)


def test_checked_record_and_views_report_damage(tmp_path, container_packs):
    path = copy_pack(container_packs["single"], tmp_path)
    record, file, offset, length = record_spans(path)[4]
    flip(file, offset)
    shard = open_pack(path, checked=True).shard(0)
    with pytest.raises(ChecksumError, match=f"record {record} "):
        shard.record(record, [0, 1])
    with pytest.raises(ChecksumError, match=f"record {record} "):
        shard.views([record - 1, record], [0, 1])
    with pytest.raises(ChecksumError, match=f"record {record} "):  # the stream's copies
        shard.read_records([record - 1, record], [0, 1])
    assert bytes(shard.views([record + 1], [0])[0][0]) == bytes(shard.field(record + 1, 0))
    assert bytes(shard.read_records([record + 1], [0])[0][0]) == bytes(shard.field(record + 1, 0))


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
def test_prefetch_hints_the_span_in_small_pieces_unless_cached(container_packs, monkeypatch):
    from torch_serialized.container import reader as reader_module

    shard = open_pack(container_packs["single"]).shard(0)
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(
        reader_module.os, "posix_fadvise", lambda fd, o, n, a: calls.append((o, n, a))
    )
    monkeypatch.setattr(reader_module, "_cached", lambda fd, offset: False)
    shard.prefetch([1, 2, 3])
    assert calls and all(a == os.POSIX_FADV_WILLNEED for _, _, a in calls)
    assert all(0 < n <= reader_module.HINT_CHUNK for _, n, _ in calls)
    calls.clear()
    monkeypatch.setattr(reader_module, "_cached", lambda fd, offset: True)
    shard.prefetch([1, 2, 3])  # already in the page cache: no hint
    assert calls == []


# -- issue #11 item 3: only regular files are read, without blocking -------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("which", ["shard", "catalog", "manifest", "single", "single->/dev/zero"])
def test_a_fifo_or_device_in_place_of_a_pack_file_is_refused(tmp_path, container_packs, which):
    """A FIFO as a shard blocked ``open_pack`` forever; a link to a device read it forever."""
    form = "single" if which.startswith("single") else "shards"
    path = copy_pack(container_packs[form], tmp_path)
    if which == "shard":
        target = container_files(path)[1]
    elif which == "catalog":
        target = catalog_file(path)
    elif which == "manifest":
        target = path / fmt.MANIFEST_NAME
    else:
        target = path
    target.unlink()
    if which.endswith("/dev/zero"):
        target.symlink_to("/dev/zero")
    else:
        os.mkfifo(target)
    kind = "character device" if which.endswith("/dev/zero") else "named pipe"
    with pytest.raises(FormatError, match=kind) as info:
        reader = open_pack(path)
        reader.field(10, 0)  # in shard 1
    assert str(target) in str(info.value)
    if which in ("shard", "catalog"):  # a damaged pack: FORMAT.md, "Integrity rules"
        assert isinstance(info.value, CorruptFileError)
        assert str(path / fmt.MANIFEST_NAME) in str(info.value)
        assert ("shard 1" if which == "shard" else "the catalog") in str(info.value)
        assert "re-pack" in str(info.value) and "the pack is a" not in str(info.value)


def test_open_file_descriptors_stay_bounded(tmp_path):
    """Issue #11 item 7: a reader holds at most ``max_open_shards`` shards (the least
    recently used is closed), whatever the access pattern and however many shards."""
    out = write_pack(tmp_path / "many", 60, max_records_per_shard=1)
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        pytest.skip("needs /proc/self/fd")
    before = len(list(fds.iterdir()))
    reader = open_pack(out, max_open_shards=4)
    order = [*range(60), *range(59, -1, -7), *range(0, 60, 3)]
    for i in order:
        assert bytes(reader.field(i, 0)) == payload(i, 0, size_of(i, 0))
        reader.shard(int(np.searchsorted(reader.starts, i, side="right")) - 1).read_records(
            [0], [0, 1]
        )  # streaming reads open a second descriptor per shard
        assert len(list(fds.iterdir())) - before <= 2 * 4 + 2  # the shards and the catalog
    assert reader.verify() == []
    with pytest.raises(ValueError, match="max_open_shards"):
        open_pack(out, max_open_shards=0)


TEN_THOUSAND_SHARDS = """
import json, os, resource, sys
import numpy as np
from torch_serialized.container.shards import PackReader, open_pack
from torch_serialized.data.pipeline import read_block, views_fit
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
reader = open_pack(sys.argv[1])
n = len(reader)
order = np.random.default_rng(0).permutation(n)
for i in order:
    assert bytes(reader.field(int(i), 0)) == str(int(i)).encode(), i
assert not views_fit(reader, 600)  # so the stream copies: views would hold 600 maps
blocks = read_block(reader, np.arange(0, 600), [0], copy=True)  # streaming reads: 600 shards
assert all(bytes(row[0]) == str(r).encode() for r, row in blocks.items())
fds = len(os.listdir("/proc/self/fd"))
print(json.dumps({"records": n, "shards": reader.num_shards, "fds": fds}))
"""


@pytest.mark.timeout(120)
def test_ten_thousand_shards_read_under_ulimit_256(tmp_path, monkeypatch):
    """Issue #11 item 7: one descriptor per shard for the reader's life (plus one more per
    streaming reader) failed with EMFILE naming no file: 8 shards under a low limit, ~1,100
    under ``ulimit -n 1024``. 10,000 one-record shards, read in random order and streamed, in
    a child process limited to 256 descriptors."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # 10,000 fsyncs would take a while
    # creating 10,000 files costs ~0.1 ms each on a journaled disk: use memory when there is some
    shm = Path("/dev/shm")
    folder = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() else tmp_path
    try:
        with PackWriter(folder / "many", ["a"], max_records_per_shard=1) as writer:
            for i in range(10_000):
                writer.add([str(i).encode()])
            writer.close()
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        proc = subprocess.run(
            [sys.executable, "-c", TEN_THOUSAND_SHARDS, str(folder / "many")],
            capture_output=True, text=True, timeout=110, env=env,
        )  # fmt: skip
    finally:
        if folder != tmp_path:
            shutil.rmtree(folder)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["records"] == result["shards"] == 10_000 and result["fds"] < 256


# -- issue #11 item 2: the manifest is protected, and so is what it points to -----------------
def _read_everything(reader) -> tuple[Any, ...]:
    records = [[bytes(reader.field(i, k)) for k in range(2)] for i in range(len(reader))]
    arrays = {name: array.tobytes() for name, array in reader.arrays().items()}
    return records, arrays, reader.user


def test_every_flipped_manifest_byte_is_refused_or_harmless(tmp_path, container_packs):
    """A flipped bit in manifest.json (a name, a count, a checksum) changed what was read
    without an error. Every byte flipped three ways: refused with our error naming the
    manifest, or (whitespace turned into other whitespace) the very same pack is read."""
    path = copy_pack(container_packs["shards"], tmp_path)
    manifest = path / fmt.MANIFEST_NAME
    original = manifest.read_bytes()
    expected = _read_everything(open_pack(container_packs["shards"]))
    outcomes = {"refused": 0, "same": 0}
    for position in range(len(original)):
        for mask in (0x01, 0x80):
            damaged = bytearray(original)
            damaged[position] ^= mask
            manifest.write_bytes(bytes(damaged))
            try:
                got = _read_everything(open_pack(path))
            except (FormatError, FileNotFoundError) as exc:
                assert str(manifest) in str(exc) or str(path) in str(exc)
                outcomes["refused"] += 1
                continue
            assert got == expected, f"byte {position} ^ {mask:#x} changed the data silently"
            outcomes["same"] += 1
    assert outcomes["refused"] > 0.9 * 2 * len(original), outcomes


def test_an_edited_catalog_is_refused_even_if_it_is_self_consistent(tmp_path, container_packs):
    """The metadata (class names, year, storage options) lives in the catalog: edited with its
    own checksums fixed up, it no longer matches the manifest's entry."""
    path = copy_pack(container_packs["shards"], tmp_path)
    catalog = catalog_file(path)
    data = catalog.read_bytes()
    footer = fmt.unpack_footer(data[-fmt.FOOTER_SIZE :], "x")
    meta = json.loads(data[footer["meta_offset"] : -fmt.FOOTER_SIZE])
    meta["user"]["seed"] = 1
    blob = json.dumps(meta, separators=(",", ":")).encode()
    body = data[: footer["meta_offset"]]
    size = len(body) + len(blob) + fmt.FOOTER_SIZE
    crc = fmt.crc32(blob)
    catalog.write_bytes(body + blob + fmt.pack_footer(len(body), len(blob), size, 0, crc))
    with pytest.raises(CorruptFileError, match="does not match") as info:
        open_pack(path)
    assert str(catalog) in str(info.value) and str(path / fmt.MANIFEST_NAME) in str(info.value)


def test_a_shard_whose_columns_differ_from_the_catalog_s_copy_is_refused(tmp_path):
    """Readers take a record's columns from the catalog's copy of ``records``: two packs of
    one identity (pinned), whose catalogs differ in one row, exchange shard 0 (its manifest
    entry with it, every checksum valid); the shard's first read refuses it."""
    with pinned_identity():
        path = write_pack(tmp_path / "a", 14, **SHARDED)
        contents = read_contents(path)
        contents.arrays["records"][3]["w"] += 1
        other = write_contents(contents, tmp_path / "b", **SHARDED)
    entry = json.loads((path / fmt.MANIFEST_NAME).read_text())["shards"][0]
    shard = other / entry["file"]
    shutil.copyfile(container_files(path)[0], shard)
    edit_manifest(other, lambda m: {**m, "shards": [entry, *m["shards"][1:]]})
    reader = open_pack(other)
    assert bytes(reader.field(7, 0)) == payload(7, 0, size_of(7, 0))  # shard 1 reads
    with pytest.raises(CorruptFileError, match="records.* differ from the catalog") as info:
        reader.field(0, 0)
    assert str(shard) in str(info.value) and str(other / fmt.MANIFEST_NAME) in str(info.value)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: {**m, "shards": [m["shards"][1], m["shards"][0], *m["shards"][2:]]},
        lambda m: {**m, "shards": [m["shards"][0], dict(m["shards"][0]), *m["shards"][2:]]},
        lambda m: {
            **m,
            "shards": [
                {**m["shards"][0], "file": m["shards"][1]["file"]},
                {**m["shards"][1], "file": m["shards"][0]["file"]},
                *m["shards"][2:],
            ],
        },  # fmt: skip
        lambda m: {**m, "pack_id": "0" * 32},
    ],
    ids=["swapped", "duplicated", "renamed", "other-pack-id"],
)
def test_a_rewritten_manifest_cannot_reorder_shards(request, tmp_path, container_packs, edit):
    """Shard entries swapped or duplicated (with a valid checksum, first_record made
    consistent) paired records with other records' places; each shard's own binding refuses
    it, naming the manifest and the shard. Swapped whole (size and meta_crc32 too), only the
    binding tells: it says which place the shard was written for."""
    path = copy_pack(container_packs["shards"], tmp_path)

    def rewrite(manifest):
        manifest = edit(manifest)
        first = 0
        for entry in manifest["shards"]:
            entry["first_record"] = first
            first += entry["num_records"]
        return manifest

    edit_manifest(path, rewrite)
    with pytest.raises(CorruptFileError, match="does not match|twice") as info:
        _read_everything(open_pack(path))
    assert str(path / fmt.MANIFEST_NAME) in str(info.value)
    if request.node.callspec.id == "swapped":
        assert "'index': 1, 'first_record': 7" in str(info.value)  # what the shard says
        assert "'index': 0, 'first_record': 0" in str(info.value)  # what the manifest expects
    members = [*container_files(path), catalog_file(path)]  # another pack id: the catalog's
    assert any(f.name in str(info.value) for f in members)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"format": "torch_serialized.shards", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "not valid JSON",
        ),  # fmt: skip
        ('{"format": "torch_serialized.shards", "format": "torch_serialized.shards"}', "duplicate"),
        ('{"format": "torch_serialized.shards", "version": NaN}', "NaN"),
    ],
    ids=["nested-100k", "duplicate-key", "nan"],
)
def test_absurd_manifests_raise_our_error_naming_it(tmp_path, text, message):
    """Issue #11 item 8: a manifest nested 100k deep gave RecursionError."""
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / fmt.MANIFEST_NAME).write_text(text)
    with pytest.raises(CorruptFileError, match=message) as info:
        open_pack(tmp_path / "p")
    assert str(tmp_path / "p" / fmt.MANIFEST_NAME) in str(info.value)


def test_a_shard_name_with_nul_is_refused_naming_the_manifest(tmp_path, container_packs):
    """Item 8: a shard name with NUL gave a bare ValueError naming no file."""
    path = copy_pack(container_packs["shards"], tmp_path)
    edit_manifest(
        path, lambda m: {**m, "shards": [{**m["shards"][0], "file": "a\x00b"}, *m["shards"][1:]]}
    )
    with pytest.raises(CorruptFileError, match="entry 0 is invalid") as info:
        open_pack(path)
    assert str(path / fmt.MANIFEST_NAME) in str(info.value)


@pytest.mark.parametrize(
    "change",
    [
        lambda blob: blob.replace(b'"user":{', b'"user":{"seed":1,', 1),  # a duplicate key
        lambda blob: blob.replace(b'"user":{', b'"user":{"x":NaN,', 1),
        lambda blob: blob.replace(b'"user":{', b'"user":{"x":1e999,', 1),
    ],
    ids=["duplicate-key", "nan", "infinity"],
)
def test_metadata_with_duplicate_keys_or_nan_is_refused(tmp_path, container_packs, change):
    """Item 8: container metadata with NaN/Infinity (the JSON spec forbids them) or duplicate
    keys (another reader may take the other value) was accepted."""
    path = copy_pack(container_packs["single"], tmp_path)
    data = path.read_bytes()
    footer = fmt.unpack_footer(data[-fmt.FOOTER_SIZE :], "x")
    blob = change(data[footer["meta_offset"] : -fmt.FOOTER_SIZE])
    body = data[: footer["meta_offset"]]
    size = len(body) + len(blob) + fmt.FOOTER_SIZE
    path.write_bytes(body + blob + fmt.pack_footer(len(body), len(blob), size, 30, fmt.crc32(blob)))
    with pytest.raises(CorruptFileError, match="not valid JSON") as info:
        open_pack(path)
    assert str(path) in str(info.value)


def test_the_least_recently_used_shard_is_closed_first(tmp_path):
    """The per-sample lookup of an open shard still counts as a use: with room for two
    shards, reading 0, 1, 0, then 2 closes shard 1, not shard 0."""
    out = write_pack(tmp_path / "lru", 6, max_records_per_shard=2)
    reader = open_pack(out, max_open_shards=2)
    first, second = reader.locate(0)[0], reader.locate(2)[0]
    for i in (1, 0, 4):
        reader.field(i, 0)
    assert first.mapped_by == os.getpid() and second.mapped_by is None
    assert bytes(reader.field(3, 0)) == payload(3, 0, size_of(3, 0))  # reopened on demand
    assert first.mapped_by is None  # now shard 0 was the least recently used


def test_a_closed_shard_is_mapped_again_without_a_second_validation(
    container_packs, monkeypatch
) -> None:
    """Validation is work for the first open of a shard in a process: after ``close()`` or
    an eviction the shard is only mapped again (0.03 vs 0.2 ms), with the same bytes."""
    reader = open_pack(container_packs["shards"], max_open_shards=1)
    first = [bytes(reader.shard(s).field(0, 0)) for s in range(reader.num_shards)]
    assert reader.num_shards > 1
    opened: list[int] = []
    original = type(reader)._open_shard
    monkeypatch.setattr(
        type(reader), "_open_shard", lambda self, s: opened.append(s) or original(self, s)
    )
    reader.close()
    again = [bytes(reader.shard(s).field(0, 0)) for s in range(reader.num_shards)]
    assert again == first and opened == []
