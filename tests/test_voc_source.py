"""voc.source: which ids a pack stores, in which order, and loading one id's files."""

from __future__ import annotations

from pathlib import Path

import pytest
from _container_helpers import (
    no_pack_output,
)
from vocfactory import (
    tiny_devkit,
)

import torch_serialized as ts
from torch_serialized.voc.reader import VOCPackReader


def test_missing_image_names_file_and_list_line(tmp_path: Path) -> None:
    root = tiny_devkit(tmp_path / "src", ["a", "b", "c"])
    (root / "VOCdevkit/VOC2007/JPEGImages/b.jpg").unlink()
    with pytest.raises(ts.SourceDataError) as info:
        ts.pack_voc(root, tmp_path / "out.tser", year="2007")
    message = str(info.value)
    assert "b.jpg" in message and "ImageSets/Main/train.txt line 2" in message
    assert isinstance(info.value, ValueError)
    no_pack_output(tmp_path)


def test_unreadable_file_is_reported(tmp_path: Path) -> None:
    root = tiny_devkit(tmp_path / "src", ["a", "b"])
    xml = root / "VOCdevkit/VOC2007/Annotations/a.xml"
    xml.unlink()
    xml.mkdir()  # reading a folder fails even as root, unlike chmod 000
    with pytest.raises(ts.SourceDataError, match=r"a\.xml.*cannot read"):
        ts.pack_voc(root, tmp_path / "out.tser", year="2007")


def test_absent_optional_files_are_not_opened(
    corner_devkit: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Masks (and annotations of Segmentation-only ids) that the folder listing lacks are never
    opened (a failed open per sample costs time, see benchmarks/README.md). The samples stay
    torchvision's (the drop-in tests check every one of them on this devkit)."""
    from torch_serialized.voc import source

    failed: list[str] = []
    real_open = open

    def logged_open(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return real_open(path, *args, **kwargs)
        except FileNotFoundError:
            failed.append(str(path))
            raise

    monkeypatch.setattr(source, "open", logged_open, raising=False)
    result = ts.pack_voc(corner_devkit, tmp_path / "p.tser", year=None)
    assert result.num_samples > 0
    assert failed == []
    pack = VOCPackReader(result.path)
    flags = pack.columns["flags"]
    from torch_serialized.voc import schema

    assert (flags & schema.HAS_MASK).any() and not (flags & schema.HAS_MASK).all()
    assert (flags & schema.HAS_OBJECT_MASK).any()
