"""pack_voc: layout, options, determinism, clear failures on bad source data, a full disk."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _container_helpers import (
    listing,
    no_pack_output,
)
from _reliability_helpers import (
    ROOT,
    TESTS,
    run_child,
    snapshot,
)
from PIL import Image
from torchvision.datasets import VOCDetection
from vocfactory import (
    TRUNCATED_JPEG,
    obj,
    tiny_devkit,
    voc_xml,
)

import torch_serialized as ts
from torch_serialized.tools.synthetic import make_synthetic_voc
from torch_serialized.voc.packed import VOCPackReader


def test_one_pack_serves_every_image_set(synthetic_devkit: Path, tmp_path: Path) -> None:
    result = ts.pack_voc(synthetic_devkit, tmp_path / "out.tser", year="2007")
    pack = VOCPackReader(result.path)
    ids = {pack.id(i) for i in range(len(pack))}
    assert len(ids) == len(pack) == result.num_samples  # each id stored once
    for image_set in ("train", "val", "trainval", "test"):
        tv = VOCDetection(synthetic_devkit, "2007", image_set)
        expected = [Path(p).stem for p in tv.images]
        assert [pack.id(int(r)) for r in pack.split("Main", image_set)] == expected
    assert pack.meta["splits"]["Main"]["trainval"] == len(
        VOCDetection(synthetic_devkit, "2007", "trainval")
    )


def test_shards_hold_the_same_samples(synthetic_devkit: Path, tmp_path: Path) -> None:
    single = ts.pack_voc(synthetic_devkit, tmp_path / "one.tser", year="2007")
    sharded = ts.pack_voc(
        synthetic_devkit, tmp_path / "shards", year="2007", max_samples_per_shard=5
    )
    assert (sharded.path / "manifest.json").is_file()
    assert len(list(sharded.path.glob("shard-*.tser"))) == -(-single.num_samples // 5)
    a = ts.VOCSerializedDataset(single.path, image_set="trainval")
    b = ts.VOCSerializedDataset(sharded.path, image_set="trainval")
    assert len(a) == len(b)
    for i in range(len(a)):
        assert a[i][1] == b[i][1]
        assert a[i][0].tobytes() == b[i][0].tobytes()
    by_bytes = ts.pack_voc(
        synthetic_devkit, tmp_path / "sized", year="2007", max_shard_bytes=400_000
    )
    assert len(list(by_bytes.path.glob("shard-*.tser"))) > 2
    assert len(ts.VOCSerializedDataset(by_bytes.path, image_set="test")) == len(
        VOCDetection(synthetic_devkit, "2007", "test")
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_num_shards_writes_exactly_n_even_shards(
    synthetic_devkit: Path, tmp_path: Path, workers: int
) -> None:
    """No ``max_samples_per_shard`` gives N shards (24 samples, 3 a shard: 8, not 10)."""
    out = tmp_path / "s"
    result = ts.pack_voc(synthetic_devkit, out, num_shards=10, workers=workers)  # 24 samples
    pack = VOCPackReader(result.path)
    sizes = [len(pack.reader.shard(s)) for s in range(pack.reader.num_shards)]
    assert sizes == [3] * 4 + [2] * 6
    assert pack.meta["options"]["max_samples_per_shard"] == 3  # what an append's shards hold
    plain = VOCPackReader(ts.pack_voc(synthetic_devkit, tmp_path / "plain.tser").path)
    assert [pack.id(r) for r in range(len(pack))] == [plain.id(r) for r in range(len(plain))]
    many = VOCPackReader(ts.pack_voc(synthetic_devkit, tmp_path / "m", num_shards=100).path)
    assert many.reader.num_shards == 24  # one a sample
    for wrong, message in (
        ({"num_shards": 0}, "positive"),
        ({"num_shards": 3, "max_shard_bytes": 10**6}, "cannot be combined"),
        ({"num_shards": 3, "max_samples_per_shard": 2}, "cannot be combined"),
    ):
        with pytest.raises(ValueError, match=message):
            ts.pack_voc(synthetic_devkit, tmp_path / "t", **wrong)


@pytest.mark.parametrize("url", ["https://127.0.0.1:9/voc", "HTTP://127.0.0.1:9/voc.tser"])
def test_pack_to_an_http_url_is_refused_before_packing(
    synthetic_devkit: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch_serialized.voc import pack as pack_module

    # refused up front, naming the URL: not a 405 from the server once the pack is built
    monkeypatch.setattr(pack_module, "survey", lambda *a, **k: pytest.fail("packed first"))
    with pytest.raises(ValueError, match=r"127\.0\.0\.1:9/voc.*read-only.*s3://"):
        ts.pack_voc(synthetic_devkit, url)


@pytest.mark.parametrize(
    "option", ["max_size", "max_shard_bytes", "max_samples_per_shard", "num_shards"]
)
def test_an_option_beyond_what_metadata_holds_is_refused_before_packing(
    tiny_root: Path, tmp_path: Path, option: str
) -> None:
    """Options go into the pack's metadata, whose integers readers bound to 2**53 - 1: a
    larger one (``--shard-size 10000TB``) failed after every record was written, with an
    error naming no argument; it is refused first now, naming it, and nothing is written."""
    with pytest.raises(ValueError, match=rf"^{option} must be at most 2\*\*53 - 1"):
        ts.pack_voc(tiny_root, tmp_path / "p", **{option: 2**53})
    assert list(tmp_path.iterdir()) == []
    ts.pack_voc(tiny_root, tmp_path / "p", **{option: 2**53 - 1})  # the bound itself packs


def test_raw_storage_returns_torchvision_pixels(synthetic_devkit: Path, tmp_path: Path) -> None:
    raw = ts.pack_voc(synthetic_devkit, tmp_path / "raw.tser", year="2007", image_storage="raw")
    tv = VOCDetection(synthetic_devkit, "2007", "train")
    ours = ts.VOCSerializedDataset(raw.path, image_set="train")
    tensors = ts.VOCSerializedDataset(raw.path, image_set="train", decode="tensor")
    for i in range(len(tv)):
        image, target = tv[i]
        mine, my_target = ours[i]
        assert mine.mode == "RGB" and mine.size == image.size
        assert mine.tobytes() == image.tobytes() and my_target == target
        chw = tensors[i][0]
        assert chw.shape == (3, image.height, image.width)
        assert np.array_equal(chw.permute(1, 2, 0).numpy(), np.asarray(image))


def test_max_size_scales_images_boxes_and_sizes(synthetic_devkit: Path, tmp_path: Path) -> None:
    small = ts.pack_voc(synthetic_devkit, tmp_path / "small.tser", year="2007", max_size=128)
    tv = VOCDetection(synthetic_devkit, "2007", "train")
    ours = ts.VOCSerializedDataset(small.path, image_set="train")
    fast = ts.VOCSerializedDataset(small.path, image_set="train", target_format="tv_tensors")
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
        assert np.allclose(boxes.numpy(), expected, atol=0.006)  # written with 2 decimals
        dict_boxes = [
            [float(o["bndbox"][k]) for k in ("xmin", "ymin", "xmax", "ymax")]
            for o in my_target["annotation"]["object"]
        ]
        assert np.allclose(dict_boxes, expected, atol=0.01)


def test_max_size_tv_tensors_boxes_are_the_dict_target_numbers(tmp_path: Path) -> None:
    """With ``max_size`` the dict target's coordinates are written with 2 decimals while the
    object table kept the unrounded products, so ``"tv_tensors"`` boxes differed from the
    dict's numbers by up to 0.005 px. The table is now read from the scaled target: the two
    formats give the same numbers (as float32)."""
    root = make_synthetic_voc(tmp_path / "src", 12, year="2007", segmentation_every=0)
    small = ts.pack_voc(root, tmp_path / "small.tser", year="2007", max_size=137)
    as_dict = ts.VOCSerializedDataset(small.path, image_set="trainval", decode="none")
    as_tv = ts.VOCSerializedDataset(
        small.path, image_set="trainval", decode="none", target_format="tv_tensors"
    )
    compared = 0
    for i in range(len(as_dict)):
        objects = as_dict[i][1]["annotation"]["object"]
        words = [[o["bndbox"][k] for k in ("xmin", "ymin", "xmax", "ymax")] for o in objects]
        expected = np.array(words, dtype=np.float64).astype(np.float32)
        assert np.array_equal(as_tv[i][1]["boxes"].numpy(), expected)
        compared += sum(any("." in w for w in row) for row in words)
    assert compared > 0, "some scaled coordinates have decimals"


def test_max_size_resizes_masks_with_their_images(tmp_path: Path) -> None:
    """With ``max_size`` the images were resized and their masks stored as they were, so
    ``VOCSerializedSegmentation`` paired a 200-pixel image with a 500-pixel mask. Masks (class
    and object) are now resized with them, nearest-neighbour: the same size as their image,
    mode P with the source's palette, every pixel a class index of the source mask."""
    from torchvision.datasets import VOCSegmentation

    root = make_synthetic_voc(tmp_path / "src", 8, year="2012", segmentation_every=2)
    small = ts.pack_voc(root, tmp_path / "small.tser", year="2012", max_size=200)
    tv = VOCSegmentation(root, "2012", "train")
    ours = ts.VOCSerializedSegmentation(small.path, image_set="train")
    assert len(ours) == len(tv) > 0
    for i in range(len(tv)):
        image, mask = ours[i]
        source_image, source_mask = tv[i]
        assert max(image.size) == 200 < max(source_image.size)
        assert mask.size == image.size and mask.mode == source_mask.mode == "P"
        assert mask.getpalette() == source_mask.getpalette()
        expected = source_mask.resize(mask.size, Image.Resampling.NEAREST)
        assert np.array_equal(np.asarray(mask), np.asarray(expected))
    from torch_serialized.voc import schema

    reader = VOCPackReader(small.path).reader  # the object masks, as stored
    stored = [bytes(reader.field(r, schema.OBJECT_MASK)) for r in range(len(reader))]
    assert sum(map(bool, stored)) >= len(tv)  # train and val
    for r, data in enumerate(stored):
        if data:
            with (
                Image.open(io.BytesIO(bytes(reader.field(r, schema.IMAGE)))) as image,
                Image.open(io.BytesIO(data)) as object_mask,
            ):
                assert object_mask.size == image.size and object_mask.mode == "P"


