"""The VOC sample schema: which fields and arrays a packed VOC dataset holds, and their codecs.

A packed VOC dataset is a container (``container.spec``) whose records have the byte fields
``FIELDS`` (image, annotation XML, class mask, object mask, torchvision's target as JSON, one
``OBJECT_DTYPE`` row per object) and the per-record ``COLUMNS``, beside dataset-level arrays
(ids, image sets, source statistics, object classes, retired records). docs/FORMAT.md, "VOC
packs", is the specification; each schema version adds one mark (retired records, objects
without rows, unparsed annotations) that readers before it must refuse.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

SCHEMA = "voc"
#: The newest schema version read; a pack is written as the lowest that holds it.
SCHEMA_VERSION = 4
#: Packs without retired records, objects without rows or unparsed annotations (0.1.0).
BASE_SCHEMA_VERSION = 1
RETIRED_SCHEMA_VERSION = 2
UNTYPED_SCHEMA_VERSION = 3
UNPARSED_SCHEMA_VERSION = 4

SOURCE_STATS_VERSION = 1
#: The source files of a record whose statistics are kept, in ``source/*`` column order.
SOURCE_FILES = ("image", "annotation", "mask", "object_mask")
ABSENT = -1
SIZE_ARRAY = "source/size"
MTIME_ARRAY = "source/mtime_ns"
DIGEST_ARRAY = "source/sha256"
RETIRED_ARRAY = "retired"
OBJECT_CLASSES_ARRAY = "objects/class_id"

FIELDS = ("image", "annotation", "mask", "object_mask", "target", "objects")
IMAGE, ANNOTATION, MASK, OBJECT_MASK, TARGET, OBJECTS = range(len(FIELDS))

COLUMNS = np.dtype(
    [
        ("width", "<u4"),  # of the stored image
        ("height", "<u4"),
        ("num_objects", "<u4"),
        ("flags", "<u4"),
    ]
)
HAS_ANNOTATION = 1
HAS_MASK = 2
HAS_OBJECT_MASK = 4
#: the annotation's objects have no ``objects`` rows
UNTYPED_OBJECTS = 8
#: the annotation's bytes are stored but did not parse: no target, no objects
UNPARSED_ANNOTATION = 16
KNOWN_FLAGS = HAS_ANNOTATION | HAS_MASK | HAS_OBJECT_MASK | UNTYPED_OBJECTS | UNPARSED_ANNOTATION
#: The flag that says a record has each of ``SOURCE_FILES`` (the image: always)
SOURCE_FLAGS = (0, HAS_ANNOTATION, HAS_MASK, HAS_OBJECT_MASK)
#: Where each of ``SOURCE_FILES`` is in a devkit: its folder, and its extension after the id
SOURCE_FOLDERS = ("JPEGImages", "Annotations", "SegmentationClass", "SegmentationObject")
SOURCE_EXTENSIONS = (".jpg", ".xml", ".png", ".png")

#: One row per object; ``class_id`` indexes the pack's ``classes`` list (its metadata).
OBJECT_DTYPE = np.dtype(
    [
        ("box", "<f4", (4,)),  # xmin, ymin, xmax, ymax as written in the XML
        ("class_id", "<i4"),
        ("difficult", "u1"),
        ("truncated", "u1"),
        ("reserved", "<u2"),
    ]
)


def schema_version(*, retired: bool, untyped: bool, unparsed: bool) -> int:
    """The version a pack is written as: the lowest whose readers read all of it."""
    if unparsed:
        return UNPARSED_SCHEMA_VERSION
    if untyped:
        return UNTYPED_SCHEMA_VERSION
    return RETIRED_SCHEMA_VERSION if retired else BASE_SCHEMA_VERSION


def split_array_name(task: str, image_set: str) -> str:
    """Name of the array listing the records of ``image_set`` of ``task``."""
    return f"split/{task}/{image_set}"


#: The deepest nesting of lists and dicts a stored target may have: what orjson reads.
MAX_TARGET_DEPTH = 1024


class TargetTooDeepError(ValueError):
    """A target nested deeper than ``MAX_TARGET_DEPTH`` or than ``json`` can write."""


def encode_target(target: dict[str, Any]) -> bytes:
    """torchvision's target dict as compact JSON, order kept; ``TargetTooDeepError`` rather
    than write a target ``decode_target`` cannot read."""
    try:
        data = json.dumps(target, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except RecursionError:
        raise TargetTooDeepError("deeper than Python's recursion limit lets json write") from None
    if data.count(b"[") + data.count(b"{") > MAX_TARGET_DEPTH:
        try:
            decode_target(data)  # the reader's own parser
        except orjson.JSONDecodeError as exc:
            raise TargetTooDeepError(
                f"lists and dicts nested deeper than the {MAX_TARGET_DEPTH} levels a pack's "
                f"reader parses ({exc})"
            ) from None
    return data


def decode_target(data: bytes | memoryview) -> dict[str, Any]:
    """Inverse of ``encode_target`` (a fresh dict); orjson, as it is the largest cost after
    the image copy on the ``decode="none"`` path."""
    result: dict[str, Any] = orjson.loads(data)
    return result


def encode_objects(
    boxes: np.ndarray, class_ids: Sequence[int], difficult: np.ndarray, truncated: np.ndarray
) -> bytes:
    """Pack per-object arrays into ``OBJECT_DTYPE`` rows."""
    rows = np.zeros(len(class_ids), dtype=OBJECT_DTYPE)
    rows["box"] = boxes
    rows["class_id"] = class_ids
    rows["difficult"] = difficult
    rows["truncated"] = truncated
    return rows.tobytes()


def encode_ids(ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """All ids as one UTF-8 byte array plus ``len(ids) + 1`` offsets."""
    encoded = [i.encode("utf-8") for i in ids]
    offsets = np.zeros(len(encoded) + 1, dtype="<u8")
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    return np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets


def decode_id(blob: np.ndarray, offsets: np.ndarray, i: int) -> str:
    """Id of record ``i`` from the arrays made by ``encode_ids``."""
    return blob[int(offsets[i]) : int(offsets[i + 1])].tobytes().decode("utf-8")


def decode_ids(blob: np.ndarray, offsets: np.ndarray) -> list[str]:
    """Every id from the arrays made by ``encode_ids``."""
    data, ends = blob.tobytes(), offsets.tolist()
    return [data[a:b].decode("utf-8") for a, b in zip(ends[:-1], ends[1:])]
