"""The original design's API: Serializer packs a VOC20xx folder, SerializedDataset reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import torch_serialized as ts
from torch_serialized.voc.packed import VOCPackReader


def test_serializer_packs_the_voc_folder_itself(synthetic_devkit: Path, tmp_path: Path) -> None:
    voc = synthetic_devkit / "VOCdevkit" / "VOC2007"
    result = ts.Serializer(voc, tmp_path / "out.tser").serialize()
    assert VOCPackReader(result.path).year == "2007"  # the folder's name gives the year
    sample = ts.SerializedDataset(result.path).get_sample(0)
    assert sample["image"].dtype == np.uint8 and sample["image"].ndim == 3
    assert "annotation" in sample["target"]


def test_serializer_passes_options_to_pack_voc(synthetic_devkit: Path, tmp_path: Path) -> None:
    voc = synthetic_devkit / "VOCdevkit" / "VOC2007"
    result = ts.Serializer(voc, tmp_path / "shards", max_samples_per_shard=5).serialize()
    assert result.path.is_dir() and len(list(result.path.glob("shard-*.tser"))) > 1


def test_serialized_dataset_returns_every_sample_in_storage_order(synthetic_packs: Any) -> None:
    dataset = ts.SerializedDataset(synthetic_packs.single)
    pack = VOCPackReader(synthetic_packs.single)
    assert len(dataset) == len(pack)
    for i in (0, len(dataset) - 1, -1):
        sample = dataset[i]
        record = range(len(pack))[i]
        assert sample["id"] == pack.id(record)
        assert sample["image"].shape[:2] == tuple(
            int(pack.columns[record][k]) for k in ("height", "width")
        )
    with pytest.raises(IndexError):
        dataset.get_sample(len(dataset))


def test_samples_without_annotation_have_an_empty_target(corner_packs: Any) -> None:
    dataset = ts.SerializedDataset(corner_packs.single)
    flags = VOCPackReader(corner_packs.single).columns["flags"]
    bare = [i for i, f in enumerate(flags) if not f & 1]
    assert bare, "the corner-case devkit has Segmentation-only ids without XML"
    assert dataset[bare[0]]["target"] == {}
