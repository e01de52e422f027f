"""VOCPackReader: a pack seen through the VOC schema, and refusals of what is not a VOC pack."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torchvision.datasets import VOCDetection

from torch_serialized.errors import FormatError
from torch_serialized.voc import schema
from torch_serialized.voc.reader import VOCPackReader
from torch_serialized.writer import PackWriter


def test_ids_splits_and_columns_are_the_source_s(synthetic_packs: Any) -> None:
    for layout in ("single", "shards"):
        pack = VOCPackReader(synthetic_packs.path(layout))
        assert pack.year == "2007" and pack.base_dir == "VOCdevkit/VOC2007"
        assert sorted(pack.image_sets("Main")) == ["test", "train", "trainval", "val"]
        tv = VOCDetection(synthetic_packs.root, "2007", "val")
        ids = [pack.id(int(r)) for r in pack.split("Main", "val")]
        assert ids == [Path(p).stem for p in tv.images]
        assert len(pack.columns) == len(pack) and set(pack.columns.dtype.names) >= {"width"}


def test_list_files_come_back_byte_for_byte(synthetic_packs: Any) -> None:
    files = VOCPackReader(synthetic_packs.single).files()
    voc = synthetic_packs.root / "VOCdevkit" / "VOC2007"
    on_disk = {p.relative_to(voc).as_posix() for p in (voc / "ImageSets").rglob("*.txt")}
    assert set(files) == on_disk
    for name, data in files.items():
        assert (voc / name).read_bytes() == data


def test_an_unknown_image_set_names_the_ones_there(synthetic_packs: Any) -> None:
    pack = VOCPackReader(synthetic_packs.single)
    with pytest.raises(ValueError, match=r"'nope' is not in .*'train'.*pick one of those"):
        pack.split("Main", "nope")


def forge(path: Path, fields: tuple[str, ...] = schema.FIELDS, **user: Any) -> Path:
    """A container whose user metadata is ``user`` (the VOC keys a reader needs by default)."""
    meta = {
        "schema": schema.SCHEMA,
        "schema_version": schema.SCHEMA_VERSION,
        "year": "2007",
        "base_dir": "VOCdevkit/VOC2007",
        "classes": [],
        "image_storage": "original",
        **user,
    }
    with PackWriter(path, fields) as writer:
        writer.add_array("ids", np.zeros(0, np.uint8))
        writer.close({k: v for k, v in meta.items() if v is not None})
    return path


def test_a_forged_minimal_pack_opens(tmp_path: Path) -> None:
    pack = VOCPackReader(forge(tmp_path / "ok.tser"))
    assert len(pack) == 0 and pack.classes == [] and pack.image_storage == "original"


@pytest.mark.parametrize(
    ("fields", "user", "message"),
    [
        (schema.FIELDS, {"schema": None}, "not a VOC pack"),
        (schema.FIELDS, {"schema": "coco"}, "not a VOC pack"),
        (schema.FIELDS, {"schema_version": schema.SCHEMA_VERSION + 1}, "newer than this"),
        (schema.FIELDS, {"schema_version": "1"}, "VOC schema version"),
        (("image", "target"), {}, "unexpected fields"),
    ],
)
def test_what_is_not_a_voc_pack_is_refused(
    tmp_path: Path, fields: tuple[str, ...], user: dict[str, Any], message: str
) -> None:
    path = forge(tmp_path / "x.tser", fields, **user)
    with pytest.raises(FormatError, match=message) as info:
        VOCPackReader(path)
    assert str(path) in str(info.value)
