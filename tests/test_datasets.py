"""The drop-in contract: the packed datasets return exactly what torchvision's VOC datasets do.

torchvision reading the original devkit is the oracle, sample by sample: on the corner-case
devkit (every quirk of ``vocfactory.CORNER_CASES``), on the real roots of
``vocfactory.real_voc_roots()`` when present, and on a small synthetic devkit; always for a
single-file pack and a sharded one. Measured with torchvision 0.29 / Pillow 12-13:
``decode="tensor"`` (torchvision's libjpeg-turbo) is pixel-identical to PIL on every image here,
CMYK, grayscale, progressive, PNG-behind-.jpg and real photos included, so it is asserted exact.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import ConcatDataset, DataLoader
from torchvision import transforms as v1
from torchvision import tv_tensors
from torchvision.datasets import VOCDetection, VOCSegmentation, wrap_dataset_for_transforms_v2
from torchvision.transforms import v2
from torchvision.transforms.functional import pil_to_tensor
from vocfactory import real_voc_roots, real_voc_skip_reason

import torch_serialized as ts
from torch_serialized import VOCSerializedDataset, VOCSerializedSegmentation
from torch_serialized.voc.classes import VOC_CLASSES
from torch_serialized.voc.packed import VOCPackReader

if TYPE_CHECKING:
    from conftest import Packed

LAYOUTS = ("single", "shards")
CORNER_SETS = [("Main", s) for s in ("train", "val", "trainval", "test", "mini")] + [
    ("Segmentation", s) for s in ("train", "val", "trainval")
]
REAL = real_voc_roots()
NO_REAL = pytest.mark.skip(reason=real_voc_skip_reason())
REAL_PARAMS = [pytest.param(root, year, id=root.name) for root, year in REAL] or [
    pytest.param(None, None, id="no-real-data", marks=NO_REAL)
]
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
VOC_LABELS = ["__background__", *VOC_CLASSES]  # torchvision's wrapper's labels
XYXY = ("xmin", "ymin", "xmax", "ymax")


# --- module-level callables (DataLoader workers under spawn import them from here) ---------------


def keep_lists(batch: list[Any]) -> list[Any]:
    """A collate_fn that keeps the samples as they are."""
    return list(batch)


def object_names(target: dict[str, Any]) -> list[str]:
    return [o["name"] for o in target["annotation"]["object"]]


def joint(image: Image.Image, target: Any) -> tuple[torch.Tensor, Any]:
    return pil_to_tensor(image), target


def v1_transform() -> v1.Compose:
    return v1.Compose([v1.ToTensor(), v1.Normalize(MEAN, STD)])


def v2_transforms() -> v2.Compose:
    return v2.Compose(
        [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.RandomHorizontalFlip(p=1.0)]
    )


# --- building both sides --------------------------------------------------------------------------


def torchvision_dataset(task: str, root: Path, year: str, image_set: str, **kw: Any) -> Any:
    """torchvision's dataset; for a list it refuses by name, its own list reading, replayed."""
    cls = VOCDetection if task == "Main" else VOCSegmentation
    standard = image_set in ("train", "val", "trainval") or (image_set, year) == ("test", "2007")
    tv = cls(str(root), year=year, image_set=image_set if standard else "train", **kw)
    if not standard:  # the lines of torchvision's _VOCBase.__init__ after verify_str_arg
        voc_root = os.path.join(str(root), "VOCdevkit", f"VOC{year}")
        with open(os.path.join(voc_root, "ImageSets", cls._SPLITS_DIR, image_set + ".txt")) as f:
            names = [x.strip() for x in f.readlines()]
        tv.image_set = image_set
        tv.images = [os.path.join(voc_root, "JPEGImages", x + ".jpg") for x in names]
        target_dir = os.path.join(voc_root, cls._TARGET_DIR)
        tv.targets = [os.path.join(target_dir, x + cls._TARGET_FILE_EXT) for x in names]
    return tv


def _corner(packed: Packed, image_set: str = "trainval") -> tuple[Path, str, str]:
    return packed.root, packed.year, image_set


def our_dataset(task: str, path: Path, image_set: str, **kw: Any) -> Any:
    cls = VOCSerializedDataset if task == "Main" else VOCSerializedSegmentation
    return cls(path, image_set=image_set, **kw)


def standard_sets(root: Path, year: str) -> list[tuple[str, str]]:
    """(task, image set) of every list torchvision accepts in a real devkit."""
    found = []
    for task in ("Main", "Segmentation"):
        folder = root / "VOCdevkit" / f"VOC{year}" / "ImageSets" / task
        for name in ("train", "val", "trainval", "test"):
            if (folder / f"{name}.txt").is_file() and (name != "test" or year == "2007"):
                found.append((task, name))
    return found


# --- comparisons ----------------------------------------------------------------------------------


def assert_same_image(expected: Image.Image, actual: Any) -> None:
    assert isinstance(actual, Image.Image) and type(actual) is type(expected)
    assert (actual.mode, actual.size) == (expected.mode, expected.size)
    assert actual.tobytes() == expected.tobytes()


def assert_same_target(expected: Any, actual: Any) -> None:
    assert actual == expected
    assert json.dumps(actual) == json.dumps(expected)  # key order too


def assert_same_mask(expected: Image.Image, actual: Any) -> None:
    assert_same_image(expected, actual)
    assert actual.getpalette() == expected.getpalette()


