"""VOC class names and the segmentation palette, as the devkit defines them."""

from __future__ import annotations

import pytest

from torch_serialized.voc.classes import (
    VOC_CLASSES,
    VOC_COLORMAP,
    VOC_PALETTE,
    label_classes,
    voc_colormap,
)


def test_classes_and_colormap() -> None:
    assert len(VOC_CLASSES) == 20 and list(VOC_CLASSES) == sorted(VOC_CLASSES)
    assert VOC_CLASSES[0] == "aeroplane" and VOC_CLASSES[-1] == "tvmonitor"
    assert len(VOC_COLORMAP) == 256 and len(VOC_PALETTE) == 768
    assert VOC_COLORMAP[:4] == ((0, 0, 0), (128, 0, 0), (0, 128, 0), (128, 128, 0))
    assert VOC_COLORMAP[15] == (192, 128, 128)  # person
    assert VOC_COLORMAP[255] == (224, 224, 192)  # void
    assert voc_colormap(21) == VOC_COLORMAP[:21]


@pytest.mark.parametrize("n", [-1, 257])
def test_colormap_refuses_sizes_outside_0_to_256(n: int) -> None:
    with pytest.raises(ValueError, match="0..256"):
        voc_colormap(n)


def test_label_classes_default_and_packed_rules() -> None:
    """``"default"``: VOC's 20 in VOC order when every class of the pack is one of them (all
    20 included), else the pack's classes in pack order; ``"packed"``: sorted by name. A
    grown pack keeps its ``base`` list and adds new classes after it."""
    every = list(reversed(VOC_CLASSES))  # all 20, first seen in reverse order
    assert label_classes("default", every, None) == list(VOC_CLASSES)
    assert label_classes("default", ["dog", "cat"], None) == list(VOC_CLASSES)
    assert label_classes("default", ["dog", "unicorn"], None) == ["dog", "unicorn"]
    assert label_classes("packed", ["dog", "unicorn", "cat"], None) == ["cat", "dog", "unicorn"]
    base = {"default": ["dog", "unicorn"], "packed": ["dog", "unicorn"]}
    grown = ["unicorn", "ant", "dog"]
    assert label_classes("default", grown, base) == ["dog", "unicorn", "ant"]
    assert label_classes("packed", grown, base) == ["dog", "unicorn", "ant"]
