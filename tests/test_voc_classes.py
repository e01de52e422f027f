"""VOC class names and the segmentation palette, as the devkit defines them."""

from __future__ import annotations

import pytest

from torch_serialized.voc.classes import VOC_CLASSES, VOC_COLORMAP, VOC_PALETTE, voc_colormap


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