def test_max_size_scales_every_coordinate_of_the_target(tmp_path: Path) -> None:
    """``max_size`` scaled each object's ``bndbox`` but left a person's ``part`` boxes and an
    action annotation's ``point`` at the source image's coordinates (FORMAT.md: every
    coordinate is the resized image's)."""
    parts = (
        "<part><name>head</name><bndbox><xmin>4</xmin><ymin>2</ymin><xmax>8</xmax>"
        "<ymax>6</ymax></bndbox></part>"
        "<part><name>hand</name><bndbox><xmin>10</xmin><ymin>12</ymin><xmax>14</xmax>"
        "<ymax>16</ymax></bndbox></part>"
    )
    xml = voc_xml("a.jpg", 32, 24, [obj("person", (2, 2, 20, 20))]).replace(
        b"</bndbox>", b"</bndbox>" + parts.encode() + b"<point><x>16</x><y>12</y></point>", 1
    )
    root = tiny_devkit(tmp_path / "src", ["a"], **{"a.xml": xml})
    small = ts.pack_voc(root, tmp_path / "small.tser", year="2007", max_size=16)
    (target_tv,) = [VOCDetection(root, "2007", "train")[0][1]]
    target = ts.VOCSerializedDataset(small.path, image_set="train")[0][1]
    before, after = target_tv["annotation"]["object"][0], target["annotation"]["object"][0]
    assert after["bndbox"] == {"xmin": "1", "ymin": "1", "xmax": "10", "ymax": "10"}
    assert [p["bndbox"] for p in after["part"]] == [
        {"xmin": "2", "ymin": "1", "xmax": "4", "ymax": "3"},
        {"xmin": "5", "ymin": "6", "xmax": "7", "ymax": "8"},
    ]
    assert after["point"] == {"x": "8", "y": "6"}
    assert [p["name"] for p in after["part"]] == [p["name"] for p in before["part"]]


