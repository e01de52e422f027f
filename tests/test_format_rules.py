"""Reader rules of docs/FORMAT.md at their edges: strict-JSON integers, versions that must
agree, and what a refusal says (the file, the field at fault, what to do)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from torch_serialized import format as fmt
from torch_serialized.errors import CorruptFileError
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
