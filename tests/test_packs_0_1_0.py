"""Packs written by torch_serialized 0.1.0 stay readable: a long-lived storage format.

``tests/data/v1`` holds golden packs of a six-image devkit written by 0.1.0 (format 1.0,
manifest version 1, VOC schema 1) and that devkit. Every sample they give must equal
torchvision's on the devkit and a fresh pack's; what a version-1 manifest can be checked
against (the copy of its metadata in the last shard) is checked.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.datasets import VOCDetection, VOCSegmentation

import torch_serialized
from torch_serialized import (
    CorruptFileError,
    VOCSerializedDataset,
    VOCSerializedIterableDataset,
    VOCSerializedSegmentation,
    export_voc,
    open_pack,
    pack_voc,
)
from torch_serialized.cli import main
from torch_serialized.container import spec as fmt

DATA = Path(__file__).resolve().parent / "data" / "v1"
DEVKIT = DATA / "devkit"
PACKS = {"single": DATA / "tiny.tser", "shards": DATA / "tiny-shards"}


def same(a: object, b: object) -> bool:
    if hasattr(a, "tobytes") and hasattr(b, "tobytes"):  # PIL images
        return a.size == b.size and a.mode == b.mode and a.tobytes() == b.tobytes()  # type: ignore[attr-defined]
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def test_the_golden_packs_are_what_0_1_0_wrote() -> None:
    manifest = json.loads((PACKS["shards"] / fmt.MANIFEST_NAME).read_text())
    assert manifest["version"] == 1 and manifest["created_by"] == "torch_serialized 0.1.0"
    for form, path in PACKS.items():
        reader = open_pack(path)
        assert reader.version == (1, 0) and len(reader) == 6, form
        assert reader.verify() == []
        assert (reader.manifest is None) == (form == "single")


def test_packs_written_now_do_not_claim_0_1_0(tmp_path: Path) -> None:
    """A format-1.1 pack said "torch_serialized 0.1.0" (the version was never raised after
    the release), so nobody could tell it from a pack 0.1.0 wrote (format 1.0)."""
    path = pack_voc(DEVKIT, tmp_path / "shards", year="2007", max_samples_per_shard=2).path
    reader = open_pack(path)
    manifest = json.loads((path / fmt.MANIFEST_NAME).read_text())
    assert reader.version == (fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR) != (1, 0)
    written_by = {manifest["created_by"], reader.user["packed_by"]}
    assert written_by == {f"torch_serialized {torch_serialized.__version__}"}
    assert "torch_serialized 0.1.0" not in written_by


@pytest.mark.parametrize("form", sorted(PACKS))
@pytest.mark.parametrize("image_set", ["train", "val", "trainval"])
def test_every_sample_equals_torchvision_and_a_fresh_pack(
    tmp_path: Path, form: str, image_set: str
) -> None:
    fresh = pack_voc(DEVKIT, tmp_path / "fresh", year="2007", max_samples_per_shard=2).path
    tv = VOCDetection(str(DEVKIT), year="2007", image_set=image_set)
    old = VOCSerializedDataset(PACKS[form], image_set=image_set)
    new = VOCSerializedDataset(fresh, image_set=image_set)
    assert len(old) == len(tv) == len(new) > 0
    for i in range(len(tv)):
        want = tv[i]
        for got in (old[i], new[i]):
            assert same(got[0], want[0]) and got[1] == want[1]
    stream = list(VOCSerializedIterableDataset(PACKS[form], image_set))
    assert [t for _, t in stream] == [tv[i][1] for i in range(len(tv))]
    tensors = VOCSerializedDataset(PACKS[form], image_set=image_set, target_format="tv_tensors")
    fresh_tensors = VOCSerializedDataset(fresh, image_set=image_set, target_format="tv_tensors")
    for i in range(len(tv)):
        a, b = tensors[i][1], fresh_tensors[i][1]
        assert all(torch.equal(a[k], b[k]) for k in ("boxes", "labels", "difficult"))


@pytest.mark.parametrize("form", sorted(PACKS))
def test_segmentation_equals_torchvision(form: str) -> None:
    tv = VOCSegmentation(str(DEVKIT), year="2007", image_set="train")
    ours = VOCSerializedSegmentation(PACKS[form], image_set="train")
    assert len(ours) == len(tv) == 1
    (image, mask), (tv_image, tv_mask) = ours[0], tv[0]
    assert same(image, tv_image) and same(mask.convert("P"), tv_mask.convert("P"))
    assert mask.getpalette() == tv_mask.getpalette()


@pytest.mark.parametrize("form", sorted(PACKS))
def test_export_and_info_of_a_0_1_0_pack(
    tmp_path: Path, form: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = export_voc(PACKS[form], tmp_path / "out")
    source = DEVKIT / "VOCdevkit" / "VOC2007"
    exported = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert exported == {
        p.relative_to(source): p.read_bytes() for p in source.rglob("*") if p.is_file()
    }
    assert main(["info", str(PACKS[form])]) == 0
    assert "torch_serialized 1.0, schema voc 1" in capsys.readouterr().out
    assert main(["verify", str(PACKS[form])]) == 0


def test_an_edited_version_1_manifest_is_caught_by_the_last_shards_copy(tmp_path: Path) -> None:
    """A version-1 manifest has no checksum, but its metadata is also in the last shard: a
    class renamed in the manifest alone would have relabelled every object silently."""
    folder = tmp_path / "v1"
    shutil.copytree(PACKS["shards"], folder)
    manifest = json.loads((folder / fmt.MANIFEST_NAME).read_text())
    manifest["user"]["classes"] = ["cat", "dog", "person"][::-1]
    (folder / fmt.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CorruptFileError, match="metadata differs from") as info:
        VOCSerializedDataset(folder, image_set="train")
    assert str(folder / fmt.MANIFEST_NAME) in str(info.value)
    assert "shard-00002.tser" in str(info.value)


def test_a_0_1_0_pack_is_replaced_by_a_new_pack(tmp_path: Path) -> None:
    for form, path in PACKS.items():
        target = tmp_path / path.name
        (shutil.copytree if form == "shards" else shutil.copyfile)(path, target)
        limits = {"max_samples_per_shard": 2} if form == "shards" else {}
        pack_voc(DEVKIT, target, year="2007", **limits)
        assert open_pack(target).version == (fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR)
        assert np.array_equal(
            open_pack(target).arrays()["records"], open_pack(path).arrays()["records"]
        )
