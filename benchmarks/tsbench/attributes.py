"""The ``attributes`` scenario: ``images[i]`` and friends, per access, at 10,000 images.

Training code written for torchvision indexes ``dataset.images`` / ``annotations`` per sample;
for us each is a lazy sequence (``torch_serialized.voc.names``). Measured on a devkit of
``ATTRIBUTE_IMAGES`` tiny samples made for it (the access cost does not depend on image size).
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np

from tsbench.context import Bench
from tsbench.core import IMAGE_SET, SEED, Row, Stat

ATTRIBUTE_IMAGES = 10_000
#: Microseconds per ``images[i]`` the target allows.
TARGET_US = 2.0

_XML = (
    "<annotation><folder>VOC2012</folder><filename>{id}.jpg</filename>"
    "<size><width>16</width><height>16</height><depth>3</depth></size><segmented>0</segmented>"
    "<object><name>dog</name><pose>Unspecified</pose><truncated>0</truncated>"
    "<difficult>0</difficult><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>9</xmax>"
    "<ymax>9</ymax></bndbox></object></annotation>"
)


def tiny_devkit(root: Path, count: int, year: str = "2012") -> Path:
    """torchvision's root of a devkit of ``count`` 16x16 samples (``trainval`` lists all)."""
    from PIL import Image

    voc = root / "VOCdevkit" / f"VOC{year}"
    for folder in ("JPEGImages", "Annotations", "ImageSets/Main"):
        (voc / folder).mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 120, 200)).save(buffer, "JPEG")
    jpeg = buffer.getvalue()
    ids = [f"{year}_{i:06d}" for i in range(count)]
    for image_id in ids:
        (voc / "JPEGImages" / f"{image_id}.jpg").write_bytes(jpeg)
        (voc / "Annotations" / f"{image_id}.xml").write_text(_XML.format(id=image_id))
    for name in ("train", "val", "trainval"):
        half = count // 2
        chosen = {"train": ids[:half], "val": ids[half:], "trainval": ids}[name]
        (voc / "ImageSets" / "Main" / f"{name}.txt").write_text("\n".join(chosen) + "\n")
    return root


def scenario_attributes(b: Bench) -> list[Row]:
    from torchvision.datasets import VOCDetection

    from torch_serialized import VOCSerializedDataset, pack_voc

    count = 512 if b.quick else ATTRIBUTE_IMAGES
    root = tiny_devkit(b.work / "attributes", count)
    pack = pack_voc(root, b.work / "attributes.tser", year="2012").path
    tv = VOCDetection(str(root), year="2012", image_set=IMAGE_SET)
    ours = VOCSerializedDataset(pack, image_set=IMAGE_SET)
    same = [str(root / p) for p in ours.images] == tv.images
    order = np.random.default_rng(SEED).permutation(count).tolist()
    sides = {"tv": tv, "ours": ours}
    times: dict[str, dict[str, list[float]]] = {
        name: {side: [] for side in sides} for name in ("images", "annotations")
    }
    passes = 3

    def run(ds: object, name: str) -> None:
        for _ in range(passes):
            for i in order:
                getattr(ds, name)[i]  # as training code writes it: attribute, then index

    for name in times:
        for ds in sides.values():
            run(ds, name)  # warm: maps, caches
    for _ in range(b.repeats):
        for name in times:
            for side, ds in sides.items():
                start = time.perf_counter()
                run(ds, name)
                times[name][side].append((time.perf_counter() - start) / count / passes * 1e6)
    b.details["attributes"] = {"images": count, "same_paths_as_torchvision": same}
    rows = []
    for name in times:
        row = Row(
            f"attribute_{name}",
            "attributes",
            f"dataset.{name}[i] at {count:,} images",
            "µs/access",
            "limit",
            Stat.of(times[name]["tv"]),
            Stat.of(times[name]["ours"]),
            target=TARGET_US,
            note="torchvision: a list; ours: a lazy read-only sequence over the pack's id "
            f"table; same paths as torchvision (joined to its root): {same}",
            reason=f"{Stat.of(times[name]['ours']).median:.2f} µs per access",
        )
        if not same:
            row.met, row.reason = False, "the paths differ from torchvision's: a bug"
        rows.append(row)
    return rows
