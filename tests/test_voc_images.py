"""voc.images: image sizes from JPEG headers, image checks, and Pillow's decompression-bomb rule."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _container_helpers import (
    listing,
)
from PIL import Image
from vocfactory import (
    TRUNCATED_JPEG,
    Sample,
    jpeg,
    jpeg_claiming,
    obj,
    palette_mask,
    png_claiming,
    tiny_devkit,
    voc_xml,
    write_voc,
)

import torch_serialized
import torch_serialized as ts
from torch_serialized.errors import SourceDataError
from torch_serialized.voc.images import jpeg_size, png_size, resized_size
from torch_serialized.voc.pack import pack_voc


def test_truncated_jpeg_passes_without_image_checks(tmp_path: Path) -> None:
    # torchvision does not validate at load time either; checking is opt-in and really decodes.
    root = tiny_devkit(tmp_path / "src", ["a", "b"], **{"b.jpg": TRUNCATED_JPEG})
    assert ts.pack_voc(root, tmp_path / "out.tser", year="2007").num_samples == 2


def test_jpeg_size_matches_pillow_on_every_corner_case(corner_devkit: Path) -> None:
    images = sorted((corner_devkit / "VOCdevkit" / "VOC2007" / "JPEGImages").glob("*.jpg"))
    assert images
    for path in images:
        data = path.read_bytes()
        size = jpeg_size(data)
        with Image.open(io.BytesIO(data)) as image:
            if image.format == "JPEG":
                assert size == image.size, path.name
            else:  # PNG bytes behind a .jpg name: Pillow decides
                assert size is None
    assert jpeg_size(b"\xff\xd8\xff\xe0\x00") is None  # cut inside the markers
    assert jpeg_size(b"GIF89a") is None


def test_pillow_limits_unchanged_by_import_and_pack(tmp_path, voc8):
    fresh = subprocess.run(
        [sys.executable, "-c", "from PIL import Image, ImageFile; "
         "print(Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    from PIL import ImageFile

    def current() -> list[str]:
        return [str(Image.MAX_IMAGE_PIXELS), str(ImageFile.LOAD_TRUNCATED_IMAGES)]

    import importlib
    import pkgutil

    for module in pkgutil.walk_packages(torch_serialized.__path__, "torch_serialized."):
        if not module.name.endswith("__main__"):
            try:
                importlib.import_module(module.name)
            except ModuleNotFoundError as exc:  # an optional dependency (e.g. matplotlib)
                if exc.name and exc.name.startswith("torch_serialized"):
                    raise
    assert current() == fresh
    pack = pack_voc(voc8, tmp_path / "voc.tser", year="2007", check_images=True).path
    for decode in ("pil", "tensor"):
        torch_serialized.VOCSerializedDataset(pack, image_set="trainval", decode=decode)[0]
    assert current() == fresh


@pytest.mark.timeout(60)
@pytest.mark.parametrize("check_images", [False, True])
@pytest.mark.parametrize(
    "bomb", [png_claiming(50_000, 50_000), jpeg_claiming(65_000, 65_000)], ids=["png", "jpeg"]
)
def test_decompression_bomb_is_refused_at_pack_time(tmp_path, bounded_memory, bomb, check_images):
    ids = ["a", "b"]
    samples = [
        Sample(i, image, voc_xml(f"{i}.jpg", 16, 16, [obj("dog", (1, 1, 8, 8))]))
        for i, image in zip(ids, [jpeg(16, 16), bomb])
    ]
    write_voc(tmp_path / "src", "2007", samples, {"Main": {"train": ids}})
    out = tmp_path / "out"
    out.mkdir()
    started = time.perf_counter()
    with pytest.raises(SourceDataError, match="decompression bomb") as info:
        pack_voc(tmp_path / "src", out / "voc.tser", year="2007", check_images=check_images)
    assert time.perf_counter() - started < 10, "the bomb was decoded"
    assert "b.jpg" in str(info.value)
    assert listing(out) == []


def _devkit_with_mask(root: Path, mask: bytes) -> Path:
    samples = [
        Sample(i, jpeg(16, 16), voc_xml(f"{i}.jpg", 16, 16, [obj("dog", (1, 1, 8, 8))]), mask=m)
        for i, m in (("a", palette_mask(16, 16)), ("b", mask))
    ]
    sets = {"Main": {"train": ["a", "b"]}, "Segmentation": {"train": ["a", "b"]}}
    write_voc(root, "2007", samples, sets)
    return root


@pytest.mark.timeout(60)
@pytest.mark.parametrize("check_images", [False, True])
def test_a_mask_bomb_is_refused_at_pack_time(tmp_path, bounded_memory, check_images):
    """Issue #11 item 4: a 50000x50000 mask packed without a word (and failed at read time
    naming neither pack nor sample); its PNG header is now checked like an image's."""
    root = _devkit_with_mask(tmp_path / "src", png_claiming(50_000, 50_000))
    with pytest.raises(SourceDataError, match="decompression bomb") as info:
        pack_voc(root, tmp_path / "out.tser", year="2007", check_images=check_images)
    assert "SegmentationClass/b.png" in str(info.value)
    assert not (tmp_path / "out.tser").exists()


