"""Build small VOCdevkit trees for tests: deterministic images, masks, XML and list files.

Not a test module. :func:`write_voc` lays out any set of :class:`Sample` records;
:func:`build_corner_case_devkit` writes the one devkit that holds every quirk the packer and the
datasets must reproduce exactly as torchvision does (see ``CORNER_CASES``). Image content is a
smooth pattern derived from a seed, so any decoded read can be checked against its source.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import numpy as np
from PIL import Image

from torch_serialized.voc.classes import VOC_CLASSES, VOC_IGNORE_INDEX, VOC_PALETTE

__all__ = [
    "OMIT",
    "Raw",
    "Sample",
    "CORNER_CASES",
    "REAL_VOC_ENV",
    "REAL_VOC_DEFAULT",
    "real_voc_dir",
    "real_voc_skip_reason",
    "build_corner_case_devkit",
    "encode_xml",
    "jpeg",
    "jpeg_claiming",
    "obj",
    "palette_mask",
    "png",
    "png_claiming",
    "real_voc_roots",
    "smooth_rgb",
    "tiny_devkit",
    "voc_xml",
    "write_voc",
    "FULL_JPEG",
    "TRUNCATED_JPEG",
]

#: One ImageSets list: ids (written one per line with "\n") or the file's raw text.
ImageSetContent = Sequence[str] | str


@dataclass(frozen=True)
class Sample:
    """One image id and the bytes of its files; ``None`` means the file is not written."""

    id: str
    image: bytes
    xml: bytes | None = None
    mask: bytes | None = None
    object_mask: bytes | None = None


def write_voc(
    root: Path,
    year: str,
    samples: Sequence[Sample],
    image_sets: Mapping[str, Mapping[str, ImageSetContent]],
) -> Path:
    """Write ``root/VOCdevkit/VOC{year}`` with ``samples`` and ``image_sets[task][name]`` lists.

    Returns the ``VOC{year}`` folder. All six standard sub-folders are created, even if empty.
    """
    voc_root = Path(root) / "VOCdevkit" / f"VOC{year}"
    folders = {
        name: voc_root / name
        for name in ("JPEGImages", "Annotations", "SegmentationClass", "SegmentationObject")
    }
    for folder in (*folders.values(), voc_root / "ImageSets" / "Main"):
        folder.mkdir(parents=True, exist_ok=True)
    (voc_root / "ImageSets" / "Segmentation").mkdir(exist_ok=True)
    for sample in samples:
        (folders["JPEGImages"] / f"{sample.id}.jpg").write_bytes(sample.image)
        if sample.xml is not None:
            (folders["Annotations"] / f"{sample.id}.xml").write_bytes(sample.xml)
        if sample.mask is not None:
            (folders["SegmentationClass"] / f"{sample.id}.png").write_bytes(sample.mask)
        if sample.object_mask is not None:
            (folders["SegmentationObject"] / f"{sample.id}.png").write_bytes(sample.object_mask)
    for task, lists in image_sets.items():
        folder = voc_root / "ImageSets" / task
        folder.mkdir(parents=True, exist_ok=True)
        for name, content in lists.items():
            text = content if isinstance(content, str) else "".join(f"{i}\n" for i in content)
            (folder / f"{name}.txt").write_bytes(text.encode("utf-8"))
    return voc_root


# --- images -------------------------------------------------------------------------------------


def smooth_rgb(w: int, h: int, seed: int = 0) -> np.ndarray:
    """A ``(h, w, 3)`` uint8 image of low-frequency sine waves chosen by ``seed``.

    Smooth content keeps even a 2500x2000 JPEG at a few dozen KB and makes decode checks easy.
    """
    rng = np.random.default_rng(seed)
    freq_x, freq_y = rng.uniform(0.5, 2.0, 3), rng.uniform(0.5, 2.0, 3)
    phase = rng.uniform(0.0, 2 * np.pi, 3)
    x = np.linspace(0.0, 1.0, w, dtype=np.float32)
    y = np.linspace(0.0, 1.0, h, dtype=np.float32)
    out = np.empty((h, w, 3), dtype=np.uint8)
    for c in range(3):  # sin(a + b) = sin a cos b + cos a sin b keeps it two outer products
        a = 2 * np.pi * freq_x[c] * x + phase[c]
        b = 2 * np.pi * freq_y[c] * y
        wave = np.outer(np.cos(b), np.sin(a)) + np.outer(np.sin(b), np.cos(a))
        out[..., c] = (127.5 + 127.0 * wave).astype(np.uint8)
    return out


def jpeg(
    w: int,
    h: int,
    mode: str = "RGB",
    seed: int = 0,
    progressive: bool = False,
    exif_orientation: int | None = None,
    quality: int = 90,
) -> bytes:
    """JPEG bytes of :func:`smooth_rgb` converted to ``mode`` (``RGB``, ``L`` or ``CMYK``)."""
    image = Image.fromarray(smooth_rgb(w, h, seed)).convert(mode)
    options: dict[str, Any] = {"quality": quality, "progressive": progressive}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation  # Orientation tag; torchvision does not apply it
        options["exif"] = exif.tobytes()
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", **options)
    return buffer.getvalue()


def png(w: int, h: int, mode: str = "RGB", seed: int = 0) -> bytes:
    """PNG bytes of :func:`smooth_rgb` converted to ``mode`` (e.g. to hide behind a .jpg name)."""
    buffer = io.BytesIO()
    Image.fromarray(smooth_rgb(w, h, seed)).convert(mode).save(buffer, format="PNG")
    return buffer.getvalue()


def palette_mask(w: int, h: int, seed: int = 0, values: Sequence[int] | None = None) -> bytes:
    """A ``P``-mode PNG with the VOC palette: background 0 and one rectangle per value.

    Each rectangle gets a 1-pixel 255 (void) border, as in VOC. ``values`` defaults to 1-3
    class ids in 1..20 picked by ``seed``; pass ``1..n`` for a SegmentationObject mask.
    """
    rng = np.random.default_rng(seed)
    if values is None:
        values = rng.choice(np.arange(1, len(VOC_CLASSES) + 1), size=rng.integers(1, 4)).tolist()
    mask = np.zeros((h, w), dtype=np.uint8)
    for value in values:
        x0, x1 = sorted(rng.integers(0, w, 2).tolist())
        y0, y1 = sorted(rng.integers(0, h, 2).tolist())
        mask[y0 : y1 + 1, x0 : x1 + 1] = VOC_IGNORE_INDEX
        mask[y0 + 1 : y1, x0 + 1 : x1] = value
    image = Image.fromarray(mask, mode="P")
    image.putpalette(VOC_PALETTE)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A 100-byte PNG whose header claims ``width`` x ``height`` RGB pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(bytes(64)))
        + chunk(b"IEND", b"")
    )


def jpeg_claiming(width: int, height: int) -> bytes:
    """A tiny real JPEG whose SOF0 header is patched to claim ``width`` x ``height``."""
    data = bytearray(jpeg(16, 16))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


# --- annotation XML -----------------------------------------------------------------------------


class Raw(str):
    """Text written into the XML unescaped: CDATA sections, comments, character references."""


class _Omit:
    """Type of :data:`OMIT`."""


#: A field value meaning "leave this element out" (e.g. ``difficult=OMIT``).
OMIT = _Omit()


def obj(name: str, box: Sequence[Any] | Mapping[str, Any], /, **fields: Any) -> dict[str, Any]:
    """One ``<object>`` as VOC2012 writes it: name, bndbox, difficult, occluded, pose, truncated.

    A 4-sequence ``box`` is ``(xmin, ymin, xmax, ymax)`` written in VOC2012's alphabetical order
    (xmax, xmin, ymax, ymin); a mapping is written as given. ``fields`` override or add children;
    ``OMIT`` removes one; ``part=[...]`` adds person-layout parts.
    """
    if isinstance(box, Mapping):
        bndbox: Any = dict(box)
    else:
        xmin, ymin, xmax, ymax = box
        bndbox = {"xmax": xmax, "xmin": xmin, "ymax": ymax, "ymin": ymin}
    result: dict[str, Any] = {
        "name": name,
        "bndbox": bndbox,
        "difficult": 0,
        "occluded": 0,
        "pose": "Unspecified",
        "truncated": 0,
    }
    result.update(fields)
    return {key: value for key, value in result.items() if value is not OMIT}


def voc_xml(
    filename: str,
    w: int,
    h: int,
    objects: Sequence[Mapping[str, Any]] = (),
    **extra: Any,
) -> bytes:
    """Annotation XML bytes (UTF-8, no declaration) in the VOC2012 style: tabs, sorted tags.

    ``extra`` overrides top-level fields in place (``folder``, ``segmented``, ``size``,
    ``source``) or appends new ones; ``OMIT`` removes one. Values: ``str``/numbers become text,
    ``None`` an empty ``<tag/>``, mappings children, lists repeated elements, :class:`Raw` markup.
    """
    fields: dict[str, Any] = {
        "filename": filename,
        "folder": "VOC2012",
        "object": list(objects),
        "segmented": 0,
        "size": {"depth": 3, "height": h, "width": w},
        "source": {
            "annotation": "PASCAL VOC2012",
            "database": "The VOC2012 Database",
            "image": "flickr",
        },
    }
    fields.update(extra)
    lines = ["<annotation>"]
    for tag, value in fields.items():
        if value is not OMIT:
            lines.extend(_element(tag, value, 1))
    lines.append("</annotation>")
    return ("\n".join(lines) + "\n").encode("utf-8")


def _element(tag: str, value: Any, depth: int) -> list[str]:
    """Lines of one element (or of several, for a list) indented with ``depth`` tabs."""
    pad = "\t" * depth
    if isinstance(value, list):
        return [line for item in value for line in _element(tag, item, depth)]
    if value is None:
        return [f"{pad}<{tag}/>"]
    if isinstance(value, Mapping):
        inner = [
            line
            for key, child in value.items()
            if child is not OMIT
            for line in _element(key, child, depth + 1)
        ]
        return [f"{pad}<{tag}>", *inner, f"{pad}</{tag}>"]
    text = value if isinstance(value, Raw) else escape(str(value))
    return [f"{pad}<{tag}>{text}</{tag}>"]


def encode_xml(
    xml: bytes, encoding: str, *, declaration: bool = True, bom: bool = False, newline: bool = True
) -> bytes:
    """Re-encode UTF-8 ``xml`` into ``encoding``, declaring it; unencodable text becomes ``&#N;``.

    ``"UTF-16"`` gets Python's BOM; ``bom=True`` adds a UTF-8 BOM; ``newline=False`` strips the
    final newline (labelImg's style).
    """
    text = xml.decode("utf-8")
    if not newline:
        text = text.rstrip("\n")
    if declaration:
        text = f'<?xml version="1.0" encoding="{encoding}"?>\n{text}'
    data = text.encode(encoding, errors="xmlcharrefreplace")
    return b"\xef\xbb\xbf" + data if bom else data


# --- the corner-case devkit ---------------------------------------------------------------------

#: Id -> the quirk that sample covers in :func:`build_corner_case_devkit`.
CORNER_CASES: dict[str, str] = {
    "000001": "one object, VOC2012 style, listed twice in Main/train; has masks",
    "000002": "no objects",
    "000003": "32 objects, some difficult/truncated, some without <difficult>; has masks",
    "000004": "repeated <part> in one object, a single <part> in another, fractional parts",
    "000005": "<pose/>, <pose></pose>, whitespace-only leaves, <source> with only empty children",
    "000006": "ISO-8859-1 declared, non-ASCII bytes",
    "000007": "UTF-8 BOM before the declaration",
    "000008": "UTF-16 with BOM, CJK text",
    "000009": "DOCTYPE without entities, comments, CDATA, char and entity references, a PI",
    "000010": "labelme: fractional bndbox, height before width, 2-space indentation",
    "000011": "Roboflow: bndbox order xmin,xmax,ymin,ymax, <folder></folder>, <occluded>",
    "000012": "labelme: nested empty <annotation/>, empty <folder/>, <pose/>, <difficult/>",
    "000013": "grayscale (L) JPEG, depth 1",
    "000014": "CMYK JPEG",
    "000015": "progressive JPEG",
    "000016": "PNG bytes behind a .jpg name",
    "000017": "EXIF orientation 6 (torchvision does not rotate), 64x32",
    "000018": "1x1 image",
    "000019": "2500x2000 smooth image",
    "000020": "us-ascii declared, non-ASCII as &#N; references, no final newline, VOC2007 style",
    "1": "collides numerically with 0001 and 000001",
    "0001": "collides numerically with 1 and 000001",
    "BMW_3-Series_2013_47_17_230_30_6_71_54_181_18_RWD_4_2_Convertible_ZFP": (
        "long id with - and _, labelImg <path> with raw UTF-8, no declaration"
    ),
    "seg_only": "segmentation only: mask, no annotation",
}

_LONG_ID = "BMW_3-Series_2013_47_17_230_30_6_71_54_181_18_RWD_4_2_Convertible_ZFP"


def _corner_samples(year: str) -> list[Sample]:
    """The samples of :data:`CORNER_CASES`, in that order."""
    folder = f"VOC{year}"

    def sample(
        sid: str,
        image: bytes,
        xml: bytes | None,
        w: int,
        h: int,
        masks: bool = False,
        objects: int = 2,
    ) -> Sample:
        seed = sum(map(ord, sid)) + len(sid)
        return Sample(
            id=sid,
            image=image,
            xml=xml,
            mask=palette_mask(w, h, seed) if masks else None,
            object_mask=palette_mask(w, h, seed + 1, range(1, objects + 1)) if masks else None,
        )

    def xml(sid: str, w: int, h: int, objects: Sequence[Mapping[str, Any]], **kw: Any) -> bytes:
        return voc_xml(f"{sid}.jpg", w, h, objects, folder=folder, **kw)

    classes = VOC_CLASSES
    many = [
        obj(
            classes[i % 20],
            (1 + i, 2 + i, 40 + i, 50 + i),
            difficult=OMIT if i % 5 == 0 else int(i % 3 == 0),
            truncated=i % 2,
        )
        for i in range(32)
    ]
    parts = [
        obj(
            "person",
            (5, 6, 70, 58),
            part=[
                {"name": "head", "bndbox": {"xmin": 10.5, "ymin": 7, "xmax": 20.25, "ymax": 18}},
                {"name": "hand", "bndbox": {"xmin": 30, "ymin": 30, "xmax": 35, "ymax": 36}},
                {"name": "hand", "bndbox": {"xmin": 50, "ymin": 31, "xmax": 55, "ymax": 37}},
            ],
        ),
        obj(
            "person",
            (40, 2, 79, 59),
            part=[{"name": "head", "bndbox": {"xmin": 41, "ymin": 3, "xmax": 60, "ymax": 20}}],
        ),
    ]
    blanks = [
        obj("cat", (2, 3, 30, 40), pose=None, truncated="   ", occluded=Raw("\n\t\t")),
        obj("dog", (10, 5, 60, 45), pose="", difficult=" \t "),
    ]
    latin = xml(
        "000006",
        48,
        40,
        [obj("chair", (1, 1, 47, 39), pose="Façade")],
        owner={"flickrid": "José Müller", "name": "Ærøskøbing café"},
    )
    bom = xml("000007", 48, 40, [obj("sofa", (3, 4, 20, 30))])
    utf16 = xml("000008", 48, 40, [obj("train", (1, 2, 30, 20), pose="中文 ü")])
    markup = b'<?xml version="1.0"?>\n<!DOCTYPE annotation>\n<!-- exported by hand -->\n' + xml(
        "000009",
        48,
        40,
        [
            obj(
                Raw("<![CDATA[ bird ]]>"),
                (1, 2, 3, 4),
                pose=Raw("Le<!-- inline -->ft"),
                occluded=Raw("&#49;"),
            ),
            obj(Raw("d&#111;g"), (5, 6, 7, 8), pose=Raw("&lt;Right &amp; &#x4E2D;&gt;")),
        ],
        owner=Raw("<?pi data?>A&amp;B"),
    )
    labelme_box = {"xmin": "91.0", "ymin": "2.5", "xmax": "254.38461538461536", "ymax": "39.75"}
    labelme = voc_xml(
        "000010.jpg",
        300,
        40,
        [obj("bus", labelme_box), obj("car", (0.5, 1.5, 10.25, 20))],
        folder=None,
        size={"height": 40, "width": 300, "depth": 3},
    ).replace(b"\t", b"  ")
    roboflow_box = {"xmin": 3, "xmax": 40, "ymin": 5, "ymax": 30}
    roboflow = voc_xml(
        "000001_jpg.rf.79720bd501927a5aa21aaf872be90efd.jpg",
        48,
        40,
        [obj("cellbody", roboflow_box, occluded=0), obj("cellbody", {**roboflow_box, "xmin": 1})],
        folder="",
        path="000001_jpg.rf.79720bd501927a5aa21aaf872be90efd.jpg",
        source={"database": "roboflow.ai"},
    )
    nested = encode_xml(
        voc_xml(
            "000012.jpg",
            48,
            40,
            [obj("person", (1, 2, 20, 30), pose=None, truncated=None, difficult=None)],
            folder=None,
            segmented=None,
            source=OMIT,
            database=None,
            annotation=None,
            image=None,
        ),
        "utf-8",
    )
    voc2007 = xml(
        "000020",
        48,
        40,
        [obj("horse", {"xmin": 1, "ymin": 2, "xmax": 40, "ymax": 35}, pose="Left")],
        owner={"flickrid": "Bjørn Søderqvist", "name": "尹以鹏"},
    )
    labelimg = voc_xml(
        f"{_LONG_ID}.jpg",
        40,
        30,
        [obj("car", (1, 1, 39, 29))],
        folder="JPEGImages",
        path=f"C:\\Users\\saman\\OneDrive\\桌面\\4\\JPEGImages\\{_LONG_ID}.jpg",
        source={"database": "Unknown"},
    )
    plain = [obj("dog", (2, 3, 40, 30))]
    return [
        sample("000001", jpeg(64, 48, seed=1), xml("000001", 64, 48, plain), 64, 48, True, 1),
        sample("000002", jpeg(48, 40, seed=2), xml("000002", 48, 40, []), 48, 40),
        sample("000003", jpeg(96, 80, seed=3), xml("000003", 96, 80, many), 96, 80, True, 5),
        sample("000004", jpeg(80, 60, seed=4), xml("000004", 80, 60, parts), 80, 60),
        sample(
            "000005",
            jpeg(64, 48, seed=5),
            xml(
                "000005",
                64,
                48,
                blanks,
                segmented=" ",
                source={"database": None, "image": ""},
            ),
            64,
            48,
        ),
        sample("000006", jpeg(48, 40, seed=6), encode_xml(latin, "ISO-8859-1"), 48, 40),
        sample("000007", jpeg(48, 40, seed=7), encode_xml(bom, "utf-8", bom=True), 48, 40),
        sample("000008", jpeg(48, 40, seed=8), encode_xml(utf16, "UTF-16"), 48, 40),
        sample("000009", jpeg(48, 40, seed=9), markup, 48, 40),
        sample("000010", jpeg(300, 40, seed=10), labelme, 300, 40),
        sample("000011", jpeg(48, 40, seed=11), roboflow, 48, 40),
        sample("000012", jpeg(48, 40, seed=12), nested, 48, 40),
        sample(
            "000013",
            jpeg(64, 48, "L", seed=13),
            xml("000013", 64, 48, plain, size={"depth": 1, "height": 48, "width": 64}),
            64,
            48,
            True,
            1,
        ),
        sample("000014", jpeg(48, 40, "CMYK", seed=14), xml("000014", 48, 40, plain), 48, 40),
        sample(
            "000015", jpeg(64, 48, seed=15, progressive=True), xml("000015", 64, 48, plain), 64, 48
        ),
        sample("000016", png(48, 40, seed=16), xml("000016", 48, 40, plain), 48, 40),
        sample(
            "000017",
            jpeg(64, 32, seed=17, exif_orientation=6),
            xml("000017", 64, 32, plain),
            64,
            32,
        ),
        sample(
            "000018", jpeg(1, 1, seed=18), xml("000018", 1, 1, [obj("bird", (1, 1, 1, 1))]), 1, 1
        ),
        sample(
            "000019",
            jpeg(2500, 2000, seed=19, quality=75),
            xml("000019", 2500, 2000, [obj("aeroplane", (100, 200, 2400, 1900))]),
            2500,
            2000,
        ),
        sample(
            "000020", jpeg(48, 40, seed=20), encode_xml(voc2007, "us-ascii", newline=False), 48, 40
        ),
        sample(
            "1",
            jpeg(32, 24, seed=101),
            xml("1", 32, 24, [obj("cow", (1, 1, 10, 10))]),
            32,
            24,
            True,
            1,
        ),
        sample(
            "0001",
            jpeg(24, 32, seed=102),
            xml("0001", 24, 32, [obj("sheep", (2, 2, 20, 30))]),
            24,
            32,
        ),
        sample(_LONG_ID, jpeg(40, 30, seed=103), labelimg, 40, 30, True, 1),
        sample("seg_only", jpeg(40, 30, seed=104), None, 40, 30, True, 2),
    ]


def build_corner_case_devkit(root: Path, year: str = "2007") -> Path:
    """Write the corner-case devkit under ``root`` (torchvision's root) and return ``root``.

    Main lists: ``train`` has CRLF endings, trailing spaces and ``000001`` twice; ``val`` shares
    ``000003`` with train; ``trainval`` is their union; ``test`` (2007 only) overlaps train.
    ``mini.txt`` is a custom split and ``dog_train.txt`` a per-class file to be skipped.
    Segmentation lists cover the ids with masks, one of them without an annotation.
    """
    samples = _corner_samples(year)
    detection = [s.id for s in samples if s.xml is not None]
    train_ids = detection[:10] + ["1", _LONG_ID]
    val_ids = ["000003"] + detection[10:20] + ["0001"]
    train_text = "".join(f"{i}  \r\n" if n % 3 else f"{i}\t \r\n" for n, i in enumerate(train_ids))
    train_text += "000001\r\n"
    main: dict[str, ImageSetContent] = {
        "train": train_text,
        "val": val_ids,
        "trainval": list(dict.fromkeys(train_ids + val_ids)),
        "mini": ["000001", "000002"],
        "dog_train": "000001  1\n000002 -1\n000003  0\n",
    }
    if year == "2007":
        main["test"] = ["000016", "000017", "000018", "000019", "000020", "1"]
    seg_train = ["000001", "000003", "1"]
    seg_val = ["000013", "seg_only", _LONG_ID]
    segmentation: dict[str, ImageSetContent] = {
        "train": seg_train,
        "val": "".join(f"{i}\r\n" for i in seg_val),
        "trainval": seg_train + seg_val,
    }
    write_voc(root, year, samples, {"Main": main, "Segmentation": segmentation})
    return root


# --- the real VOC sample set --------------------------------------------------------------------

#: The setting that points the tests at the real VOC-format roots (shared/data/voc-real, see
#: its SOURCES.md): a folder holding ``<name>/VOCdevkit/VOC<year>`` roots.
REAL_VOC_ENV = "TORCH_SERIALIZED_REAL_VOC"
#: Where they are looked for when the setting is unset: ``shared/`` beside the repository.
REAL_VOC_DEFAULT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "voc-real"


def real_voc_dir() -> Path:
    """The real data folder: ``$TORCH_SERIALIZED_REAL_VOC``, else :data:`REAL_VOC_DEFAULT`."""
    value = os.environ.get(REAL_VOC_ENV, "")
    return Path(value).expanduser() if value else REAL_VOC_DEFAULT


def real_voc_roots() -> list[tuple[Path, str]]:
    """``(torchvision root, year)`` of every root in :func:`real_voc_dir`; empty when that
    folder is absent and the setting unset. A setting that names a folder without roots is
    a mistake, not a reason to skip: it raises."""
    folder = real_voc_dir()
    roots = [
        (voc.parent.parent, voc.name[3:])
        for voc in sorted(folder.glob("*/VOCdevkit/VOC[0-9][0-9][0-9][0-9]"))
        if voc.is_dir()
    ]
    if not roots and os.environ.get(REAL_VOC_ENV):
        raise RuntimeError(
            f"{REAL_VOC_ENV}={os.environ[REAL_VOC_ENV]!r} holds no <name>/VOCdevkit/VOC<year> "
            "folders; point it at shared/data/voc-real or unset it"
        )
    return roots


def real_voc_skip_reason() -> str:
    """Why tests on real data are skipped: where they looked, and the setting to change it."""
    return (
        f"no real VOC data at {real_voc_dir()}; set {REAL_VOC_ENV} to the voc-real folder "
        "(shared/data/voc-real) to run these tests"
    )


def tiny_devkit(root: Path, ids: list[str], **overrides: bytes | None) -> Path:
    """A 2007 devkit whose ids all have a small JPEG and XML (train: all, val: the first);
    ``overrides`` replace files by name (``"003.jpg"``, ``"003.xml"``)."""
    samples = []
    for i, image_id in enumerate(ids):
        image = overrides.get(f"{image_id}.jpg", jpeg(32, 24, seed=i))
        xml = overrides.get(
            f"{image_id}.xml", voc_xml(f"{image_id}.jpg", 32, 24, [obj("dog", (1, 2, 20, 20))])
        )
        samples.append(Sample(image_id, image, xml))  # type: ignore[arg-type]
    write_voc(root, "2007", samples, {"Main": {"train": ids, "val": ids[:1]}})
    return root


#: A 200x150 JPEG, and the same cut in half: header intact, scan data missing.
FULL_JPEG = jpeg(200, 150, seed=1)
TRUNCATED_JPEG = FULL_JPEG[: len(FULL_JPEG) // 2]
