"""A deterministic synthetic Pascal VOC dataset on disk.

Benchmarks, tests and the offline sample need a VOCdevkit without the 2 GB download. The
images are not photographs, but they have VOC's sizes and roughly its JPEG cost (about
100 KB per 500x375 image, from multi-octave noise, shading and textured object shapes drawn
where the boxes are), so decode and I/O measurements stay meaningful. Annotations follow the
genuine VOC XML schema and masks are palette PNGs with the VOC colormap and 255 borders, so
``torchvision.datasets.VOCDetection`` / ``VOCSegmentation`` read the tree unchanged.

Every image is a pure function of ``(seed, image index)``; ids and splits are a pure function
of ``(seed, year, num_images)``. The same arguments therefore give byte-identical files, however
the work were divided between processes (on one platform: another libjpeg or numpy build may
round a few pixels differently).
"""

# More than 400 lines: one recipe (image texture, object shapes, masks, XML, lists) whose
# parts share the random streams that make every byte reproducible.

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from ..voc.classes import VOC_CLASSES, VOC_IGNORE_INDEX, VOC_PALETTE
from ..voc.layout import base_dir

__all__ = ["make_synthetic_voc"]

# (width, height, share): the common VOC sizes, landscape 500x375 first.
_SIZES: tuple[tuple[int, int, float], ...] = (
    (500, 375, 0.50),
    (375, 500, 0.20),
    (500, 333, 0.10),
    (333, 500, 0.05),
    (500, 500, 0.04),
    (400, 300, 0.03),
    (500, 400, 0.03),
    (500, 334, 0.03),
    (353, 500, 0.02),
)
_POSES: tuple[str, ...] = ("Unspecified", "Left", "Right", "Frontal", "Rear")
_POSE_P = np.array([0.45, 0.2, 0.2, 0.1, 0.05])
_NUM_OBJECTS_P = np.array([0.42, 0.24, 0.14, 0.09, 0.06, 0.05])  # 1..6 objects
_TALL = frozenset({"person", "bottle", "pottedplant", "chair"})
_WIDE = frozenset({"aeroplane", "boat", "bus", "car", "diningtable", "sofa", "train"})
_SHAPES: tuple[str, ...] = ("ellipse", "rectangle", "rounded", "polygon")

_JPEG_QUALITY = 92  # Pillow's defaults otherwise (4:2:0 subsampling, baseline, JFIF)
_TILE = 640  # side of each precomputed noise tile; larger than any VOC image side
_NUM_TILES = 4
_BORDER = 3  # width of the 255 "void" band drawn around each object in the masks

# Independent random streams: one for the noise tiles, one for ids/splits, one per image.
_STREAM_TILES, _STREAM_LAYOUT, _STREAM_IMAGE = 1, 2, 3


def _class_probabilities() -> np.ndarray:
    """VOC-like class frequencies: person dominates, then chair and car."""
    weights = np.ones(len(VOC_CLASSES))
    weights[VOC_CLASSES.index("person")] = 8.0
    weights[VOC_CLASSES.index("chair")] = 2.0
    weights[VOC_CLASSES.index("car")] = 2.0
    return weights / weights.sum()


_CLASS_P = _class_probabilities()


@dataclass(frozen=True)
class _NoiseBank:
    """Precomputed texture tiles, cropped, flipped and mixed per image (cheap per image).

    ``features`` is ``(n, T, T, 4)`` float32 with unit-std channels: 1/f multi-octave
    structure, fine grain (one- and two-pixel scale) and two low-frequency colour fields. An
    image is ``crop @ mix + base`` with a random ``(4, 3)`` mix: one small matmul per texture.
    """

    features: np.ndarray


@dataclass(frozen=True)
class _Part:
    name: str
    box: tuple[int, int, int, int]  # 1-based inclusive xmin, ymin, xmax, ymax


@dataclass(frozen=True)
class _Object:
    name: str
    pose: str
    truncated: int
    occluded: int
    difficult: int
    box: tuple[int, int, int, int]  # 1-based inclusive xmin, ymin, xmax, ymax, inside the image
    shape: str
    geometry: tuple[float, ...]  # 0-based drawing coords: x0, y0, x1, y1 or polygon x, y pairs
    parts: tuple[_Part, ...] = ()


def _upsampled(rng: np.random.Generator, cells: int, size: int) -> np.ndarray:
    """Gaussian noise on a ``cells`` x ``cells`` grid, bicubically upsampled to ``size``."""
    low = rng.standard_normal((cells, cells)).astype(np.float32)
    if cells >= size:
        return low[:size, :size]
    up = Image.fromarray(low).resize((size, size), Image.Resampling.BICUBIC)
    return np.asarray(up, dtype=np.float32)


