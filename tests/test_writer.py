"""PackWriter and ContainerWriter: round trips, layout options, refusals, write errors.

Record contents are derived from their indices (``payload(i, k, size)``), so every read checks
itself; ``parse_container`` is an independent reader written from docs/FORMAT.md.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from _container_helpers import (
    COLUMNS,
    FIELDS,
    FORMS,
    SHARDED,
    catalog_file,
    container_files,
    listing,
    parse_container,
    payload,
    run_python,
    write_pack,
)
from hypothesis import HealthCheck, given, settings
from strategies import datasets, limits

from torch_serialized.container import spec as fmt
from torch_serialized.container.reader import ContainerReader
from torch_serialized.container.shards import open_pack
from torch_serialized.container.shardwriter import PackWriter
from torch_serialized.errors import WriteError


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

        # the layout, read by the independent parser: alignment, shard limits, bindings
        files = container_files(out)
        total = 0
        for s, file in enumerate(files):
            meta, index = parse_container(file)
            assert meta["alignment"] == fmt.DEFAULT_ALIGNMENT
            assert all(int(o) % 64 == 0 for o in index["offset"].ravel())
            assert meta["index"]["offset"] % 64 == 0
            assert all(d["offset"] % 64 == 0 for d in meta["arrays"].values())
            m = meta["num_records"]
            if form == "shards":
                assert m <= limit.get("max_records_per_shard", m)
                assert m >= 1 or len(files) == 1
                if m > 1 and "max_shard_bytes" in limit:
                    assert (
                        int((index["offset"] + index["length"]).max()) <= limit["max_shard_bytes"]
                    )
                assert all(d["per_record"] for d in meta["arrays"].values())  # all in the catalog
                assert meta["user"] == {}
                assert meta["pack"] == {
                    "pack_id": reader.manifest.pack_id,
                    "role": "shard",
                    "index": s,
                    "first_record": total,
                    "num_records": m,
                }
            else:
                assert meta["pack"]["role"] == "single" and meta["user"] == data["user"]
            total += m
        assert total == n
        if form == "shards":
            manifest = json.loads((out / fmt.MANIFEST_NAME).read_text())
            assert manifest["num_records"] == n and "user" not in manifest
            token = manifest["catalog"]["file"][len("catalog-") : -len(".tser")]
            assert [e["file"] for e in manifest["shards"]] == [
                f"shard-{s:05d}-{token}.tser" for s in range(len(files))
            ]
            assert [e["bytes"] for e in manifest["shards"]] == [f.stat().st_size for f in files]
            assert listing(out) == sorted(
                [fmt.MANIFEST_NAME, f"catalog-{token}.tser"] + [f.name for f in files]
            )
            meta, index = parse_container(catalog_file(out))
            assert index.shape == (0, len(data["fields"])) and meta["user"] == data["user"]
            assert not any(d["per_record"] for d in meta["arrays"].values())
            assert set(meta["arrays"]) == expected_names
            assert meta["pack"] == {
                "pack_id": manifest["pack_id"],
                "role": "catalog",
                "num_records": n,
                "num_shards": len(files),
            }


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
        assert [e.num_records for e in reader.entries] == [1, 1, 1]
    assert reader.verify() == []


@pytest.mark.parametrize("alignment", [8, 4096, fmt.MAX_ALIGNMENT])
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


def test_add_after_abort_is_refused(tmp_path):
    w = PackWriter(tmp_path / "out", FIELDS)
    w.add([b"a", b"b"])
    w.abort()
    with pytest.raises(ValueError, match="closed"):
        w.add([b"a", b"b"])
    with pytest.raises(ValueError, match="closed"):
        w.close()
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


def _manifest_copy(tmp_path: Path) -> bytes:
    return (write_pack(tmp_path / "model", 3, **SHARDED) / fmt.MANIFEST_NAME).read_bytes()


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda d, m: (d / fmt.MANIFEST_NAME).write_text("{}"), id="junk-manifest"),
        pytest.param(lambda d, m: (d / fmt.MANIFEST_NAME).write_bytes(m), id="manifest-alone"),
        pytest.param(
            lambda d, m: (d / fmt.MANIFEST_NAME).write_bytes(m[:-30] + m[-29:]), id="damaged"
        ),
        pytest.param(lambda d, m: (d / fmt.MANIFEST_NAME).mkdir(), id="manifest-is-folder"),
    ],
)
def test_folder_with_a_manifest_is_not_replaced_unless_it_is_a_pack(tmp_path, build):
    """Issue #11 item 1: a folder that merely holds a file named manifest.json, with other
    files beside it, is someone's data: refused with WriteError, nothing deleted."""
    manifest = _manifest_copy(tmp_path)
    out = tmp_path / "precious"
    out.mkdir()
    (out / "thesis.txt").write_text("years of work")
    build(out, manifest)
    before = sorted(p.name for p in out.iterdir())
    for options in ({}, SHARDED):
        with pytest.raises(WriteError, match="not a torch_serialized pack") as info:
            write_pack(out, 3, **options)
        assert isinstance(info.value, OSError) and str(out) in str(info.value)
    assert sorted(p.name for p in out.iterdir()) == before
    assert (out / "thesis.txt").read_text() == "years of work"


