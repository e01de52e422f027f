"""Bytes of a packed VOC record -> what a dataset returns: image, target dict or tensors, mask.
``SampleDecoder`` serves both dataset kinds, never reads the pack, and checks per record only
what open cannot: pixel limit, undecodable bytes, class ids outside the label list."""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.functional import pil_to_tensor

from ..errors import FormatError, ImageTooLargeError, SourceDataError
from ..voc import schema
from ..voc.classes import label_classes
from ..voc.images import check_pixels, jpeg_size, pil_reason
from ..voc.packed import VOCPackReader
from ..voc.xml import extract_objects

__all__ = ["Decode", "TargetFormat", "Classes", "SampleDecoder", "label_names"]

#: ``"pil"``: torchvision's PIL RGB image. ``"tensor"``: uint8 CHW via ``decode_jpeg`` (PIL for
#: non-JPEG). ``"none"``: the stored bytes as a 1-D uint8 tensor, to decode later (on the GPU).
Decode = Literal["pil", "tensor", "none"]
#: ``"dict"``: torchvision's XML dict. ``"tv_tensors"``: ``{"boxes": BoundingBoxes (XYXY),
#: "labels": int64, "difficult": bool}`` from stored arrays, no parsing.
TargetFormat = Literal["dict", "tv_tensors"]
#: ``"tv_tensors"`` label names (label = position). ``None``: ``"__background__"``, then VOC's
#: 20 if the pack has only those, else the pack's in first-seen order. ``"packed"``: background,
#: then sorted (0.1.0). A sequence: those names. Appends add new classes after the list.
Classes = Literal["packed"] | Sequence[str] | None
Buffer = memoryview | np.ndarray | bytes

#: torchvision >= 0.29 warns on each ``decode_jpeg`` (TorchCodec); our call, not the user's:
#: silenced around it (``-W error`` safe).
_TV_DECODE_DEPRECATED = r"The image decoding and encoding capabilities of TorchVision"


def label_names(pack: VOCPackReader, classes: Classes) -> list[str]:
    """The label names ``classes`` stands for (see ``Classes``)."""
    if isinstance(classes, str) and classes != "packed":
        raise ValueError(f"classes must be None, 'packed' or a list of names, got {classes!r}")
    if classes is None or isinstance(classes, str):
        rule = "default" if classes is None else "packed"
        return ["__background__", *label_classes(rule, pack.classes, pack.meta.get("label_base"))]
    names = list(classes)
    if len(set(names)) != len(names):
        raise ValueError("classes must not repeat a name")
    return names