def assert_same_sample(expected: tuple[Any, Any], actual: tuple[Any, Any], task: str) -> None:
    assert isinstance(actual, tuple) and len(actual) == 2
    assert_same_image(expected[0], actual[0])
    if task == "Main":
        assert_same_target(expected[1], actual[1])
    else:
        assert_same_mask(expected[1], actual[1])


def assert_same_dataset(tv: Any, ours: Any, task: str) -> None:
    n = len(tv)
    assert len(ours) == n > 0
    for i in range(n):
        assert_same_sample(tv[i], ours[i], task)
    for i in (-1, -n):
        assert_same_sample(tv[i], ours[i], task)
    for i in (n, n + 7, -n - 1):
        with pytest.raises(IndexError):
            tv[i]
        with pytest.raises(IndexError):
            ours[i]


def assert_same_tensors(expected: Any, actual: Any) -> None:
    """Equal tensors (or tv_tensors, or nested dicts/lists of them), same class and dtype."""
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_same_tensors(expected[key], actual[key])
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for e, a in zip(expected, actual):
            assert_same_tensors(e, a)
    elif isinstance(expected, torch.Tensor):
        assert type(actual) is type(expected) and actual.dtype == expected.dtype
        assert torch.equal(actual.as_subclass(torch.Tensor), expected.as_subclass(torch.Tensor))
        if isinstance(expected, tv_tensors.BoundingBoxes):
            assert isinstance(actual, tv_tensors.BoundingBoxes)
            assert (actual.format, actual.canvas_size) == (expected.format, expected.canvas_size)
    else:
        assert actual == expected


def xml_boxes(target: dict[str, Any]) -> torch.Tensor:
    """The (n, 4) XYXY float32 boxes of torchvision's target dict, as written in the XML."""
    boxes = [[float(o["bndbox"][k]) for k in XYXY] for o in target["annotation"]["object"]]
    return torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)


# --- 1. sample-by-sample equality -----------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("task", "image_set"), CORNER_SETS)
def test_corner_cases_equal_torchvision(
    corner_packs: Packed, task: str, image_set: str, layout: str
) -> None:
    tv = torchvision_dataset(task, corner_packs.root, corner_packs.year, image_set)
    ours = our_dataset(task, corner_packs.path(layout), image_set)
    assert_same_dataset(tv, ours, task)


@pytest.mark.parametrize(("root", "year"), REAL_PARAMS)
def test_real_data_equals_torchvision(
    real_packs: Callable[[Path, str], Packed], root: Path, year: str
) -> None:
    packed = real_packs(root, year)
    sets = standard_sets(root, year)
    assert ("Main", "trainval") in sets
    for task, image_set in sets:
        tv = torchvision_dataset(task, root, year, image_set)
        for layout in LAYOUTS:
            assert_same_dataset(tv, our_dataset(task, packed.path(layout), image_set), task)


# --- 2. a VOCDetection for torchvision's transforms-v2 wrapper ------------------------------------


def wrapper_cases(packed: Packed, image_set: str, target_keys: Any) -> tuple[int, int]:
    """Compare the wrapped datasets sample by sample; return (compared, crashed) counts.

    torchvision's wrapper crashes on images without objects (KeyError), names outside VOC's 20
    classes (KeyError) and fractional coordinates (``int("91.0")``: ValueError); ours must then
    crash the same way, since it is torchvision's wrapper over the same target dict.
    """
    tv = torchvision_dataset("Main", packed.root, packed.year, image_set)
    ours = VOCSerializedDataset(packed.single, image_set=image_set)
    assert isinstance(ours, VOCDetection)
    tvw = wrap_dataset_for_transforms_v2(tv, target_keys=target_keys)
    ow = wrap_dataset_for_transforms_v2(ours, target_keys=target_keys)
    assert isinstance(ow, VOCDetection) and len(ow) == len(tvw)
    compared = crashed = 0
    for i in range(len(tvw)):
        try:
            expected = tvw[i]
        except (KeyError, ValueError) as exc:
            with pytest.raises(type(exc)):
                ow[i]
            crashed += 1
            continue
        actual = ow[i]
        assert_same_image(expected[0], actual[0])
        assert list(actual[1]) == list(expected[1])
        assert_same_tensors(expected[1]["boxes"], actual[1]["boxes"])
        assert_same_tensors(expected[1]["labels"], actual[1]["labels"])
        if "annotation" in expected[1]:
            assert_same_target(expected[1]["annotation"], actual[1]["annotation"])
        compared += 1
    return compared, crashed


@pytest.mark.parametrize("target_keys", [None, {"boxes", "labels", "annotation"}])
def test_wrapper_on_corner_cases(corner_packs: Packed, target_keys: Any) -> None:
    results = {s: wrapper_cases(corner_packs, s, target_keys) for s in ("trainval", "test")}
    # trainval: 000002 (no objects), 000010 (fractional) and 000011 (cellbody) crash torchvision
    assert results == {"trainval": (20, 3), "test": (6, 0)}


@pytest.mark.parametrize(("root", "year"), REAL_PARAMS)
def test_wrapper_on_real_data(
    real_packs: Callable[[Path, str], Packed], root: Path, year: str
) -> None:
    packed = real_packs(root, year)
    compared, crashed = wrapper_cases(packed, "trainval", {"boxes", "labels", "annotation"})
    # labelme has fractional boxes, the helmet and cell sets classes outside VOC's 20
    assert crashed == (0 if root.name.startswith("smsjb") else compared + crashed)


