"""The VOC sample schema: which fields and arrays a packed VOC dataset holds, and their codecs.

A packed VOC dataset is a container (see ``torch_serialized.container.spec``) whose records are
samples with these byte fields:

- ``image``: the JPEGImages file bytes, unchanged (or raw RGB pixels / a resized JPEG when
  packed with ``image_storage="raw"`` or ``max_size``);
- ``annotation``: the Annotations XML bytes, unchanged (empty when the id has none);
- ``mask``: the SegmentationClass PNG bytes, unchanged (empty when none);
- ``object_mask``: the SegmentationObject PNG bytes, unchanged (empty when none);
- ``target``: torchvision's parsed target dict as compact UTF-8 JSON (empty when no XML),
  lists and dicts nested at most ``MAX_TARGET_DEPTH`` deep;
- ``objects``: one ``OBJECT_DTYPE`` row per ``<object>``, for the fast tensor target.

The per-record ``records`` array has dtype ``COLUMNS``. Dataset-level arrays: ``ids`` (UTF-8
bytes of all ids concatenated) with ``id_offsets`` (N + 1 offsets), and ``split/TASK/NAME``
(record numbers of image set NAME of task Main or Segmentation, in list-file order).

Source statistics (``SOURCE_STATS_VERSION``, metadata key ``source_stats``; absent in packs
written before it): what ``append_voc`` compares to tell a changed source file without
reading it, like rsync's quick check. ``source/size`` and ``source/mtime_ns`` (int64, shape
``[N, 4]``, columns in ``SOURCE_FILES`` order) hold each source file's size and modification
time in nanoseconds when it was read (``ABSENT`` size: the file was not there or not read).
The stored ``annotation``, ``mask`` and ``object_mask`` fields are the files' own bytes, and so
is ``image`` when stored as is; when images are stored transformed (``image_storage="raw"`` or
``max_size``), ``source/sha256`` (uint8, ``[N, 32]``) holds each source image's SHA-256, so a
content comparison needs no re-encoding (a row of zeros: not known, the record came from a
pack written before).

Object classes (``objects/class_id``, int32; absent in packs written before it): the class id
of every stored object, records in record order (retired ones included), each record's objects
in stored order; ``num_objects`` of ``records`` says how many are each record's. The same ids
as the shards' ``objects`` fields, kept beside the other dataset arrays so that ``append_voc``
recounts the image sets' classes without reading a shard (at a URL: without downloading one).

Retired records (schema version 2, only in shard folders): a record replaced or dropped by an
append stays in its shard (shards are never rewritten) and is listed in the dataset-level
array ``retired`` (int64 record numbers, ascending). No image set refers to it; readers that
walk every record skip it (``VOCPackReader.live``). A pack without retired records is written
as schema version 1, which older readers read.

Objects without a row (schema version 3): torchvision reads any XML and leaves its objects to
the training code, so an annotation whose objects the ``objects`` rows cannot hold (an object
without a single ``<bndbox>`` of four finite numbers or a single non-empty ``<name>``, a
``<difficult>`` or ``<truncated>`` other than 0, 1 or empty, a root that is not
``<annotation>``) is packed all the same: its ``target`` is torchvision's dict as for any
other, its ``objects`` field is empty and ``flags`` has ``UNTYPED_OBJECTS``, so a
``tv_tensors`` target of it raises instead of returning no boxes. A pack holding such a
record is written as schema version 3, which readers before it refuse rather than read
those records as having no objects.

Annotations that do not parse (schema version 4): ``VOCSegmentation`` never reads an
id's XML, so an id listed only in ``ImageSets/Segmentation`` whose ``Annotations`` file is
not an XML document the packer parses (malformed, an encoding expat cannot read, entity
declarations or external DTD and entity references, which we refuse, nesting too deep to
convert or store) is packed all the same: its
``annotation`` field holds the file's bytes (``HAS_ANNOTATION``, so an export writes it
back), its ``target`` and ``objects`` fields are empty and ``flags`` has
``UNPARSED_ANNOTATION``. No ``split/Main/*`` list may name such a record. A pack holding one
is written as schema version 4, which readers before it refuse rather than look for a target
that is not there.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

SCHEMA = "voc"
#: The newest schema version read; a pack is written as the lowest version that holds it
#: (``schema_version``), so older readers read every pack they can read correctly.
SCHEMA_VERSION = 4
#: Packs without retired records, objects without rows or unparsed annotations (what
#: torch_serialized 0.1.0 reads).
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
#: the annotation's objects have no ``objects`` rows (see the module docstring)
UNTYPED_OBJECTS = 8
#: the annotation's bytes are stored but did not parse: no target, no objects (see the
#: module docstring); always with ``HAS_ANNOTATION``, never in a ``Main`` image set
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


#: The deepest nesting of lists and dicts a stored target may have: what ``decode_target``'s
#: parser (orjson) reads. ``json`` writes deeper documents wherever Python's recursion limit
#: lets it (Python >= 3.12 checks C recursion apart), so a writer checks.
MAX_TARGET_DEPTH = 1024


class TargetTooDeepError(ValueError):
    """A target nested too deeply to store: deeper than ``MAX_TARGET_DEPTH``, or than Python's
    recursion limit lets ``json`` write."""


def encode_target(target: dict[str, Any]) -> bytes:
    """torchvision's target dict as compact JSON: strings, lists and dicts only, order kept.

    Raises ``TargetTooDeepError`` rather than write a target ``decode_target`` cannot read.
    """
    try:
        data = json.dumps(target, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except RecursionError:
        raise TargetTooDeepError("deeper than Python's recursion limit lets json write") from None
    # only a document holding that many brackets can nest that deep: free for every other one
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
    """Inverse of ``encode_target`` (a fresh dict the caller may mutate).

    orjson, not ``json``: on the bytes-level hot path (``decode="none"``) parsing the target
    is the largest cost after the image copy, and orjson is faster (benchmarks/README.md,
    "Measurements behind the code") with the same result for the strings, lists and dicts
    stored here.
    """
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
    """Every id from the arrays made by ``encode_ids``, at once (ASCII ids in one decode)."""
    ends = offsets.tolist()
    if len(blob) and int(blob.max()) >= 0x80:
        return [decode_id(blob, offsets, i) for i in range(len(ends) - 1)]
    text = blob.tobytes().decode("ascii")
    return [text[a:b] for a, b in zip(ends[:-1], ends[1:])]
