"""Reader rules of docs/FORMAT.md at their edges: strict-JSON integers, versions that must
agree, and what a refusal says (the file, the field at fault, what to do)."""

from __future__ import annotations

import json
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

from torch_serialized import format as fmt
from torch_serialized.errors import CorruptFileError, UnsupportedVersionError
from torch_serialized.reader import ContainerReader, PackReader, open_pack
from torch_serialized.writer import PackWriter

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
    catalog = fmt.CatalogEntry("catalog-00000000.tser", 200, 1)
    shard = fmt.ShardEntry("shard-00000-00000000.tser", 0, 1, 200, 1)
    data = fmt.build_manifest(
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
        fmt.parse_manifest(text.encode(), "/p/manifest.json")
    with pytest.raises(ValueError, match="integer"):
        fmt.build_manifest(
            created_by="t",
            pack_id=_PACK_ID,
            num_records=2**60,
            fields=["a"],
            catalog=catalog,
            shards=[fmt.ShardEntry("s.tser", 0, 2**60, 200, 1)],
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
        ({"meta": _set("format_version", [1, 0])}, r"format_version \[1, 0\]"),
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
    with pytest.raises(CorruptFileError, match="major version 0") as info:
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
