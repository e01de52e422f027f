"""Contracts of the synthetic VOC generator: deterministic bytes, torchvision-readable, VOC-like."""

from __future__ import annotations

import re
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torchvision.datasets import VOCDetection, VOCSegmentation

from torch_serialized.tools import make_synthetic_voc
from torch_serialized.voc.classes import VOC_CLASSES, VOC_PALETTE

VOC_SIZES = {(500, 375), (375, 500), (500, 333), (333, 500), (500, 500), (400, 300), (500, 400),
             (500, 334), (353, 500)}  # fmt: skip


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _box(element: ET.Element) -> list[int]:
    return [int(element.findtext(f"bndbox/{t}", "")) for t in ("xmin", "ymin", "xmax", "ymax")]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


@pytest.fixture(scope="module")
def voc40(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 images at the default settings (every 4th image segmented)."""
    root = make_synthetic_voc(tmp_path_factory.mktemp("voc40"), 40)
    return root / "VOCdevkit" / "VOC2012"


def test_byte_identical_and_independent_of_count(tmp_path: Path) -> None:
    a = _files(make_synthetic_voc(tmp_path / "a", 6, seed=3, segmentation_every=2))
    b = _files(make_synthetic_voc(tmp_path / "b", 6, seed=3, segmentation_every=2))
    assert a == b and len(a) == 6 * 2 + 3 * 2 + 3 + 3
    # Image i depends on (seed, i) only: a longer run draws the same first images.
    longer = make_synthetic_voc(tmp_path / "c", 9, seed=3, segmentation_every=2)
    jpegs = sorted((longer / "VOCdevkit" / "VOC2012" / "JPEGImages").iterdir())
    assert [p.read_bytes() for p in jpegs[:6]] == [v for k, v in a.items() if k.endswith(".jpg")]
    other = _files(make_synthetic_voc(tmp_path / "d", 6, seed=4, segmentation_every=2))
    jpeg = {v for k, v in a.items() if k.endswith(".jpg")}
    assert len(other) == len(a) and not jpeg & set(other.values())


@pytest.mark.parametrize("year", ["2012", "2007", "2011"])
def test_torchvision_reads_every_sample(tmp_path: Path, year: str) -> None:
    root = make_synthetic_voc(tmp_path, 8, year=year, segmentation_every=2)
    image_sets = ["train", "val", "trainval"] + (["test"] if year == "2007" else [])
    for image_set in image_sets:
        det = VOCDetection(root, year=year, image_set=image_set)
        seg = VOCSegmentation(root, year=year, image_set=image_set)
        assert len(det) > 0 and len(seg) > 0
        for image, target in det:
            ann = target["annotation"]
            assert image.size == (int(ann["size"]["width"]), int(ann["size"]["height"]))
            assert isinstance(ann["object"], list) and 1 <= len(ann["object"]) <= 6
            assert ann["folder"] == f"VOC{year}" and ann["segmented"] in {"0", "1"}
        for image, mask in seg:
            with mask:  # torchvision returns the mask lazily opened
                assert image.mode == "RGB" and mask.mode == "P" and mask.size == image.size


def test_image_sets(voc40: Path) -> None:
    for kind in ("Main", "Segmentation"):
        folder = voc40 / "ImageSets" / kind
        train, val = _lines(folder / "train.txt"), _lines(folder / "val.txt")
        assert not set(train) & set(val)
        assert _lines(folder / "trainval.txt") == sorted(train + val)
    main = _lines(voc40 / "ImageSets" / "Main" / "trainval.txt")
    assert len(main) == 40 and len(_lines(voc40 / "ImageSets" / "Main" / "val.txt")) == 20
    assert all(re.fullmatch(r"20(0[89]|1[01])_\d{6}", i) for i in main)
    assert len(_lines(voc40 / "ImageSets" / "Segmentation" / "trainval.txt")) == 10


def test_2007_ids_and_test_split(tmp_path: Path) -> None:
    voc = make_synthetic_voc(tmp_path, 8, year="2007", segmentation_every=0) / "VOCdevkit/VOC2007"
    main = voc / "ImageSets" / "Main"
    ids = _lines(main / "trainval.txt") + _lines(main / "test.txt")
    assert len(ids) == 8 and all(re.fullmatch(r"\d{6}", i) for i in ids)
    assert len(_lines(main / "test.txt")) == 4
    assert not (voc / "ImageSets" / "Segmentation").exists()


def test_jpeg_sizes_are_voc_like(voc40: Path) -> None:
    jpegs = sorted((voc40 / "JPEGImages").glob("*.jpg"))
    kb = [p.stat().st_size / 1000 for p in jpegs]
    assert 80 <= statistics.median(kb) <= 130, kb
    assert min(kb) >= 40 and max(kb) <= 200, kb
    for p in jpegs:
        with Image.open(p) as im:
            assert im.format == "JPEG" and im.mode == "RGB" and im.size in VOC_SIZES


def test_annotations_follow_voc_schema(voc40: Path) -> None:
    counts, difficult, truncated, parts = [], 0, 0, 0
    for path in sorted((voc40 / "Annotations").glob("*.xml")):
        root = ET.parse(path).getroot()
        assert [c.tag for c in root][:6] == ["folder", "filename", "source", "size", "segmented",
                                             "object"]  # fmt: skip
        assert root.findtext("filename") == path.stem + ".jpg"
        assert root.findtext("source/database", "").startswith("The VOC")
        width, height = int(root.findtext("size/width", "")), int(root.findtext("size/height", ""))
        with Image.open(voc40 / "JPEGImages" / f"{path.stem}.jpg") as im:
            assert im.size == (width, height) and root.findtext("size/depth") == "3"
        segmented = (voc40 / "SegmentationClass" / f"{path.stem}.png").exists()
        assert root.findtext("segmented") == str(int(segmented))
        objects = root.findall("object")
        counts.append(len(objects))
        for obj in objects:
            assert obj.findtext("name") in VOC_CLASSES
            assert obj.findtext("pose") in {"Unspecified", "Left", "Right", "Frontal", "Rear"}
            assert obj.findtext("truncated") in {"0", "1"}
            assert obj.findtext("occluded") in {None, "0", "1"}
            difficult += obj.findtext("difficult") == "1"
            truncated += obj.findtext("truncated") == "1"
            box = _box(obj)
            assert 1 <= box[0] < box[2] <= width and 1 <= box[1] < box[3] <= height
            parts += len(obj.findall("part"))
            for part in obj.findall("part"):
                assert obj.findtext("name") == "person"
                assert part.findtext("name") in {"head", "hand", "foot"}
                p = _box(part)
                assert box[0] <= p[0] < p[2] <= box[2] and box[1] <= p[1] < p[3] <= box[3]
    assert min(counts) >= 1 and max(counts) <= 6 and len(set(counts)) > 2
    assert difficult > 0 and truncated > 0 and parts > 0  # what the readers' tests need


def test_masks_use_voc_palette(voc40: Path) -> None:
    masks = sorted((voc40 / "SegmentationClass").glob("*.png"))
    assert len(masks) == 10
    for path in masks:
        xml = ET.parse(voc40 / "Annotations" / f"{path.stem}.xml").getroot()
        names = {VOC_CLASSES.index(o.findtext("name", "")) + 1 for o in xml.findall("object")}
        with Image.open(voc40 / "JPEGImages" / f"{path.stem}.jpg") as image:
            image_size = image.size
        with Image.open(path) as cls, Image.open(voc40 / "SegmentationObject" / path.name) as obj:
            for mask in (cls, obj):
                assert mask.mode == "P" and mask.size == image_size
                assert bytes(mask.getpalette() or []) == VOC_PALETTE
            values = set(np.unique(np.asarray(cls)).tolist())
            assert values <= names | {0, 255} and 255 in values and len(values & names) > 0
            instances = set(np.unique(np.asarray(obj)).tolist())
            assert instances <= set(range(len(xml.findall("object")) + 1)) | {255}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"year": "2013"}, "year"),
        ({"num_images": 0}, "num_images=0"),
        ({"seed": -1}, "seed=-1"),
        ({"segmentation_every": -1}, "segmentation_every=-1"),
    ],
)
def test_rejects_bad_arguments(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_synthetic_voc(tmp_path, **kwargs)  # type: ignore[arg-type]
