"""A deterministic synthetic Pascal VOC dataset on disk, for examples, tests and the demo:
VOC's image sizes and roughly its JPEG cost (so timings mean something), its XML and palette
masks (torchvision reads it unchanged). The same arguments give the same bytes."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from ..voc.classes import VOC_CLASSES, VOC_IGNORE_INDEX, VOC_PALETTE
from ..voc.layout import base_dir

__all__ = ["make_synthetic_voc"]

_SIZES: tuple[tuple[int, int, float], ...] = (  # (width, height, share) of VOC's sizes
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
_SHAPES: tuple[str, ...] = ("ellipse", "rectangle", "rounded_rectangle", "polygon")
_CLASS_P = np.array(  # VOC-like: person dominates, then chair and car
    [8.0 if c == "person" else 2.0 if c in ("chair", "car") else 1.0 for c in VOC_CLASSES]
)
_CLASS_P /= _CLASS_P.sum()

_JPEG_QUALITY = 92  # Pillow's defaults otherwise (4:2:0 subsampling, baseline, JFIF)
_TILE = 640  # side of each precomputed noise tile; larger than any VOC image side
_NUM_TILES = 4
_BORDER = 3  # width of the 255 "void" band drawn around each object in the masks

_STREAM_TILES, _STREAM_LAYOUT, _STREAM_IMAGE = 1, 2, 3  # independent random streams


@dataclass
class _Object:
    name: str
    pose: str
    truncated: int
    occluded: int
    difficult: int
    box: tuple[int, int, int, int]  # 1-based inclusive xmin, ymin, xmax, ymax, inside the image
    shape: str
    geometry: tuple[float, ...]  # 0-based drawing coords: x0, y0, x1, y1 or polygon x, y pairs
    parts: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (name, box), boxes as ``box``


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


def _make_noise_bank(seed: int) -> np.ndarray:
    """Per-seed ``(n, T, T, 4)`` float32 tiles textures crop: 1/f, grain, colour (about 0.3 s)."""
    rng = np.random.default_rng([seed, _STREAM_TILES])
    size, tiles = _TILE, []
    for _ in range(_NUM_TILES):
        # ~photographs' 1/f spectrum, flatter so mid-scale detail carries JPEG cost too
        structure = np.zeros((size, size), np.float32)
        for cells in (3, 6, 12, 24, 48, 96, 192):
            structure += _upsampled(rng, cells, size) * (3.0 / cells) ** 0.75
        grain = _upsampled(rng, size // 2, size) + 0.6 * _upsampled(rng, size, size)
        chroma = [_upsampled(rng, 5, size) + _upsampled(rng, 20, size) for _ in range(2)]
        tiles.append(np.stack([_unit(c) for c in (structure, grain, *chroma)], axis=-1))
    return np.stack(tiles)


def _texture(
    bank: np.ndarray, rng: np.random.Generator, height: int, width: int, detail: float
) -> np.ndarray:
    """An RGB float32 texture from a random, randomly flipped crop of a random tile."""
    tint = rng.uniform(0.75, 1.25, size=3)
    mix = np.empty((4, 3))
    mix[0] = tint * rng.uniform(28.0, 50.0)  # structure (shading, blobs, mid-scale detail)
    mix[1] = tint * detail * rng.uniform(0.8, 1.25)  # grain: sets most of the JPEG cost
    mix[2:] = rng.uniform(-8.0, 8.0, size=(2, 3))  # colour drift
    k = int(rng.integers(bank.shape[0]))
    y = int(rng.integers(bank.shape[1] - height + 1))
    x = int(rng.integers(bank.shape[2] - width + 1))
    flip_y, flip_x = rng.integers(2, size=2)
    crop = bank[k, y : y + height, x : x + width][:: -1 if flip_y else 1, :: -1 if flip_x else 1]
    rgb = crop @ mix.astype(np.float32)
    rgb += rng.uniform(50.0, 190.0, size=3).astype(np.float32)
    return rgb


def _draw_shape(
    draw: ImageDraw.ImageDraw, obj: _Object, fill: int, outline: int | None = None, width: int = 0
) -> None:
    """Draw ``obj``'s silhouette, optionally outlined."""
    xy = obj.geometry
    style: dict[str, Any] = {"fill": fill, "outline": outline, "width": width}
    if obj.shape == "rounded_rectangle":
        style["radius"] = int(0.2 * min(xy[2] - xy[0], xy[3] - xy[1]))
    getattr(draw, obj.shape)(xy, **style)  # the ImageDraw method of that name