def _unit(a: np.ndarray) -> np.ndarray:
    a = a - a.mean(dtype=np.float64)
    return (a / a.std(dtype=np.float64)).astype(np.float32)


def _make_noise_bank(seed: int) -> _NoiseBank:
    """Build the per-seed texture tiles (about 0.3 s, once per call); all images crop these."""
    rng = np.random.default_rng([seed, _STREAM_TILES])
    size, tiles = _TILE, []
    for _ in range(_NUM_TILES):
        # Roughly the 1/f amplitude spectrum of photographs, a little flatter so that
        # mid-scale detail (3-20 px) carries part of the JPEG cost, not only the grain.
        structure = np.zeros((size, size), np.float32)
        for cells in (3, 6, 12, 24, 48, 96, 192):
            structure += _upsampled(rng, cells, size) * (3.0 / cells) ** 0.75
        grain = _upsampled(rng, size // 2, size) + 0.6 * _upsampled(rng, size, size)
        chroma = [_upsampled(rng, 5, size) + _upsampled(rng, 20, size) for _ in range(2)]
        tiles.append(np.stack([_unit(c) for c in (structure, grain, *chroma)], axis=-1))
    return _NoiseBank(np.stack(tiles))


def _crop(tiles: np.ndarray, rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A random tile, cropped at a random offset and randomly flipped (a view, no copy)."""
    k = int(rng.integers(tiles.shape[0]))
    y = int(rng.integers(tiles.shape[1] - height + 1))
    x = int(rng.integers(tiles.shape[2] - width + 1))
    view = tiles[k, y : y + height, x : x + width]
    flip_y, flip_x = rng.integers(2, size=2)
    return view[:: -1 if flip_y else 1, :: -1 if flip_x else 1]


def _texture(
    bank: _NoiseBank, rng: np.random.Generator, height: int, width: int, detail: float
) -> np.ndarray:
    """An RGB float32 texture: tinted 1/f luminance with fine grain, plus colour drift."""
    tint = rng.uniform(0.75, 1.25, size=3)
    mix = np.empty((4, 3))
    mix[0] = tint * rng.uniform(28.0, 50.0)  # structure (shading, blobs, mid-scale detail)
    mix[1] = tint * detail * rng.uniform(0.8, 1.25)  # grain: sets most of the JPEG cost
    mix[2:] = rng.uniform(-8.0, 8.0, size=(2, 3))  # colour drift
    rgb = _crop(bank.features, rng, height, width) @ mix.astype(np.float32)
    rgb += rng.uniform(50.0, 190.0, size=3).astype(np.float32)
    return rgb


def _draw_shape(
    draw: ImageDraw.ImageDraw,
    obj: _Object,
    fill: int,
    offset: tuple[float, float] = (0.0, 0.0),
    outline: int | None = None,
    width: int = 0,
) -> None:
    """Draw ``obj``'s silhouette (shifted by ``-offset``) with ``fill`` and an optional outline."""
    dx, dy = offset
    xy = [v - (dx if i % 2 == 0 else dy) for i, v in enumerate(obj.geometry)]
    if obj.shape == "ellipse":
        draw.ellipse(xy, fill=fill, outline=outline, width=width)
    elif obj.shape == "rectangle":
        draw.rectangle(xy, fill=fill, outline=outline, width=width)
    elif obj.shape == "rounded":
        radius = int(0.2 * min(xy[2] - xy[0], xy[3] - xy[1]))
        draw.rounded_rectangle(xy, radius=radius, fill=fill, outline=outline, width=width)
    else:
        draw.polygon(xy, fill=fill, outline=outline, width=width)


def _render_image(
    bank: _NoiseBank, rng: np.random.Generator, width: int, height: int, objects: Sequence[_Object]
) -> Image.Image:
    """Background texture, then each object's own texture inside its silhouette."""
    detail = rng.uniform(15.0, 24.0)  # per-image sharpness: spreads the JPEG sizes
    rgb = _texture(bank, rng, height, width, detail)
    for obj in objects:
        x0, y0, x1, y1 = obj.box[0] - 1, obj.box[1] - 1, obj.box[2], obj.box[3]
        mask = Image.new("L", (x1 - x0, y1 - y0), 0)
        _draw_shape(ImageDraw.Draw(mask), obj, 1, offset=(x0, y0))
        inside = np.asarray(mask, dtype=bool)[:, :, None]
        tex = _texture(bank, rng, y1 - y0, x1 - x0, detail * rng.uniform(0.8, 1.2))
        np.copyto(rgb[y0:y1, x0:x1], tex, where=inside)
    np.clip(rgb, 0.0, 255.0, out=rgb)
    return Image.fromarray(rgb.astype(np.uint8))


def _render_masks(width: int, height: int, objects: Sequence[_Object]) -> tuple[Image.Image, ...]:
    """SegmentationClass and SegmentationObject PNGs: VOC palette, 255 bands at the borders."""
    masks = []
    for by_class in (True, False):
        mask = Image.new("P", (width, height), 0)
        mask.putpalette(VOC_PALETTE)
        draw = ImageDraw.Draw(mask)
        for index, obj in enumerate(objects, start=1):
            value = VOC_CLASSES.index(obj.name) + 1 if by_class else index
            _draw_shape(draw, obj, value, outline=VOC_IGNORE_INDEX, width=_BORDER)
        masks.append(mask)
    return tuple(masks)


# (part, probability, x0, y0, x1, y1) as fractions of the person box: VOC's person layout.
_PERSON_PARTS: tuple[tuple[str, float, float, float, float, float], ...] = (
    ("head", 1.0, 0.34, 0.02, 0.66, 0.2),
    ("hand", 0.8, 0.02, 0.45, 0.18, 0.55),
    ("hand", 0.6, 0.82, 0.45, 0.98, 0.55),
    ("foot", 0.5, 0.2, 0.92, 0.45, 0.99),
)


def _person_parts(rng: np.random.Generator, box: tuple[int, int, int, int]) -> tuple[_Part, ...]:
    """Head, hands and feet boxes inside a person box, as in VOC's person-layout annotations."""
    xmin, ymin, xmax, ymax = box
    bw, bh = xmax - xmin, ymax - ymin
    parts = []
    for name, p, fx0, fy0, fx1, fy1 in _PERSON_PARTS:
        if rng.random() >= p:
            continue
        part = (
            xmin + round(fx0 * bw),
            ymin + round(fy0 * bh),
            xmin + round(fx1 * bw),
            ymin + round(fy1 * bh),
        )
        if part[2] > part[0] and part[3] > part[1]:
            parts.append(_Part(name, part))
    return tuple(parts)


def _plan_object(rng: np.random.Generator, width: int, height: int) -> _Object:
    """One object: class, box (possibly truncated by the border), silhouette and flags."""
    name = VOC_CLASSES[int(rng.choice(len(VOC_CLASSES), p=_CLASS_P))]
    aspect = math.exp(rng.normal(0.0, 0.3))  # height / width
    aspect *= 2.0 if name in _TALL else 0.6 if name in _WIDE else 1.0
    area = math.exp(rng.uniform(math.log(0.01), math.log(0.6))) * width * height
    bw = min(max(math.sqrt(area / aspect), 12.0), 1.15 * width)
    bh = min(max(bw * aspect, 12.0), 1.15 * height)
    cx, cy = rng.uniform(0.1, 0.9) * width, rng.uniform(0.1, 0.9) * height
    gx0, gy0, gx1, gy1 = cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2
    x0, y0 = max(0, math.floor(gx0)), max(0, math.floor(gy0))
    x1, y1 = min(width, math.ceil(gx1)), min(height, math.ceil(gy1))  # exclusive
    truncated = int(gx0 < 0 or gy0 < 0 or gx1 > width or gy1 > height)
    shape = _SHAPES[int(rng.integers(len(_SHAPES)))]
    if shape == "polygon":
        n = int(rng.integers(5, 9))
        angles = np.sort(rng.uniform(0.0, 2 * math.pi, n))
        radii = rng.uniform(0.75, 1.0, n)
        xs = cx + 0.5 * bw * radii * np.cos(angles)
        ys = cy + 0.5 * bh * radii * np.sin(angles)
        geometry = tuple(float(round(v, 2)) for xy in zip(xs, ys) for v in xy)
    else:
        geometry = (gx0, gy0, gx1 - 1, gy1 - 1)
    box = (x0 + 1, y0 + 1, x1, y1)
    small = (x1 - x0) * (y1 - y0) < 0.01 * width * height
    difficult = int(rng.random() < (0.3 if small else 0.02))
    pose = _POSES[int(rng.choice(len(_POSES), p=_POSE_P))]
    parts: tuple[_Part, ...] = ()
    if name == "person" and x1 - x0 >= 40 and y1 - y0 >= 80 and rng.random() < 0.35:
        parts = _person_parts(rng, box)
    return _Object(name, pose, truncated, 0, difficult, box, shape, geometry, parts)


def _plan_objects(rng: np.random.Generator, width: int, height: int) -> list[_Object]:
    """1-6 objects, back to front; an object is ``occluded`` when a later box covers >10% of it."""
    count = int(rng.choice(len(_NUM_OBJECTS_P), p=_NUM_OBJECTS_P)) + 1
    objects = [_plan_object(rng, width, height) for _ in range(count)]
    # Draw big objects first so small ones stay visible, as in photographs.
    objects.sort(key=lambda o: -(o.box[2] - o.box[0]) * (o.box[3] - o.box[1]))
    planned = []
    for i, obj in enumerate(objects):
        xmin, ymin, xmax, ymax = obj.box
        own = (xmax - xmin + 1) * (ymax - ymin + 1)
        covered = 0
        for other in objects[i + 1 :]:
            ox = min(xmax, other.box[2]) - max(xmin, other.box[0]) + 1
            oy = min(ymax, other.box[3]) - max(ymin, other.box[1]) + 1
            covered = max(covered, max(ox, 0) * max(oy, 0))
        occluded = int(covered > 0.1 * own)
        planned.append(replace(obj, occluded=occluded))
    return planned


def _annotation_xml(
    image_id: str,
    year: str,
    width: int,
    height: int,
    segmented: bool,
    objects: Sequence[_Object],
    rng: np.random.Generator,
) -> str:
    """The annotation in the genuine VOC layout (tab-indented, no XML declaration).

    VOC2007-style files carry flickr ids and an owner and no ``occluded``; later years name the
    database after the image's id year and give ``occluded`` on most images.
    """
    voc2007 = year == "2007"
    source_year = "2007" if voc2007 else image_id[:4]
    lines = [
        "<annotation>",
        f"\t<folder>VOC{year}</folder>",
        f"\t<filename>{image_id}.jpg</filename>",
        "\t<source>",
        f"\t\t<database>The VOC{source_year} Database</database>",
        f"\t\t<annotation>PASCAL VOC{source_year}</annotation>",
        "\t\t<image>flickr</image>",
    ]
    if voc2007:
        lines += [
            f"\t\t<flickrid>{int(rng.integers(10**8, 4 * 10**8))}</flickrid>",
            "\t</source>",
            "\t<owner>",
            f"\t\t<flickrid>user{int(rng.integers(10**4, 10**5))}</flickrid>",
            "\t\t<name>?</name>",
            "\t</owner>",
        ]
    else:
        lines.append("\t</source>")
    lines += [
        "\t<size>",
        f"\t\t<width>{width}</width>",
        f"\t\t<height>{height}</height>",
        "\t\t<depth>3</depth>",
        "\t</size>",
        f"\t<segmented>{int(segmented)}</segmented>",
    ]
    with_occluded = not voc2007 and rng.random() < 0.75

    def bndbox(box: tuple[int, int, int, int], indent: str) -> list[str]:
        tags = ("xmin", "ymin", "xmax", "ymax")
        inner = [f"{indent}\t<{t}>{v}</{t}>" for t, v in zip(tags, box)]
        return [f"{indent}<bndbox>", *inner, f"{indent}</bndbox>"]

    for obj in objects:
        lines += [
            "\t<object>",
            f"\t\t<name>{obj.name}</name>",
            f"\t\t<pose>{obj.pose}</pose>",
            f"\t\t<truncated>{obj.truncated}</truncated>",
        ]
        if with_occluded:
            lines += [f"\t\t<occluded>{obj.occluded}</occluded>", *bndbox(obj.box, "\t\t")]
            lines.append(f"\t\t<difficult>{obj.difficult}</difficult>")
        else:
            lines.append(f"\t\t<difficult>{obj.difficult}</difficult>")
            lines += bndbox(obj.box, "\t\t")
        for part in obj.parts:
            lines += ["\t\t<part>", f"\t\t\t<name>{part.name}</name>", *bndbox(part.box, "\t\t\t")]
            lines.append("\t\t</part>")
        lines.append("\t</object>")
    lines.append("</annotation>")
    return "\n".join(lines) + "\n"


def _image_ids(rng: np.random.Generator, year: str, num_images: int) -> list[str]:
    """Sorted, unique ids: ``000123`` for 2007, ``2008_000123`` (2008..year) for later years."""
    gaps = np.cumsum(rng.integers(1, 4, size=num_images)) + 1
    if year == "2007":
        return [f"{n:06d}" for n in gaps]
    prefixes = list(range(2008, min(int(year), 2011) + 1))
    ids, start = [], 0
    for p, prefix in enumerate(prefixes):
        stop = (p + 1) * num_images // len(prefixes)
        base = gaps[start - 1] if start else 0
        ids += [f"{prefix}_{n - base:06d}" for n in gaps[start:stop]]
        start = stop
    return ids


def _splits(rng: np.random.Generator, year: str, segmented: Sequence[bool]) -> list[str]:
    """Each image's split: half train / half val, or (2007) a quarter each and half test.

    Segmented and other images are split separately, so the Segmentation lists are balanced too
    and, as in VOC, each Segmentation split is a subset of the Main split of the same name.
    """
    split = ["train"] * len(segmented)
    for group in (True, False):
        members = [i for i, s in enumerate(segmented) if s == group]
        order = [members[k] for k in rng.permutation(len(members))]
        half, quarter = len(order) // 2, len(order) // 4
        held_out = ("test",) * half + ("val",) * quarter if year == "2007" else ("val",) * half
        for i, name in zip(order, held_out):
            split[i] = name
    return split


def _write_image_sets(folder: Path, ids: Sequence[str], splits: Sequence[str], year: str) -> None:
    """``train``/``val``/``trainval`` (and ``test`` for 2007) lists, one sorted id per line."""
    folder.mkdir(parents=True, exist_ok=True)
    names = ("train", "val", "test") if year == "2007" else ("train", "val")
    lists = {name: [i for i, s in zip(ids, splits) if s == name] for name in names}
    lists["trainval"] = sorted(lists["train"] + lists["val"])
    for name, members in lists.items():
        text = "".join(f"{m}\n" for m in sorted(members))
        (folder / f"{name}.txt").write_text(text, encoding="ascii", newline="\n")


def make_synthetic_voc(
    root: str | os.PathLike[str],
    num_images: int = 64,
    *,
    year: str = "2012",
    seed: int = 0,
    segmentation_every: int = 4,
    progress: bool = False,
) -> Path:
    """Write a synthetic VOCdevkit under ``root`` and return ``root`` as a :class:`Path`.

    Creates ``VOCdevkit/VOC{year}/`` (``TrainVal/VOCdevkit/VOC2011`` for 2011, where torchvision
    looks) with JPEGImages, Annotations, ImageSets/Main and, for every ``segmentation_every``-th
    image (0: none), SegmentationClass, SegmentationObject and ImageSets/Segmentation. Existing
    files of the same names are overwritten. The same arguments always give the same bytes.
    """
    if year not in {str(y) for y in range(2007, 2013)}:
        raise ValueError(f"year must be one of '2007'..'2012' (a string), got {year!r}")
    if num_images < 1:
        raise ValueError(f"num_images must be at least 1, got {num_images}")
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    if segmentation_every < 0:
        raise ValueError(f"segmentation_every must be >= 0 (0: no masks), got {segmentation_every}")
    root = Path(root)
    voc = root / base_dir(year)
    folders = ("JPEGImages", "Annotations", "SegmentationClass", "SegmentationObject")
    for name in folders:
        (voc / name).mkdir(parents=True, exist_ok=True)

    layout_rng = np.random.default_rng([seed, _STREAM_LAYOUT, int(year)])
    ids = _image_ids(layout_rng, year, num_images)
    segmented = [segmentation_every > 0 and i % segmentation_every == 0 for i in range(num_images)]
    splits = _splits(layout_rng, year, segmented)
    bank = _make_noise_bank(seed)
    size_p = np.array([s[2] for s in _SIZES])
    size_p /= size_p.sum()

    for i in tqdm(range(num_images), desc="synthetic VOC", unit="img", disable=not progress):
        rng = np.random.default_rng([seed, _STREAM_IMAGE, i])
        width, height, _ = _SIZES[int(rng.choice(len(_SIZES), p=size_p))]
        objects = _plan_objects(rng, width, height)
        image = _render_image(bank, rng, width, height, objects)
        image.save(voc / "JPEGImages" / f"{ids[i]}.jpg", "JPEG", quality=_JPEG_QUALITY)
        xml = _annotation_xml(ids[i], year, width, height, segmented[i], objects, rng)
        (voc / "Annotations" / f"{ids[i]}.xml").write_text(xml, encoding="utf-8", newline="\n")
        if segmented[i]:
            by_class, by_object = _render_masks(width, height, objects)
            by_class.save(voc / "SegmentationClass" / f"{ids[i]}.png")
            by_object.save(voc / "SegmentationObject" / f"{ids[i]}.png")

    _write_image_sets(voc / "ImageSets" / "Main", ids, splits, year)
    seg_ids = [m for m, s in zip(ids, segmented) if s]
    seg_splits = [s for s, m in zip(splits, segmented) if m]
    if seg_ids:
        _write_image_sets(voc / "ImageSets" / "Segmentation", seg_ids, seg_splits, year)
    return root