def test_pack_folder_with_a_foreign_file_is_not_replaced(tmp_path):
    out = write_pack(tmp_path / "pack", 3, **SHARDED)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(WriteError, match="'notes.txt'"):
        write_pack(out, 3, **SHARDED)
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    (out / "sub").mkdir()  # a folder named like nothing of the pack
    with pytest.raises(WriteError, match="'sub'"):
        write_pack(out, 3)


@pytest.mark.parametrize(
    "content",
    [fmt.MAGIC, fmt.MAGIC + bytes(200), fmt.pack_header(64)[:-1] + b"\x00" + bytes(100)],
    ids=["magic-only", "magic-then-zeros", "bad-header-crc"],
)
def test_file_that_only_starts_like_a_pack_is_not_replaced(tmp_path, content):
    out = tmp_path / "x.tser"
    out.write_bytes(content)
    with pytest.raises(WriteError, match="not a torch_serialized pack"):
        write_pack(out, 3)
    assert out.read_bytes() == content


@pytest.mark.parametrize("member", ["shard", "catalog"])
def test_a_shard_or_catalog_of_a_folder_is_not_replaced(tmp_path, member):
    """A file of a shard folder has a valid header, but replacing it alone breaks the pack:
    refused in either form, with the folder to pass instead; the pack still verifies."""
    folder = write_pack(tmp_path / "pack", 20, **SHARDED)
    target = container_files(folder)[1] if member == "shard" else catalog_file(folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    what = "shard 2 of 3" if member == "shard" else "the catalog"
    for options in ({}, SHARDED):
        with pytest.raises(WriteError, match=f"is {what} of the pack at") as info:
            write_pack(target, 3, **options)
        assert info.value.errno == errno.EEXIST
        assert f"pass the folder {folder}" in str(info.value)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    reader = open_pack(folder)
    assert len(reader) == 20 and reader.verify() == []


def test_a_shard_copied_out_of_its_folder_is_not_replaced(tmp_path):
    """Its metadata binds it to a shard folder: still no pack by itself."""
    folder = write_pack(tmp_path / "pack", 20, **SHARDED)
    for source in (container_files(folder)[2], catalog_file(folder)):
        copy = tmp_path / source.name
        copy.write_bytes(source.read_bytes())
        with pytest.raises(WriteError, match="of a shard folder") as info:
            write_pack(copy, 3)
        assert "pass the shard folder it belongs to" in str(info.value)
        assert copy.read_bytes() == source.read_bytes()


def test_our_packs_are_replaced_in_either_form(tmp_path):
    """A verified pack (a truncated one included: its header is ours) is replaced, also by a
    pack of the other form; our own stale temporaries inside a folder do not block it."""
    out = write_pack(tmp_path / "p", 3, **SHARDED)
    (out / ".manifest.json.tmp-999999999-0123abcd").write_text("left by a killed writer")
    write_pack(out, 4, **SHARDED)
    assert len(open_pack(out)) == 4
    write_pack(out, 5)  # folder -> file
    assert len(open_pack(out)) == 5
    data = out.read_bytes()
    out.write_bytes(data[: len(data) // 2])  # truncated: still ours
    write_pack(out, 6, **SHARDED)  # file -> folder
    assert len(open_pack(out)) == 6


def test_missing_output_folder(tmp_path):
    with pytest.raises(WriteError, match="does not exist") as info:
        PackWriter(tmp_path / "no" / "out.tser", FIELDS)
    assert info.value.errno == errno.ENOENT


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