class SampleDecoder:
    """Decodes one pack's records for one image set (holds what it needs, not the pack)."""

    def __init__(
        self,
        pack: VOCPackReader,
        *,
        task: str = "Main",
        image_set: str | None = None,
        decode: Decode = "pil",
        target_format: TargetFormat = "dict",
        classes: Classes = None,
        zero_copy: bool = False,
    ) -> None:
        if decode not in ("pil", "tensor", "none"):
            raise ValueError(f"decode must be 'pil', 'tensor' or 'none', got {decode!r}")
        if target_format not in ("dict", "tv_tensors"):
            raise ValueError(f"target_format must be 'dict' or 'tv_tensors', got {target_format!r}")
        self.task, self.decode, self.target_format = task, decode, target_format
        self.zero_copy = zero_copy
        self.raw = pack.image_storage == "raw"
        self._where, self._field, self._id = pack.where, pack.field, pack.id  # for errors only
        self.label_names = label_names(pack, classes)
        position = {name: i for i, name in enumerate(self.label_names)}
        #: label of each pack class id, -1 outside the label list
        self._labels = np.array([position.get(n, -1) for n in pack.classes], np.int64)
        self._unknown = bool((self._labels < 0).any())  # classes the label list leaves out
        columns = pack.columns
        self._untyped = (columns["flags"] & schema.UNTYPED_OBJECTS) != 0
        self._sizes = np.stack([columns["height"], columns["width"]], axis=1).astype(np.int64)
        split_key = f"{task}/{image_set}"
        if target_format == "tv_tensors" and image_set is not None:
            present = pack.meta.get("class_counts", {}).get(split_key, {})
            unknown = sorted(n for n in present if n not in position)
            if unknown:
                raise ValueError(
                    f"{pack.name}: classes {unknown} of {split_key} are not in the label list; "
                    "pass classes='packed' or a list of class names including them"
                )

    @property
    def target_field(self) -> int:
        """The field ``target`` decodes: the mask, the JSON dict or the object rows."""
        if self.task == "Segmentation":
            return schema.MASK
        return schema.TARGET if self.target_format == "dict" else schema.OBJECTS

    def decoded_nbytes(self, records: Sequence[int]) -> list[int] | None:
        """Decoded image bytes per record where the columns tell (``decode="tensor"`` JPEGs
        within the pixel limit: 3 x h x w), else None (``workers.SharedBlock``)."""
        if self.decode != "tensor" or self.raw:
            return None
        pixels = [h * w for h, w in self._sizes[np.asarray(records, dtype=np.int64)].tolist()]
        limit = Image.MAX_IMAGE_PIXELS
        return None if limit and max(pixels, default=0) > limit else [3 * p for p in pixels]

    @property
    def stored_bytes(self) -> bool:
        """Whether images are tensors of stored bytes (map views with ``image(view=True)``)."""
        return self.decode == "none" or (self.raw and self.decode == "tensor")

    def image(self, record: int, data: Buffer, *, view: bool = False) -> Any:
        """The image from its ``IMAGE`` field; ``view``: stored bytes as read-only views of the
        map, for a caller that copies them (``share_batch``)."""
        if self.raw:
            return self._raw_image(record, data, view)
        if self.decode == "pil":
            return self._pil(record, data, "image")
        if self.decode == "none":
            return self._tensor(data, view)
        size = jpeg_size(_view(data))
        if size is not None:
            self._check_pixels(record, size)
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings(
                        "ignore", _TV_DECODE_DEPRECATED, category=DeprecationWarning
                    )
                    return decode_jpeg(_owned_tensor(data), mode=ImageReadMode.RGB)
            except RuntimeError:
                pass  # a JPEG flavour libjpeg in torchvision refuses: PIL below decides
        return pil_to_tensor(self._pil(record, data, "image"))

    def _check_pixels(self, record: int, size: tuple[int, int]) -> None:
        """Pillow's pixel limit for a size read without Pillow (id looked up only if over)."""
        limit = Image.MAX_IMAGE_PIXELS
        if limit and size[0] * size[1] > limit:
            check_pixels(size, self._where(record), ImageTooLargeError)

    def _pil(self, record: int, data: Buffer, what: str) -> Image.Image:
        """``data`` decoded by PIL (images as RGB, masks as opened), errors raised as ours."""
        try:
            image = Image.open(io.BytesIO(_view(data)))
            if what == "image":
                return image.convert("RGB")
            image.load()
            return image
        except Image.DecompressionBombError as exc:
            raise ImageTooLargeError(
                f"{self._where(record)}: the {what}: {exc} (raise PIL.Image.MAX_IMAGE_PIXELS "
                "if the image is genuine)"
            ) from None
        except (OSError, ValueError, SyntaxError) as exc:
            raise FormatError(
                f"{self._where(record)}: the stored {what} cannot be decoded "
                f"({type(exc).__name__}: {pil_reason(exc)}); re-pack it (check_images=True finds "
                "damaged source files)"
            ) from exc

    def _raw_image(self, record: int, data: Buffer, view: bool) -> Any:
        height, width = self._sizes[record].tolist()
        self._check_pixels(record, (width, height))
        if len(data) != width * height * 3:
            raise FormatError(
                f"{self._where(record)}: {len(data)} bytes of raw pixels for a {width}x{height} "
                "RGB image; the pack is damaged, re-pack it"
            )
        if self.decode == "pil":
            return Image.frombytes("RGB", (width, height), bytes(data))
        pixels = self._tensor(data, view)
        if self.decode == "none":
            return pixels
        return pixels.view(height, width, 3).permute(2, 0, 1)

    def _tensor(self, data: Buffer, view: bool) -> torch.Tensor:
        """Stored bytes as a uint8 tensor: a copy, or (``zero_copy``, ``view``) a read-only
        view of the map (torch's warning about that silenced: documented)."""
        if not (view or self.zero_copy) or isinstance(data, np.ndarray) or not len(data):
            return _owned_tensor(data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(data, dtype=torch.uint8)

    def target(self, record: int, data: Buffer) -> Any:
        """The target from its ``target_field``: the mask as PIL opens it (mode P), else
        torchvision's dict or the ``tv_tensors`` dict."""
        if self.task == "Segmentation":
            return self._pil(record, data, "mask")
        if self.target_format == "dict":
            return self._dict_target(record, data)
        if self._untyped[record]:
            raise self._no_rows(record)
        objects = np.frombuffer(data, dtype=schema.OBJECT_DTYPE)
        try:  # unsigned: -1 must fail the lookup, not wrap to the last class
            labels: np.ndarray | None = self._labels[objects["class_id"].view(np.uint32)]
        except IndexError:
            labels = None
        if labels is None or (self._unknown and bool((labels < 0).any())):
            raise FormatError(
                f"{self._where(record)}: an object's class is not in the label list (the pack's "
                "classes or class counts are damaged); re-pack it"
            )
        height, width = self._sizes[record].tolist()
        return {
            "boxes": tv_tensors.BoundingBoxes(
                torch.from_numpy(objects["box"].copy()),
                format=tv_tensors.BoundingBoxFormat.XYXY,
                canvas_size=(height, width),
            ),
            "labels": torch.from_numpy(labels),
            "difficult": torch.from_numpy(objects["difficult"].astype(bool)),
        }

    def _dict_target(self, record: int, data: Buffer) -> dict[str, Any]:
        """The stored JSON as torchvision's dict (fresh per call)."""
        try:
            target: Any = schema.decode_target(_view(data))
            found = "" if type(target) is dict else "not a JSON object"
        except ValueError as exc:  # orjson.JSONDecodeError
            found = f"not valid JSON ({exc})"
        if found:
            raise FormatError(f"{self._where(record)}: the stored target is {found}; re-pack it")
        return target

    def _no_rows(self, record: int) -> SourceDataError:
        """The error for ``tv_tensors`` of objects packed without boxes, with the reason."""
        source = f"Annotations/{self._id(record)}.xml"
        try:
            stored = self._dict_target(record, self._field(record, schema.TARGET))
            extract_objects(stored, source=source)
            reason = f"{source}: its objects were packed without boxes."
        except SourceDataError as exc:
            reason = str(exc)
        return SourceDataError(
            f"{self._where(record)} has no tv_tensors target: {reason} Use target_format='dict', "
            "or fix the XML and append it with replace_changed=True (`pack --append "
            "--replace-changed`), or leave the id out of the image set."
        )


def _view(data: Buffer) -> memoryview | bytes:
    return data.data if isinstance(data, np.ndarray) else data


def _owned_tensor(data: Buffer) -> torch.Tensor:
    """A uint8 tensor owning its memory (copies only read-only views)."""
    if isinstance(data, np.ndarray) and data.flags.writeable:
        return torch.from_numpy(data)
    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
