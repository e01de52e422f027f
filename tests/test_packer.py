"""pack_voc: layout, options, determinism, and clear failures on bad source data."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _container_helpers import pack_file_bytes
from PIL import Image
from torchvision.datasets import VOCDetection, VOCSegmentation
from vocfactory import Sample, jpeg, obj, voc_xml, write_voc

import torch_serialized as ts
from torch_serialized.tools import make_synthetic_voc
from torch_serialized.voc.images import jpeg_size
from torch_serialized.voc.reader import VOCPackReader


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_synthetic_voc(tmp_path_factory.mktemp("syn"), 24, year="2007", seed=3)


def _tiny_devkit(root: Path, ids: list[str], **overrides: bytes | None) -> Path:
    """A 2007 devkit whose ids all have a small JPEG and XML; overrides replace files."""
    samples = []
    for i, image_id in enumerate(ids):
        image = overrides.get(f"{image_id}.jpg", jpeg(32, 24, seed=i))
        xml = overrides.get(
            f"{image_id}.xml", voc_xml(f"{image_id}.jpg", 32, 24, [obj("dog", (1, 2, 20, 20))])
        )
        samples.append(Sample(image_id, image, xml))  # type: ignore[arg-type]
    write_voc(root, "2007", samples, {"Main": {"train": ids, "val": ids[:1]}})
    return root


_FULL = jpeg(200, 150, seed=1)
_TRUNCATED = _FULL[: len(_FULL) // 2]  # header intact, scan data cut


def _no_output(folder: Path) -> None:
    leftovers = [p.name for p in folder.iterdir() if p.name.startswith((".out", "out"))]
    assert leftovers == []


def test_one_pack_serves_every_image_set(synthetic: Path, tmp_path: Path) -> None:
    result = ts.pack_voc(synthetic, tmp_path / "out.tser", year="2007")
    pack = VOCPackReader(result.path)
    ids = {pack.id(i) for i in range(len(pack))}
    assert len(ids) == len(pack) == result.num_samples  # each id stored once
    for image_set in ("train", "val", "trainval", "test"):
        tv = VOCDetection(synthetic, "2007", image_set)
        expected = [Path(p).stem for p in tv.images]
        assert [pack.id(int(r)) for r in pack.split("Main", image_set)] == expected
    assert pack.meta["splits"]["Main"]["trainval"] == len(
        VOCDetection(synthetic, "2007", "trainval")
    )


def test_voc_folder_itself_gives_the_year(synthetic: Path, tmp_path: Path) -> None:
    result = ts.Serializer(synthetic / "VOCdevkit" / "VOC2007", tmp_path / "out.tser").serialize()
    assert VOCPackReader(result.path).year == "2007"
    sample = ts.SerializedDataset(result.path).get_sample(0)
    assert sample["image"].dtype == np.uint8 and sample["image"].ndim == 3
    assert "annotation" in sample["target"]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_samples_per_shard": 5},  # shard ends inside worker chunks
        {"max_shard_bytes": 400_000},
        {"image_storage": "raw", "max_size": 64},
        {"on_error": "skip", "check_images": True},
    ],
    ids=["file", "shards-by-count", "shards-by-size", "raw-resized", "skip"],
)
def test_parallel_pack_is_byte_identical(
    synthetic: Path, tmp_path: Path, options: dict[str, Any]
) -> None:
    """Workers lay records out in scratch files and copy them into holes the writer leaves:
    every byte, padding and shard boundaries included, must equal a one-process pack."""
    if options.get("on_error") == "skip":  # a bad sample in the middle of a worker chunk
        source = tmp_path / "src"
        shutil.copytree(synthetic, source)
        jpegs = sorted((source / "VOCdevkit/VOC2007/JPEGImages").iterdir())
        jpegs[len(jpegs) // 2].write_bytes(_TRUNCATED)
        synthetic = source
    one = ts.pack_voc(synthetic, tmp_path / "one", year="2007", **options)
    assert bool(one.skipped) == ("on_error" in options)
    for workers in (2, 3):
        many = ts.pack_voc(
            synthetic, tmp_path / f"w{workers}", year="2007", workers=workers, **options
        )
        assert pack_file_bytes(many.path) == pack_file_bytes(one.path)
        assert many.skipped == one.skipped
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_parallel_pack_fails_cleanly(tmp_path: Path) -> None:
    ids = [f"{i:03d}" for i in range(40)]
    root = _tiny_devkit(tmp_path / "src", ids)
    (root / "VOCdevkit/VOC2007/JPEGImages/027.jpg").unlink()
    with pytest.raises(ts.SourceDataError) as info:
        ts.pack_voc(root, tmp_path / "out.tser", year="2007", workers=2)
    assert "027.jpg" in str(info.value) and "train.txt line 28" in str(info.value)
    _no_output(tmp_path)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_shards_hold_the_same_samples(synthetic: Path, tmp_path: Path) -> None:
    single = ts.pack_voc(synthetic, tmp_path / "one.tser", year="2007")
    sharded = ts.pack_voc(synthetic, tmp_path / "shards", year="2007", max_samples_per_shard=5)
    assert (sharded.path / "manifest.json").is_file()
    assert len(list(sharded.path.glob("*.tser"))) == -(-single.num_samples // 5)
    a = ts.VOCSerializedDataset(single.path, "trainval")
    b = ts.VOCSerializedDataset(sharded.path, "trainval")
    assert len(a) == len(b)
    for i in range(len(a)):
        assert a[i][1] == b[i][1]
        assert a[i][0].tobytes() == b[i][0].tobytes()
    by_bytes = ts.pack_voc(synthetic, tmp_path / "sized", year="2007", max_shard_bytes=400_000)
    assert len(list(by_bytes.path.glob("*.tser"))) > 2
    assert len(ts.VOCSerializedDataset(by_bytes.path, "test")) == len(
        VOCDetection(synthetic, "2007", "test")
    )


def test_raw_storage_returns_torchvision_pixels(synthetic: Path, tmp_path: Path) -> None:
    raw = ts.pack_voc(synthetic, tmp_path / "raw.tser", year="2007", image_storage="raw")
    tv = VOCDetection(synthetic, "2007", "train")
    ours = ts.VOCSerializedDataset(raw.path, "train")
    tensors = ts.VOCSerializedDataset(raw.path, "train", decode="tensor")
    for i in range(len(tv)):
        image, target = tv[i]
        mine, my_target = ours[i]
        assert mine.mode == "RGB" and mine.size == image.size
        assert mine.tobytes() == image.tobytes() and my_target == target
        chw = tensors[i][0]
        assert chw.shape == (3, image.height, image.width)
        assert np.array_equal(chw.permute(1, 2, 0).numpy(), np.asarray(image))


def test_max_size_scales_images_boxes_and_sizes(synthetic: Path, tmp_path: Path) -> None:
    small = ts.pack_voc(synthetic, tmp_path / "small.tser", year="2007", max_size=128)
    tv = VOCDetection(synthetic, "2007", "train")
    ours = ts.VOCSerializedDataset(small.path, "train")
    fast = ts.VOCSerializedDataset(small.path, "train", target_format="tv_tensors")
    for i in range(len(tv)):
        image, target = tv[i]
        mine, my_target = ours[i]
        scale = 128 / max(image.size)
        assert max(mine.size) == 128
        assert abs(mine.width - image.width * scale) <= 1
        size = my_target["annotation"]["size"]
        assert (int(size["width"]), int(size["height"])) == mine.size
        boxes = fast[i][1]["boxes"]
        assert tuple(boxes.canvas_size) == (mine.height, mine.width)
        original = [
            [float(o["bndbox"][k]) for k in ("xmin", "ymin", "xmax", "ymax")]
            for o in target["annotation"]["object"]
        ]
        sx, sy = mine.width / image.width, mine.height / image.height
        expected = np.array(original, dtype=np.float32) * np.array([sx, sy, sx, sy], np.float32)
        assert np.allclose(boxes.numpy(), expected, atol=1e-3)
        dict_boxes = [
            [float(o["bndbox"][k]) for k in ("xmin", "ymin", "xmax", "ymax")]
            for o in my_target["annotation"]["object"]
        ]
        assert np.allclose(dict_boxes, expected, atol=0.01)


def test_missing_image_names_file_and_list_line(tmp_path: Path) -> None:
    root = _tiny_devkit(tmp_path / "src", ["a", "b", "c"])
    (root / "VOCdevkit/VOC2007/JPEGImages/b.jpg").unlink()
    with pytest.raises(ts.SourceDataError) as info:
        ts.pack_voc(root, tmp_path / "out.tser", year="2007")
    message = str(info.value)
    assert "b.jpg" in message and "ImageSets/Main/train.txt line 2" in message
    assert isinstance(info.value, ValueError)
    _no_output(tmp_path)


def test_missing_annotation_fails_and_skip_mode_reports(tmp_path: Path) -> None:
    root = _tiny_devkit(tmp_path / "src", ["a", "b", "c"])
    (root / "VOCdevkit/VOC2007/Annotations/c.xml").unlink()
    with pytest.raises(ts.SourceDataError, match=r"c\.xml"):
        ts.pack_voc(root, tmp_path / "out.tser", year="2007")
    _no_output(tmp_path)
    result = ts.pack_voc(root, tmp_path / "out.tser", year="2007", on_error="skip")
    assert [s.id for s in result.skipped] == ["c"] and "c.xml" in result.skipped[0].reason
    assert result.report is not None
    assert json.loads(result.report.read_text())[0]["id"] == "c"
    assert ts.VOCSerializedDataset(result.path, "train").ids == ["a", "b"]


@pytest.mark.parametrize(
    ("name", "content", "check_images", "expected"),
    [
        ("b.jpg", b"this is not an image", False, "not a readable image"),
        ("b.jpg", _TRUNCATED, True, "not a readable image"),
        ("b.xml", b"<annotation><object></annotation>", False, "line 1"),
        (
            "b.xml",
            b'<?xml version="1.0"?><!DOCTYPE a [<!ENTITY x "xx"><!ENTITY y "&x;&x;">]>'
            b"<annotation>&y;</annotation>",
            False,
            "entit",
        ),
    ],
)
def test_bad_files_fail_fast_with_the_file_named(
    tmp_path: Path, name: str, content: bytes, check_images: bool, expected: str
) -> None:
    root = _tiny_devkit(tmp_path / "src", ["a", "b"], **{name: content})
    with pytest.raises(ts.SourceDataError) as info:
        ts.pack_voc(root, tmp_path / "out.tser", year="2007", check_images=check_images)
    assert name in str(info.value) and expected in str(info.value)
    _no_output(tmp_path)


def test_truncated_jpeg_passes_without_image_checks(tmp_path: Path) -> None:
    # torchvision does not validate at load time either; checking is opt-in and really decodes.
    root = _tiny_devkit(tmp_path / "src", ["a", "b"], **{"b.jpg": _TRUNCATED})
    assert ts.pack_voc(root, tmp_path / "out.tser", year="2007").num_samples == 2


def test_unreadable_file_is_reported(tmp_path: Path) -> None:
    root = _tiny_devkit(tmp_path / "src", ["a", "b"])
    xml = root / "VOCdevkit/VOC2007/Annotations/a.xml"
    xml.unlink()
    xml.mkdir()  # reading a folder fails even as root, unlike chmod 000
    with pytest.raises(ts.SourceDataError, match=r"a\.xml.*cannot read"):
        ts.pack_voc(root, tmp_path / "out.tser", year="2007")


def test_missing_list_files_and_blank_lines(tmp_path: Path) -> None:
    root = _tiny_devkit(tmp_path / "src", ["a"])
    lists = root / "VOCdevkit/VOC2007/ImageSets/Main"
    (lists / "train.txt").write_text("a\n\na\n")
    with pytest.raises(ts.SourceDataError, match=r"train\.txt.*line 2"):
        ts.pack_voc(root, tmp_path / "out.tser", year="2007")
    for path in lists.iterdir():
        path.unlink()
    with pytest.raises(ts.SourceDataError, match="ImageSets"):
        ts.pack_voc(root, tmp_path / "out.tser", year="2007")
    _no_output(tmp_path)


def test_empty_list_file_gives_an_empty_image_set(tmp_path: Path) -> None:
    root = _tiny_devkit(tmp_path / "src", ["a"])
    (root / "VOCdevkit/VOC2007/ImageSets/Main/val.txt").write_text("")
    result = ts.pack_voc(root, tmp_path / "out.tser", year="2007")
    assert (
        len(ts.VOCSerializedDataset(result.path, "val"))
        == len(VOCDetection(root, "2007", "val"))
        == 0
    )


def test_packed_classes_and_unknown_labels(tmp_path: Path) -> None:
    xml = voc_xml("a.jpg", 32, 24, [obj("helmet", (1, 2, 3, 4)), obj("head", (2.5, 3, 9, 9.75))])
    root = _tiny_devkit(tmp_path / "src", ["a", "b"], **{"a.xml": xml})
    result = ts.pack_voc(root, tmp_path / "out.tser", year="2007")
    with pytest.raises(ValueError, match="helmet"):
        ts.VOCSerializedDataset(result.path, "train", target_format="tv_tensors")
    ds = ts.VOCSerializedDataset(result.path, "train", target_format="tv_tensors", classes="packed")
    target = ds[0][1]
    names = ["__background__", "dog", "head", "helmet"]
    assert [names[i] for i in target["labels"].tolist()] == ["helmet", "head"]
    assert target["boxes"].tolist()[1] == [2.5, 3.0, 9.0, 9.75]
    custom = ts.VOCSerializedDataset(
        result.path, "train", target_format="tv_tensors", classes=["helmet", "head", "dog"]
    )
    assert custom[0][1]["labels"].tolist() == [0, 1]


def test_image_bytes_are_stored_unchanged(synthetic: Path, tmp_path: Path) -> None:
    result = ts.pack_voc(synthetic, tmp_path / "out.tser", year="2007")
    ds = ts.VOCSerializedDataset(result.path, "trainval", decode="none")
    tv = VOCDetection(synthetic, "2007", "trainval")
    for i in range(len(ds)):
        assert bytes(ds[i][0].numpy()) == Path(tv.images[i]).read_bytes()
        with Image.open(io.BytesIO(bytes(ds[i][0].numpy()))) as image:
            assert image.format == "JPEG"


def test_jpeg_size_matches_pillow_on_every_corner_case(corner_devkit: Path) -> None:
    images = sorted((corner_devkit / "VOCdevkit" / "VOC2007" / "JPEGImages").glob("*.jpg"))
    assert images
    for path in images:
        data = path.read_bytes()
        size = jpeg_size(data)
        with Image.open(io.BytesIO(data)) as image:
            if image.format == "JPEG":
                assert size == image.size, path.name
            else:  # PNG bytes behind a .jpg name: Pillow decides
                assert size is None
    assert jpeg_size(b"\xff\xd8\xff\xe0\x00") is None  # cut inside the markers
    assert jpeg_size(b"GIF89a") is None


def test_torchvision_keywords_year_and_download(synthetic: Path, tmp_path: Path) -> None:
    path = ts.pack_voc(synthetic, tmp_path / "out.tser", year="2007").path
    tv = VOCDetection(synthetic, year="2007", image_set="val", download=False)
    ours = ts.VOCSerializedDataset(path, year="2007", image_set="val", download=False)
    assert len(ours) == len(tv) and ours[0][1] == tv[0][1]
    segmentation = VOCSegmentation(synthetic, year="2007", image_set="val")
    assert len(ts.VOCSerializedSegmentation(path, year="2007", image_set="val")) == len(
        segmentation
    )
    with pytest.raises(ValueError, match="VOC2007, not VOC2012"):
        ts.VOCSerializedDataset(path, year="2012")
    with pytest.raises(ValueError, match="local file"):
        ts.VOCSerializedDataset(path, download=True)


def test_undecoded_bytes_batch_decode_like_the_tensor_path(synthetic: Path, tmp_path: Path) -> None:
    # README: decode="none" output goes to torchvision.io.decode_jpeg in batches (GPU there;
    # the same call on the CPU here) and gives what decode="tensor" gives per sample.
    import warnings

    from torchvision.io import ImageReadMode, decode_jpeg

    path = ts.pack_voc(synthetic, tmp_path / "out.tser", year="2007").path
    raw = ts.VOCSerializedDataset(path, "train", decode="none")
    tensors = ts.VOCSerializedDataset(path, "train", decode="tensor")
    batch = [raw[i][0] for i in range(len(raw))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torchvision 0.29 -> TorchCodec
        decoded = decode_jpeg(batch, mode=ImageReadMode.RGB)
    assert len(decoded) == len(tensors) > 0
    for i, image in enumerate(decoded):
        assert torch.equal(image, tensors[i][0])


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