def test_wrapped_dataset_pickles(corner_packs: Packed) -> None:
    ours = VOCSerializedDataset(corner_packs.shards, image_set="test", transforms=v2_transforms())
    wrapped = wrap_dataset_for_transforms_v2(ours, target_keys={"boxes", "labels", "annotation"})
    expected = [wrapped[i] for i in range(len(wrapped))]  # maps are open before pickling
    clone = pickle.loads(pickle.dumps(wrapped))
    assert type(clone).__name__ == "WrappedVOCSerializedDataset"
    assert isinstance(clone, VOCSerializedDataset) and len(clone) == len(wrapped)
    assert clone.transforms is not None and clone._dataset.transforms is None
    for i, sample in enumerate(expected):
        assert_same_tensors(sample, clone[i])


def test_wrapped_segmentation_gives_masks(corner_packs: Packed) -> None:
    tv = wrap_dataset_for_transforms_v2(torchvision_dataset("Segmentation", *_corner(corner_packs)))
    ours = wrap_dataset_for_transforms_v2(
        VOCSerializedSegmentation(corner_packs.single, image_set="trainval")
    )
    assert len(ours) == len(tv)
    for i in range(len(tv)):
        (image, mask), (our_image, our_mask) = tv[i], ours[i]
        assert_same_image(image, our_image)
        assert isinstance(our_mask, tv_tensors.Mask)
        assert_same_tensors(mask, our_mask)


# --- 3. target_format="tv_tensors" ---------------------------------------------------------------


@pytest.mark.parametrize("image_set", ["train", "test"])
def test_tv_tensors_equal_the_wrapper(corner_packs: Packed, image_set: str) -> None:
    """Where the wrapper works, the same boxes (as float) and labels; where not, no crash."""
    tv = torchvision_dataset("Main", *_corner(corner_packs, image_set))
    wrapped = wrap_dataset_for_transforms_v2(tv)
    # the corner cases hold a class outside VOC's 20 ("cellbody"): ask for VOC's labels
    ours = VOCSerializedDataset(
        corner_packs.shards, image_set=image_set, target_format="tv_tensors", classes=VOC_LABELS
    )
    empty = fractional = 0
    for i in range(len(tv)):
        image, target = tv[i]
        _, actual = ours[i]
        assert list(actual) == ["boxes", "labels", "difficult"]
        boxes, labels = actual["boxes"], actual["labels"]
        assert isinstance(boxes, tv_tensors.BoundingBoxes) and boxes.dtype == torch.float32
        assert boxes.format == tv_tensors.BoundingBoxFormat.XYXY
        assert boxes.canvas_size == (image.height, image.width)
        assert labels.dtype == torch.int64
        assert torch.equal(boxes.as_subclass(torch.Tensor), xml_boxes(target))
        try:
            _, expected = wrapped[i]
        except KeyError:  # no objects
            assert boxes.shape == (0, 4) and labels.shape == (0,)
            assert actual["difficult"].shape == (0,)
            empty += 1
            continue
        except ValueError:  # fractional coordinates: ours keeps them
            assert not torch.equal(boxes, boxes.round())
            fractional += 1
            continue
        assert boxes.canvas_size == expected["boxes"].canvas_size
        assert torch.equal(boxes.as_subclass(torch.Tensor), expected["boxes"].float())
        assert torch.equal(labels, expected["labels"])
    assert (empty, fractional) == ((1, 1) if image_set == "train" else (0, 0))


def _tv_tensor_sources() -> list[Any]:
    return [pytest.param("corner", None, id="corner"), *REAL_PARAMS]


@pytest.mark.parametrize(("root", "year"), _tv_tensor_sources())
def test_tv_tensors_match_the_xml(
    corner_packs: Packed,
    real_packs: Callable[[Path, str], Packed],
    root: Any,
    year: Any,
) -> None:
    """Boxes, names (through an explicit class list) and difficult flags as in the XML."""
    packed = corner_packs if root == "corner" else real_packs(root, year)
    for image_set in ("trainval", "test") if root == "corner" else ("trainval",):
        tv = torchvision_dataset("Main", packed.root, packed.year, image_set)
        targets = [tv[i][1] for i in range(len(tv))]
        classes = ["__background__", *sorted({n for t in targets for n in object_names(t)})]
        ours = VOCSerializedDataset(
            packed.single, image_set=image_set, target_format="tv_tensors", classes=classes
        )
        for i, target in enumerate(targets):
            actual = ours[i][1]
            objects = target["annotation"]["object"]
            assert torch.equal(actual["boxes"].as_subclass(torch.Tensor), xml_boxes(target))
            assert [classes[k] for k in actual["labels"]] == object_names(target)
            assert actual["difficult"].tolist() == [o.get("difficult") == "1" for o in objects]


def test_tv_tensors_refuse_unknown_classes(corner_packs: Packed) -> None:
    with pytest.raises(ValueError, match="cellbody"):
        VOCSerializedDataset(
            corner_packs.single, image_set="val", target_format="tv_tensors", classes=VOC_LABELS
        )
    ours = VOCSerializedDataset(
        corner_packs.single, image_set="val", target_format="tv_tensors", classes="packed"
    )
    assert len(ours) == 12


def _default_labels_case(packed: Packed) -> tuple[list[str], list[str]]:
    """(the names the default classes give, the names the pack holds in pack order)."""
    ours = VOCSerializedDataset(packed.single, image_set="trainval", target_format="tv_tensors")
    return ours.label_names, VOCPackReader(packed.single).classes


