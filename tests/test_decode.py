"""decode.SampleDecoder: bytes in, images / targets / masks out; it never reads the pack."""

from __future__ import annotations

import io
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from _container_helpers import Contents, rebuild_pack
from PIL import Image
from torchvision import tv_tensors
from torchvision.io import ImageReadMode, decode_jpeg
from vocfactory import jpeg_claiming, palette_mask, png_claiming

from torch_serialized import (
    VOCSerializedDataset,
    VOCSerializedIterableDataset,
    VOCSerializedSegmentation,
    pack_voc,
)
from torch_serialized.container.shards import PackReader
from torch_serialized.data.decode import SampleDecoder, label_names
from torch_serialized.errors import FormatError, ImageTooLargeError
from torch_serialized.voc import schema
from torch_serialized.voc.classes import VOC_CLASSES
from torch_serialized.voc.packed import VOCPackReader


@pytest.fixture(scope="module")
def pack(synthetic_packs: Any) -> VOCPackReader:
    return VOCPackReader(synthetic_packs.single)


def image_bytes(pack: VOCPackReader, record: int = 0) -> bytes:
    return bytes(pack.field(record, schema.IMAGE))


def test_the_decoder_keeps_no_reader(pack: VOCPackReader) -> None:
    decoder = SampleDecoder(pack)
    assert not any(isinstance(v, (VOCPackReader, PackReader)) for v in vars(decoder).values())


@pytest.mark.parametrize("kind", [bytes, memoryview, lambda b: np.frombuffer(b, np.uint8).copy()])
def test_pil_image_from_any_buffer(pack: VOCPackReader, kind: Any) -> None:
    data = image_bytes(pack)
    image = SampleDecoder(pack).image(0, kind(data))
    expected = Image.open(io.BytesIO(data)).convert("RGB")
    assert image.mode == "RGB" and np.array_equal(np.asarray(image), np.asarray(expected))