def _render_image(
    bank: np.ndarray, rng: np.random.Generator, width: int, height: int, objects: Sequence[_Object]
) -> Image.Image:
    detail = rng.uniform(15.0, 24.0)  # per-image sharpness: spreads the JPEG sizes
    rgb = _texture(bank, rng, height, width, detail)
    for obj in objects:
        x0, y0, x1, y1 = obj.box[0] - 1, obj.box[1] - 1, obj.box[2], obj.box[3]
        mask = Image.new("1", (width, height))
        _draw_shape(ImageDraw.Draw(mask), obj, 1)
        inside = np.asarray(mask)[y0:y1, x0:x1, None]
        tex = _texture(bank, rng, y1 - y0, x1 - x0, detail * rng.uniform(0.8, 1.2))
        np.copyto(rgb[y0:y1, x0:x1], tex, where=inside)
    np.clip(rgb, 0.0, 255.0, out=rgb)
    return Image.fromarray(rgb.astype(np.uint8))


def _render_masks(width: int, height: int, objects: Sequence[_Object]) -> tuple[Image.Image, ...]:
    """SegmentationClass and SegmentationObject PNGs: VOC palette, 255 bands at borders."""
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


def _plan_object(rng: np.random.Generator, width: int, height: int) -> _Object:
    """One object: class, box (maybe truncated), silhouette, flags, maybe person parts."""
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
    small = (x1 - x0) * (y1 - y0) < 0.01 * width * height
    difficult = int(rng.random() < (0.3 if small else 0.02))
    pose = _POSES[int(rng.choice(len(_POSES), p=_POSE_P))]
    box = (x0 + 1, y0 + 1, x1, y1)
    parts = []
    if name == "person" and x1 - x0 >= 40 and y1 - y0 >= 80 and rng.random() < 0.35:
        size = (x1 - x0 - 1, y1 - y0 - 1)  # of the 1-based inclusive box
        for part, p, *fractions in _PERSON_PARTS:
            corners = tuple(box[k % 2] + round(f * size[k % 2]) for k, f in enumerate(fractions))
            if rng.random() < p and corners[2] > corners[0] and corners[3] > corners[1]:
                parts.append((part, corners))
    return _Object(name, pose, truncated, 0, difficult, box, shape, geometry, tuple(parts))


def _plan_objects(rng: np.random.Generator, width: int, height: int) -> list[_Object]:
    """1-6 objects, largest first (drawn back to front), some ``occluded``."""
    count = int(rng.choice(len(_NUM_OBJECTS_P), p=_NUM_OBJECTS_P)) + 1
    objects = [_plan_object(rng, width, height) for _ in range(count)]
    objects.sort(key=lambda o: -(o.box[2] - o.box[0]) * (o.box[3] - o.box[1]))
    for obj in objects:
        obj.occluded = int(rng.random() < 0.3)
    return objects


_Tree = list[tuple[str, object]]


def _element(tag: str, value: object, depth: int) -> list[str]:
    """``<tag>value</tag>`` indented by ``depth`` tabs; a list value holds children."""
    pad = "\t" * depth
    if not isinstance(value, list):
        return [f"{pad}<{tag}>{value}</{tag}>"]
    inner = [line for name, child in value for line in _element(name, child, depth + 1)]
    return [f"{pad}<{tag}>", *inner, f"{pad}</{tag}>"]