@pytest.mark.parametrize(("root", "year"), _tv_tensor_sources())
def test_default_classes_are_voc_or_the_packed_ones(
    corner_packs: Packed, real_packs: Callable[[Path, str], Packed], root: Any, year: Any
) -> None:
    """classes=None: VOC's labels when every packed class is a VOC class, else the packed
    classes in pack order; either way the labels name the XML's objects, on both layouts and
    the iterable, and ``classes=`` overrides it."""
    packed = corner_packs if root == "corner" else real_packs(root, year)
    names, packed_classes = _default_labels_case(packed)
    custom = not set(packed_classes) <= set(VOC_CLASSES)
    assert names == (["__background__", *packed_classes] if custom else VOC_LABELS)
    tv = torchvision_dataset("Main", packed.root, packed.year, "trainval")
    for layout in LAYOUTS:
        ours = VOCSerializedDataset(
            packed.path(layout), image_set="trainval", target_format="tv_tensors"
        )
        stream = ts.VOCSerializedIterableDataset(
            packed.path(layout), "trainval", target_format="tv_tensors", decode="none"
        )
        assert ours.label_names == stream.label_names == names
        for i, (_, streamed) in enumerate(stream):
            target = ours[i][1]
            assert [names[k] for k in target["labels"]] == object_names(tv[i][1])
            assert torch.equal(streamed["labels"], target["labels"])
    if custom:
        assert ("cellbody" in names) == (root == "corner" or "zzkkzz" in root.name)
        by_name = VOCSerializedDataset(
            packed.single, image_set="trainval", target_format="tv_tensors", classes="packed"
        )
        assert by_name.label_names == ["__background__", *sorted(packed_classes)]


@pytest.mark.parametrize(("root", "year"), [pytest.param("synthetic", None), *REAL_PARAMS])
def test_default_labels_equal_the_wrapper_on_voc_data(
    synthetic_packs: Packed, real_packs: Callable[[Path, str], Packed], root: Any, year: Any
) -> None:
    """Where a dataset holds VOC classes only, the default labels are the wrapper's."""
    packed = synthetic_packs if root == "synthetic" else real_packs(root, year)
    names, _ = _default_labels_case(packed)
    if names != VOC_LABELS:
        pytest.skip(f"{packed.root.name} holds classes outside VOC's 20")
    wrapped = wrap_dataset_for_transforms_v2(
        torchvision_dataset("Main", packed.root, packed.year, "trainval")
    )
    ours = VOCSerializedDataset(packed.shards, image_set="trainval", target_format="tv_tensors")
    compared = 0
    for i in range(len(ours)):
        try:
            expected = wrapped[i][1]
        except ValueError:  # fractional coordinates (labelme): the wrapper cannot
            continue
        assert torch.equal(ours[i][1]["labels"], expected["labels"])
        compared += 1
    assert compared > 0 or "labelme" in packed.root.name


# --- 4. transforms, attributes, repr --------------------------------------------------------------


@pytest.mark.parametrize("task", ["Main", "Segmentation"])
def test_v1_transforms_like_torchvision(corner_packs: Packed, task: str) -> None:
    image_set = "val"  # L, CMYK, progressive, PNG, EXIF, 1x1 and 2500x2000 images
    target_transform = object_names if task == "Main" else pil_to_tensor
    kw = {"transform": v1_transform(), "target_transform": target_transform}
    cases = [(kw, kw), ({"transforms": joint}, {"transforms": joint})]
    for tv_kw, our_kw in cases:
        tv = torchvision_dataset(task, *_corner(corner_packs, image_set), **tv_kw)
        ours = our_dataset(task, corner_packs.single, image_set, **our_kw)
        for i in range(len(tv)):
            expected, actual = tv[i], ours[i]
            assert_same_tensors(expected[0], actual[0])
            if task == "Main" and "transforms" in tv_kw:
                assert_same_target(expected[1], actual[1])
            elif task == "Main":
                assert actual[1] == expected[1]
            else:
                assert_same_tensors(expected[1], actual[1])


@pytest.mark.parametrize("task", ["Main", "Segmentation"])
def test_v2_transforms_on_the_wrapper(synthetic_packs: Packed, task: str) -> None:
    tv = torchvision_dataset(
        task, synthetic_packs.root, synthetic_packs.year, "trainval", transforms=v2_transforms()
    )
    ours = our_dataset(task, synthetic_packs.shards, "trainval", transforms=v2_transforms())
    tvw, ow = wrap_dataset_for_transforms_v2(tv), wrap_dataset_for_transforms_v2(ours)
    assert len(ow) == len(tvw) > 0
    for i in range(len(tvw)):
        expected, actual = tvw[i], ow[i]
        assert isinstance(actual[0], tv_tensors.Image) and actual[0].dtype == torch.float32
        assert_same_tensors(expected, actual)


@pytest.mark.parametrize("cls", [VOCSerializedDataset, VOCSerializedSegmentation])
def test_transforms_and_transform_together_raise(corner_packs: Packed, cls: type) -> None:
    base = VOCDetection if cls is VOCSerializedDataset else VOCSegmentation
    kw = {"transforms": joint, "transform": v1.ToTensor()}
    with pytest.raises(ValueError) as expected:
        base(str(corner_packs.root), year=corner_packs.year, image_set="train", **kw)
    with pytest.raises(ValueError) as actual:
        cls(corner_packs.single, image_set="train", **kw)
    assert str(actual.value) == str(expected.value)
    with pytest.raises(ValueError):
        cls(corner_packs.single, image_set="train", target_transform=object_names, transforms=joint)


