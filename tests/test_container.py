"""Contracts of the container: round trips, damage detection, atomic writes, processes, memory.

Record contents are derived from their indices (``payload(i, k, size)``), so every read checks
itself. ``parse_container`` is an independent reader written from docs/FORMAT.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _container_helpers import (
    FieldBytes,
    pack_file_bytes,
    parse_container,
    payload,
    read_all_pickled,
    read_error,
    size_of,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from torch_serialized import format as fmt
from torch_serialized.errors import (
    ChecksumError,
    CorruptFileError,
    FileChangedError,
    FormatError,
    TorchSerializedError,
    TruncatedFileError,
    UnsupportedVersionError,
    WriteError,
)
from torch_serialized.reader import ContainerReader, PackReader, open_pack
from torch_serialized.writer import PackWriter

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ["image", "target"]
COLUMNS = np.dtype([("id", "<u4"), ("w", "<f4")])
SHARDED = {"max_records_per_shard": 7}
FORMS = {"single": {}, "shards": SHARDED}
ignore_fork_warning = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded:DeprecationWarning",
    "ignore:This DataLoader will create:UserWarning",
)


def write_pack(
    out: Path, n: int, *, seed: int = 0, user: dict[str, Any] | None = None, **limits: Any
) -> Path:
    """A pack of ``n`` self-describing records (content shifted by ``seed``)."""
    with PackWriter(out, FIELDS, columns=COLUMNS, **limits) as w:
        for i in range(n):
            j = i + seed
            w.add([payload(j, k, size_of(j, k)) for k in range(len(FIELDS))], (j, j / 2))
        w.add_array("classes", np.arange(5, dtype="<i8"))
        w.close({"seed": seed} if user is None else user)
    return out


def check_pack(reader: PackReader, n: int, seed: int = 0) -> None:
    assert len(reader) == n and reader.fields == FIELDS
    for i in range(n):
        for k in range(len(FIELDS)):
            assert bytes(reader.field(i, k)) == payload(i + seed, k, size_of(i + seed, k))


def container_files(path: Path) -> list[Path]:
    if path.is_dir():
        manifest = json.loads((path / fmt.MANIFEST_NAME).read_text())
        return [path / s["file"] for s in manifest["shards"]]
    return [path]


def record_spans(path: Path) -> list[tuple[int, Path, int, int]]:
    """(global record, file, offset, length) of every non-empty field, by the spec."""
    spans, start = [], 0
    for file in container_files(path):
        meta, index = parse_container(file)
        for i in range(index.shape[0]):
            for k in range(index.shape[1]):
                if index[i, k]["length"]:
                    spans.append(
                        (start + i, file, int(index[i, k]["offset"]), int(index[i, k]["length"]))
                    )
        start += meta["num_records"]
    return spans


def flip(file: Path, position: int) -> None:
    with open(file, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0x5A]))


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, Path]:
    """A 30-record pack in both forms (read-only: tests that damage it copy it first)."""
    folder = tmp_path_factory.mktemp("packs")
    return {form: write_pack(folder / form, 30, **limits) for form, limits in FORMS.items()}


def copy_pack(src: Path, dst_folder: Path) -> Path:
    dst = dst_folder / src.name
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copyfile(src, dst)
    return dst


# -- round trips ----------------------------------------------------------------------------
SIMPLE_CODES = ["|b1", "|i1", "|u1", "<i2", "<i4", "<i8", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8"]


def element(code: str) -> st.SearchStrategy[Any]:
    dtype = np.dtype(code)
    if dtype.kind == "b":
        return st.booleans()
    if dtype.kind == "f":
        return st.floats(width=8 * dtype.itemsize, allow_nan=False)
    info = np.iinfo(dtype)
    return st.integers(int(info.min), int(info.max))


payloads = st.one_of(
    st.binary(max_size=200),
    st.sampled_from([b"", b"\x00", bytes(63), bytes(64), bytes(65)]),
    st.integers(0, 5000).map(lambda n: payload(n, 0, n)),
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(blacklist_categories=("Cs",)), max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def datasets(draw: st.DrawFn) -> dict[str, Any]:
    k = draw(st.integers(1, 4))
    fields = draw(
        st.lists(st.text("abcxyz_é", min_size=1, max_size=5), min_size=k, max_size=k, unique=True)
    )
    n = draw(st.integers(0, 12))
    records = draw(st.lists(st.lists(payloads, min_size=k, max_size=k), min_size=n, max_size=n))
    columns = rows = None
    if draw(st.booleans()):
        spec = draw(
            st.lists(
                st.tuples(st.sampled_from("pqrs"), st.sampled_from(SIMPLE_CODES)),
                min_size=1,
                max_size=3,
                unique_by=lambda t: t[0],
            )
        )
        columns = np.dtype(spec)
        rows = [draw(st.tuples(*(element(c) for _, c in spec))) for _ in range(n)]
    arrays = draw(
        st.dictionaries(
            st.sampled_from(["classes", "index", "meta", "x"]),
            hnp.arrays(
                st.sampled_from(SIMPLE_CODES).map(np.dtype),
                hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
            ),
            max_size=3,
        )
    )
    user = draw(st.dictionaries(st.text(max_size=6), json_values, max_size=4))
    return {
        "fields": fields,
        "records": records,
        "columns": columns,
        "rows": rows,
        "arrays": arrays,
        "user": user,
    }


limits = st.one_of(
    st.fixed_dictionaries({"max_records_per_shard": st.integers(1, 5)}),
    st.fixed_dictionaries({"max_shard_bytes": st.integers(1, 3000)}),
    st.fixed_dictionaries(
        {"max_records_per_shard": st.integers(1, 5), "max_shard_bytes": st.integers(1, 3000)}
    ),
)


@pytest.mark.parametrize("form", ["single", "shards"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=datasets(), limit=limits)
def test_round_trip(form, data, limit):
    limit = limit if form == "shards" else {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pack"
        with PackWriter(out, data["fields"], columns=data["columns"], **limit) as w:
            for i, record in enumerate(data["records"]):
                assert w.add(record, None if data["rows"] is None else data["rows"][i]) == i
            for name, array in data["arrays"].items():
                w.add_array(name, array)
            w.close(data["user"])
        assert listing(Path(tmp)) == ["pack"]
        assert out.is_dir() == (form == "shards")

        reader = open_pack(out)
        n = len(data["records"])
        assert len(reader) == reader.num_records == n
        assert reader.fields == data["fields"]
        assert reader.user == data["user"]
        for i, record in enumerate(data["records"]):
            for k, expected in enumerate(record):
                got = reader.field(i, k)
                assert isinstance(got, memoryview) and got.readonly and bytes(got) == expected
        with pytest.raises(IndexError):
            reader.field(n, 0)

        arrays = reader.arrays()
        expected_names = set(data["arrays"]) | (
            {"records"} if data["columns"] is not None else set()
        )
        assert set(arrays) == expected_names
        for name, array in data["arrays"].items():
            got = arrays[name]
            assert got.dtype == array.dtype and got.shape == array.shape
            assert got.tobytes() == array.tobytes()  # bit-exact, NaN payloads included
            assert not got.flags.writeable
        if data["columns"] is not None:
            expected_rows = np.array(data["rows"], dtype=data["columns"]).reshape(n)
            assert arrays["records"].dtype == data["columns"]
            assert arrays["records"].tobytes() == expected_rows.tobytes()
        assert reader.verify() == []

        # the layout, read by the independent parser: alignment and shard limits
        files = container_files(out)
        total = 0
        for s, file in enumerate(files):
            meta, index = parse_container(file)
            assert meta["alignment"] == fmt.DEFAULT_ALIGNMENT
            assert all(int(o) % 64 == 0 for o in index["offset"].ravel())
            assert meta["index"]["offset"] % 64 == 0
            assert all(d["offset"] % 64 == 0 for d in meta["arrays"].values())
            m = meta["num_records"]
            total += m
            if form == "shards":
                assert m <= limit.get("max_records_per_shard", m)
                assert m >= 1 or len(files) == 1
                if m > 1 and "max_shard_bytes" in limit:
                    assert (
                        int((index["offset"] + index["length"]).max()) <= limit["max_shard_bytes"]
                    )
                dataset_level = {a for a, d in meta["arrays"].items() if not d["per_record"]}
                assert dataset_level == (set(data["arrays"]) if s == len(files) - 1 else set())
        assert total == n
        if form == "shards":
            manifest = json.loads((out / fmt.MANIFEST_NAME).read_text())
            assert manifest["num_records"] == n and manifest["user"] == data["user"]
            assert [e["file"] for e in manifest["shards"]] == [
                f"shard-{s:05d}.tser" for s in range(len(files))
            ]
            assert [e["bytes"] for e in manifest["shards"]] == [f.stat().st_size for f in files]


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

    from torch_serialized.parallel import copy_range
    from torch_serialized.writer import ContainerWriter

    limit = limit if form == "shards" else {}
    rows = data["rows"]
    with tempfile.TemporaryDirectory() as tmp:

        def write(out: Path, **extra: Any) -> PackWriter:
            w = PackWriter(out, data["fields"], columns=data["columns"], **limit, **extra)
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
    from torch_serialized.writer import ContainerWriter

    with open(tmp_path / "x", "wb") as f:
        w = ContainerWriter(f, ["a", "b"])
        w.add([b"abc", b"de"])
        entries = w.entries(0)
        with pytest.raises(ValueError, match="expected 2 entries"):
            w.reserve(entries[:1])
        shifted = entries.copy()
        shifted["offset"] += 8
        with pytest.raises(ValueError, match="alignment"):
            w.reserve(shifted)
        with pytest.raises(IndexError):
            w.entries(1)


@pytest.mark.parametrize("form", FORMS)
def test_empty_dataset(tmp_path, form):
    out = write_pack(tmp_path / "empty", 0, user={"empty": True}, **FORMS[form])
    reader = open_pack(out)
    assert len(reader) == 0 and reader.fields == FIELDS and reader.user == {"empty": True}
    assert reader.arrays()["records"].shape == (0,)
    assert reader.arrays()["records"].dtype == COLUMNS
    assert reader.arrays()["classes"].tolist() == [0, 1, 2, 3, 4]
    assert reader.verify() == []
    with pytest.raises(IndexError):
        reader.field(0, 0)
    assert len(container_files(out)) == 1


@pytest.mark.parametrize("form", FORMS)
def test_record_of_many_mib(tmp_path, form):
    big = os.urandom(20 << 20)
    out = tmp_path / "big"
    with PackWriter(
        out, ["a", "b"], **({"max_shard_bytes": 1 << 20} if form == "shards" else {})
    ) as w:
        w.add([b"small", b""])
        w.add([big, b"x"])
        w.add([b"", b"after"])
        w.close()
    reader = open_pack(out)
    assert [bytes(reader.field(i, 0)) for i in range(3)] == [b"small", big, b""]
    assert bytes(reader.field(2, 1)) == b"after"
    if form == "shards":
        assert [s.num_records for s in reader.shards] == [1, 1, 1]
    assert reader.verify() == []


@pytest.mark.parametrize("alignment", [8, 4096])
def test_other_alignments(tmp_path, alignment):
    out = tmp_path / "a.tser"
    with PackWriter(out, ["a"], alignment=alignment) as w:
        for i in range(20):
            w.add([payload(i, 0, i * 13)])
        w.close()
    meta, index = parse_container(out)
    assert meta["alignment"] == alignment == ContainerReader(out).alignment
    assert all(int(o) % alignment == 0 for o in index["offset"].ravel())
    assert [bytes(open_pack(out).field(i, 0)) for i in range(20)] == [
        payload(i, 0, i * 13) for i in range(20)
    ]


@pytest.mark.parametrize("alignment", [0, 4, 48, 2 * fmt.MAX_ALIGNMENT])
@pytest.mark.parametrize("form", FORMS)
def test_invalid_alignment_refused(tmp_path, alignment, form):
    with pytest.raises(ValueError, match="alignment"):
        PackWriter(tmp_path / "a", ["a"], alignment=alignment, **FORMS[form])
    assert listing(tmp_path) == []


def test_manifest_path_and_reader_shapes(packs):
    reader = open_pack(packs["shards"] / fmt.MANIFEST_NAME)
    assert reader.path == str(packs["shards"])
    assert [s.num_records for s in reader.shards] == [7, 7, 7, 7, 2]
    assert reader.starts.tolist() == [0, 7, 14, 21, 28, 30]
    check_pack(reader, 30)
    assert reader.arrays()["records"]["id"].tolist() == list(range(30))
    assert reader.nbytes == sum(f.stat().st_size for f in packs["shards"].iterdir())
    assert reader.field_index("target") == 1
    with pytest.raises(KeyError, match="nope"):
        reader.field_index("nope")


# -- damage ---------------------------------------------------------------------------------
def assert_bad_content(exc: BaseException, path: Path) -> None:
    assert isinstance(exc, ValueError) and isinstance(exc, TorchSerializedError)
    assert str(path) in str(exc)


@pytest.mark.parametrize("position", [0, 8, 9, 12, 16, 20, 30, 59, 60, 63])
def test_corrupted_header_byte(tmp_path, packs, position):
    path = copy_pack(packs["single"], tmp_path)
    flip(path, position)
    with pytest.raises(CorruptFileError) as info:
        open_pack(path)
    assert_bad_content(info.value, path)


def test_wrong_magic(tmp_path, packs):
    path = copy_pack(packs["single"], tmp_path)
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
def test_truncated_file(tmp_path, packs, cut):
    path = copy_pack(packs["single"], tmp_path)
    size = path.stat().st_size
    keep = int(size * cut) if isinstance(cut, float) else cut % size if cut < 0 else cut
    os.truncate(path, keep)
    with pytest.raises(TruncatedFileError) as info:
        open_pack(path)
    assert_bad_content(info.value, path)


@pytest.mark.parametrize("extra", [b"\x00", bytes(4096)])
def test_appended_bytes(tmp_path, packs, extra):
    path = copy_pack(packs["single"], tmp_path)
    data = path.read_bytes()
    path.write_bytes(data + extra + data[-64:])  # ends like a footer, but the size is wrong
    with pytest.raises(TruncatedFileError, match="footer says") as info:
        open_pack(path)
    assert_bad_content(info.value, path)


def patch_version(path: Path, major: int, minor: int) -> None:
    with open(path, "r+b") as f:
        header = bytearray(f.read(64))
        header[8:12] = struct.pack("<HH", major, minor)
        header[60:64] = struct.pack("<I", fmt.crc32(bytes(header[:60])))
        f.seek(0)
        f.write(header)


def test_newer_major_version(tmp_path, packs):
    path = copy_pack(packs["single"], tmp_path)
    patch_version(path, fmt.FORMAT_MAJOR + 1, 0)
    with pytest.raises(UnsupportedVersionError, match="newer") as info:
        open_pack(path)
    assert_bad_content(info.value, path)


def test_newer_minor_version_is_read(tmp_path, packs):
    path = copy_pack(packs["single"], tmp_path)
    patch_version(path, fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR + 3)
    reader = open_pack(path)
    assert reader.shards[0].version == (fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR + 3)
    check_pack(reader, 30)


@pytest.mark.parametrize("form", FORMS)
def test_flipped_record_bytes(tmp_path, packs, form):
    path = copy_pack(packs[form], tmp_path)
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
        with pytest.raises(ChecksumError, match=f"record {local} ") as info:
            for k in range(2):
                checked.field(i, k)
        assert_bad_content(info.value, Path(shard.path))


# a small pack for fuzzing: every byte is either covered by a checksum or is padding
@pytest.fixture(scope="module")
def small_pack(tmp_path_factory) -> tuple[bytes, list[tuple[int, int, int]]]:
    path = write_pack(tmp_path_factory.mktemp("small") / "s.tser", 6)
    return path.read_bytes(), [(r, o, n) for r, _, o, n in record_spans(path)]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.data())
def test_any_flipped_byte_is_detected_or_harmless(tmp_path, small_pack, data):
    original, spans = small_pack
    position = data.draw(st.integers(0, len(original) - 1), label="position")
    damaged = bytearray(original)
    damaged[position] ^= data.draw(st.integers(1, 255), label="xor")
    path = tmp_path / "fuzz.tser"
    path.write_bytes(damaged)
    in_record = sorted({r for r, o, n in spans if o <= position < o + n})
    try:
        reader = open_pack(path)
    except FormatError as exc:
        assert_bad_content(exc, path)
        assert not in_record, "a damaged record byte must not fail the open"
        return
    assert reader.verify() == in_record
    if not in_record:  # padding: every read is intact
        check_pack(reader, 6)


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


def test_missing_shard(tmp_path, packs):
    path = copy_pack(packs["shards"], tmp_path)
    (path / "shard-00002.tser").unlink()
    with pytest.raises(FileNotFoundError, match="shard-00002"):
        open_pack(path)


def test_manifest_pointing_to_replaced_shard(tmp_path, packs):
    path = copy_pack(packs["shards"], tmp_path)
    other = write_pack(tmp_path / "other", 30, seed=100, **SHARDED)
    shutil.copyfile(other / "shard-00001.tser", path / "shard-00001.tser")
    with pytest.raises(CorruptFileError, match="replaced") as info:
        open_pack(path)
    assert_bad_content(info.value, path / "shard-00001.tser")


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
            "invalid shard",
        ),
        (
            lambda m: {**m, "shards": [{**m["shards"][0], "file": "/etc/passwd"}]},
            CorruptFileError,
            "invalid shard",
        ),
        (
            lambda m: {**m, "shards": [{**m["shards"][0], "num_records": 8}]},
            CorruptFileError,
            "replaced",
        ),
    ],
)
def test_damaged_manifest(tmp_path, packs, edit, error, message):
    path = copy_pack(packs["shards"], tmp_path)
    manifest = path / fmt.MANIFEST_NAME
    edited = edit(json.loads(manifest.read_text()))
    manifest.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(error, match=message) as info:
        open_pack(path)
    assert isinstance(info.value, ValueError)
    assert str(path) in str(info.value)


def test_checked_reader_reports_damaged_record(tmp_path, packs):
    path = copy_pack(packs["single"], tmp_path)
    record, file, offset, length = record_spans(path)[4]
    flip(file, offset)
    reader = open_pack(path, checked=True)
    with pytest.raises(ChecksumError, match=f"record {record} ") as info:
        for k in range(2):
            reader.field(record, k)
    assert_bad_content(info.value, path)


# -- atomic writes ------------------------------------------------------------------------------
@pytest.mark.parametrize("form", FORMS)
def test_exception_mid_write_leaves_nothing(tmp_path, form):
    out = tmp_path / "out.tser"
    with pytest.raises(RuntimeError, match="boom"), PackWriter(out, FIELDS, **FORMS[form]) as w:
        for i in range(20):
            w.add([payload(i, 0, 100), b""])
        raise RuntimeError("boom")
    assert listing(tmp_path) == []


@pytest.mark.parametrize("form", FORMS)
def test_failure_at_close_leaves_nothing(tmp_path, form):
    out = tmp_path / "out.tser"
    with pytest.raises(TypeError), PackWriter(out, FIELDS, **FORMS[form]) as w:
        w.add([b"a", b"b"])
        w.close({"not json": object()})
    assert listing(tmp_path) == []


@pytest.mark.parametrize("form", FORMS)
def test_leaving_the_block_without_close_commits(tmp_path, form):
    out = tmp_path / "out"
    with PackWriter(out, FIELDS, **FORMS[form]) as w:
        w.add([b"a", b"b"])
    assert listing(tmp_path) == ["out"]
    assert bytes(open_pack(out).field(0, 1)) == b"b"


def test_add_after_abort_is_refused(tmp_path):
    w = PackWriter(tmp_path / "out", FIELDS)
    w.add([b"a", b"b"])
    w.abort()
    with pytest.raises(ValueError, match="closed"):
        w.add([b"a", b"b"])
    with pytest.raises(ValueError, match="closed"):
        w.close()
    assert listing(tmp_path) == []


@pytest.mark.parametrize("old_form", FORMS)
@pytest.mark.parametrize("new_form", FORMS)
def test_previous_pack_kept_on_failure_replaced_on_success(tmp_path, old_form, new_form):
    out = write_pack(tmp_path / "out", 30, **FORMS[old_form])
    with (
        pytest.raises(KeyboardInterrupt),
        PackWriter(out, FIELDS, columns=COLUMNS, **FORMS[new_form]) as w,
    ):
        for i in range(10):
            w.add([b"new", b"new"], (i, 0.0))
        raise KeyboardInterrupt
    assert listing(tmp_path) == ["out"]
    check_pack(open_pack(out), 30)
    assert open_pack(out).verify() == []

    write_pack(out, 12, seed=50, **FORMS[new_form])
    assert listing(tmp_path) == ["out"]
    assert out.is_dir() == (new_form == "shards")
    check_pack(open_pack(out), 12, seed=50)


# Child scripts import writer and errors without the package __init__ (which imports torch):
# faster, and it checks that the writer never imports torch.
PRELUDE = f"""
import sys, types
package = types.ModuleType("torch_serialized")
package.__path__ = [{str(ROOT / "torch_serialized")!r}]
sys.modules["torch_serialized"] = package
from torch_serialized.writer import PackWriter
from torch_serialized.errors import WriteError
assert "torch" not in sys.modules, "the writer imported torch"
"""


def run_python(code: str, *args: str, **kwargs: Any) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


SLOW_WRITER = """
    import time
    single = PackWriter(sys.argv[1] + "/single.tser", ["a"])
    (single.scratch() / "chunk-000000").write_bytes(bytes(1000))  # as pack workers leave it
    shards = PackWriter(sys.argv[1] + "/shards", ["a"], max_records_per_shard=2)
    for i in range(100000):
        single.add([bytes(1000)])
        shards.add([bytes(1000)])
        if i == 5:
            print("started", flush=True)
        time.sleep(0.01)
