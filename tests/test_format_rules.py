"""Reader rules of docs/FORMAT.md at their edges: strict-JSON integers, versions that must
agree, and what a refusal says (the file, the field at fault, what to do)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _container_helpers import (
    catalog_file,
    container_files,
    copy_pack,
    rewrite_container,
)

from torch_serialized.container import manifest as mf
from torch_serialized.container import spec as fmt
from torch_serialized.container.reader import ContainerReader
from torch_serialized.container.shards import PackReader, open_pack
from torch_serialized.container.shardwriter import PackWriter
from torch_serialized.errors import CorruptFileError, UnsupportedVersionError

_PACK_ID = "0123456789abcdef" * 2


# -- strict JSON: integers a double holds exactly ---------------------------------------------
@pytest.mark.parametrize("value", [fmt.MAX_JSON_INT, -fmt.MAX_JSON_INT, 0, -0, 2**32])
def test_strict_json_accepts_integers_a_double_holds(value):
    assert fmt.loads_json(f'{{"n": {value}}}'.encode(), "m", "metadata") == {"n": value}


@pytest.mark.parametrize(
    "text",
    [
        str(fmt.MAX_JSON_INT + 1),
        str(-fmt.MAX_JSON_INT - 1),
        str(2**64),
        "9" * 400,
        "-" + "9" * 400,
    ],
)
def test_strict_json_refuses_integers_a_double_cannot_hold(text):
    """A double-based parser (JavaScript, many C libraries) reads these as another number or as
    Infinity: two readers would see two contents behind one checksum."""
    for data in (f'{{"n": {text}}}', f'{{"a": ["x", {{"n": {text}}}]}}'):
        with pytest.raises(CorruptFileError, match="integer") as info:
            fmt.loads_json(data.encode(), "/p/meta", "metadata")
        assert "/p/meta" in str(info.value) and "re-pack" in str(info.value)


def test_strict_json_long_digit_runs_in_strings_are_fine():
    text = '{"id": "2008_' + "1" * 40 + '", "n": 12345678901234}'
    assert fmt.loads_json(text.encode(), "m", "metadata")["n"] == 12345678901234


def test_writer_refuses_metadata_integers_a_reader_would_refuse(tmp_path):
    """The writer mirrors the reader: it never writes a file the reader refuses."""
    with (
        pytest.raises(ValueError, match="integer"),
        PackWriter(tmp_path / "p.tser", ["a"]) as writer,
    ):
        writer.add([b"x"])
        writer.close({"big": fmt.MAX_JSON_INT + 1})
    assert not (tmp_path / "p.tser").exists()
    with PackWriter(tmp_path / "q.tser", ["a"]) as writer:
        writer.add([b"x"])
        writer.close({"big": fmt.MAX_JSON_INT, "small": -fmt.MAX_JSON_INT})


def test_manifest_refuses_integers_a_double_cannot_hold():
    catalog = mf.CatalogEntry("catalog-00000000.tser", 200, 1)
    shard = mf.ShardEntry("shard-00000-00000000.tser", 0, 1, 200, 1)
    data = mf.build_manifest(
        created_by="t",
        pack_id=_PACK_ID,
        num_records=1,
        fields=["a"],
        catalog=catalog,
        shards=[shard],
    )
    manifest = json.loads(data)
    text = json.dumps(manifest).replace('"version": 2', f'"version": 2, "x": {2**53}')
    with pytest.raises(CorruptFileError, match="integer"):
        mf.parse_manifest(text.encode(), "/p/manifest.json")
    with pytest.raises(ValueError, match="integer"):
        mf.build_manifest(
            created_by="t",
            pack_id=_PACK_ID,
            num_records=2**60,
            fields=["a"],
            catalog=catalog,
            shards=[mf.ShardEntry("s.tser", 0, 2**60, 200, 1)],
        )


def test_array_descriptor_numbers_stay_within_the_bound():
    """Descriptor numbers (offsets, sizes, CRC32s) are far below 2**53 for any real file."""
    desc = fmt.array_descriptor(np.arange(3, dtype="<i8"), 1 << 50)
    assert all(abs(v) <= fmt.MAX_JSON_INT for v in (desc["offset"], desc["nbytes"], desc["crc32"]))


# -- versions: header, footer and metadata agree; major 0 is never written --------------------
def _pack(tmp_path: Path) -> Path:
    with PackWriter(tmp_path / "p.tser", ["a"]) as writer:
        writer.add([b"x"])
        writer.close({"k": 1})
    return tmp_path / "p.tser"


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda meta: meta.update({key: value})


def test_rewrite_helper_keeps_a_valid_file(tmp_path):
    path = _pack(tmp_path)
    rewrite_container(path, meta=_set("zz", 1))
    assert ContainerReader(path).meta["zz"] == 1


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"footer_version": (1, 0)}, "footer says format version 1.0, its header 1.1"),
        ({"footer_version": (2, 1)}, "footer says format version 2.1, its header 1.1"),
        (
            {"meta": _set("format_version", [1, 0])},
            r"format_version is \[1, 0\], the header's 1.1",
        ),
        ({"meta": _set("format_version", [1, 1, 0])}, "format_version"),
        ({"meta": _set("format_version", [True, 1])}, "format_version"),
        ({"meta": _set("format_version", "1.1")}, "format_version"),
        ({"meta": lambda m: m.pop("format_version")}, "format_version"),
    ],
)
def test_versions_that_differ_from_the_header_are_refused(tmp_path, edit, message):
    path = _pack(tmp_path)
    rewrite_container(path, **edit)
    with pytest.raises(CorruptFileError, match=message) as info:
        ContainerReader(path)
    assert str(path) in str(info.value) and "re-pack" in str(info.value)


def test_major_version_0_is_refused(tmp_path):
    path = _pack(tmp_path)
    rewrite_container(
        path,
        header_version=(0, 1),
        footer_version=(0, 1),
        meta=_set("format_version", [0, 1]),
    )
    with pytest.raises(CorruptFileError, match="major version is 0") as info:
        ContainerReader(path)
    assert not isinstance(info.value, UnsupportedVersionError)
    assert str(path) in str(info.value)


def test_a_newer_minor_in_all_three_places_is_read(tmp_path):
    path = _pack(tmp_path)
    rewrite_container(
        path,
        header_version=(1, 9),
        footer_version=(1, 9),
        meta=_set("format_version", [1, 9]),
    )
    assert ContainerReader(path).version == (1, 9)


def test_a_newer_major_is_still_unsupported(tmp_path):
    path = _pack(tmp_path)
    rewrite_container(
        path,
        header_version=(2, 0),
        footer_version=(2, 0),
        meta=_set("format_version", [2, 0]),
    )
    with pytest.raises(UnsupportedVersionError, match="upgrade"):
        ContainerReader(path)


def test_format_1_0_packs_of_0_1_0_still_open():
    data = Path(__file__).parent / "data" / "v1"
    assert ContainerReader(data / "tiny.tser").version == (1, 0)
    assert len(PackReader(data / "tiny-shards")) > 0


# -- damage inside a shard or catalog names the manifest too ----------------------------------
def _damage_header(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[30] ^= 1  # a reserved byte: the header checksum no longer matches
    file.write_bytes(data)


def _damage_magic(file: Path) -> None:
    file.write_bytes(b"\x89PNG\r\n\x1a\n" + file.read_bytes()[8:])


def _damage_footer(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[-30] ^= 1  # inside the footer's checksummed bytes
    file.write_bytes(data)


@pytest.mark.parametrize("damage", [_damage_header, _damage_magic, _damage_footer])
@pytest.mark.parametrize("member", ["shard", "catalog"])
def test_damage_in_a_member_names_the_manifest_and_the_member(
    tmp_path, container_packs, member, damage
):
    path = copy_pack(container_packs["shards"], tmp_path)
    file = container_files(path)[1] if member == "shard" else catalog_file(path)
    damage(file)
    with pytest.raises(CorruptFileError) as info:
        open_pack(path).field(10, 0)  # record 10 is in shard 1
    message = str(info.value)
    assert str(file) in message and str(path / fmt.MANIFEST_NAME) in message
    assert ("shard 1" if member == "shard" else "the catalog") in message
    assert "re-pack" in message and "pack_voc" not in message


def test_a_shard_that_is_a_folder_is_a_damaged_pack(tmp_path, container_packs):
    path = copy_pack(container_packs["shards"], tmp_path)
    file = container_files(path)[1]
    file.unlink()
    file.mkdir()
    with pytest.raises(CorruptFileError, match="directory") as info:
        open_pack(path).field(10, 0)
    assert str(path / fmt.MANIFEST_NAME) in str(info.value)


# -- every refusal names the file and the field at fault, and says what to do ------------------
def _patch_header(path: Path, offset: int, value: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + len(value)] = value
    struct.pack_into("<I", data, 60, fmt.crc32(bytes(data[:60])))
    path.write_bytes(data)


def _patch_footer(path: Path, offset: int, value: bytes) -> None:
    data = bytearray(path.read_bytes())
    start = len(data) - fmt.FOOTER_SIZE
    data[start + offset : start + offset + len(value)] = value
    struct.pack_into("<I", data, start + 52, fmt.crc32(bytes(data[start : start + 52])))
    path.write_bytes(data)


def _index_entry_past_the_data(path: Path) -> None:
    data = bytearray(path.read_bytes())
    meta_offset = struct.unpack_from("<Q", data, len(data) - fmt.FOOTER_SIZE)[0]
    desc = json.loads(data[meta_offset : -fmt.FOOTER_SIZE])["index"]
    struct.pack_into("<Q", data, desc["offset"], meta_offset)  # record 0, field "a"
    path.write_bytes(data)
    index = bytes(data[desc["offset"] : desc["offset"] + desc["nbytes"]])
    rewrite_container(path, meta=lambda meta: meta["index"].update(crc32=fmt.crc32(index)))


def _array_into_the_metadata(path: Path) -> None:
    """An array from the first data byte to 8 bytes past the metadata's start, its crc32
    that of those bytes (the metadata's first 8 do not change with it)."""
    data = path.read_bytes()
    meta_offset = struct.unpack_from("<Q", data, len(data) - fmt.FOOTER_SIZE)[0]
    nbytes = meta_offset - fmt.HEADER_SIZE + 8
    desc = {"shape": [nbytes], "nbytes": nbytes, "offset": fmt.HEADER_SIZE}
    rewrite_container(path, meta=_array(**desc))
    crc = fmt.crc32(path.read_bytes()[fmt.HEADER_SIZE : fmt.HEADER_SIZE + nbytes])
    rewrite_container(path, meta=_array(**desc, crc32=crc))
    assert fmt.crc32(path.read_bytes()[fmt.HEADER_SIZE : fmt.HEADER_SIZE + nbytes]) == crc


def _array(**desc: Any) -> Callable[[dict[str, Any]], None]:
    base = {"dtype": "|u1", "shape": [0], "offset": 64, "nbytes": 0, "crc32": 0}
    return lambda meta: meta["arrays"].update(z={**base, **desc})


@pytest.mark.parametrize(
    ("damage", "fault"),
    [
        (lambda p: _patch_header(p, 12, struct.pack("<I", 128)), "header_size is 128, not 64"),
        (lambda p: _patch_header(p, 16, struct.pack("<I", 48)), "alignment 48 is not a power"),
        (
            lambda p: p.write_bytes(p.read_bytes()[:30] + b"\x01" + p.read_bytes()[31:]),
            "header checksum",
        ),
        (lambda p: p.write_bytes(b"GIF89a\0\0" + p.read_bytes()[8:]), "not a torch_serialized"),
        (lambda p: _patch_footer(p, 0, struct.pack("<Q", 8)), "meta_offset 8 and meta_length"),
        (lambda p: _patch_footer(p, 36, struct.pack("<HH", 1, 0)), "footer says format version"),
        (lambda p: _patch_footer(p, 24, struct.pack("<Q", 5)), "num_records is 1, not 5"),
        (lambda p: rewrite_container(p, meta=_set("format", "zip")), "format is 'zip'"),
        (lambda p: rewrite_container(p, meta=_set("fields", ["a", "a"])), "fields are"),
        (lambda p: rewrite_container(p, meta=_set("user", [])), "user is"),
        (lambda p: rewrite_container(p, meta=_set("arrays", 3)), "arrays is 3"),
        (lambda p: rewrite_container(p, meta=_set("index", {})), "descriptor of array 'index'"),
        (lambda p: rewrite_container(p, meta=_array(dtype="<U1")), "'z' has an invalid dtype"),
        (lambda p: rewrite_container(p, meta=_array(shape=[-1])), "descriptor of array 'z'"),
        (lambda p: rewrite_container(p, meta=_array(crc32=True)), "descriptor of array 'z'"),
        (lambda p: rewrite_container(p, meta=_array(nbytes=9)), "array 'z' .9 bytes at 64."),
        (_array_into_the_metadata, "array 'z' .* does not fit its shape or the file"),
        (lambda p: rewrite_container(p, meta=_array(per_record=1)), "per_record of array 'z'"),
        (
            lambda p: rewrite_container(p, meta=_array(per_record=True)),
            "per-record array 'z' has shape",
        ),
        (
            lambda p: rewrite_container(p, meta=lambda m: m["pack"].update(role="x")),
            "binding has role 'x'",
        ),
        (
            lambda p: rewrite_container(p, meta=lambda m: m["pack"].update(pack_id="AB")),
            "binding has pack_id 'AB'",
        ),
        (
            lambda p: rewrite_container(
                p, meta=lambda m: m["index"].update(dtype="|u1", shape=[24])
            ),
            "record index has dtype",
        ),
        (_index_entry_past_the_data, "places record 0 field 'a' at offset"),
        (lambda p: p.write_bytes(p.read_bytes() + bytes(7)), "truncated.* or appended to"),
        (lambda p: p.write_bytes(p.read_bytes()[:-1]), "truncated.* or appended to"),
    ],
)
def test_container_refusals_name_the_file_the_fault_and_what_to_do(tmp_path, damage, fault):
    path = _pack(tmp_path)
    damage(path)
    with pytest.raises(CorruptFileError, match=fault) as info:
        ContainerReader(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and message.endswith(fmt.DAMAGED)


@pytest.mark.parametrize(
    ("edit", "fault"),
    [
        (lambda m: m.update(format="x"), "format 'x'"),
        (lambda m: m.update(version=0), "version is 0"),
        (lambda m: m.update(fields=[]), "fields are"),
        (lambda m: m.update(shards=[]), "lists no shards"),
        (lambda m: m.update(num_records=9), "num_records is 9"),
        (lambda m: m.update(pack_id="x"), "pack_id is 'x'"),
        (lambda m: m.update(catalog=None), "catalog entry"),
        (lambda m: m["shards"][0].update(bytes=1), "shard entry 0"),
        (lambda m: m["shards"].append(m["shards"][0]), "shard entry 1|twice"),
    ],
)
def test_manifest_refusals_name_the_file_the_fault_and_what_to_do(edit, fault):
    catalog = mf.CatalogEntry("catalog-00000000.tser", 200, 1)
    shard = mf.ShardEntry("shard-00000-00000000.tser", 0, 1, 200, 1)
    manifest = json.loads(
        mf.build_manifest(
            created_by="t",
            pack_id=_PACK_ID,
            num_records=1,
            fields=["a"],
            catalog=catalog,
            shards=[shard],
        )
    )
    edit(manifest)
    manifest["checksum"] = mf.manifest_checksum(manifest)
    with pytest.raises(CorruptFileError, match=fault) as info:
        mf.parse_manifest(json.dumps(manifest).encode(), "/p/manifest.json")
    message = str(info.value)
    assert message.startswith("/p/manifest.json: ") and message.endswith(fmt.DAMAGED)


# -- the manifest checksum's canonical JSON: fixed, not a mutable module dict -----------------
def test_canonical_json_has_fixed_options():
    body = {"b": [1, "é"], "a": {"z": None, "y": "\n\x1f"}}
    assert mf.canonical_json(body) == '{"a":{"y":"\\n\\u001f","z":null},"b":[1,"é"]}'
    with pytest.raises(ValueError):
        mf.canonical_json({"x": float("nan")})
    assert not hasattr(fmt, "CANONICAL_JSON")  # a dict anyone could change: every checksum


# -- what docs/FORMAT.md leaves to readers, as the Python reader does it ----------------------
def test_per_record_is_optional_and_defaults_to_false(tmp_path):
    path = _pack(tmp_path)
    rewrite_container(path, meta=_array(shape=[0]))  # no per_record key
    reader = ContainerReader(path)
    assert "per_record" not in reader.meta["arrays"]["z"] and not reader.is_per_record("z")


def test_binding_keys_outside_the_role_are_ignored(tmp_path):
    path = _pack(tmp_path)
    rewrite_container(path, meta=lambda meta: meta["pack"].update(index=3, note="x"))
    assert set(ContainerReader(path).meta["pack"]) == {"pack_id", "role"}


def test_alignment_and_reserved_fields_are_not_checked_by_readers(tmp_path):
    path = _pack(tmp_path)
    data = bytearray(path.read_bytes())
    offset, length, _size, num, _crc = struct.unpack_from("<QQQQI", data, len(data) - 64)
    meta = json.loads(data[offset : offset + length])
    struct.pack_into("<I", data, meta["index"]["offset"] + 20, 5)  # record 0's reserved
    index = bytes(data[meta["index"]["offset"] :][: meta["index"]["nbytes"]])
    meta["index"]["crc32"] = fmt.crc32(index)
    raw = json.dumps(meta, separators=(",", ":")).encode()
    body = bytes(data[:offset]) + bytes(8) + raw  # the metadata 8 bytes past an aligned offset
    footer = struct.pack(
        "<QQQQIHH12x", offset + 8, len(raw), len(body) + 64, num, fmt.crc32(raw), 1, 1
    )
    path.write_bytes(body + footer + struct.pack("<I", fmt.crc32(footer)) + fmt.MAGIC)
    reader = ContainerReader(path)
    assert bytes(reader.field(0, 0)) == b"x" and reader.verify() == []


def test_a_lone_surrogate_is_read_but_never_written(tmp_path):
    assert fmt.loads_json(b'{"a": "\\ud800"}', "m", "metadata") == {"a": "\ud800"}
    with (
        pytest.raises(ValueError),
        PackWriter(tmp_path / "p.tser", ["a"]) as writer,
    ):
        writer.add([b"x"])
        writer.close({"a": "\ud800"})