@pytest.mark.parametrize(
    "mask",
    [b"", jpeg(16, 16), palette_mask(16, 16)[:-40]],
    ids=["empty", "jpeg", "truncated"],
)
def test_check_images_checks_masks_too(tmp_path, mask):
    """``check_images=True`` decodes every mask as a PNG: an empty, non-PNG or truncated mask
    is refused naming the file (or skipped with on_error="skip"); without it they pack as
    torchvision would read them (and fail at read time with our error)."""
    root = _devkit_with_mask(tmp_path / "src", mask)
    with pytest.raises(SourceDataError, match="PNG mask") as info:
        pack_voc(root, tmp_path / "out.tser", year="2007", check_images=True)
    assert "SegmentationClass/b.png" in str(info.value)
    skipped = pack_voc(
        root, tmp_path / "skip.tser", year="2007", check_images=True, on_error="skip"
    )
    assert [s.id for s in skipped.skipped] == ["b"] and skipped.num_samples == 1
    assert pack_voc(root, tmp_path / "lax.tser", year="2007").num_samples == 2


@pytest.mark.parametrize("check_images", [False, True])
def test_an_unreadable_image_is_named_by_its_file(tmp_path: Path, check_images: bool) -> None:
    """The message named Pillow's in-memory stream (``<_io.BytesIO object at 0x7f...>``)."""
    root = tiny_devkit(tmp_path / "src", ["a", "b"], **{"b.jpg": b"not an image at all"})
    with pytest.raises(SourceDataError) as info:
        pack_voc(root, tmp_path / "out.tser", year="2007", check_images=check_images)
    message = str(info.value)
    assert "JPEGImages/b.jpg: not a readable image (cannot identify image file)" in message
    assert "BytesIO" not in message and " at 0x" not in message


def test_an_unreadable_mask_is_named_by_its_file(tmp_path: Path) -> None:
    root = _devkit_with_mask(tmp_path / "src", b"not a png at all")
    with pytest.raises(SourceDataError) as info:
        pack_voc(root, tmp_path / "out.tser", year="2007", check_images=True)
    message = str(info.value)
    assert "SegmentationClass/b.png: not a readable PNG mask" in message
    assert "BytesIO" not in message and " at 0x" not in message


def _segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload


#: A start-of-frame (baseline) for a 300 x 200 (width x height) RGB image.
_SOF0 = _segment(0xC0, b"\x08" + (200).to_bytes(2, "big") + (300).to_bytes(2, "big") + b"\x03")


@pytest.mark.parametrize(
    "markers",
    [
        pytest.param(_segment(0xC4, b"\x00" + bytes(16) + b"\x05"), id="DHT before SOF"),
        pytest.param(_segment(0xCC, b"\x00\x10"), id="DAC before SOF"),
        pytest.param(b"\xff\xd8", id="repeated SOI"),
        pytest.param(b"\xff\xff" + _segment(0xE0, b"JFIF\x00"), id="fill byte, APP0"),
    ],
)
def test_jpeg_size_reads_the_frame_header_past_other_markers(markers: bytes) -> None:
    """Huffman (C4) and arithmetic (CC) table segments share the SOF marker range but hold
    no size; standalone markers have no length."""
    assert jpeg_size(b"\xff\xd8" + markers + _SOF0 + b"\xff\xda") == (300, 200)


def test_png_size_reads_png_headers() -> None:
    out = io.BytesIO()
    Image.new("P", (7, 5)).save(out, format="PNG")
    png = out.getvalue()
    assert png_size(png) == (7, 5) and png_size(b"\xff\xd8" + _SOF0) is None
    not_ihdr = png[:12] + b"IDAT" + png[16:]  # the first chunk must be IHDR
    assert png_size(not_ihdr) is None


def test_resized_size_rounds_and_keeps_images_at_the_limit() -> None:
    assert resized_size(500, 300, 500) is None  # at max_size: stored as is, not re-encoded
    assert resized_size(300, 500, 500) is None
    assert resized_size(1000, 335, 500) == (500, 168)  # 167.5 rounds to 168
    assert resized_size(1000, 1, 500) == (500, 1)  # never 0
    assert resized_size(1000, 335, None) is None