"""


def test_sigkill_mid_write_leaves_no_output_and_stale_temp_is_removed(tmp_path):
    proc = run_python(SLOW_WRITER, str(tmp_path))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == "started\n", proc.stderr.read() if proc.stderr else ""
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    left = listing(tmp_path)
    assert sorted(name.split("-")[0] for name in left) == [
        ".shards.tmp",
        ".single.tser.tmp",  # the output being written
        ".single.tser.tmp",  # and its scratch folder
    ]
    assert all(f"-{proc.pid}-" in name for name in left)
    assert not (tmp_path / "single.tser").exists() and not (tmp_path / "shards").exists()

    for name, limits in (("single.tser", {}), ("shards", {"max_records_per_shard": 2})):
        with PackWriter(tmp_path / name, ["a"], **limits) as w:
            assert not any(n.startswith(f".{name}.tmp-{proc.pid}-") for n in listing(tmp_path))
            w.add([b"fresh"])
            w.close()
    assert listing(tmp_path) == ["shards", "single.tser"]
    assert bytes(open_pack(tmp_path / "shards").field(0, 0)) == b"fresh"


FSIZE_WRITER = """
    import json, resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    results = {}
    for name, limits in (("single.tser", {}), ("shards", {"max_records_per_shard": 1000})):
        try:
            with PackWriter(sys.argv[1] + "/" + name, ["a"], **limits) as w:
                for i in range(64):
                    w.add([bytes(64 << 10)])
                w.close()
            results[name] = None
        except WriteError as exc:
            results[name] = [isinstance(exc, OSError), exc.errno, str(exc)]
    print(json.dumps(results))
