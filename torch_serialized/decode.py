"""Bytes of a packed VOC record -> what a dataset returns: image, target dict or tensors, mask.

Like torchvision's ``read_file`` then ``decode_jpeg(data)``, reading and decoding are apart:
the caller reads a record's fields (a view into the map, or a private copy from a streaming
read) and passes them in; the decoder never reads the pack. One ``SampleDecoder`` serves both
the map-style and the iterable datasets, so the two return identical samples. ``decode`` picks
the image path (see ``Decode``), ``target_format`` the target (see ``TargetFormat``).
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.functional import pil_to_tensor

from .voc import schema
from .voc.classes import VOC_CLASSES
from .voc.reader import VOCPackReader

__all__ = ["Decode", "TargetFormat", "Classes", "SampleDecoder", "label_names"]

#: ``"pil"``: a PIL RGB image, exactly torchvision's. ``"tensor"``: a uint8 CHW tensor
#: decoded by ``torchvision.io.decode_jpeg`` (PIL for non-JPEG bytes); skips PIL conversions.
#: ``"none"``: the stored bytes as a 1-D uint8 tensor, for decoding later (e.g. on the GPU).
Decode = Literal["pil", "tensor", "none"]
#: ``"dict"``: torchvision's parsed XML dict. ``"tv_tensors"``: ``{"boxes": BoundingBoxes
#: (XYXY, float32), "labels": int64, "difficult": bool}`` built from stored arrays, no parsing.
TargetFormat = Literal["dict", "tv_tensors"]
#: Label names for ``"tv_tensors"`` targets (label = position in the list):
#:
#: - ``None`` (default): ``"__background__"`` at 0, then VOC's 20 classes (as torchvision's
#:   wrapper) when every class in the pack is one of them; otherwise the pack's classes in
#:   pack order (the order they first appear in the packed samples), so custom datasets work
#:   without arguments and their labels do not move when a class is added later.
#: - ``"packed"``: ``"__background__"``, then the pack's classes sorted by name (0.1.0's rule,
#:   kept so that labels of models trained with it stay the same; it differs from ``None``).
#: - a sequence of names: exactly that list; every class of the image set must be in it.
Classes = Literal["packed"] | Sequence[str] | None
#: Bytes of one record field: a read-only view into the map, or a private array.
Buffer = memoryview | np.ndarray | bytes

_JPEG_SOI = b"\xff\xd8"
_XYXY = tv_tensors.BoundingBoxFormat.XYXY
#: torchvision >= 0.29 warns on every ``decode_jpeg`` call (moving to TorchCodec); the call is
#: our choice, not the user's, so that one warning is silenced around it (``-W error`` safe).
_TV_DECODE_DEPRECATED = r"The image decoding and encoding capabilities of TorchVision"


def label_names(pack: VOCPackReader, classes: Classes) -> list[str]:
    """The label name list that ``classes`` stands for (see ``Classes``)."""
    if classes is None:
        if set(pack.classes) <= set(VOC_CLASSES):
            return ["__background__", *VOC_CLASSES]
        return ["__background__", *pack.classes]
    if isinstance(classes, str):
        if classes != "packed":
            raise ValueError(f"classes must be None, 'packed' or a list of names, got {classes!r}")
        return ["__background__", *sorted(pack.classes)]
    names = list(classes)
    if len(set(names)) != len(names):
        raise ValueError("classes must not repeat a name")
    return names


class SampleDecoder:
    """Decodes the fields of records of one pack, for one image set.

    It keeps what decoding needs from the pack (image sizes, label ids, storage kind), not
    the pack itself.
    """

    def __init__(
        self,
        pack: VOCPackReader,
        *,
        decode: Decode = "pil",
        target_format: TargetFormat = "dict",
        classes: Classes = None,
        split_key: str | None = None,
        zero_copy: bool = False,
    ) -> None:
        if decode not in ("pil", "tensor", "none"):
            raise ValueError(f"decode must be 'pil', 'tensor' or 'none', got {decode!r}")
        if target_format not in ("dict", "tv_tensors"):
            raise ValueError(f"target_format must be 'dict' or 'tv_tensors', got {target_format!r}")
        self.decode = decode
        self.target_format = target_format
        #: tensors of stored bytes (``decode="none"``, raw pixels) view the map, not a copy
        self.zero_copy = zero_copy
        self._quiet_pid: int | None = None  # the process torch's warning was silenced in
        self.raw = pack.image_storage == "raw"
        self.label_names = label_names(pack, classes)
        position = {name: i for i, name in enumerate(self.label_names)}
        self._labels = np.array([position.get(n, -1) for n in pack.classes], dtype=np.int64)
        columns = pack.columns
        #: (height, width) of every stored image; one small array, read per sample
        self._sizes = np.stack([columns["height"], columns["width"]], axis=1).astype(np.int64)
        if target_format == "tv_tensors" and split_key is not None:
            present = pack.meta.get("class_counts", {}).get(split_key, {})
            unknown = sorted(n for n in present if n not in position)
            if unknown:
                raise ValueError(
                    f"{pack.path}: classes {unknown} of {split_key} are not in the label list; "
                    "pass classes='packed' or a list of class names including them"
                )

    @property
    def target_field(self) -> int:
        """The record field ``target`` decodes: the JSON dict or the object rows."""
        return schema.TARGET if self.target_format == "dict" else schema.OBJECTS

    def image_reader(self) -> Callable[[int, Buffer], Any]:
        """``image`` with its dispatch on this decoder's settings done once, for loops that
        call it per sample (the stored-bytes copy is then one call, not three)."""
        if not self.raw and self.decode == "none" and not self.zero_copy:
            return _bytes_image
        return self.image

    def target_reader(self) -> Callable[[int, Buffer], Any]:
        """``target`` with its dispatch done once (see ``image_reader``)."""
        return _dict_target if self.target_format == "dict" else self.target

    def image(self, record: int, data: Buffer) -> Any:
        """The image of ``record`` from ``data``, its ``schema.IMAGE`` field."""
        if self.raw:
            return self._raw_image(record, data)
        if self.decode == "pil":
            return Image.open(_stream(data)).convert("RGB")
        if self.decode == "none":
            return self._tensor(data)
        if bytes(data[:2]) == _JPEG_SOI:
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings(
                        "ignore", _TV_DECODE_DEPRECATED, category=DeprecationWarning
                    )
                    return decode_jpeg(_owned_tensor(data), mode=ImageReadMode.RGB)
            except RuntimeError:
                pass  # a JPEG flavour libjpeg in torchvision refuses: PIL below decides
        return pil_to_tensor(Image.open(_stream(data)).convert("RGB"))

    def _raw_image(self, record: int, data: Buffer) -> Any:
        height, width = self._sizes[record].tolist()
        if self.decode == "pil":
            return Image.frombytes("RGB", (width, height), bytes(data))
        pixels = self._tensor(data)
        if self.decode == "none":
            return pixels
        return pixels.view(height, width, 3).permute(2, 0, 1)

    def _tensor(self, data: Buffer) -> torch.Tensor:
        """Stored bytes as a 1-D uint8 tensor: a copy it owns, or with ``zero_copy`` a
        read-only view of the map (torch warns once per process about such views; the
        documented ``zero_copy`` contract is that warning, so it is silenced here)."""
        if not self.zero_copy or isinstance(data, np.ndarray) or not len(data):
            return _owned_tensor(data)
        if self._quiet_pid != os.getpid():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.frombuffer(data, dtype=torch.uint8)
            self._quiet_pid = os.getpid()
            return tensor
        return torch.frombuffer(data, dtype=torch.uint8)

    def target(self, record: int, data: Buffer) -> Any:
        """The target of ``record`` from ``data``, its ``target_field``."""
        if self.target_format == "dict":
            return schema.decode_target(_view(data))
        objects = np.frombuffer(data, dtype=schema.OBJECT_DTYPE)
        return {
            "boxes": _boxes(
                torch.from_numpy(objects["box"].copy()), tuple(self._sizes[record].tolist())
            ),
            "labels": torch.from_numpy(self._labels[objects["class_id"]]),
            "difficult": torch.from_numpy(objects["difficult"].astype(bool)),
        }

    def targets(self, records: Sequence[int], data: Sequence[Buffer]) -> list[Any]:
        """``[self.target(r, d) for r, d in zip(records, data)]``, built for the whole batch:
        ``tv_tensors`` targets come from one array per key, split into per-sample views."""
        if self.target_format == "dict":
            return [schema.decode_target(_view(d)) for d in data]
        objects = np.frombuffer(b"".join(_view(d) for d in data), dtype=schema.OBJECT_DTYPE)
        counts = [len(d) // schema.OBJECT_DTYPE.itemsize for d in data]
        boxes = torch.from_numpy(objects["box"].copy()).split(counts)
        labels = torch.from_numpy(self._labels[objects["class_id"]]).split(counts)
        difficult = torch.from_numpy(objects["difficult"].astype(bool)).split(counts)
        sizes = self._sizes[np.asarray(records, dtype=np.int64)].tolist()
        return [
            {"boxes": _boxes(b, (size[0], size[1])), "labels": lab, "difficult": d}
            for b, lab, d, size in zip(boxes, labels, difficult, sizes)
        ]

    def mask(self, data: Buffer) -> Image.Image:
        """A SegmentationClass mask from its ``schema.MASK`` field, as PIL opens the PNG
        (mode P, palette)."""
        return Image.open(_stream(data))


def _bytes_image(record: int, data: Buffer) -> torch.Tensor:
    """``SampleDecoder.image`` for ``decode="none"`` without ``zero_copy``: a copy it owns."""
    return _owned_tensor(data)


def _dict_target(record: int, data: Buffer) -> Any:
    """``SampleDecoder.target`` for ``target_format="dict"``."""
    return schema.decode_target(_view(data))


def _boxes(tensor: torch.Tensor, canvas_size: tuple[int, int]) -> tv_tensors.BoundingBoxes:
    """``BoundingBoxes(tensor, format=XYXY, canvas_size=canvas_size)`` for an (n, 4) float32
    tensor, through torchvision's own ``_wrap`` (what its transforms use): the public
    constructor re-checks and converts its input, ~4 µs of a ~12 µs target."""
    try:
        return tv_tensors.BoundingBoxes._wrap(
            tensor, format=_XYXY, canvas_size=canvas_size, check_dims=False
        )
    except (AttributeError, TypeError):  # a torchvision without that private helper
        return tv_tensors.BoundingBoxes(tensor, format=_XYXY, canvas_size=canvas_size)


def _view(data: Buffer) -> memoryview | bytes:
    return data.data if isinstance(data, np.ndarray) else data


def _stream(data: Buffer) -> io.BytesIO:
    """A file object over ``data`` for PIL (shares ``bytes``, copies other buffers)."""
    return io.BytesIO(_view(data))


def _owned_tensor(data: Buffer) -> torch.Tensor:
    """A 1-D uint8 tensor of ``data`` that owns its memory (no copy if ``data`` is already a
    private writable array, as the iterable's reads are; a copy of a read-only map view)."""
    if isinstance(data, np.ndarray) and data.flags.writeable:
        return torch.from_numpy(data)
    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    # a bytearray copy and a tensor over it: ~1 µs less than numpy's copy + from_numpy
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
