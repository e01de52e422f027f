"""The VOC sample schema: fields, columns and arrays of a packed VOC dataset, and their codecs;
docs/FORMAT.md, "VOC packs", is the specification. Each schema version adds one mark that
readers before it must refuse."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

SCHEMA = "voc"
SCHEMA_VERSION = 4  #: newest read; a pack is written as the lowest that holds it
BASE_SCHEMA_VERSION = 1  #: 0.1.0: no retired records, untyped objects, unparsed XML
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
UNTYPED_OBJECTS = 8  # the annotation's objects have no ``objects`` rows
UNPARSED_ANNOTATION = 16  # the annotation is stored but did not parse: no target, no objects
KNOWN_FLAGS = HAS_ANNOTATION | HAS_MASK | HAS_OBJECT_MASK | UNTYPED_OBJECTS | UNPARSED_ANNOTATION
SOURCE_FLAGS = (0, HAS_ANNOTATION, HAS_MASK, HAS_OBJECT_MASK)
SOURCE_FOLDERS = ("JPEGImages", "Annotations", "SegmentationClass", "SegmentationObject")
SOURCE_EXTENSIONS = (".jpg", ".xml", ".png", ".png")

OBJECT_DTYPE = np.dtype(  #: a row per object; class_id indexes metadata classes
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
    return f"split/{task}/{image_set}"


MAX_TARGET_DEPTH = 1024  #: deepest list/dict nesting of a stored target: orjson's


class TargetTooDeepError(ValueError):
    """A target nested deeper than ``MAX_TARGET_DEPTH`` or than ``json`` can write."""


def encode_target(target: dict[str, Any]) -> bytes:
    """torchvision's target as compact JSON, order kept; ``TargetTooDeepError`` rather than
    write one ``decode_target`` cannot read."""
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
    """Inverse of ``encode_target``; orjson: the top cost after ``decode="none"``'s copy."""
    result: dict[str, Any] = orjson.loads(data)
    return result


def encode_objects(
    boxes: np.ndarray, class_ids: Sequence[int], difficult: np.ndarray, truncated: np.ndarray
) -> bytes:
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
    return blob[int(offsets[i]) : int(offsets[i + 1])].tobytes().decode("utf-8")


def decode_ids(blob: np.ndarray, offsets: np.ndarray) -> list[str]:
    data, ends = blob.tobytes(), offsets.tolist()
    return [data[a:b].decode("utf-8") for a, b in zip(ends[:-1], ends[1:])]