def test_missing_annotation_fails_and_skip_mode_reports(tmp_path: Path) -> None:
    root = tiny_devkit(tmp_path / "src", ["a", "b", "c"])
    (root / "VOCdevkit/VOC2007/Annotations/c.xml").unlink()
    with pytest.raises(ts.SourceDataError, match=r"c\.xml"):
        ts.pack_voc(root, tmp_path / "out.tser", year="2007")
    no_pack_output(tmp_path)
    result = ts.pack_voc(root, tmp_path / "out.tser", year="2007", on_error="skip")
    assert [s.id for s in result.skipped] == ["c"] and "c.xml" in result.skipped[0].reason
    assert result.report is not None
    assert json.loads(result.report.read_text())[0]["id"] == "c"
    assert ts.VOCSerializedDataset(result.path, image_set="train").ids == ["a", "b"]


@pytest.mark.parametrize("options", [{}, {"max_samples_per_shard": 2}, {"workers": 2}])
def test_skipping_every_sample_writes_nothing_and_says_why(tmp_path: Path, options) -> None:
    """``on_error="skip"`` that leaves out every listed id (every image a `.JPG`, say) is a
    layout mistake, not a 0-sample pack: refused with the count and the first reasons, no
    output and no report left (an earlier pack at the path stays as it was)."""
    root = tiny_devkit(tmp_path / "src", ["a", "b", "c", "d"])
    images = root / "VOCdevkit/VOC2007/JPEGImages"
    for path in images.glob("*.jpg"):
        path.rename(path.with_suffix(".JPG"))
    out = tmp_path / ("out" if options.get("max_samples_per_shard") else "out.tser")
    with pytest.raises(ts.SourceDataError) as info:
        ts.pack_voc(root, out, year="2007", on_error="skip", **options)
    message = str(info.value)
    assert "every one of the 4 listed samples was skipped" in message
    assert "'a.JPG' is there" in message and "(and 1 more)" in message
    assert not out.exists() and not out.with_name(out.name + ".skipped.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_clean_repack_removes_the_stale_report(tmp_path: Path) -> None:
    """Issue #11 item 8: a ``.skipped.json`` of an earlier pack survived a clean re-pack and
    described samples the new pack holds."""
    root = tiny_devkit(tmp_path / "src", ["a", "b", "c"])
    xml = root / "VOCdevkit/VOC2007/Annotations/c.xml"
    content = xml.read_bytes()
    xml.unlink()
    for options in ({}, {"max_samples_per_shard": 2}):
        out = tmp_path / ("out" if options else "out.tser")
        first = ts.pack_voc(root, out, year="2007", on_error="skip", **options)
        assert first.report == out.with_name(out.name + ".skipped.json") and first.report.exists()
        xml.write_bytes(content)
        again = ts.pack_voc(root, out, year="2007", on_error="skip", **options)
        assert again.skipped == [] and again.report is None
        assert not first.report.exists()
        xml.unlink()


@pytest.mark.parametrize("content", ["my notes", '[{"id": "a"}]', "{}"])
def test_a_file_named_like_the_report_that_is_not_ours_is_kept(tmp_path: Path, content) -> None:
    """Item 1's rule for the report: a file at OUTPUT.skipped.json that is not our report is
    neither overwritten nor removed; the pack refuses to start."""
    root = tiny_devkit(tmp_path / "src", ["a", "b"])
    (root / "VOCdevkit/VOC2007/Annotations/b.xml").unlink()
    report = tmp_path / "out.tser.skipped.json"
    report.write_text(content)
    for on_error in ("skip", "raise"):
        with pytest.raises(ts.WriteError, match="not a skipped-samples report") as info:
            ts.pack_voc(root, tmp_path / "out.tser", year="2007", on_error=on_error)
        assert str(report) in str(info.value)
        assert report.read_text() == content and not (tmp_path / "out.tser").exists()


@pytest.mark.parametrize("output", ["folder", "file"])
def test_pack_voc_never_replaces_what_it_did_not_write(tmp_path: Path, output: str) -> None:
    """Issue #11 item 1: ``pack_voc(root, out)`` deleted a folder ``out`` that merely held a
    file named manifest.json, with everything else in it."""
    root = tiny_devkit(tmp_path / "src", ["a", "b"])
    out = tmp_path / "out"
    if output == "folder":
        out.mkdir()
        (out / "manifest.json").write_text('{"my": "config"}')
        (out / "results.csv").write_text("epoch,loss\n1,0.5\n")
    else:
        out.write_bytes(b"\x89TSER\r\n\x1a but not a pack")
    before = snapshot(out)
    for options in ({}, {"max_samples_per_shard": 1}):
        for workers in (1, 2):
            with pytest.raises(ts.WriteError, match="not a torch_serialized pack") as info:
                ts.pack_voc(root, out, year="2007", workers=workers, **options)
            assert str(out) in str(info.value)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


@pytest.mark.parametrize("output", ["", ".", "/"])
def test_an_output_that_names_no_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output: str
) -> None:
    """``pack_voc(root, "")`` raised "PosixPath('.') has an empty name"; the command line said
    ". already exists": an empty output is the current folder, never a pack to write."""
    root = tiny_devkit(tmp_path / "src", ["a", "b"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="the .tser file \\(or shard folder\\) to write") as info:
        ts.pack_voc(root, output, year="2007")
    assert ("empty" in str(info.value)) == (output == "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_dash_output_is_a_file_named_dash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In Python a path is a path: ``pack_voc(root, "-")`` writes a file named ``-``, as
    ``open("-", "wb")`` would (the command line refuses ``-``; README, Command line)."""
    root = tiny_devkit(tmp_path / "src", ["a", "b"])
    monkeypatch.chdir(tmp_path)
    result = ts.pack_voc(root, "-", year="2007")
    assert result.path == tmp_path / "-" and len(VOCPackReader("-")) == 2


@pytest.mark.parametrize(
    ("name", "content", "check_images", "expected"),
    [
        ("b.jpg", b"this is not an image", False, "not a readable image"),
        ("b.jpg", TRUNCATED_JPEG, True, "not a readable image"),
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
    root = tiny_devkit(tmp_path / "src", ["a", "b"], **{name: content})
    with pytest.raises(ts.SourceDataError) as info:
        ts.pack_voc(root, tmp_path / "out.tser", year="2007", check_images=check_images)
    assert name in str(info.value) and expected in str(info.value)
    no_pack_output(tmp_path)


def test_missing_list_files_and_blank_lines(tmp_path: Path) -> None:
    root = tiny_devkit(tmp_path / "src", ["a"])
    lists = root / "VOCdevkit/VOC2007/ImageSets/Main"
    (lists / "train.txt").write_text("a\n\na\n")
    with pytest.raises(ts.SourceDataError, match=r"train\.txt.*line 2"):
        ts.pack_voc(root, tmp_path / "out.tser", year="2007")
    for path in lists.iterdir():
        path.unlink()
    with pytest.raises(ts.SourceDataError, match="ImageSets"):
        ts.pack_voc(root, tmp_path / "out.tser", year="2007")
    no_pack_output(tmp_path)


def test_empty_list_file_gives_an_empty_image_set(tmp_path: Path) -> None:
    root = tiny_devkit(tmp_path / "src", ["a"])
    (root / "VOCdevkit/VOC2007/ImageSets/Main/val.txt").write_text("")
    result = ts.pack_voc(root, tmp_path / "out.tser", year="2007")
    assert (
        len(ts.VOCSerializedDataset(result.path, image_set="val"))
        == len(VOCDetection(root, "2007", "val"))
        == 0
    )


def test_packed_classes_and_unknown_labels(tmp_path: Path) -> None:
    xml = voc_xml("a.jpg", 32, 24, [obj("helmet", (1, 2, 3, 4)), obj("head", (2.5, 3, 9, 9.75))])
    root = tiny_devkit(tmp_path / "src", ["a", "b"], **{"a.xml": xml})
    result = ts.pack_voc(root, tmp_path / "out.tser", year="2007")
    # classes=None on custom data: the packed classes in pack order (first seen: a, then b)
    default = ts.VOCSerializedDataset(result.path, image_set="train", target_format="tv_tensors")
    assert default.label_names == ["__background__", "helmet", "head", "dog"]
    assert default[0][1]["labels"].tolist() == [1, 2] and default[1][1]["labels"].tolist() == [3]
    with pytest.raises(ValueError, match="helmet"):  # a list without them is refused
        ts.VOCSerializedDataset(
            result.path,
            image_set="train",
            target_format="tv_tensors",
            classes=["__background__", "dog"],
        )
    ds = ts.VOCSerializedDataset(
        result.path, image_set="train", target_format="tv_tensors", classes="packed"
    )
    target = ds[0][1]
    names = ["__background__", "dog", "head", "helmet"]  # "packed": sorted by name
    assert ds.label_names == names
    assert [names[i] for i in target["labels"].tolist()] == ["helmet", "head"]
    assert target["boxes"].tolist()[1] == [2.5, 3.0, 9.0, 9.75]
    custom = ts.VOCSerializedDataset(
        result.path,
        image_set="train",
        target_format="tv_tensors",
        classes=["helmet", "head", "dog"],
    )
    assert custom[0][1]["labels"].tolist() == [0, 1]


def test_year_is_detected_by_default_and_reported(synthetic_devkit: Path, tmp_path: Path) -> None:
    """A root holding only VOC2007 just works without year=, and the result says 2007."""
    voc2007 = synthetic_devkit / "VOCdevkit" / "VOC2007"
    for source in (synthetic_devkit, voc2007, synthetic_devkit / "VOCdevkit"):
        result = ts.pack_voc(source, tmp_path / "out.tser")
        assert (result.year, result.voc_root) == ("2007", voc2007)
        assert VOCPackReader(result.path).year == "2007"
    assert ts.pack_voc(synthetic_devkit, tmp_path / "out.tser", year="2007").year == "2007"
    with pytest.raises(ts.SourceDataError, match="No Pascal VOC 2012 folder"):
        ts.pack_voc(voc2007, tmp_path / "other.tser", year="2012")  # not silently 2007
    both = tmp_path / "both"
    for year in ("2007", "2012"):
        shutil.copytree(voc2007, both / "VOCdevkit" / f"VOC{year}")
    with pytest.raises(ts.SourceDataError, match=r"several VOC folders.*year="):
        ts.pack_voc(both, tmp_path / "both.tser")
    assert ts.pack_voc(both, tmp_path / "both.tser", year="2012").year == "2012"


def test_num_bytes_is_the_size_on_disk(synthetic_devkit: Path, tmp_path: Path) -> None:
    one = ts.pack_voc(synthetic_devkit, tmp_path / "one.tser")
    assert one.num_bytes == (tmp_path / "one.tser").stat().st_size
    shards = ts.pack_voc(synthetic_devkit, tmp_path / "shards", max_samples_per_shard=5)
    assert shards.num_bytes == sum(p.stat().st_size for p in (tmp_path / "shards").iterdir())
    assert shards.num_bytes == ts.open_pack(shards.path).nbytes


def test_progress_ends_with_the_summary_rate(
    synthetic_devkit: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a short pack the bar's last MB/s is the summary's, not the first sample's."""
    result = ts.pack_voc(synthetic_devkit, tmp_path / "one.tser", progress=True)
    last = capsys.readouterr().err.split("\r")[-1]
    rate = f"{result.num_bytes / result.seconds / 1e6:.0f} MB/s"
    assert "24/24" in last and last.rstrip().endswith(f"{rate}]"), last


def test_image_bytes_are_stored_unchanged(synthetic_devkit: Path, tmp_path: Path) -> None:
    result = ts.pack_voc(synthetic_devkit, tmp_path / "out.tser", year="2007")
    ds = ts.VOCSerializedDataset(result.path, image_set="trainval", decode="none")
    tv = VOCDetection(synthetic_devkit, "2007", "trainval")
    for i in range(len(ds)):
        assert bytes(ds[i][0].numpy()) == Path(tv.images[i]).read_bytes()
        with Image.open(io.BytesIO(bytes(ds[i][0].numpy()))) as image:
            assert image.format == "JPEG"


def check_disk_full_report(stdout: str, folder: Path, code: int, hint: str) -> None:
    results = json.loads(stdout.strip().splitlines()[-1])
    for name in ("voc.tser", "voc"):
        report = results[name]
        assert report is not None, f"{name}: the pack succeeded"
        assert report["error"] == "WriteError" and report["oserror"]
        assert report["errno"] == code
        assert str(folder / name) in report["message"]
        assert hint in report["message"] and "No partial output" in report["message"]
    assert results["left"] == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_file_size_limit_under_pack_voc_raises_write_error_and_leaves_nothing(
    tmp_path, voc40, workers
):
    folder = tmp_path / "out"
    folder.mkdir()
    proc = run_child("pack_and_report", str(voc40), str(folder), str(256 << 10), str(workers))
    stdout, stderr = proc.communicate(timeout=100)
    assert proc.returncode == 0, stderr  # not killed by SIGXFSZ, no traceback
    assert "Traceback" not in stderr
    check_disk_full_report(stdout, folder, errno.EFBIG, "file size limit")
    assert listing(folder) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_full_tmpfs_under_pack_voc_raises_write_error_and_leaves_nothing(tmp_path, voc40, workers):
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare to mount a private tmpfs")
    folder = tmp_path / "small"
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    code = "import sys, _reliability_helpers as h; h.child_main(*sys.argv[1:])"
    script = 'mount -t tmpfs -o size=2m tmpfs "$1" || exit 77; shift; exec "$@"'
    proc = subprocess.run(
        [unshare, "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(folder)]
        + [sys.executable, "-c", code, "pack_and_report", str(voc40), str(folder), "0"]
        + [str(workers)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    cannot_mount = proc.returncode == 77 or (proc.returncode == 1 and "unshare" in proc.stderr)
    if cannot_mount and not proc.stdout and "Traceback" not in proc.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    check_disk_full_report(proc.stdout, folder, errno.ENOSPC, "free disk space")


@pytest.mark.parametrize("max_size", [0, -1])
def test_a_max_size_below_one_pixel_is_refused(
    tiny_root: Path, tmp_path: Path, max_size: int
) -> None:
    """``max_size=0`` would make every image 1x1 (or divide by zero): refused first, naming the
    option and the value, with nothing written."""
    message = rf"^max_size must be a positive number of pixels, got {max_size}$"
    with pytest.raises(ValueError, match=message):
        ts.pack_voc(tiny_root, tmp_path / "p", max_size=max_size)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"workers": 0}, "workers must be >= 1, got 0"),
        ({"image_storage": "jpeg"}, "image_storage must be 'original' or 'raw', got 'jpeg'"),
        ({"max_file_bytes": 0}, "max_file_bytes must be a positive number, got 0"),
        ({"on_error": "ignore"}, "on_error must be 'raise' or 'skip', got 'ignore'"),
    ],
)
def test_a_bad_option_is_refused_before_packing(
    tiny_root: Path, tmp_path: Path, option: dict, message: str
) -> None:
    """Options are checked once, before any work (``records.Options``), naming the option."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ts.pack_voc(tiny_root, tmp_path / "p", **option)
    assert list(tmp_path.iterdir()) == []


def test_overwrite_false_refuses_an_existing_pack_and_nothing_else(
    voc8: Path, tmp_path: Path
) -> None:
    """``overwrite=False`` (the command line's default) keeps an existing pack; a new path
    is packed, and what is no pack is refused whatever ``overwrite`` says."""
    out = tmp_path / "p.tser"
    ts.pack_voc(voc8, out, overwrite=False)
    before = out.read_bytes()
    with pytest.raises(FileExistsError, match=r"p\.tser.*overwrite=True"):
        ts.pack_voc(voc8, out, overwrite=False)
    assert out.read_bytes() == before
    ts.pack_voc(voc8, out)  # the library's default replaces it
    notes = tmp_path / "notes.tser"
    notes.write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(OSError, match="not a torch_serialized pack"):
            ts.pack_voc(voc8, notes, overwrite=overwrite)
    assert notes.read_text() == "mine"


def test_an_output_moved_aside_by_another_packer_is_our_error(
    synthetic_devkit: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two packs of one output at once: the other one moves ours aside right after our commit
    to put its own in place. What reaches the user names the output (issue #34), not a bare
    FileNotFoundError from counting the bytes of a folder that is gone for a moment."""
    from torch_serialized.voc import records

    out = tmp_path / "out"
    write = records.write

    def write_then_swapped(*args: object, **kwargs: object) -> Path:
        path = write(*args, **kwargs)  # type: ignore[arg-type]
        path.rename(tmp_path / f".out.old-{os.getpid()}-0")  # the other writer's first rename
        return path

    monkeypatch.setattr(records, "write", write_then_swapped)
    with pytest.raises(ts.errors.FileChangedError, match=r"out.*another process"):
        ts.pack_voc(synthetic_devkit, out, max_samples_per_shard=8)
