"""decode.SampleDecoder: bytes in, images / targets / masks out; it never reads the pack."""

from __future__ import annotations

import io
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.io import ImageReadMode, decode_jpeg
from vocfactory import palette_mask

from torch_serialized.decode import SampleDecoder, label_names
from torch_serialized.reader import PackReader
from torch_serialized.voc import schema
from torch_serialized.voc.classes import VOC_CLASSES
from torch_serialized.voc.reader import VOCPackReader


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
    mask = SampleDecoder(pack).mask(png)
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
def test_readers_are_image_and_target(
    pack: VOCPackReader, decode: Any, target_format: Any, zero_copy: bool
) -> None:
    """The per-sample callables the datasets bind once return what image/target return,
    for buffers of every kind (map views, bytes, private arrays) and empty ones."""
    decoder = SampleDecoder(
        pack, decode=decode, target_format=target_format, classes="packed", zero_copy=zero_copy
    )
    image_of, target_of = decoder.image_reader(), decoder.target_reader()
    for record in range(len(pack)):
        field = pack.field(record, decoder.target_field)
        for data in (field, bytes(field), np.frombuffer(bytes(field), np.uint8).copy()):
            expected, actual = decoder.target(record, data), target_of(record, data)
            if target_format == "dict":
                assert actual == expected
            else:
                assert list(actual) == list(expected)
                for key in expected:
                    assert type(actual[key]) is type(expected[key])
                    assert torch.equal(actual[key], expected[key])
        image = pack.field(record, schema.IMAGE)
        for data in (image, bytes(image)):
            expected, actual = decoder.image(record, data), image_of(record, data)
            if decode == "pil":
                assert actual.tobytes() == expected.tobytes()
            else:
                assert type(actual) is type(expected) and torch.equal(actual, expected)
    if decode == "none" and not zero_copy:
        empty = image_of(0, b"")
        assert empty.dtype == torch.uint8 and empty.shape == (0,)
