"""Bytes of a packed VOC record -> what a dataset returns: image, target dict or tensors, mask.

As torchvision's ``read_file`` then ``decode_jpeg(data)``, reading and decoding are apart:
the caller passes a record's fields in (views of the map, or private copies); the decoder
never reads the pack. One ``SampleDecoder`` serves both the map-style and the iterable
datasets, so the two return identical samples.

Stored bytes are untrusted, and this is where what cannot be checked at open is checked, per
record: the size an image declares against Pillow's ``MAX_IMAGE_PIXELS`` before anything is
allocated (``ImageTooLargeError``); bytes that do not decode, a target that is not a JSON
object, class ids out of range (``FormatError`` naming the pack, the record and its id); a
``tv_tensors`` target of objects packed without rows (``SourceDataError`` saying why).
"""

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
from ..voc.images import check_pixels, declared_size, jpeg_size, pil_reason
from ..voc.packed import VOCPackReader
from ..voc.xml import extract_objects

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
#:   without arguments and their labels do not move when a class is added later (a pack
#:   grown by ``append_voc`` keeps the list it had, new classes after it: ``label_names``).
#: - ``"packed"``: ``"__background__"``, then the pack's classes sorted by name (0.1.0's rule,
#:   kept so that labels of models trained with it stay the same; it differs from ``None``);
#:   after an append, the sorted list the pack had, new classes after it.
#: - a sequence of names: exactly that list; every class of the image set must be in it.
Classes = Literal["packed"] | Sequence[str] | None
#: Bytes of one record field: a read-only view into the map, or a private array.
Buffer = memoryview | np.ndarray | bytes

#: torchvision >= 0.29 warns on every ``decode_jpeg`` call (moving to TorchCodec); the call is
#: our choice, not the user's, so that one warning is silenced around it (``-W error`` safe).
_TV_DECODE_DEPRECATED = r"The image decoding and encoding capabilities of TorchVision"


def label_names(pack: VOCPackReader, classes: Classes) -> list[str]:
    """The label name list that ``classes`` stands for (see ``Classes``)."""
    base = pack.meta.get("label_base")
    if classes is None:
        return ["__background__", *label_classes("default", pack.classes, base)]
    if isinstance(classes, str):
        if classes != "packed":
            raise ValueError(f"classes must be None, 'packed' or a list of names, got {classes!r}")
        return ["__background__", *label_classes("packed", pack.classes, base)]
    names = list(classes)
    if len(set(names)) != len(names):
        raise ValueError("classes must not repeat a name")
    return names


