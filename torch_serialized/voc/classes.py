"""Pascal VOC class names (torchvision's alphabetical order) and the segmentation colormap."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

VOC_CLASSES: tuple[str, ...] = (  #: mask value i + 1 is VOC_CLASSES[i]; 0: background
    "aeroplane",
    "bicycle",
    "bird",
    "boat",
    "bottle",
    "bus",
    "car",
    "cat",
    "chair",
    "cow",
    "diningtable",
    "dog",
    "horse",
    "motorbike",
    "person",
    "pottedplant",
    "sheep",
    "sofa",
    "train",
    "tvmonitor",
)

VOC_IGNORE_INDEX: int = 255  #: Mask value of the "void" band that VOC draws around object borders.


def voc_colormap(n: int = 256) -> tuple[tuple[int, int, int], ...]:
    """The first ``n`` colours of the VOC devkit's ``labelcolormap`` (bit-interleaved)."""
    if not 0 <= n <= 256:
        raise ValueError(f"voc_colormap: n must be in 0..256, got {n}")

    def channel(i: int, c: int) -> int:  # bit j of channel c is bit 3j + c of i, high bits first
        return sum(((i >> (3 * j + c)) & 1) << (7 - j) for j in range(8))

    return tuple((channel(i, 0), channel(i, 1), channel(i, 2)) for i in range(n))


#: The 256-entry VOC palette (0 black, ..., 255 the void colour ``(224, 224, 192)``).
VOC_COLORMAP: tuple[tuple[int, int, int], ...] = voc_colormap()

VOC_PALETTE: bytes = bytes(v for rgb in VOC_COLORMAP for v in rgb)  #: For ``PIL.Image.putpalette``.


def label_classes(rule: str, classes: Sequence[str], base: Mapping[str, Any] | None) -> list[str]:
    """The class names after ``"__background__"`` in ``tv_tensors`` labels: ``"default"``
    (VOC's 20 if they hold every class, else pack order) or ``"packed"`` (sorted). After an append,
    ``base`` (metadata ``label_base``) comes first, so no label moves."""
    if base is not None:
        known = set(base[rule])
        return [*base[rule], *(c for c in classes if c not in known)]
    if rule == "packed":
        return sorted(classes)
    return list(VOC_CLASSES) if set(classes) <= set(VOC_CLASSES) else list(classes)
