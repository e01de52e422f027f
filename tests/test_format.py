"""format.py is the spec in code, docs/FORMAT.md the spec in prose: they must say the same.

The tables of FORMAT.md are parsed here and compared with the constants, structs and dtypes of
``torch_serialized.container.spec``; then the pack/unpack and dtype codecs are round-tripped.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import itertools
import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_serialized.container import manifest as mf
from torch_serialized.container import spec as fmt
from torch_serialized.container.reader import ContainerReader
from torch_serialized.container.shards import PackReader
from torch_serialized.container.shardwriter import PackWriter
from torch_serialized.errors import (
    CorruptFileError,
    FormatError,
    TruncatedFileError,
    UnsupportedVersionError,
)

DOC = (Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md").read_text(encoding="utf-8")

_TYPES = {"u16": "H", "u32": "I", "u64": "Q"}


# -- reading the document ------------------------------------------------------------------
def section(title: str) -> str:
    """The text under the heading ``title`` (any level), up to the next heading."""
    match = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ |\Z)", DOC, re.M | re.S)
    assert match, f"FORMAT.md has no section {title!r}"
    return match.group(1)


def tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table in ``text``, as rows of {column: cell} (backticks stripped)."""
    found: list[list[dict[str, str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and set(lines[i + 1]) <= set("|-: "):
            head = split_row(lines[i])
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(dict(zip(head, split_row(lines[i]))))
                i += 1
            found.append(rows)
        else:
            i += 1
    return found


def split_row(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [c.strip().replace("\\|", "|").strip("`") for c in cells]


def table(title: str, n: int = 0) -> list[dict[str, str]]:
    return tables(section(title))[n]


def hex_blocks(text: str) -> list[bytes]:
    """The bytes of each hex-dump code block (``address  xx xx ...`` lines) in ``text``."""
    out = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```$", text, re.M | re.S):
        lines = block.strip().splitlines()
        if lines and all(re.fullmatch(r"[0-9a-f]{8}(  ([0-9a-f]{2} ?)+)", ln) for ln in lines):
            out.append(bytes.fromhex("".join(ln[10:] for ln in lines)))
    return out


def layout(rows: list[dict[str, str]]) -> tuple[str, list[tuple[str, int, int]]]:
    """Struct format and (name, offset, size) list from a byte-layout table; checks contiguity."""
    code, fields, position = "<", [], 0
    for row in rows:
        offset, size = int(row["Offset"]), int(row["Size"])
        assert offset == position, f"{row['Name']} at {offset}, expected {position}"
        code += f"{size}s" if row["Type"] == "bytes" else _TYPES[row["Type"]]
        if row["Type"] != "bytes":
            assert struct.calcsize("<" + _TYPES[row["Type"]]) == size
        fields.append((row["Name"], offset, size))
        position += size
    return code, fields


def decode(data: bytes, fields: list[tuple[str, int, int]], types: dict[str, str]) -> dict:
    out = {}
    for name, offset, size in fields:
        raw = data[offset : offset + size]
        out[name] = raw if types[name] == "bytes" else int.from_bytes(raw, "little")
    return out


# -- constants -----------------------------------------------------------------------------
def test_constants_match_document():
    rows = table("Constants")
    assert {r["Name"] for r in rows} >= {"MAGIC", "FORMAT_MAJOR", "HEADER_SIZE", "FOOTER_SIZE"}
    for row in rows:
        assert getattr(fmt, row["Name"]) == ast.literal_eval(row["Value"]), row["Name"]


def test_magic_hex_in_document():
    match = re.search(r"magic is the 8 bytes `([0-9A-F ]+)`", DOC)
    assert match and bytes.fromhex(match.group(1)) == fmt.MAGIC
    assert len(fmt.MAGIC) == 8


def test_header_layout_matches_document():
    rows = table("Header")
    code, fields = layout(rows)
    assert code == fmt.HEADER.format
    assert struct.calcsize(code) == fmt.HEADER_SIZE == fmt.HEADER.size
    types = {r["Name"]: r["Type"] for r in rows}
    got = decode(fmt.pack_header(128), fields, types)
    assert got["magic"] == fmt.MAGIC
    assert (got["major"], got["minor"]) == (fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR)
    assert got["header_size"] == fmt.HEADER_SIZE
    assert got["alignment"] == 128
    assert got["flags"] == 0 and got["reserved"] == bytes(len(got["reserved"]))
    crc_offset = dict((n, o) for n, o, _ in fields)["header_crc32"]
    assert crc_offset == fmt.HEADER_SIZE - 4
    assert got["header_crc32"] == fmt.crc32(fmt.pack_header(128)[:crc_offset])


def test_footer_layout_matches_document():
    rows = table("Footer")
    code, fields = layout(rows)
    assert code == fmt.FOOTER.format
    assert struct.calcsize(code) == fmt.FOOTER_SIZE == fmt.FOOTER.size
    types = {r["Name"]: r["Type"] for r in rows}
    values = {
        "meta_offset": 2**40 + 3,
        "meta_length": 1234,
        "file_size": 2**41,
        "num_records": 77,
        "meta_crc32": 0xDEADBEEF,
    }
    data = fmt.pack_footer(*values.values())
    got = decode(data, fields, types)
    for name, value in values.items():
        assert got[name] == value, name
    assert (got["major"], got["minor"]) == (fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR)
    assert got["reserved"] == bytes(len(got["reserved"]))
    assert got["magic"] == fmt.MAGIC and data.endswith(fmt.MAGIC)
    crc_offset = dict((n, o) for n, o, _ in fields)["footer_crc32"]
    assert got["footer_crc32"] == fmt.crc32(data[:crc_offset])
    # the names the code returns are the document's, in the document's order
    named = [n for n, _, _ in fields if n not in ("reserved", "footer_crc32", "magic")]
    assert list(fmt.unpack_footer(data, "x")) == named


def test_index_dtype_matches_document():
    rows = table("The record index")
    code, fields = layout(rows)
    assert struct.calcsize(code) == fmt.INDEX_DTYPE.itemsize == 24
    doc_dtype = np.dtype(
        {
            "names": [n for n, _, _ in fields],
            "formats": ["<" + {"u64": "u8", "u32": "u4"}[r["Type"]] for r in rows],
            "offsets": [o for _, o, _ in fields],
        }
    )
    assert doc_dtype == fmt.INDEX_DTYPE
    spelled = re.search(r"In JSON: `(\[\[.*?\]\])`", section("The record index"))
    assert spelled and json.loads(spelled.group(1)) == fmt.dtype_to_json(fmt.INDEX_DTYPE)


def test_type_codes_match_document():
    documented = {row["Code"] for row in table("Type codes")}
    assert len(documented) == 12
    candidates = {
        order + kind + size
        for order, kind, size in itertools.product("<>|=", "biufcUSVOMm?", "12485")
    }
    for code in candidates | documented:
        if code in documented:
            assert fmt.dtype_from_json(code, "x") == np.dtype(code)
            assert fmt.dtype_to_json(np.dtype(code)) == code
        else:
            with pytest.raises(CorruptFileError):
                fmt.dtype_from_json(code, "x")


def test_crc_check_value_in_document():
    assert 'crc32(b"123456789") == 0xCBF43926' in DOC
    assert fmt.crc32(b"123456789") == 0xCBF43926
    assert fmt.crc32(b"6789", fmt.crc32(b"12345")) == 0xCBF43926


def _written(tmp_path: Path, **kwargs) -> PackReader:
    with PackWriter(tmp_path / "p", ["a", "b"], columns=np.dtype([("n", "<u4")]), **kwargs) as w:
        w.add([b"x", b"yy"], (1,))
        w.add_array("extra", np.arange(3))
        w.close({"k": 1})
    return PackReader(tmp_path / "p")


def test_metadata_keys_match_document(tmp_path):
    meta = ContainerReader(_written(tmp_path).path).meta
    assert list(meta) == [row["Key"] for row in table("Metadata")]
    desc_keys = [row["Key"] for row in table("Array descriptors", 0)]
    extra_keys = [row["Key"] for row in table("Array descriptors", 1)]
    assert list(meta["index"]) == desc_keys
    for desc in meta["arrays"].values():
        assert list(desc) == desc_keys + extra_keys


def test_binding_keys_match_document(tmp_path):
    documented = [row["Key"] for row in table("Pack binding")]
    reader = _written(tmp_path, max_records_per_shard=1)
    (tmp_path / "s").mkdir()
    bindings = [
        reader.shard(0).meta["pack"],
        ContainerReader(_written(tmp_path / "s").path).meta["pack"],
    ]
    bindings.append(ContainerReader(Path(reader.path) / reader.manifest.catalog.file).meta["pack"])
    assert [b["role"] for b in bindings] == [fmt.ROLE_SHARD, fmt.ROLE_SINGLE, fmt.ROLE_CATALOG]
    for found in bindings:
        assert set(found) <= set(documented)
        assert [k for k in documented if k in found] == list(found)  # the documented order
        assert fmt.parse_binding(found, "x") == found


def test_manifest_keys_match_document(tmp_path):
    reader = _written(tmp_path, max_records_per_shard=1)
    manifest = json.loads((Path(reader.path) / fmt.MANIFEST_NAME).read_text())
    assert list(manifest) == [row["Key"] for row in table("The manifest")]
    for entry in manifest["shards"]:
        assert list(entry) == [row["Key"] for row in table("Shard and catalog entries", 0)]
        assert re.fullmatch(r"shard-\d{5}-[0-9a-f]{8}" + re.escape(fmt.FILE_SUFFIX), entry["file"])
    assert list(manifest["catalog"]) == [
        row["Key"] for row in table("Shard and catalog entries", 1)
    ]
    assert re.fullmatch(
        r"catalog-[0-9a-f]{8}" + re.escape(fmt.FILE_SUFFIX), manifest["catalog"]["file"]
    )


def test_manifest_checksum_is_the_documented_computation(tmp_path):
    """docs/FORMAT.md's Python spelling of the canonical checksum, run on a written manifest."""
    reader = _written(tmp_path, max_records_per_shard=1)
    manifest = json.loads((Path(reader.path) / fmt.MANIFEST_NAME).read_text())
    code = re.search(r"```python\n(.*?)```", section("The manifest checksum"), re.S).group(1)
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    documented = eval(code, {"hashlib": hashlib, "json": json, "body": body})
    assert manifest["checksum"] == "sha256:" + documented == mf.manifest_checksum(manifest)


def test_worked_example_matches_writer(tmp_path, monkeypatch):
    path = tmp_path / "ex.tser"
    pack_id = re.search(r"pack id `([0-9a-f]{32})`", section("Worked example")).group(1)
    # created_by names the writing version: the example's bytes are those of the version the
    # document shows, whatever version runs the test
    documented = json.loads(re.search(r"```json\n(.*?)```", section("Worked example"), re.S)[1])
    for module in ("writer", "shardwriter"):
        monkeypatch.setattr(
            f"torch_serialized.container.{module}.CREATED_BY", documented["created_by"]
        )
    with PackWriter(path, ["image", "target"], pack_id=pack_id) as w:
        w.add([b"\xff\xd8jpeg", b'{"a":1}'])
        w.add([b"", b"{}"])
        w.close({"note": "demo"})
    data = path.read_bytes()
    text = section("Worked example")
    header, entry, footer = hex_blocks(text)
    assert header == data[:64] == fmt.pack_header(64)
    assert entry == data[256 : 256 + len(entry)]
    doc_meta = json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))
    meta = ContainerReader(path).meta
    assert {**doc_meta, "created_by": None} == {**meta, "created_by": None}
    # the documented footer describes the documented metadata, byte for byte
    blob = json.dumps(doc_meta, separators=(",", ":")).encode()
    got = fmt.unpack_footer(footer, "doc")
    assert got["meta_offset"] == 384 and got["num_records"] == 2
    assert got["meta_length"] == len(blob) and got["meta_crc32"] == fmt.crc32(blob)
    assert got["file_size"] == 384 + len(blob) + 64 == len(data)
    assert data[: got["meta_offset"]] == data[:384]
    assert f"is {len(data)} bytes long" in text


# -- header and footer codecs ---------------------------------------------------------------
@pytest.mark.parametrize("alignment", [8, 16, 64, 4096, fmt.MAX_ALIGNMENT])
def test_header_round_trip(alignment):
    data = fmt.pack_header(alignment)
    assert len(data) == fmt.HEADER_SIZE
    assert fmt.unpack_header(data, "f") == (fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR, alignment)


def _patched_header(offset: int, value: bytes) -> bytes:
    data = bytearray(fmt.pack_header(64))
    data[offset : offset + len(value)] = value
    data[60:64] = struct.pack("<I", fmt.crc32(bytes(data[:60])))
    return bytes(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "too short"),
        (fmt.pack_header(64)[:63], "too short"),
        (b"PK\x03\x04" + fmt.pack_header(64)[4:], "not a torch_serialized file"),
        (fmt.pack_header(64)[:30] + b"\x01" + fmt.pack_header(64)[31:], "checksum"),
        (_patched_header(12, struct.pack("<I", 128)), "header_size is 128, not 64"),
        (_patched_header(16, struct.pack("<I", 0)), "alignment"),
        (_patched_header(16, struct.pack("<I", 4)), "alignment"),
        (_patched_header(16, struct.pack("<I", 48)), "alignment"),
        (_patched_header(16, struct.pack("<I", fmt.MAX_ALIGNMENT * 2)), "alignment"),
    ],
)
def test_unpack_header_rejects(data, message):
    with pytest.raises(CorruptFileError, match=message) as info:
        fmt.unpack_header(data, "/some/file.tser")
    assert isinstance(info.value, ValueError)
    assert "/some/file.tser" in str(info.value)


def test_unpack_header_ignores_unknown_flags_and_reserved():
    data = _patched_header(20, b"\x01\x00\x00\x00\xff\xff")
    assert fmt.unpack_header(data, "f")[2] == 64


u64 = st.integers(0, 2**64 - 1)


@settings(max_examples=50, deadline=None)
@given(u64, u64, u64, u64, st.integers(0, 2**32 - 1))
def test_footer_round_trip(meta_offset, meta_length, file_size, num_records, meta_crc):
    data = fmt.pack_footer(meta_offset, meta_length, file_size, num_records, meta_crc)
    assert len(data) == fmt.FOOTER_SIZE
    assert fmt.unpack_footer(data, "f") == {
        "meta_offset": meta_offset,
        "meta_length": meta_length,
        "file_size": file_size,
        "num_records": num_records,
        "meta_crc32": meta_crc,
        "major": fmt.FORMAT_MAJOR,
        "minor": fmt.FORMAT_MINOR,
    }


@pytest.mark.parametrize("position", [0, 8, 31, 40, 51, 52, 55, 56, 63])
def test_unpack_footer_rejects_any_damaged_byte(position):
    data = bytearray(fmt.pack_footer(1, 2, 3, 4, 5))
    data[position] ^= 0x40
    with pytest.raises(CorruptFileError, match="/f.tser"):
        fmt.unpack_footer(bytes(data), "/f.tser")


@pytest.mark.parametrize("size", [0, 8, 63, 65])
def test_unpack_footer_rejects_wrong_length(size):
    data = (fmt.pack_footer(1, 2, 3, 4, 5) * 2)[-size:] if size else b""
    with pytest.raises(TruncatedFileError, match="/f.tser"):
        fmt.unpack_footer(data, "/f.tser")


def test_pad_to():
    assert [fmt.pad_to(p, 64) for p in (0, 1, 63, 64, 65, 128)] == [0, 63, 1, 0, 63, 0]
    assert fmt.pad_to(7, 8) == 1


# -- metadata and manifest codecs -----------------------------------------------------------
_NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=8)
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-fmt.MAX_JSON_INT, fmt.MAX_JSON_INT)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


_PACK_ID = "0123456789abcdef" * 2


def _metadata(num: int, fields: list[str], user: dict, arrays: dict | None = None) -> bytes:
    index = fmt.array_descriptor(np.zeros((num, len(fields)), fmt.INDEX_DTYPE), 64)
    return fmt.build_metadata(
        created_by="test",
        num_records=num,
        fields=fields,
        alignment=64,
        index=index,
        arrays=arrays or {},
        user=user,
        pack=fmt.binding(fmt.ROLE_SHARD, _PACK_ID, index=2, first_record=10, num_records=num),
    )


@settings(max_examples=50, deadline=None)
@given(
    num=st.integers(0, 20),
    fields=st.lists(_NAMES, min_size=1, max_size=4, unique=True),
    user=st.dictionaries(st.text(max_size=6), _JSON, max_size=4),
)
def test_metadata_round_trip(num, fields, user):
    arrays = {"ids": {**fmt.array_descriptor(np.arange(num), 64), "per_record": True}}
    data = _metadata(num, fields, user, arrays)
    meta = fmt.parse_metadata(
        data,
        version=(fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR),
        num_records=num,
        data_end=64 + 24 * num * 4,
        path="m",
    )
    assert list(meta) == [row["Key"] for row in table("Metadata")]
    assert meta["format"] == fmt.FORMAT_NAME
    assert meta["format_version"] == [fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR]
    assert (meta["num_records"], meta["fields"], meta["user"]) == (num, fields, user)
    assert meta["arrays"] == arrays
    assert meta["pack"]["role"] == fmt.ROLE_SHARD and meta["pack"]["num_records"] == num
    assert data == json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: b"\xff" + m, "not valid JSON"),
        (lambda m: b"[1]", "not a JSON object"),
        (lambda m: b"[" * 100_000, "not valid JSON"),
        (lambda m: m.replace(b'"torch_serialized"', b'"other"'), "format is 'other'"),
        (lambda m: m.replace(b'"num_records":2', b'"num_records":3'), "num_records is 3"),
        (lambda m: m.replace(b'"user":{}', b'"user":[]'), r"user is \[\], not an object"),
        (lambda m: m.replace(b'"shape":[2,1]', b'"shape":[1,2]'), "record index"),
        (lambda m: m.replace(b'"fields":["a"]', b'"fields":["a","a"]'), "fields are"),
        (lambda m: m.replace(b'"user":{}', b'"user":{},"user":{}'), "duplicate key"),
        (lambda m: m.replace(b'"user":{}', b'"user":{"x":NaN}'), "NaN"),
        (lambda m: m.replace(b'"role":"shard"', b'"role":"chard"'), "binding has role 'chard'"),
        (lambda m: m.replace(b'"index":2', b'"index":-2'), r"binding \(shard\) has index -2"),
    ],
)
def test_parse_metadata_refuses(edit, message):
    data = edit(_metadata(2, ["a"], {}))
    with pytest.raises(CorruptFileError, match=message):
        fmt.parse_metadata(
            data,
            version=(fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR),
            num_records=2,
            data_end=1024,
            path="m",
        )


def _shards(count: int, size: int = 1) -> list[mf.ShardEntry]:
    return [
        mf.ShardEntry(f"shard-{i:05d}-0badcafe.tser", i * size, size, 200 + i, i)
        for i in range(count)
    ]


_CATALOG = mf.CatalogEntry("catalog-0badcafe.tser", 300, 7)


def _manifest(shards: list[mf.ShardEntry], fields: list[str] | None = None) -> bytes:
    return mf.build_manifest(
        created_by="test",
        pack_id=_PACK_ID,
        num_records=sum(s.num_records for s in shards),
        fields=fields or ["a"],
        catalog=_CATALOG,
        shards=shards,
    )


@settings(max_examples=50, deadline=None)
@given(
    count=st.integers(1, 5),
    size=st.integers(0, 2**40),
    fields=st.lists(_NAMES, min_size=1, max_size=4, unique=True),
)
def test_manifest_round_trip(count, size, fields):
    shards = _shards(count, size)
    data = _manifest(shards, fields)
    manifest = mf.parse_manifest(data, "manifest.json")
    assert manifest == mf.Manifest(
        version=fmt.MANIFEST_VERSION,
        created_by="test",
        num_records=count * size,
        fields=tuple(fields),
        shards=tuple(shards),
        pack_id=_PACK_ID,
        catalog=_CATALOG,
        checksum=json.loads(data)["checksum"],
    )
    assert list(json.loads(data)) == [row["Key"] for row in table("The manifest")]
    assert data.endswith(b"\n")
    assert manifest.files() == [_CATALOG.file, *(s.file for s in shards)]


def _manifest_text(**edits) -> bytes:
    """A valid manifest's JSON with keys replaced (``None`` removes one), checksum recomputed."""
    manifest = json.loads(_manifest(_shards(2)))
    for key, value in edits.items():
        if value is None:
            manifest.pop(key)
        else:
            manifest[key] = value
    if "checksum" not in edits:
        manifest["checksum"] = mf.manifest_checksum(manifest)
    return json.dumps(manifest).encode()


@pytest.mark.parametrize(
    ("data", "error", "message"),
    [
        (b"\xff", CorruptFileError, "not valid JSON"),
        (b"[" * 100_000, CorruptFileError, "not valid JSON"),
        (b'{"format": "x"}', CorruptFileError, "not a torch_serialized shard manifest"),
        (
            b'{"format": "torch_serialized.shards", "version": 3}',
            UnsupportedVersionError,
            "newer",
        ),
        (b'{"format": "torch_serialized.shards", "version": 0}', CorruptFileError, "version"),
        (b'{"format": "torch_serialized.shards", "version": true}', CorruptFileError, "version"),
        (b'{"format": "torch_serialized.shards", "version": 1}', CorruptFileError, "fields"),
        (_manifest(_shards(2)).replace(b'"test"', b'"tesT"'), CorruptFileError, "checksum"),
        (_manifest_text(shards=[]), CorruptFileError, "no shards"),
        (_manifest_text(num_records=5), CorruptFileError, "num_records"),
        (_manifest_text(pack_id="ABC"), CorruptFileError, "pack_id"),
        (_manifest_text(fields=["a", "a"]), CorruptFileError, "fields"),
        (_manifest_text(catalog=None), CorruptFileError, "catalog"),
        (
            _manifest_text(catalog={**dataclasses.asdict(_CATALOG), "bytes": 5}),
            CorruptFileError,
            "catalog",
        ),
        (_manifest_text(checksum=None), CorruptFileError, "checksum"),
    ],
)
def test_parse_manifest_refuses(data, error, message):
    with pytest.raises(error, match=message):
        mf.parse_manifest(data, "manifest.json")


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "..",
        "../x",
        "a/b",
        "/abs",
        "a\\b",
        "a\x00b",
        "line\nbreak",
        ".hidden",
        "manifest.json",
        "x" * 256,
        7,
        None,
    ],
)
def test_parse_manifest_refuses_shard_names(name):
    shards = [
        {**dataclasses.asdict(s), "file": name} if i == 1 else dataclasses.asdict(s)
        for i, s in enumerate(_shards(2))
    ]
    with pytest.raises(CorruptFileError, match="entry 1 is invalid") as info:
        mf.parse_manifest(_manifest_text(shards=shards), "manifest.json")
    assert "manifest.json" in str(info.value)


@pytest.mark.parametrize(
    "edit",
    [
        lambda e: {**e, "first_record": e["first_record"] + 1},
        lambda e: {**e, "num_records": -1},
        lambda e: {**e, "num_records": True},
        lambda e: {**e, "num_records": 1.0},
        lambda e: {**e, "bytes": 127},
        lambda e: {**e, "meta_crc32": 2**32},
        lambda e: {k: v for k, v in e.items() if k != "first_record"},
        lambda e: [e],
    ],
)
def test_parse_manifest_refuses_shard_numbers(edit):
    shards = [dataclasses.asdict(s) for s in _shards(3)]
    shards[1] = edit(shards[1])
    with pytest.raises(CorruptFileError, match="entry 1 is invalid"):
        mf.parse_manifest(_manifest_text(shards=shards), "manifest.json")


def test_parse_manifest_refuses_a_file_named_twice():
    shards = [dataclasses.asdict(s) for s in _shards(2)]
    shards[1]["file"] = shards[0]["file"]
    with pytest.raises(CorruptFileError, match="twice"):
        mf.parse_manifest(_manifest_text(shards=shards), "manifest.json")
    catalog = {**dataclasses.asdict(_CATALOG), "file": shards[0]["file"]}
    with pytest.raises(CorruptFileError, match="twice"):
        mf.parse_manifest(_manifest_text(catalog=catalog), "manifest.json")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"a": 1, "a": 2}', "duplicate key"),
        ('{"a": NaN}', "NaN"),
        ('{"a": -Infinity}', "Infinity"),
        ('{"a": 1e400}', "out of range"),
        ('{"a": ' + "[" * 65 + "]" * 65 + "}", "more than 64 deep"),
        ('{"a": ' + '{"b": ' * 70 + "1" + "}" * 70 + "}", "more than 64 deep"),
        ("[" * 100_000 + "]" * 100_000, "recursion|deep"),
        ('\ufeff{"a": 1}', "not valid JSON"),
    ],
)
def test_strict_json_refusals_name_the_file(text, message):
    """Issue #11 item 8: duplicate keys, NaN/Infinity and absurd nesting are refused with our
    error naming the file, never a RecursionError or a silent choice."""
    with pytest.raises(CorruptFileError, match=message) as info:
        fmt.loads_json(text.encode(), "/some/manifest.json", "manifest")
    assert "/some/manifest.json" in str(info.value)
    for where in ("manifest", "metadata"):
        with pytest.raises(CorruptFileError):
            if where == "manifest":
                mf.parse_manifest(text.encode(), "m.json")
            else:
                fmt.parse_metadata(
                    text.encode(),
                    version=(fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR),
                    num_records=0,
                    data_end=64,
                    path="m",
                )


def test_strict_json_accepts_depth_64_and_unicode():
    text = '{"a": ' + "[" * 63 + "]" * 63 + ', "é": "\\u00e9", "n": -0.5}'
    assert fmt.loads_json(text.encode(), "x", "x")["n"] == -0.5


def test_strict_json_refuses_depth_65_exactly():
    text = '{"a": ' + "[" * 64 + "]" * 64 + "}"
    with pytest.raises(CorruptFileError, match=f"more than {fmt.MAX_JSON_DEPTH} deep"):
        fmt.loads_json(text.encode(), "x", "x")


@pytest.mark.parametrize(("offset", "fits"), [(1024 - 16, True), (1024 - 8, False)])
def test_an_array_must_end_before_the_metadata(offset, fits):
    """Bytes of an array that ran into the metadata would be read as data."""
    desc = {"dtype": "|u1", "shape": [16], "offset": offset, "nbytes": 16, "crc32": 0}
    if fits:
        assert fmt.check_descriptor(desc, "z", 1024, "f.tser")[2:4] == (offset, 16)
    else:
        with pytest.raises(CorruptFileError, match=r"f\.tser: .*'z' \(16 bytes at 1016\) does not"):
            fmt.check_descriptor(desc, "z", 1024, "f.tser")


@pytest.mark.parametrize(
    "value",
    [
        None,
        [],
        {"pack_id": "0" * 32},
        {"pack_id": "0" * 31, "role": "single"},
        {"pack_id": "G" * 32, "role": "single"},
        {"pack_id": "0" * 32, "role": "other"},
        {"pack_id": "0" * 32, "role": "shard", "index": 0, "first_record": 0},
        {"pack_id": "0" * 32, "role": "shard", "index": -1, "first_record": 0, "num_records": 1},
        {"pack_id": "0" * 32, "role": "catalog", "num_records": 1, "num_shards": False},
    ],
)
def test_parse_binding_refuses(value):
    with pytest.raises(CorruptFileError, match="binding"):
        fmt.parse_binding(value, "f.tser")


def test_binding_round_trip():
    for role, extra in (
        (fmt.ROLE_SINGLE, {}),
        (fmt.ROLE_SHARD, {"index": 3, "first_record": 70, "num_records": 5}),
        (fmt.ROLE_CATALOG, {"num_records": 75, "num_shards": 4}),
    ):
        value = fmt.binding(role, _PACK_ID, **extra)
        assert (
            fmt.parse_binding(value, "x") == value == {"pack_id": _PACK_ID, "role": role, **extra}
        )
        assert fmt.parse_binding({**value, "future": 1}, "x") == value  # unknown keys ignored


def test_names_carry_the_token():
    assert fmt.shard_file_name(3, "0badcafe") == "shard-00003-0badcafe.tser"
    assert fmt.catalog_file_name("0badcafe") == "catalog-0badcafe.tser"
    assert (
        re.fullmatch(r"[0-9a-f]{32}", fmt.new_pack_id()) and fmt.new_pack_id() != fmt.new_pack_id()
    )
    assert re.fullmatch(r"[0-9a-f]{8}", fmt.new_token())


# -- dtype codec ----------------------------------------------------------------------------
SIMPLE = sorted(row["Code"] for row in table("Type codes"))
names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8).filter(
    lambda s: s.strip("\x00") == s
)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(names, st.sampled_from(SIMPLE)), min_size=1, max_size=6, unique_by=lambda t: t[0]
    )
)
def test_structured_dtype_round_trip(spec):
    dtype = np.dtype(spec)
    as_json = fmt.dtype_to_json(dtype)
    assert as_json == [list(item) for item in spec]
    back = fmt.dtype_from_json(json.loads(json.dumps(as_json)), "f")
    assert back == dtype and back.itemsize == sum(np.dtype(c).itemsize for _, c in spec)


@pytest.mark.parametrize("code", SIMPLE)
def test_simple_dtype_round_trip(code):
    assert fmt.dtype_from_json(fmt.dtype_to_json(np.dtype(code)), "f") == np.dtype(code)


@pytest.mark.parametrize("native", ["=u4", "=f8", "int64", "bool", "uint8", "float16"])
def test_native_dtypes_are_stored_little_endian(native):
    code = fmt.dtype_to_json(np.dtype(native))
    assert isinstance(code, str) and code[0] in "<|"


@pytest.mark.parametrize(
    "dtype",
    [
        np.dtype(object),
        np.dtype("U4"),
        np.dtype("S4"),
        np.dtype("V8"),
        np.dtype("M8[ns]"),
        np.dtype("m8[s]"),
        np.dtype("c8"),
        np.dtype(">u4"),
        np.dtype([("a", "<u4"), ("b", object)]),
        np.dtype([("a", "<u4", (3,))]),
        np.dtype([("a", [("b", "<u4")])]),
        np.dtype([("a", "u1"), ("b", "<u4")], align=True),
        np.dtype({"names": ["a"], "formats": ["<u4"], "offsets": [4]}),
    ],
)
def test_dtype_to_json_refuses(dtype):
    with pytest.raises(ValueError):
        fmt.dtype_to_json(dtype)


@pytest.mark.parametrize(
    "value",
    [
        "<f1",
        "<b2",
        "|u4",
        ">u4",
        "=u4",
        "u4",
        "|O",
        "O",
        "<U4",
        "<c8",
        "<M8",
        "<u4\n",
        " <u4",
        "",
        5,
        None,
        True,
        {},
        [],
        [["a"]],
        [["a", "<u4", "x"]],
        [["a", "|O"]],
        [["a", "<u4"], ["a", "<u4"]],
        [["", "<u4"]],
        [[1, "<u4"]],
        [["a", [["b", "<u4"]]]],
        [("a", "<u4")],
        [[f"f{i}", "|u1"] for i in range(1025)],
    ],
)
def test_dtype_from_json_refuses(value):
    with pytest.raises(CorruptFileError, match="/x.tser") as info:
        fmt.dtype_from_json(value, "/x.tser")
    assert isinstance(info.value, (FormatError, ValueError))


def test_dtype_from_json_accepts_many_fields():
    spec = [[f"f{i}", "|u1"] for i in range(1024)]
    assert fmt.dtype_from_json(spec, "f").itemsize == 1024