@pytest.mark.parametrize(("task", "image_set"), [("Main", "trainval"), ("Segmentation", "val")])
def test_attributes_and_repr(corner_packs: Packed, task: str, image_set: str) -> None:
    tv = torchvision_dataset(task, *_corner(corner_packs, image_set))
    root = str(corner_packs.root)
    for layout in LAYOUTS:
        ours = our_dataset(task, corner_packs.path(layout), image_set)
        assert isinstance(ours, type(tv))
        assert (ours.year, ours.image_set) == (tv.year, tv.image_set)
        names = ("images", "annotations") if task == "Main" else ("images", "masks")
        for name in names:
            ours_paths, tv_paths = getattr(ours, name), getattr(tv, name)
            assert [os.path.join(root, p) for p in ours_paths] == tv_paths
        text = repr(ours)
        assert type(ours).__name__ in text
        assert f"Number of datapoints: {len(tv)}" in text
        assert f"Image set: {image_set}" in text


# --- 5. DataLoader workers, fork and spawn --------------------------------------------------------


def _loader_batches(dataset: Any, num_workers: int = 2, context: str | None = None) -> list[Any]:
    loader = DataLoader(
        dataset,
        batch_size=4,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=keep_lists,
        multiprocessing_context=context,
    )
    return list(loader)


def _loader_datasets(packed: Packed, flavour: str) -> tuple[Any, Any]:
    """torchvision's and our trainval with v1 transforms, or wrapped with v2 transforms."""
    if flavour == "v1":
        kw: dict[str, Any] = {"transform": v1_transform(), "target_transform": object_names}
        tv = torchvision_dataset("Main", packed.root, packed.year, "trainval", **kw)
        return tv, VOCSerializedDataset(packed.shards, image_set="trainval", **kw)
    kw = {"transforms": v2_transforms()}
    tv = torchvision_dataset("Main", packed.root, packed.year, "trainval", **kw)
    ours = VOCSerializedDataset(packed.shards, image_set="trainval", **kw)
    return wrap_dataset_for_transforms_v2(tv), wrap_dataset_for_transforms_v2(ours)


@pytest.mark.parametrize("flavour", ["v1", "v2"])
def test_dataloader_batches_equal_torchvision(synthetic_packs: Packed, flavour: str) -> None:
    tv, ours = _loader_datasets(synthetic_packs, flavour)
    ours[0]  # map the shards in this process first: forked workers must still read right
    expected, actual = _loader_batches(tv), _loader_batches(ours)
    assert [len(b) for b in actual] == [len(b) for b in expected] == [4, 4, 4]
    assert_same_tensors(expected, actual)


@pytest.mark.slow
def test_dataloader_under_spawn(synthetic_packs: Packed) -> None:
    """Both flavours in one spawn pool (a spawned worker pays ~10 s importing torch): the
    pickled datasets, maps dropped, must reopen them; torchvision's batches are read in-process.
    """
    pairs = [_loader_datasets(synthetic_packs, flavour) for flavour in ("v1", "v2")]
    tv: ConcatDataset[Any] = ConcatDataset([p[0] for p in pairs])
    ours: ConcatDataset[Any] = ConcatDataset([p[1] for p in pairs])
    for dataset in ours.datasets:
        dataset[0]  # open the maps in the parent, so pickling has something to drop
    assert len(pickle.dumps(ours)) < synthetic_packs.single.stat().st_size // 10  # no pixels
    expected = _loader_batches(tv, num_workers=0)
    actual = _loader_batches(ours, context="spawn")
    assert [len(b) for b in actual] == [len(b) for b in expected] == [4] * 6
    assert_same_tensors(expected, actual)


# --- 6. decode="tensor" and decode="none" ---------------------------------------------------------


@pytest.mark.parametrize("source", ["synthetic", "corner"])
def test_decode_tensor_equals_pil_to_tensor(
    synthetic_packs: Packed, corner_packs: Packed, source: str
) -> None:
    packed = synthetic_packs if source == "synthetic" else corner_packs
    for image_set in ("trainval", "test"):
        tv = torchvision_dataset("Main", packed.root, packed.year, image_set)
        ours = VOCSerializedDataset(packed.shards, image_set=image_set, decode="tensor")
        for i in range(len(tv)):
            expected, actual = pil_to_tensor(tv[i][0]), ours[i][0]
            assert type(actual) is torch.Tensor and actual.dtype == torch.uint8
            assert actual.shape == expected.shape
            assert torch.equal(actual, expected), tv.images[i]  # exact: see module docstring


@pytest.mark.parametrize("task", ["Main", "Segmentation"])
def test_decode_none_returns_file_bytes(corner_packs: Packed, task: str) -> None:
    tv = torchvision_dataset(task, *_corner(corner_packs))
    ours = our_dataset(task, corner_packs.single, "trainval", decode="none")
    for i in range(len(tv)):
        data = ours[i][0]
        assert type(data) is torch.Tensor and data.dtype == torch.uint8 and data.dim() == 1
        assert data.numpy().tobytes() == Path(tv.images[i]).read_bytes()


def _address(buffer: Any) -> int:
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)


@pytest.mark.parametrize("task", ["Main", "Segmentation"])
@pytest.mark.parametrize("layout", ["single", "shards"])
def test_zero_copy_bytes_view_the_mapped_file(corner_packs: Packed, task: str, layout: str) -> None:
    """``zero_copy=True``: the same bytes, but the tensor's memory is the pack's mapping (no
    copy); without it each sample owns a copy."""
    tv = torchvision_dataset(task, *_corner(corner_packs))
    views = our_dataset(task, corner_packs.path(layout), "trainval", decode="none", zero_copy=True)
    copies = our_dataset(task, corner_packs.path(layout), "trainval", decode="none")
    for i in range(len(tv)):
        view, copy = views[i][0], copies[i][0]
        assert type(view) is torch.Tensor and view.dtype == torch.uint8 and view.dim() == 1
        assert view.numpy().tobytes() == Path(tv.images[i]).read_bytes()
        mapped = views.pack.field(views._record(i)[1], 0)
        if len(mapped):
            assert view.data_ptr() == _address(mapped)
            assert copy.data_ptr() != _address(mapped)
    assert "Zero copy: True" in repr(views)