class SampleDecoder:
    """Decodes the fields of records of one pack, for one image set.

    It keeps what decoding needs from the pack (image sizes, label ids, storage kind) and how
    to name a record in an error (``VOCPackReader.where``), not the pack itself.
    """

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
        self._where = pack.where  # names a record in errors: the decoder never reads the pack
        #: tensors of stored bytes (``decode="none"``, raw pixels) view the map, not a copy
        self.zero_copy = zero_copy
        self.raw = pack.image_storage == "raw"
        self.label_names = label_names(pack, classes)
        position = {name: i for i, name in enumerate(self.label_names)}
        self._labels = np.array([position.get(n, -1) for n in pack.classes], dtype=np.int64)
        #: pack classes outside the label list (-1 above): checked per read, as the class
        #: counts that ruled them out for this image set below are only the metadata's word
        self._unknown = bool((self._labels < 0).any())
        columns = pack.columns
        #: records whose annotations' objects have no rows (``schema.UNTYPED_OBJECTS``): a
        #: ``tv_tensors`` target of one raises, saying why (``_no_rows``) from its stored dict
        self._untyped = (columns["flags"] & schema.UNTYPED_OBJECTS) != 0
        self._field, self._id = pack.field, pack.id  # for that error only
        #: (height, width) of every stored image; one small array, read per sample
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
        """The record field ``target`` decodes: the mask, the JSON dict or the object rows."""
        if self.task == "Segmentation":
            return schema.MASK
        return schema.TARGET if self.target_format == "dict" else schema.OBJECTS

    def decoded_nbytes(self, records: Sequence[int]) -> list[int] | None:
        """Each record's decoded image size in bytes where the pack's columns give it
        (``decode="tensor"`` of JPEGs: 3 x height x width; not past the pixel limit, which
        decoding checks first), else None (``SharedBlock``)."""
        if self.decode != "tensor" or self.raw:
            return None
        pixels = [h * w for h, w in self._sizes[np.asarray(records, dtype=np.int64)].tolist()]
        limit = Image.MAX_IMAGE_PIXELS
        return None if limit and max(pixels, default=0) > limit else [3 * p for p in pixels]

    @property
    def stored_bytes(self) -> bool:
        """Whether images are tensors of the stored bytes (``decode="none"``, raw pixels as
        tensors): what ``image(view=True)`` returns as views of the map."""
        return self.decode == "none" or (self.raw and self.decode == "tensor")

    def image(self, record: int, data: Buffer, *, view: bool = False) -> Any:
        """The image of ``record`` from ``data``, its ``schema.IMAGE`` field.

        ``view``: stored bytes (``stored_bytes``) as read-only views of the map, as with
        ``zero_copy``, for a caller that copies them anyway and never hands a view on (a
        DataLoader worker's shared block: ``workers.share_batch(borrowed=)``)."""
        if self.raw:
            return self._raw_image(record, data, view)
        if self.decode == "pil":
            return self._pil(record, data, "image")
        if self.decode == "none":
            return self._tensor(data, view)
        size = jpeg_size(_view(data))
        if size is not None:
            self._check_pixels(record, size, warn=True)
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings(
                        "ignore", _TV_DECODE_DEPRECATED, category=DeprecationWarning
                    )
                    return decode_jpeg(_owned_tensor(data), mode=ImageReadMode.RGB)
            except RuntimeError:
                pass  # a JPEG flavour libjpeg in torchvision refuses: PIL below decides
        return pil_to_tensor(self._pil(record, data, "image"))

    def _check_pixels(self, record: int, size: tuple[int, int], *, warn: bool) -> None:
        """``voc.images.check_pixels`` with the limit read now; the record is named (its id
        looked up) only when the size is over the limit."""
        limit = Image.MAX_IMAGE_PIXELS
        if limit and size[0] * size[1] > (limit if warn else 2 * limit):
            check_pixels(size, self._where(record), ImageTooLargeError)

    def _pil(self, record: int, data: Buffer, what: str) -> Image.Image:
        """``data`` decoded by PIL, its declared size checked first and PIL's errors raised as
        ours, naming the record: the image converted to RGB exactly as torchvision's loader
        does, or the mask as PIL opens it."""
        size = declared_size(_view(data))
        if size is not None:
            self._check_pixels(record, size, warn=False)  # PIL itself warns below
        try:
            image = Image.open(io.BytesIO(_view(data)))  # shares bytes, copies other buffers
            if what == "image":
                return image.convert("RGB")
            image.load()
            return image
        except Image.DecompressionBombError as exc:
            raise ImageTooLargeError(f"{self._where(record)}: the {what}: {exc}") from None
        except (OSError, ValueError, SyntaxError) as exc:
            raise FormatError(
                f"{self._where(record)}: the stored {what} cannot be decoded "
                f"({type(exc).__name__}: {pil_reason(exc)}); the source file was damaged (pack "
                "with check_images=True to find such files) or the pack is, re-pack it"
            ) from exc

    def _raw_image(self, record: int, data: Buffer, view: bool) -> Any:
        """Raw stored pixels as ``decode`` asks."""
        height, width = self._sizes[record].tolist()
        # the same rule as every decode path, though the columns must also match the bytes
        self._check_pixels(record, (width, height), warn=True)
        if len(data) != width * height * 3:
            raise FormatError(
                f"{self._where(record)}: {len(data)} bytes of raw pixels for a "
                f"{width}x{height} RGB image ({width * height * 3} bytes); the pack is "
                "damaged, re-pack it"
            )
        if self.decode == "pil":
            return Image.frombytes("RGB", (width, height), bytes(data))
        pixels = self._tensor(data, view)
        if self.decode == "none":
            return pixels
        return pixels.view(height, width, 3).permute(2, 0, 1)

    def _tensor(self, data: Buffer, view: bool) -> torch.Tensor:
        """Stored bytes as a 1-D uint8 tensor: a copy it owns, or with ``zero_copy`` or
        ``view`` a read-only view of the map (a private array, or nothing, as a tensor of its
        own).

        Torch warns once per process about read-only views; the documented ``zero_copy``
        contract is that warning, so it is silenced."""
        if not (view or self.zero_copy) or isinstance(data, np.ndarray) or not len(data):
            return _owned_tensor(data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(data, dtype=torch.uint8)

    def target(self, record: int, data: Buffer) -> Any:
        """The target of ``record`` from ``data``, its ``target_field``."""
        if self.task == "Segmentation":
            return self.mask(record, data)
        if self.target_format == "dict":
            return self._dict_target(record, data)
        objects, labels = self._objects(record, data)
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
        """The stored target JSON as torchvision's dict (a fresh one per call: the caller may
        mutate it); damaged bytes raise ours."""
        try:
            target = schema.decode_target(_view(data))
        except ValueError as exc:  # orjson.JSONDecodeError
            raise FormatError(
                f"{self._where(record)}: the stored target is not valid JSON ({exc}); "
                "the pack is damaged, re-pack it"
            ) from None
        if type(target) is not dict:
            raise FormatError(
                f"{self._where(record)}: the stored target is not a JSON object; "
                "the pack is damaged, re-pack it"
            )
        return target

    def _objects(self, record: int, data: Buffer) -> tuple[np.ndarray, np.ndarray]:
        """The stored object rows of ``record`` and their labels, the class ids checked
        against the pack's classes and this decoder's label list (never a wrong label, never
        a wrapped index)."""
        if self._untyped[record]:
            raise self._no_rows(record)
        try:
            objects = np.frombuffer(data, dtype=schema.OBJECT_DTYPE)
            # unsigned: -1 must fail the lookup, not wrap to the last class
            labels = self._labels[objects["class_id"].view(np.uint32)]
        except (ValueError, IndexError):
            raise FormatError(
                f"{self._where(record)}: the stored objects are not rows of "
                f"{len(self._labels)} known classes; the pack is damaged, re-pack it"
            ) from None
        if self._unknown and bool((labels < 0).any()):
            raise FormatError(
                f"{self._where(record)}: an object's class is not in the label list, though "
                "the pack's class counts said so; the pack is damaged, re-pack it"
            )
        return objects, labels

    def _no_rows(self, record: int) -> SourceDataError:
        """The error for a ``tv_tensors`` target of a record whose objects have no rows, with
        the reason the packer found, found again in its stored dict (this path only)."""
        source = f"Annotations/{self._id(record)}.xml"
        try:
            stored = self._dict_target(record, self._field(record, schema.TARGET))
            extract_objects(stored, source=source)
            reason = f"{source}: its objects were packed without boxes."
        except SourceDataError as exc:
            reason = str(exc)
        return SourceDataError(
            f"{self._where(record)} has no tv_tensors target: {reason} torchvision reads such "
            "an annotation but cannot make boxes of it either. Use target_format='dict' for "
            "torchvision's dict of it, or fix the XML and append it with "
            "append_voc(..., replace_changed=True) (`pack --append --replace-changed`), or "
            "leave the id out of the image set."
        )

    def mask(self, record: int, data: Buffer) -> Image.Image:
        """A SegmentationClass mask from its ``schema.MASK`` field, as PIL opens the PNG (mode
        P, palette), its pixels decoded here, so damaged bytes raise our error naming the
        record rather than PIL's later in a transform."""
        return self._pil(record, data, "mask")


def _view(data: Buffer) -> memoryview | bytes:
    return data.data if isinstance(data, np.ndarray) else data


def _owned_tensor(data: Buffer) -> torch.Tensor:
    """A 1-D uint8 tensor of ``data`` that owns its memory (no copy if ``data`` is already a
    private writable array, as the iterable's reads are; a copy of a read-only map view)."""
    if isinstance(data, np.ndarray) and data.flags.writeable:
        return torch.from_numpy(data)
    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