def test_tensor_and_none_paths(pack: VOCPackReader) -> None:
    data = image_bytes(pack)
    tensor = SampleDecoder(pack, decode="tensor").image(0, data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torchvision 0.29 -> TorchCodec
        expected = decode_jpeg(
            torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB
        )
    assert torch.equal(tensor, expected)
    raw = SampleDecoder(pack, decode="none").image(0, data)
    assert raw.dtype == torch.uint8 and bytes(raw.numpy()) == data


def test_a_read_only_array_is_copied_not_borrowed(pack: VOCPackReader) -> None:
    """Without ``zero_copy`` the tensor owns its bytes: a read-only array (a view of a map)
    is copied, so writing to the tensor never reaches the stored bytes."""
    data = np.frombuffer(image_bytes(pack), np.uint8).copy()
    data.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps a read-only array
        owned = SampleDecoder(pack, decode="none").image(0, data)
    owned[0] = 255 - int(data[0])
    assert int(data[0]) == image_bytes(pack)[0] and owned.data_ptr() != data.ctypes.data


def test_zero_copy_views_the_given_buffer(pack: VOCPackReader) -> None:
    view = pack.field(0, schema.IMAGE)
    shared = SampleDecoder(pack, decode="none", zero_copy=True).image(0, view)
    owned = SampleDecoder(pack, decode="none").image(0, view)
    address = np.frombuffer(view, np.uint8).__array_interface__["data"][0]
    assert shared.data_ptr() == address and owned.data_ptr() != address
    assert bytes(shared.numpy()) == bytes(owned.numpy()) == bytes(view)


def test_dict_target_from_its_json(pack: VOCPackReader) -> None:
    target = {"annotation": {"filename": "a.jpg", "object": [{"name": "dog"}]}}
    decoded = SampleDecoder(pack).target(0, schema.encode_target(target))
    assert decoded == target


def test_tv_tensors_target_from_object_rows(pack: VOCPackReader) -> None:
    decoder = SampleDecoder(pack, target_format="tv_tensors", classes="packed")
    boxes = np.array([[1, 2, 30, 40]], dtype=np.float32)
    data = schema.encode_objects(boxes, [0], np.array([1]), np.array([0]))
    target = decoder.target(3, data)
    assert decoder.target_field == schema.OBJECTS
    assert isinstance(target["boxes"], tv_tensors.BoundingBoxes)
    assert target["boxes"].tolist() == boxes.tolist()
    height, width = int(pack.columns[3]["height"]), int(pack.columns[3]["width"])
    assert tuple(target["boxes"].canvas_size) == (height, width)
    assert target["labels"].tolist() == [decoder.label_names.index(pack.classes[0])]
    assert target["difficult"].tolist() == [True]


def test_mask_as_pil_opens_the_png(pack: VOCPackReader) -> None:
    png = palette_mask(7, 5, seed=1)
    mask = SampleDecoder(pack, task="Segmentation").target(0, png)
    assert mask.mode == "P" and mask.size == (7, 5)


def test_label_names(pack: VOCPackReader) -> None:
    assert label_names(pack, None) == ["__background__", *VOC_CLASSES]
    assert label_names(pack, "packed") == ["__background__", *sorted(pack.classes)]
    assert label_names(pack, ["a", "b"]) == ["a", "b"]
    with pytest.raises(ValueError, match="repeat"):
        label_names(pack, ["a", "a"])
    with pytest.raises(ValueError, match="classes must be"):
        label_names(pack, "all")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"decode": "jpeg"}, "decode must be"), ({"target_format": "coco"}, "target_format must be")],
)
def test_arguments_are_checked(pack: VOCPackReader, kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SampleDecoder(pack, **kwargs)  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")
@pytest.mark.parametrize("decode", ["pil", "tensor", "none"])
@pytest.mark.parametrize("target_format", ["dict", "tv_tensors"])
@pytest.mark.parametrize("zero_copy", [False, True])
def test_every_buffer_kind_and_views_decode_alike(
    pack: VOCPackReader, decode: Any, target_format: Any, zero_copy: bool
) -> None:
    """Targets and images are the same from buffers of every kind (map views, bytes, private
    arrays) and empty ones; ``image(view=True)`` (a DataLoader worker's read) returns what
    ``image`` returns, its stored bytes viewing the map instead of a copy."""
    decoder = SampleDecoder(
        pack, decode=decode, target_format=target_format, classes="packed", zero_copy=zero_copy
    )
    assert decoder.stored_bytes == (decode == "none")
    for record in range(len(pack)):
        field = pack.field(record, decoder.target_field)
        expected = decoder.target(record, field)
        for data in (bytes(field), np.frombuffer(bytes(field), np.uint8).copy()):
            actual = decoder.target(record, data)
            if target_format == "dict":
                assert actual == expected
            else:
                assert list(actual) == list(expected)
                for key in expected:
                    assert type(actual[key]) is type(expected[key])
                    assert torch.equal(actual[key], expected[key])
        image = pack.field(record, schema.IMAGE)
        for data in (image, bytes(image), np.frombuffer(bytes(image), np.uint8).copy()):
            expected, actual = decoder.image(record, data), decoder.image(record, data, view=True)
            if decode == "pil":
                assert actual.tobytes() == expected.tobytes()
            else:
                assert type(actual) is type(expected) and torch.equal(actual, expected)
        viewed = decoder.image(record, image, view=True)
        if decode == "none":
            address = np.frombuffer(image, np.uint8).ctypes.data
            assert viewed.data_ptr() == address
    for view in (False, True):
        if decode == "none":
            empty = decoder.image(0, b"", view=view)
            assert empty.dtype == torch.uint8 and empty.shape == (0,)


# -- issue #11 item 4: one pixel limit on every decode path, checked before allocating ----------
def _image(record: int, data: bytes) -> Any:
    def edit(contents: Contents) -> None:
        contents.records[record][schema.IMAGE] = data

    return edit


def _mask(record: int, data: bytes) -> Any:
    def edit(contents: Contents) -> None:
        contents.records[record][schema.MASK] = data

    return edit


def _raw_size(record: int, width: int, height: int) -> Any:
    def edit(contents: Contents) -> None:
        contents.arrays["records"]["width"][record] = width
        contents.arrays["records"]["height"][record] = height

    return edit


@pytest.fixture(scope="module")
def raw_pack(tiny_root: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("raw")
    return pack_voc(tiny_root, folder / "raw.tser", year="2007", image_storage="raw").path


def _names_the_record(exc: BaseException, path: Any, pack_path: Any, record: int) -> None:
    pack = VOCPackReader(pack_path)
    assert str(path) in str(exc) and f"record {record} (id {pack.id(record)!r})" in str(exc)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("decode", ["pil", "tensor"])
def test_a_stored_jpeg_bomb_is_refused_before_decoding(
    tmp_path: Any, tiny_packs: dict[str, Any], bounded_memory: None, decode: str
) -> None:
    """A 600-byte JPEG claiming 14000x14000: ``decode="tensor"`` returned a 588 MB tensor,
    ``decode="pil"`` raised Pillow's DecompressionBombError; both raise ImageTooLargeError
    naming pack, record and id, under a 512 MiB address-space cap."""
    bomb = jpeg_claiming(14_000, 14_000)
    path = rebuild_pack(tiny_packs["single"], tmp_path / "bomb.tser", _image(1, bomb))
    dataset = VOCSerializedDataset(path, image_set="train", decode=decode)
    dataset[0]
    with pytest.raises(ImageTooLargeError, match="decompression bomb") as info:
        dataset[1]
    assert isinstance(info.value, FormatError)
    _names_the_record(info.value, path, path, 1)
    stream = VOCSerializedIterableDataset(path, "train", decode=decode)
    with pytest.raises(ImageTooLargeError):
        list(stream)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("decode", ["pil", "tensor", "none"])
def test_raw_columns_claiming_a_huge_image_are_refused(
    tmp_path: Any, raw_pack: Any, bounded_memory: None, decode: str
) -> None:
    """A raw-pixel pack whose columns claim 60000x60000 made ``Image.frombytes`` allocate it;
    columns that disagree with the stored bytes raised a bare ValueError."""
    huge = rebuild_pack(raw_pack, tmp_path / "huge.tser", _raw_size(1, 60_000, 60_000))
    with pytest.raises(ImageTooLargeError) as info:
        VOCSerializedDataset(huge, image_set="train", decode=decode)[1]
    _names_the_record(info.value, huge, huge, 1)
    off = rebuild_pack(raw_pack, tmp_path / "off.tser", _raw_size(1, 20, 10))
    with pytest.raises(FormatError, match="raw pixels") as info:
        VOCSerializedDataset(off, image_set="train", decode=decode)[1]
    _names_the_record(info.value, off, off, 1)
    assert VOCSerializedDataset(off, image_set="train", decode=decode)[0] is not None


@pytest.mark.timeout(60)
def test_a_stored_mask_bomb_or_junk_mask_raises_our_error(
    tmp_path: Any, tiny_packs: dict[str, Any], bounded_memory: None
) -> None:
    """Masks were never checked: a 50000x50000 or an empty mask failed later with an error
    naming neither pack nor sample. (An empty mask under flag 2 is refused at open now: the
    record's columns say it has one.)"""
    empty = rebuild_pack(tiny_packs["single"], tmp_path / "empty.tser", _mask(0, b""))
    with pytest.raises(FormatError, match="record 0's columns contradict its fields"):
        VOCSerializedSegmentation(empty, image_set="train")
    for name, data, error in (
        ("bomb", png_claiming(50_000, 50_000), ImageTooLargeError),
        ("jpeg", b"\xff\xd8 not really", FormatError),
    ):
        path = rebuild_pack(tiny_packs["single"], tmp_path / f"{name}.tser", _mask(0, data))
        dataset = VOCSerializedSegmentation(path, image_set="train")
        assert int(dataset.records[0]) == 0
        with pytest.raises(error) as info:
            dataset[0]
        _names_the_record(info.value, path, path, 0)


@pytest.mark.parametrize("decode", ["pil", "tensor"])
def test_the_limit_is_pillows_read_at_call_time(
    tiny_packs: dict[str, Any], raw_pack: Any, monkeypatch: pytest.MonkeyPatch, decode: str
) -> None:
    """Users set ``PIL.Image.MAX_IMAGE_PIXELS`` as they do for Pillow: every path (images,
    raw pixels, masks) follows the value of the moment, with Pillow's warning above it and the
    error above twice it; ``None`` turns it off."""
    detection = VOCSerializedDataset(tiny_packs["single"], image_set="train", decode=decode)
    raw = VOCSerializedDataset(raw_pack, image_set="train", decode=decode)
    masks = VOCSerializedSegmentation(tiny_packs["single"], image_set="train", decode=decode)
    readers = {"image": lambda: detection[0], "raw": lambda: raw[0], "mask": lambda: masks[0]}
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50)  # the images have 120 to 170 pixels
    for read in readers.values():
        with pytest.raises(ImageTooLargeError, match="exceeds limit of 100 pixels"):
            read()
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    for name, read in readers.items():
        with pytest.warns(Image.DecompressionBombWarning):
            image, target = read()
            if name == "mask":
                target.load()
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    for read in readers.values():
        read()


@pytest.mark.parametrize("decode", ["pil", "tensor"])
def test_undecodable_stored_bytes_are_named_without_pillows_stream(
    pack: VOCPackReader, decode: str
) -> None:
    """Stored bytes no decoder reads raise our error naming the record; Pillow's text names
    only the in-memory stream it was given (``<_io.BytesIO object at 0x...>``): left out."""
    decoder = SampleDecoder(pack, decode=decode)  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="the stored image cannot be decoded") as failed:
        decoder.image(0, b"no image format starts like this")
    assert "BytesIO" not in str(failed.value) and pack.id(0) in str(failed.value)


