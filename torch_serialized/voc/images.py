"""Pack-time image processing: what to store for an image, its size, and resizing. By default the
file's bytes and the JPEG header's size; ``ImageOptions`` can decode, store raw RGB or shrink.
Pillow's decompression-bomb limit applies either way."""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from PIL import Image, UnidentifiedImageError

from ..errors import SourceDataError

RESIZE_QUALITY = 90  #: JPEG quality of images re-encoded after resizing.
SKIP_HINT = "(or leave such samples out: on_error='skip' in pack_voc, --skip-bad in the CLI)"
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  #: SOF markers: hold the size
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_STREAM_REPR = re.compile(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>")


@dataclass(frozen=True)
class ImageOptions:
    """How ``pack_voc`` stores images (its ``image_storage``, ``max_size``, ``check_images``)."""

    image_storage: str = "original"
    max_size: int | None = None
    check_images: bool = False

    @property
    def decodes(self) -> bool:
        return self.check_images or self.image_storage == "raw" or bool(self.max_size)

    @property
    def transformed(self) -> bool:
        """Whether stored images may differ from their files (so a pack keeps their SHA-256)."""
        return self.image_storage != "original" or self.max_size is not None


def store_image(
    data: bytes, path: str, options: ImageOptions
) -> tuple[bytes, int, int, tuple[float, float] | None]:
    """The bytes to store for an image, its stored size, and the box scale if resized."""
    if not options.decodes:
        size = jpeg_size(data)
        if size is not None:
            check_pixels(size, path, SourceDataError)
            return data, size[0], size[1], None
    with _opened(data, path, "image") as img:
        width, height = img.size
        if options.decodes:
            img = img.convert("RGB")  # decodes every pixel: truncated data fails here
        size = resized_size(width, height, options.max_size)
        if size is None:
            stored = img.tobytes() if options.image_storage == "raw" else data
            return stored, width, height, None
        img = img.resize(size, Image.Resampling.BILINEAR, reducing_gap=3.0)
        scale = (size[0] / width, size[1] / height)
        if options.image_storage == "raw":
            return img.tobytes(), size[0], size[1], scale
        out = io.BytesIO()
        img.save(out, format="JPEG", quality=RESIZE_QUALITY)
        return out.getvalue(), size[0], size[1], scale


def resized_size(width: int, height: int, max_size: int | None) -> tuple[int, int] | None:
    """The size ``max_size`` resizes ``width`` x ``height`` to, or None (kept as is)."""
    if not max_size or max(width, height) <= max_size:
        return None
    factor = max_size / max(width, height)
    return max(1, round(width * factor)), max(1, round(height * factor))


def image_scale(data: bytes, path: str, options: ImageOptions) -> tuple[float, float] | None:
    """The scale ``store_image`` resizes this image by (from its header), or None."""
    with _opened(data, path, "image") as img:
        size = img.size
    resized = resized_size(size[0], size[1], options.max_size)
    return None if resized is None else (resized[0] / size[0], resized[1] / size[1])


def check_mask(data: bytes, path: str, options: ImageOptions) -> None:
    """A mask's declared size within the pixel limit; with ``check_images``, a whole PNG."""
    size = png_size(data)
    if size is not None:
        check_pixels(size, path, SourceDataError)
    if not options.check_images:
        return
    with _opened(data, path, "PNG mask") as img:  # a PNG's size was checked above
        if img.format != "PNG":
            raise ValueError(f"a {img.format} image, not a PNG")
        img.load()


@contextlib.contextmanager
def _opened(data: bytes | memoryview, path: str, what: str) -> Iterator[Image.Image]:
    """``data`` opened by Pillow; its (or the caller's ``ValueError``) errors as ours."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            yield img
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise SourceDataError(
            f"{path}: not a readable {what} ({pil_reason(exc)}); replace the file or remove "
            f"its id from the lists {SKIP_HINT}"
        ) from None
    except Image.DecompressionBombError as exc:
        raise SourceDataError(f"{path}: {exc}; refusing a decompression bomb") from None


def pil_reason(exc: BaseException) -> str:
    """Pillow's message without the ``<_io.BytesIO object at 0x...>`` it names."""
    return _STREAM_REPR.sub("", str(exc)) or type(exc).__name__


def png_size(data: bytes | memoryview) -> tuple[int, int] | None:
    """``(width, height)`` from a PNG's IHDR chunk, or ``None`` if ``data`` is no PNG."""
    if len(data) < 24 or bytes(data[:8]) != _PNG_SIGNATURE or bytes(data[12:16]) != b"IHDR":
        return None
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def jpeg_size(data: bytes | memoryview) -> tuple[int, int] | None:
    """``(width, height)`` from a JPEG's start-of-frame header, or ``None`` (then ask Pillow).
    Much faster than Pillow (benchmarks/README.md, "Measurements behind the code"): it keeps
    packing and the read-time pixel check cheap."""
    if bytes(data[:2]) != b"\xff\xd8":
        return None
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if length < 2:
            return None
        if marker in _SOF_MARKERS:
            if i + 9 > n:
                return None
            height = int.from_bytes(data[i + 5 : i + 7], "big")
            width = int.from_bytes(data[i + 7 : i + 9], "big")
            return (width, height) if width and height else None
        i += 2 + length
    return None


def check_pixels(size: tuple[int, int], where: str, error: type[Exception]) -> None:
    """Pillow's decompression-bomb rule for a size read without Pillow: above twice
    ``MAX_IMAGE_PIXELS`` ``error`` naming ``where``, above it a warning."""
    limit = Image.MAX_IMAGE_PIXELS
    pixels = size[0] * size[1]
    if limit and pixels > 2 * limit:
        raise error(
            f"{where}: image size ({pixels} pixels, {size[0]}x{size[1]}) exceeds limit of "
            f"{2 * limit} pixels, could be decompression bomb DOS attack; refusing it "
            "(raise PIL.Image.MAX_IMAGE_PIXELS if the image is genuine)"
        )
    if limit and pixels > limit:
        warnings.warn(
            f"{where}: image size ({pixels} pixels) exceeds limit of {limit} pixels, could be "
            "decompression bomb DOS attack.",
            Image.DecompressionBombWarning,
            stacklevel=3,
        )


def scale_target(
    target: dict[str, Any], scale: tuple[float, float], width: int, height: int
) -> None:
    """Rescale a target's size and coordinates (boxes, part boxes, points) for a resized image."""
    annotation = target.get("annotation")
    if isinstance(annotation, dict):
        if isinstance(size := annotation.get("size"), dict):
            size["width"], size["height"] = str(width), str(height)
        _scale_coordinates(annotation.get("object", []), scale)


_COORDINATE_AXES = {  #: Coordinate elements of a VOC annotation -> the axis of each child.
    "bndbox": {"xmin": 0, "xmax": 0, "ymin": 1, "ymax": 1},
    "point": {"x": 0, "y": 1},
}


def _scale_coordinates(node: Any, scale: tuple[float, float]) -> None:
    """Scale every coordinate below ``node`` in place; non-numbers are left."""
    if isinstance(node, list):
        for item in node:
            _scale_coordinates(item, scale)
    elif isinstance(node, dict):
        for key, value in node.items():
            axes = _COORDINATE_AXES.get(key)
            if axes is None:
                _scale_coordinates(value, scale)
                continue
            for element in value if isinstance(value, list) else [value]:
                for name, axis in axes.items():
                    with contextlib.suppress(KeyError, TypeError, ValueError):
                        scaled = f"{float(element[name]) * scale[axis]:.2f}"
                        element[name] = scaled.rstrip("0").rstrip(".")


def resize_mask(data: bytes, path: str, scale: tuple[float, float]) -> bytes:
    """A mask PNG resized as its image, nearest-neighbour so pixels keep class indices."""
    with _opened(data, path, "PNG mask") as img:
        size = (max(1, round(img.width * scale[0])), max(1, round(img.height * scale[1])))
        resized = img.resize(size, Image.Resampling.NEAREST)  # keeps palette and info
    out = io.BytesIO()
    resized.save(out, format="PNG")
    return out.getvalue()


def same_mask(a: bytes | memoryview, b: bytes | memoryview) -> bool:
    """Same size, mode, palette and pixels (unreadable: False)."""
    try:
        with Image.open(io.BytesIO(a)) as one, Image.open(io.BytesIO(b)) as two:
            return (
                one.size == two.size
                and one.mode == two.mode
                and one.getpalette() == two.getpalette()
                and one.tobytes() == two.tobytes()
            )
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return False