"""


def test_file_size_limit_raises_write_error_and_leaves_nothing(tmp_path):
    pytest.importorskip("resource")
    proc = run_python(FSIZE_WRITER, str(tmp_path))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    results = json.loads(out)
    for name in ("single.tser", "shards"):
        assert results[name] is not None, f"{name}: no WriteError"
        is_oserror, code, message = results[name]
        assert is_oserror and code == errno.EFBIG
        assert str(tmp_path / name) in message
        assert "file size limit" in message and "No partial output" in message
    assert listing(tmp_path) == []


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_refuses_to_overwrite_what_is_not_a_pack(tmp_path, kind):
    out = tmp_path / "precious"
    if kind == "file":
        out.write_text("my thesis")
    else:
        out.mkdir()
        (out / "a.txt").write_text("x")
    with pytest.raises(WriteError, match="not a torch_serialized pack") as info:
        PackWriter(out, FIELDS)
    assert isinstance(info.value, OSError) and info.value.errno == errno.EEXIST
    assert str(out) in str(info.value)
    assert listing(tmp_path) == ["precious"]
    assert (out.read_text() if kind == "file" else (out / "a.txt").read_text()) in (
        "my thesis",
        "x",
    )


def test_missing_output_folder(tmp_path):
    with pytest.raises(WriteError, match="does not exist") as info:
        PackWriter(tmp_path / "no" / "out.tser", FIELDS)
    assert info.value.errno == errno.ENOENT


# -- processes ------------------------------------------------------------------------------
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
def test_dataloader_workers(packs, context, persistent):
    from torch.utils.data import DataLoader

    readers = [open_pack(packs["single"]), open_pack(packs["shards"])]
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
def test_pickled_reader_reopens_in_another_process(packs):
    blobs, expected = [], []
    for form in FORMS:
        reader = open_pack(packs[form])
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
    blob = pickle.dumps(reader)
    write_pack(out, 30, seed=7, **FORMS[form])  # replaced atomically by a new pack

    check_pack(reader, 30)  # this process keeps reading the file it validated
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


# -- memory ---------------------------------------------------------------------------------
def smaps() -> dict[str, int]:
    values = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        values[key] = int(value.split()[0]) * 1024
    return values


@pytest.mark.parametrize("form", FORMS)
def test_reading_every_record_does_not_grow_private_memory(tmp_path, form):
    if not Path("/proc/self/smaps_rollup").exists():
        pytest.skip("needs /proc/self/smaps_rollup (Linux >= 4.14)")
    n = 20_000
    out = tmp_path / "many"
    limits = {"max_records_per_shard": 5000} if form == "shards" else {}
    with PackWriter(out, ["a", "b"], **limits) as w:
        for i in range(n):
            w.add([payload(i, 0, 50 + i % 300), payload(i, 1, i % 40)])
        w.close()
    size = (
        sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        if out.is_dir()
        else out.stat().st_size
    )
    reader = open_pack(out)
    bytes(reader.field(0, 0))
    before = smaps()
    total = 0
    for i in range(n):
        total += len(bytes(reader.field(i, 0))) + len(bytes(reader.field(i, 1)))
    after = smaps()
    assert total == sum(50 + i % 300 + i % 40 for i in range(n))
    mib = 1 << 20
    assert after["Anonymous"] - before["Anonymous"] < 4 * mib
    assert after["Private_Dirty"] - before["Private_Dirty"] < 4 * mib
    uss = after["Private_Clean"] + after["Private_Dirty"]
    assert uss - (before["Private_Clean"] + before["Private_Dirty"]) < size + 4 * mib


@pytest.mark.parametrize("content", [b"", b"tiny", b"x" * 200])
def test_file_replaced_by_junk_raises_file_changed(tmp_path, content):
    out = write_pack(tmp_path / "out.tser", 5)
    reader = open_pack(out)
    blob = pickle.dumps(reader)
    junk = tmp_path / "junk"
    junk.write_bytes(content)
    os.replace(junk, out)  # a new inode: the map held by `reader` stays valid
    with pytest.raises(FileChangedError, match="replaced or modified"):
        pickle.loads(blob).field(0, 0)
    check_pack(reader, 5)


def test_unstorable_columns_and_arrays_refused_up_front(tmp_path):
    with pytest.raises(ValueError, match="cannot be stored"):
        PackWriter(tmp_path / "a", FIELDS, columns=np.dtype([("name", "U8")]))
    with pytest.raises(ValueError, match="distinct"):
        PackWriter(tmp_path / "a", ["x", "x"], max_records_per_shard=1)
    with PackWriter(tmp_path / "b", FIELDS) as w:
        with pytest.raises(ValueError, match="cannot be stored"):
            w.add_array("names", np.array(["a", "b"]))
        with pytest.raises(ValueError, match="cannot be stored"):
            w.add_array("objects", np.array([None, 1]))
        w.add_array("ok", np.arange(2))
        with pytest.raises(ValueError, match="already stored"):
            w.add_array("ok", np.arange(2))
        with pytest.raises(ValueError, match="already stored"):
            w.add_array("records", np.arange(2))
        w.add([b"a", b"b"])
    assert open_pack(tmp_path / "b").arrays()["ok"].tolist() == [0, 1]
    assert "a" not in listing(tmp_path)