def _counts_without_cat(c: Contents) -> None:
    c.user["class_counts"]["Main/train"].pop("cat")


@pytest.mark.parametrize("form", ["single", "shards"])
def test_an_object_of_a_class_the_counts_left_out_is_refused_never_labelled(
    tmp_path: Any, tiny_packs: dict[str, Any], form: str
) -> None:
    """Class counts that leave out a class its objects have (an append's recount bug, a
    hostile pack) let a label list without that class through the constructor; every read of
    such an object then raises naming the record, never labels it 0 (background) or -1, and
    a batch raises as its records one by one do."""
    limits = {"max_records_per_shard": 2} if form == "shards" else {}
    path = rebuild_pack(tiny_packs[form], tmp_path / "bad", _counts_without_cat, **limits)
    kwargs: dict[str, Any] = {"target_format": "tv_tensors", "classes": ["__background__", "dog"]}
    dataset = VOCSerializedDataset(path, image_set="train", **kwargs)
    pack = VOCPackReader(path)
    cat = [pack.id(int(r)) for r in dataset.records].index("000001")
    assert dataset[0][1]["labels"].tolist() == [1]  # the dogs read
    where = pack.where(int(dataset.records[cat]))
    reads = {
        "getitem": lambda: dataset[cat],
        "getitems": lambda: dataset.__getitems__([0, cat, 2]),
        "one by one": lambda: [dataset[i] for i in (0, cat, 2)],
        "stream": lambda: list(VOCSerializedIterableDataset(path, "train", **kwargs)),
    }
    for name, read in reads.items():
        with pytest.raises(FormatError, match="an object's class is not in the label list") as info:
            read()
        assert str(info.value).startswith(f"{where}: "), name