def test_zero_copy_raw_pixels_and_workers(synthetic_devkit: Path, tmp_path: Path) -> None:
    """Raw-pixel packs give the same CHW tensors as views; views cross DataLoader workers."""
    from torch_serialized import pack_voc

    raw = pack_voc(synthetic_devkit, tmp_path / "raw.tser", year=None, image_storage="raw").path
    views = VOCSerializedDataset(raw, image_set="trainval", decode="tensor", zero_copy=True)
    copies = VOCSerializedDataset(raw, image_set="trainval", decode="tensor")
    for i in range(len(views)):
        assert torch.equal(views[i][0], copies[i][0])
    loader = DataLoader(views, batch_size=4, num_workers=2, collate_fn=list)
    got = [image for batch in loader for image, _ in batch]
    assert len(got) == len(copies)
    assert all(torch.equal(a, copies[i][0]) for i, a in enumerate(got))


@pytest.mark.slow
def test_zero_copy_contract_no_warning_and_writes_fault(corner_packs: Packed) -> None:
    """In a fresh interpreter: reading views warns nothing (even under ``-W error``), and
    writing into one is refused by the read-only map (SIGSEGV), never silently stored."""
    read = (
        "import sys; from torch_serialized import VOCSerializedDataset as D\n"
        "ds = D(sys.argv[1], image_set='trainval', decode='none', zero_copy=True)\n"
        "print(sum(len(ds[i][0]) for i in range(len(ds))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", read, str(corner_packs.single)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 0
    write = read.replace("print(sum(len(ds[i][0]) for i in range(len(ds))))", "ds[0][0][0] = 0")
    done = subprocess.run(
        [sys.executable, "-c", write, str(corner_packs.single)], capture_output=True, timeout=120
    )
    assert done.returncode == -signal.SIGSEGV


# --- 7. torchvision's keywords, decoding undecoded bytes in batches -------------------------------
def test_torchvision_keywords_year_and_download(synthetic_devkit: Path, tmp_path: Path) -> None:
    path = ts.pack_voc(synthetic_devkit, tmp_path / "out.tser", year="2007").path
    tv = VOCDetection(synthetic_devkit, year="2007", image_set="val", download=False)
    ours = ts.VOCSerializedDataset(path, year="2007", image_set="val", download=False)
    assert len(ours) == len(tv) and ours[0][1] == tv[0][1]
    segmentation = VOCSegmentation(synthetic_devkit, year="2007", image_set="val")
    assert len(ts.VOCSerializedSegmentation(path, year="2007", image_set="val")) == len(
        segmentation
    )
    with pytest.raises(ValueError, match="VOC2007, not VOC2012"):
        ts.VOCSerializedDataset(path, year="2012")
    with pytest.raises(ValueError, match="pack_voc"):
        ts.VOCSerializedDataset(path, download=True)


def test_torchvision_positional_arguments(synthetic_packs: Packed) -> None:
    """``VOCDetection(root, "2007", "train", False, transform, target_transform, None)`` with
    the pack as the first argument: the same samples; an image set where the year goes says so."""
    root, path = synthetic_packs.root, synthetic_packs.single
    tv = VOCDetection(str(root), "2007", "train", False, pil_to_tensor, object_names, None)
    ours = VOCSerializedDataset(path, "2007", "train", False, pil_to_tensor, object_names, None)
    assert ours.image_set == "train" and len(ours) == len(tv) > 0
    for i in range(len(tv)):
        (image, names), (ref_image, ref_names) = ours[i], tv[i]
        assert torch.equal(image, ref_image) and names == ref_names
    seg = VOCSegmentation(str(root), "2007", "val")
    assert_same_dataset(seg, VOCSerializedSegmentation(path, "2007", "val"), "Segmentation")
    with pytest.raises(ValueError, match=r"'train' is an image set.*image_set='train'"):
        VOCSerializedDataset(path, "train")


def test_undecoded_bytes_batch_decode_like_the_tensor_path(
    synthetic_devkit: Path, tmp_path: Path
) -> None:
    # README: decode="none" output goes to torchvision.io.decode_jpeg in batches (GPU there;
    # the same call on the CPU here) and gives what decode="tensor" gives per sample.
    import warnings

    from torchvision.io import ImageReadMode, decode_jpeg
    from tsbench.gpu import batched_decode

    if not batched_decode():  # README's recipe says so
        pytest.skip("decode_jpeg takes a list from torchvision 0.19 on")
    path = ts.pack_voc(synthetic_devkit, tmp_path / "out.tser", year="2007").path
    raw = ts.VOCSerializedDataset(path, image_set="train", decode="none")
    tensors = ts.VOCSerializedDataset(path, image_set="train", decode="tensor")
    batch = [raw[i][0] for i in range(len(raw))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torchvision 0.29 -> TorchCodec
        decoded = decode_jpeg(batch, mode=ImageReadMode.RGB)
    assert len(decoded) == len(tensors) > 0
    for i, image in enumerate(decoded):
        assert torch.equal(image, tensors[i][0])


# --- 7. batch fetch: __getitems__ ---------------------------------------------------------------


def assert_same_value(expected: Any, actual: Any) -> None:
    """Equal samples of any kind ours return: PIL images, tensors, target dicts, tv_tensors."""
    if isinstance(expected, Image.Image):
        assert_same_image(expected, actual)
        if expected.mode == "P":
            assert actual.getpalette() == expected.getpalette()
    elif isinstance(expected, (tuple, list)):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for e, a in zip(expected, actual):
            assert_same_value(e, a)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_same_value(expected[key], actual[key])
    else:
        assert_same_tensors(expected, actual)


def batch_orders(n: int) -> list[list[int]]:
    """Index lists a DataLoader or a user may pass: shuffled, with repeats and negatives."""
    order = np.random.default_rng(n).permutation(n).tolist()
    return [order, order[: max(1, n // 3)], [0, 0, n - 1], [-1, -n, n // 2], []]


def flip_joint(image: Any, target: Any) -> tuple[Any, Any]:
    """A joint transform: a v2 flip of image, boxes and mask (stored bytes: reversed)."""
    if isinstance(image, torch.Tensor) and image.dim() == 1:
        return image.flip(0), target
    return v2.RandomHorizontalFlip(p=1.0)(image, target)  # type: ignore[no-any-return]


BATCH_CASES = (
    [
        pytest.param("Main", {"decode": d, "target_format": "dict"}, id=f"main-{d}-dict")
        for d in ("pil", "tensor", "none")
    ]
    + [
        pytest.param(
            "Main",
            {"decode": d, "target_format": "tv_tensors", "classes": "packed"},
            id=f"main-{d}-tv",
        )
        for d in ("pil", "tensor", "none")
    ]
    + [
        pytest.param("Segmentation", {"decode": d}, id=f"seg-{d}")
        for d in ("pil", "tensor", "none")
    ]
)


def check_batches(task: str, path: Path, image_set: str, kw: dict[str, Any]) -> None:
    ours = our_dataset(task, path, image_set, **kw)
    for indices in batch_orders(len(ours)):
        assert_same_value([ours[i] for i in indices], ours.__getitems__(indices))
    ours = our_dataset(task, path, image_set, transforms=flip_joint, **kw)
    indices = batch_orders(len(ours))[0]
    assert_same_value([ours[i] for i in indices], ours.__getitems__(indices))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("task", "kw"), BATCH_CASES)
def test_getitems_equals_per_index_access(
    corner_packs: Packed, task: str, kw: dict[str, Any], layout: str
) -> None:
    for set_task, image_set in CORNER_SETS:
        if set_task == task:
            check_batches(task, corner_packs.path(layout), image_set, kw)


@pytest.mark.slow
@pytest.mark.parametrize(("root", "year"), REAL_PARAMS)
def test_getitems_equals_per_index_access_on_real_data(
    real_packs: Callable[[Path, str], Packed], root: Path, year: str
) -> None:
    packed = real_packs(root, year)
    sets = standard_sets(root, year)
    # trainval holds every sample of train and val: batches over it cover their records
    covering = [(t, s) for t, s in sets if s not in ("train", "val") or (t, "trainval") not in sets]
    for task, image_set in covering:
        for param in BATCH_CASES:
            case_task, kw = param.values
            if case_task == task:
                for layout in LAYOUTS:
                    check_batches(task, packed.path(layout), image_set, kw)


@pytest.mark.parametrize("task", ["Main", "Segmentation"])
def test_getitems_refuses_bad_indices_as_a_list_does(corner_packs: Packed, task: str) -> None:
    ours = our_dataset(task, corner_packs.shards, "trainval", decode="none")
    n = len(ours)
    for bad in ([0, n], [-n - 1], [1, 2, n + 5]):
        with pytest.raises(IndexError):
            ours.__getitems__(bad)


def test_dataloader_calls_getitems_once_per_batch(synthetic_packs: Packed, monkeypatch) -> None:
    ours = VOCSerializedDataset(synthetic_packs.shards, image_set="trainval", decode="none")
    calls: list[int] = []
    batch = VOCSerializedDataset.__getitems__

    def counted(self: Any, indices: Any) -> Any:
        calls.append(len(indices))
        return batch(self, indices)

    monkeypatch.setattr(VOCSerializedDataset, "__getitems__", counted)
    loader = DataLoader(ours, batch_size=5, shuffle=True, collate_fn=keep_lists)
    got = [sample for batch_ in loader for sample in batch_]
    n = len(ours)
    assert calls == [5] * (n // 5) + [n % 5] * (n % 5 > 0) and len(got) == n


def _owned_and_fresh(first: Any, second: Any) -> None:
    """Two reads of one sample are separate objects: mutating the first (its image bytes,
    its target) leaves the second as read."""
    image, target = first
    again_image, again_target = second
    assert again_image is not image and again_target is not target
    snapshot = copy.deepcopy(second)
    image.add_(1)  # owned, writable memory: a copy, never the map nor a shared buffer
    if "annotation" in target:
        target["annotation"]["object"].clear()
        target["annotation"]["filename"] = "changed"
    else:
        target["boxes"].add_(1)
        target["labels"].add_(1)
        target.clear()
    assert_same_value(snapshot, second)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("task", ["Main", "Segmentation"])
def test_a_batch_holds_one_decoded_image_at_a_time(
    synthetic_packs: Packed, task: str, layout: str
) -> None:
    """``__getitems__`` with a transform decoded the whole batch, then transformed it: every
    decoded image of the batch stayed alive until the last transform ran (the drop-in's
    32 PIL images, ~18 MB per worker, on top of the tensors made from them), where a
    per-index fetch holds one. Each image is now transformed as soon as it is decoded."""
    alive: list[int] = []
    seen: list[weakref.ref[Any]] = []

    def to_tensor(image: Any, target: Any) -> tuple[Any, Any]:
        seen.append(weakref.ref(image))
        alive.append(sum(ref() is not None for ref in seen))
        return pil_to_tensor(image), target

    ours = our_dataset(task, synthetic_packs.path(layout), "train", transforms=to_tensor)
    plain = our_dataset(task, synthetic_packs.path(layout), "train")
    indices = list(range(len(ours)))[::-1]
    batch = ours.__getitems__(indices)
    assert len(alive) == len(indices) > 1 and max(alive) == 1
    for i, (image, target) in zip(indices, batch):
        assert torch.equal(image, pil_to_tensor(plain[i][0]))
        assert_same_value(target, plain[i][1])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("target_format", ["dict", "tv_tensors"])
def test_each_read_returns_fresh_samples(
    corner_packs: Packed, layout: str, target_format: str
) -> None:
    """The fast read paths share nothing mutable between calls: per index and in a batch
    that names one index twice."""
    kw: dict[str, Any] = {"decode": "none", "target_format": target_format, "classes": "packed"}
    ours = VOCSerializedDataset(corner_packs.path(layout), image_set="trainval", **kw)
    plain = VOCSerializedDataset(corner_packs.path(layout), image_set="trainval", decode="none")
    with_objects = next(i for i in range(len(plain)) if plain[i][1]["annotation"].get("object"))
    _owned_and_fresh(ours[with_objects], ours[with_objects])
    first, second = ours.__getitems__([with_objects, with_objects])
    _owned_and_fresh(first, second)
    _owned_and_fresh(ours.__getitems__([with_objects])[0], ours[with_objects])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("task", ["Main", "Segmentation"])
def test_bad_indices_name_the_index_and_the_length(
    synthetic_packs: Packed, task: str, layout: str
) -> None:
    """``ds[10000]`` said "index out of bounds on dimension 1" and ``ds["000002"]``
    "memoryview: invalid slice key": neither named the index nor the length."""
    ours = our_dataset(task, synthetic_packs.path(layout), "train", decode="none")
    n, name = len(ours), type(ours).__name__
    for bad in (n, 10000, -n - 1):
        for call, argument in ((ours.__getitem__, bad), (ours.__getitems__, [0, bad])):
            with pytest.raises(IndexError) as caught:
                call(argument)
            message = str(caught.value)
            assert f"{name} index {bad} is out of range" in message
            assert f"{n} samples (0 to {n - 1}, or -{n} to -1)" in message
            assert "image set 'train'" in message
    for wrong in ("000002", 1.5, None, slice(1, 3), (1,), [1], np.array([1])):
        for call, argument in ((ours.__getitem__, wrong), (ours.__getitems__, [wrong])):
            with pytest.raises(TypeError) as caught:
                call(argument)
            assert f"{name} indices must be integers, not {type(wrong).__name__}" in str(
                caught.value
            )
    with pytest.raises(TypeError, match=re.escape("ids.index('000002')")):
        ours["000002"]
    span = range(*slice(1, 3).indices(n))
    with pytest.raises(TypeError, match=re.escape(f"Subset(dataset, {span})")):
        ours[1:3]
    assert_same_value(ours[-1], ours[n - 1])
    for one in (True, np.int64(1), np.uint8(1), torch.tensor(1)):  # what a list accepts
        assert_same_value(ours[one], ours[int(one)])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_index_lookup_survives_pickle_and_copy(corner_packs: Packed, layout: str) -> None:
    """A pickled or copied dataset indexes as a list does."""
    ours = VOCSerializedDataset(corner_packs.path(layout), image_set="trainval", decode="none")
    n = len(ours)
    for clone in (pickle.loads(pickle.dumps(ours)), copy.deepcopy(ours), copy.copy(ours)):
        for i in (0, n - 1, -1, -n, np.int64(1)):
            assert_same_value(ours[i], clone[i])
        for bad in (n, -n - 1):
            with pytest.raises(IndexError):
                clone[bad]
        with pytest.raises(TypeError):
            clone["0"]


class PerIndex(VOCSerializedDataset):
    """A user subclass that changes what one sample is."""

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image, target = super().__getitem__(index)
        return image, {"wrapped": target}


def test_getitems_defers_to_an_overriding_getitem(corner_packs: Packed) -> None:
    """Subclasses that override ``__getitem__`` (a user's, torchvision's transforms-v2 wrapper)
    keep deciding what a sample is when a DataLoader fetches whole batches."""
    ours = PerIndex(corner_packs.single, image_set="trainval", decode="none")
    assert_same_value([ours[i] for i in (2, 0)], ours.__getitems__([2, 0]))
    wrapped = wrap_dataset_for_transforms_v2(
        VOCSerializedDataset(corner_packs.single, image_set="train"),
        target_keys={"boxes", "labels"},
    )
    tv = wrap_dataset_for_transforms_v2(
        torchvision_dataset("Main", corner_packs.root, corner_packs.year, "train"),
        target_keys={"boxes", "labels"},
    )
    indices = [i for i in range(len(tv)) if _wrapper_ok(tv, i)]
    assert indices
    assert_same_value([tv[i] for i in indices], wrapped.__getitems__(indices))


def _wrapper_ok(tv: Any, i: int) -> bool:
    try:
        tv[i]
    except (KeyError, ValueError):  # torchvision's wrapper crashes on some corner cases
        return False
    return True
