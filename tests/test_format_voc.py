"""docs/FORMAT.md's "VOC packs" section is enough to read a VOC sample without our code.

An independent reader (``parse_container``, written from FORMAT.md) follows the section's
recipe, sample ``i`` of an image set to record ``split[i]`` to its fields, and must give
torchvision's bytes, targets and boxes; the section's tables must name the schema's fields,
columns, object rows and metadata keys as ``voc/schema.py`` and ``pack_voc`` write them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _container_helpers import parse_container
from test_format import section, tables
from torchvision.datasets import VOCDetection

from torch_serialized import VOCSerializedDataset, pack_voc
from torch_serialized.tools import make_synthetic_voc
from torch_serialized.voc import schema


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = make_synthetic_voc(tmp_path_factory.mktemp("voc") / "root", num_images=12)
    return root, pack_voc(root, root.parent / "voc.tser").path


def _array(data: bytes, meta: dict[str, Any], name: str) -> np.ndarray:
    """An array from its descriptor, as FORMAT.md's *Array descriptors* say."""
    desc = meta["arrays"][name]
    code = desc["dtype"]
    dtype = np.dtype([tuple(pair) for pair in code] if isinstance(code, list) else code)
    raw = data[desc["offset"] : desc["offset"] + desc["nbytes"]]
    return np.frombuffer(raw, dtype).reshape(desc["shape"])


def _column(title: str, n: int, column: str) -> list[str]:
    return [row[column] for row in tables(section(title))[n]]


def test_record_fields_and_object_rows_match_the_schema() -> None:
    assert _column("Record fields", 0, "Field") == list(schema.FIELDS)
    assert _column("Record fields", 0, "k") == [str(k) for k in range(len(schema.FIELDS))]
    text = section("Record fields")
    assert f"one {schema.OBJECT_DTYPE.itemsize}-byte row" in text
    row = re.search(r"An `objects` row.*?\n\n", text, re.S)
    assert row is not None
    spelled = re.findall(r"`(\w+)` (\d )?(?:× )?(float32|int32|uint8|uint16)", row.group(0))
    codes = {"float32": "<f4", "int32": "<i4", "uint8": "|u1", "uint16": "<u2"}
    documented = [(name, codes[kind]) for name, _, kind in spelled]
    actual = [(name, schema.OBJECT_DTYPE[name].base.str) for name in schema.OBJECT_DTYPE.names]
    assert documented == actual
    assert schema.OBJECT_DTYPE["box"].shape == (4,) and "4 × float32" in row.group(0)


def test_arrays_and_columns_match_the_schema(packed: tuple[Path, Path]) -> None:
    rows = {row["Name"]: row for row in tables(section("Dataset arrays"))[0]}
    assert list(rows)[:2] == ["records", "ids`, `id_offsets"]
    columns = rows["records"]["Type"] + rows["records"]["Meaning"]
    assert re.findall(r"`(\w+)`", rows["records"]["Type"]) == list(schema.COLUMNS.names)
    assert all(schema.COLUMNS[name].str == "<u4" for name in schema.COLUMNS.names)
    assert "each uint32" in columns
    flags = {
        "1 has an annotation": schema.HAS_ANNOTATION,
        "2 a class mask": schema.HAS_MASK,
        "4 an object mask": schema.HAS_OBJECT_MASK,
    }
    for spelled, value in flags.items():
        assert spelled.startswith(f"{value} ") and spelled in columns
    meta, _ = parse_container(packed[1])
    written = set(meta["arrays"])
    assert {"records", "ids", "id_offsets"} <= written
    assert {"split/TASK/SET", "file/PATH"} <= set(rows)
    assert any(n.startswith("split/Main/") for n in written)
    assert any(n.startswith("file/") for n in written)


def test_metadata_keys_are_documented(packed: tuple[Path, Path]) -> None:
    meta, _ = parse_container(packed[1])
    documented: set[str] = set()
    for cell in _column("Metadata (`user`)", 0, "Key"):
        documented |= {key.strip(" `") for key in cell.split(",")}
    appended = {
        row["Name"] for row in tables(section("Source statistics, retired records, history"))[0]
    }
    missing = set(meta["user"]) - documented - appended
    assert not missing, f"keys pack_voc writes that FORMAT.md does not describe: {missing}"


@pytest.mark.parametrize("image_set", ["train", "trainval"])
def test_the_documented_recipe_reads_torchvisions_samples(
    packed: tuple[Path, Path], image_set: str
) -> None:
    """Sample ``i``: ``r = split/Main/SET[i]``, fields 0 and 4 (and 5) of record ``r``."""
    root, path = packed
    data = path.read_bytes()
    meta, index = parse_container(path)
    user = meta["user"]
    split = _array(data, meta, f"split/Main/{image_set}")
    ids, offsets = _array(data, meta, "ids"), _array(data, meta, "id_offsets")
    objects_dtype = np.dtype(
        [
            ("box", "<f4", (4,)),
            ("class_id", "<i4"),
            ("difficult", "u1"),
            ("truncated", "u1"),
            ("reserved", "<u2"),
        ]
    )  # spelled from FORMAT.md's "An `objects` row"
    tv = VOCDetection(str(root), year=user["year"], image_set=image_set)
    ours = VOCSerializedDataset(
        path, image_set=image_set, decode="none", target_format="tv_tensors", classes="packed"
    )
    assert len(split) == len(tv) == user["splits"]["Main"][image_set]
    for i, r in enumerate(split.tolist()):

        def field(k: int, r: int = r) -> bytes:
            entry = index[r, k]
            return data[int(entry["offset"]) : int(entry["offset"]) + int(entry["length"])]

        record_id = bytes(ids[int(offsets[r]) : int(offsets[r + 1])]).decode("utf-8")
        assert tv.images[i].endswith(f"/{record_id}.jpg")
        assert field(0) == Path(tv.images[i]).read_bytes()
        assert json.loads(field(4)) == tv[i][1]
        rows = np.frombuffer(field(5), objects_dtype)
        names = [user["classes"][c] for c in rows["class_id"]]
        assert names == [o["name"] for o in tv[i][1]["annotation"]["object"]]
        boxes = [
            [float(o["bndbox"][k]) for k in ("xmin", "ymin", "xmax", "ymax")]
            for o in tv[i][1]["annotation"]["object"]
        ]
        assert rows["box"].tolist() == boxes
        assert rows["box"].tolist() == ours[i][1]["boxes"].tolist()