def _annotation_xml(
    image_id: str,
    year: str,
    width: int,
    height: int,
    segmented: bool,
    objects: Sequence[_Object],
    rng: np.random.Generator,
) -> str:
    """The annotation in VOC's layout (tabs, no declaration), as VOC2007's or later years'."""
    voc2007 = year == "2007"
    source_year = "2007" if voc2007 else image_id[:4]
    source: _Tree = [
        ("database", f"The VOC{source_year} Database"),
        ("annotation", f"PASCAL VOC{source_year}"),
        ("image", "flickr"),
    ]
    fields: _Tree = [("folder", f"VOC{year}"), ("filename", f"{image_id}.jpg"), ("source", source)]
    size = [("width", width), ("height", height), ("depth", 3)]
    fields += [("size", size), ("segmented", int(segmented))]
    with_occluded = not voc2007 and rng.random() < 0.75
    corners = ("xmin", "ymin", "xmax", "ymax")
    for obj in objects:
        box = ("bndbox", list(zip(corners, obj.box)))
        children: _Tree = [("name", obj.name), ("pose", obj.pose), ("truncated", obj.truncated)]
        if with_occluded:
            children += [("occluded", obj.occluded), box, ("difficult", obj.difficult)]
        else:
            children += [("difficult", obj.difficult), box]
        for name, part in obj.parts:
            children.append(("part", [("name", name), ("bndbox", list(zip(corners, part)))]))
        fields.append(("object", children))
    return "\n".join(_element("annotation", fields, 0)) + "\n"


def _image_ids(rng: np.random.Generator, year: str, num_images: int) -> list[str]:
    """Sorted unique ids: ``000123`` for 2007, ``2008_000123`` (2008..year, at most 2011) later."""
    numbers = np.cumsum(rng.integers(1, 4, size=num_images)) + 1
    if year == "2007":
        return [f"{n:06d}" for n in numbers]
    years = min(int(year), 2011) - 2007
    return [f"{2008 + i * years // num_images}_{n:06d}" for i, n in enumerate(numbers)]


def _splits(rng: np.random.Generator, year: str, segmented: Sequence[bool]) -> list[str]:
    """Each image's split (half train / half val; 2007: a quarter each and half test);
    segmented images apart, so Segmentation splits are subsets of Main's, as in VOC."""
    split = ["train"] * len(segmented)
    for group in (True, False):
        members = [i for i, s in enumerate(segmented) if s == group]
        order = [members[k] for k in rng.permutation(len(members))]
        half, quarter = len(order) // 2, len(order) // 4
        held_out = ("test",) * half + ("val",) * quarter if year == "2007" else ("val",) * half
        for i, name in zip(order, held_out):
            split[i] = name
    return split


def _write_image_sets(folder: Path, members: Sequence[tuple[str, str]], year: str) -> None:
    """``train``/``val``/``trainval`` (2007: ``test``) lists of ``members``, sorted."""
    folder.mkdir(parents=True, exist_ok=True)
    names = ("train", "val", "test") if year == "2007" else ("train", "val")
    lists = {name: [i for i, s in members if s == name] for name in names}
    lists["trainval"] = lists["train"] + lists["val"]
    for name, listed in lists.items():
        text = "".join(f"{m}\n" for m in sorted(listed))
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
    """Write a synthetic VOCdevkit under ``root`` where torchvision looks for ``year`` (masks
    and Segmentation lists for every ``segmentation_every``-th image, 0: none), overwriting files
    of the same names; return ``root`` as a ``Path``. Same arguments, same bytes."""
    if year not in {str(y) for y in range(2007, 2013)}:
        raise ValueError(f"year must be one of '2007'..'2012' (a string), got {year!r}")
    if min(num_images - 1, seed, segmentation_every) < 0:
        raise ValueError(
            "num_images must be at least 1, seed and segmentation_every at least 0; got "
            f"num_images={num_images}, seed={seed}, segmentation_every={segmentation_every}"
        )
    root = Path(root)
    voc = root / base_dir(year)
    for name in ("JPEGImages", "Annotations", "SegmentationClass", "SegmentationObject"):
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

    _write_image_sets(voc / "ImageSets" / "Main", list(zip(ids, splits)), year)
    if any(segmented):
        members = [(m, s) for m, s, listed in zip(ids, splits, segmented) if listed]
        _write_image_sets(voc / "ImageSets" / "Segmentation", members, year)
    return root
