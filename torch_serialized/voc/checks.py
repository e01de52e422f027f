"""The VOC layer's checks of a pack at open: every metadata value and array it reads, and each
file's ``records`` columns, so nothing later trips over a damaged or crafted pack (``FormatError``
naming file and field). Only a record's class ids and target JSON are checked as read."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..container.manifest import member_of
from ..container.reader import ContainerReader
from ..container.shards import PackReader
from ..container.spec import clip
from ..errors import FormatError, UnsupportedVersionError
from . import schema
from .classes import label_classes
from .layout import TASKS


def check_voc_pack(reader: PackReader) -> dict[str, Any]:
    """Check an open pack's VOC meaning; return its VOC metadata. ``FormatError`` names the
    pack (or, for a shard or catalog opened alone, the folder to pass instead)."""
    name = reader.name
    if reader.manifest is None:  # one file: a pack, or a piece of one
        member = member_of(name, reader.binding)
        if member is not None:
            raise FormatError(f"{name} is {member}, not a pack by itself; {member.advice}")
    meta = reader.user
    if meta.get("schema") != schema.SCHEMA:
        raise FormatError(
            f"{name} is a torch_serialized file but not a VOC pack "
            f"(schema {meta.get('schema')!r}); pack it with torch_serialized.pack_voc"
        )
    version = meta.get("schema_version")
    if type(version) is int and version > schema.SCHEMA_VERSION:
        raise UnsupportedVersionError(
            f"{name}: VOC schema version {version} is newer than this torch_serialized reads "
            f"({schema.SCHEMA_VERSION}); upgrade torch_serialized"
        )
    if type(version) is not int or version < 1:
        raise _bad(name, "schema_version", f"an integer from 1 to {schema.SCHEMA_VERSION}", version)
    if tuple(reader.fields) != schema.FIELDS:
        raise _bad(name, "fields", repr(list(schema.FIELDS)), list(reader.fields))
    check_metadata(meta, len(reader), name)
    check_arrays(reader.arrays(), meta, len(reader), name)
    if reader.single is not None:  # a shard folder's shards: when opened (``check_records``)
        check_record_fields(reader.single, 0, name)
    return meta


def _bad(path: str, field: str, expected: str, found: Any) -> FormatError:
    text = clip(repr(found), 60)
    return FormatError(
        f"{path}: VOC metadata field {field!r} is invalid: expected {expected}, found {text}; "
        "the pack is damaged or was not written by pack_voc: re-pack it"
    )


def _is_int(value: Any, low: int = 0) -> bool:
    return type(value) is int and value >= low


def _names(value: Any) -> bool:
    return (
        isinstance(value, list)
        and all(isinstance(v, str) for v in value)
        and len(set(value)) == len(value)
    )


#: (key, default when absent, rule, what it wants) of each metadata value checked alone
_VALUES: tuple[tuple[str, Any, Callable[[Any], bool], str], ...] = (
    ("year", None, lambda v: isinstance(v, str) and len(v) == 4 and v.isdigit(), "4 digits"),
    ("base_dir", None, lambda v: isinstance(v, str), "a string"),
    ("voc_folder", None, lambda v: isinstance(v, str), "a string"),
    ("classes", None, _names, "a list of distinct class names"),
    ("image_storage", None, lambda v: v in ("original", "raw"), "'original' or 'raw'"),
    ("max_size", None, lambda v: v is None or _is_int(v, 1), "null or a positive integer"),
    ("source_bytes", None, lambda v: v is None or _is_int(v), "null or a non-negative integer"),
    ("source_stats", None, lambda v: v in (None, schema.SOURCE_STATS_VERSION), "null or 1"),
    ("options", {}, lambda v: isinstance(v, dict), "a JSON object"),
    ("skipped", [], lambda v: isinstance(v, list), "a JSON list"),
    ("splits", None, lambda v: isinstance(v, dict) and set(v) <= set(TASKS), f"keys in {TASKS}"),
    (
        "history",
        [],
        lambda v: (
            isinstance(v, list)
            and all(isinstance(e, dict) and isinstance(e.get("action"), str) for e in v)
        ),
        "a list of objects with an 'action'",
    ),
)


def check_metadata(meta: dict[str, Any], num_records: int, path: str) -> None:
    """Every metadata value the VOC layer reads has the type and range ``pack_voc`` writes."""
    for key, default, valid, expected in _VALUES:
        if not valid(meta.get(key, default)):
            raise _bad(path, key, expected, meta.get(key))
    if meta.get("num_samples") != num_records:
        raise _bad(
            path, "num_samples", f"the pack's {num_records} records", meta.get("num_samples")
        )
    for task, sets in meta["splits"].items():
        if not isinstance(sets, dict) or not all(_is_int(n) for n in sets.values()):
            raise _bad(path, f"splits.{task}", "image set names -> record counts", sets)
    classes = meta["classes"]
    counts = meta.get("class_counts", {})
    if not isinstance(counts, dict) or not all(
        isinstance(per, dict) and all(name in classes and _is_int(n) for name, n in per.items())
        for per in counts.values()
    ):
        raise _bad(path, "class_counts", "'task/set' -> class name -> count", counts)
    for key in ("max_samples_per_shard", "max_shard_bytes"):  # an append writes with them
        limit = meta.get("options", {}).get(key)
        if limit is not None and not _is_int(limit, 1):
            raise _bad(path, f"options.{key}", "null or a positive integer", limit)
    base = meta.get("label_base")  # the label lists of the classes before the first append
    if base is not None:
        lists = (
            isinstance(base, dict)
            and set(base) == {"default", "packed"}
            and all(map(_names, base.values()))
        )
        before = classes[: len(base["packed"])] if lists else []  # no label of them moves
        if not lists or base != {rule: label_classes(rule, before, None) for rule in base}:
            raise _bad(path, "label_base", "the label lists of the pack's first classes", base)


def check_arrays(
    arrays: Mapping[str, np.ndarray], meta: dict[str, Any], num_records: int, path: str
) -> None:
    """Every dataset-level array has ``pack_voc``'s dtype, shape and values."""
    columns = _array(arrays, "records", schema.COLUMNS, (num_records,), path)
    retired = _check_records(columns, arrays, meta, path)
    ids = _array(arrays, "ids", np.uint8, (-1,), path)
    offsets = _array(arrays, "id_offsets", "<u8", (num_records + 1,), path)
    starts = offsets[:-1][offsets[1:] > offsets[:-1]].astype(np.int64)  # of non-empty ids
    if num_records and (
        int(offsets[0]) != 0
        or int(offsets[-1]) != len(ids)
        or bool((offsets[1:] < offsets[:-1]).any())
        or bool(((ids[starts] & 0xC0) == 0x80).any())  # no id starts inside a character
    ):
        raise _bad(path, "id_offsets", "ascending offsets of each id in ids", "other offsets")
    try:
        ids.tobytes().decode("utf-8")  # with the starts above: every id decodes alone too
    except UnicodeDecodeError:
        raise _bad(path, "ids", "UTF-8 text", "other bytes") from None
    files = len(schema.SOURCE_FILES)
    for name in (schema.SIZE_ARRAY, schema.MTIME_ARRAY):
        if meta.get("source_stats") or name in arrays:
            _array(arrays, name, "<i8", (num_records, files), path)
    if schema.DIGEST_ARRAY in arrays:
        _array(arrays, schema.DIGEST_ARRAY, np.uint8, (num_records, 32), path)
    if schema.OBJECT_CLASSES_ARRAY in arrays:  # one class id per stored object
        total = int(columns["num_objects"].sum(dtype=np.int64))
        _array(arrays, schema.OBJECT_CLASSES_ARRAY, "<i4", (total,), path)
    for name in arrays:
        if name.startswith("file/"):
            _array(arrays, name, np.uint8, (-1,), path)
    named = {name for name in arrays if name.startswith("split/")}
    listed = {schema.split_array_name(t, n) for t, sets in meta["splits"].items() for n in sets}
    if named != listed:
        raise _bad(path, "splits", f"the image sets stored ({sorted(named)})", sorted(listed))
    unparsed = np.flatnonzero(columns["flags"] & schema.UNPARSED_ANNOTATION)
    for task, sets in meta["splits"].items():
        for name, count in sets.items():
            field = schema.split_array_name(task, name)
            records = _array(arrays, field, "<i8", (count,), path)
            if count and (int(records.min()) < 0 or int(records.max()) >= num_records):
                extremes = [int(records.min()), int(records.max())]
                raise _bad(path, field, f"record numbers below {num_records}", extremes)
            if np.isin(records, retired).any():
                raise _bad(path, field, "live records only", "a retired one")
            if task == "Main" and np.isin(records, unparsed).any():  # VOCDetection needs XML
                found = f"record {int(records[np.isin(records, unparsed)][0])}"
                raise _bad(path, field, "no record whose annotation did not parse", found)


def _array(
    arrays: Mapping[str, np.ndarray], name: str, dtype: Any, shape: tuple[int, ...], path: str
) -> np.ndarray:
    """``arrays[name]``, refused unless of ``dtype`` and ``shape`` (-1: any length)."""
    array = arrays.get(name)
    if (
        array is None
        or array.dtype != np.dtype(dtype)
        or len(array.shape) != len(shape)
        or any(want not in (-1, have) for want, have in zip(shape, array.shape))
    ):
        wanted = "x".join("N" if n < 0 else str(n) for n in shape)
        found = "nothing" if array is None else f"{array.dtype} {array.shape}"
        raise _bad(path, name, f"{wanted} {np.dtype(dtype)}", found)
    return array


def _check_records(
    columns: np.ndarray, arrays: Mapping[str, np.ndarray], meta: dict[str, Any], path: str
) -> np.ndarray:
    """Check every record's flags and marks against the schema version; return the retired."""
    flags, counted = columns["flags"], columns["num_objects"]
    untyped = (flags & schema.UNTYPED_OBJECTS) != 0
    unparsed = (flags & schema.UNPARSED_ANNOTATION) != 0
    rules = (
        (flags & np.uint32(~schema.KNOWN_FLAGS & 0xFFFFFFFF), f"flags within {schema.KNOWN_FLAGS}"),
        (untyped & (counted != 0), "no objects counted for flag 8 (objects without rows)"),
        (
            unparsed & (((flags & schema.HAS_ANNOTATION) == 0) | untyped | (counted != 0)),
            "flag 16 (unparsed) with flag 1, no flag 8, no objects",
        ),
    )
    for wrong, expected in rules:
        if wrong.any():
            r = int(np.flatnonzero(wrong)[0])
            found = f"flags {int(flags[r])}, {int(counted[r])} objects in record {r}"
            raise _bad(path, "records", expected, found)
    retired = np.empty(0, "<i8")
    if schema.RETIRED_ARRAY in arrays:  # ascending record numbers
        retired = _array(arrays, schema.RETIRED_ARRAY, "<i8", (-1,), path)
    marks = (
        (untyped.any(), schema.UNTYPED_SCHEMA_VERSION, "objects without rows"),
        (unparsed.any(), schema.UNPARSED_SCHEMA_VERSION, "unparsed annotations"),
        (schema.RETIRED_ARRAY in arrays, schema.RETIRED_SCHEMA_VERSION, "retired records"),
    )
    for present, version, what in marks:
        if present and meta["schema_version"] < version:
            raise _bad(path, "schema_version", f"{version} with {what}", meta["schema_version"])
    if len(retired) and (
        int(retired[0]) < 0 or int(retired[-1]) >= len(columns) or (np.diff(retired) <= 0).any()
    ):
        raise _bad(path, "retired", f"ascending record numbers below {len(columns)}", "others")
    return retired


def check_record_fields(
    container: ContainerReader, first_record: int, name: str | None = None
) -> None:
    """A file's ``records`` columns agree with its field lengths (FORMAT.md, "Record columns")."""
    columns = container.arrays().get("records")
    if (
        tuple(container.fields) != schema.FIELDS
        or columns is None
        or columns.dtype != schema.COLUMNS
        or columns.shape != (container.num_records,)
    ):
        return
    lengths = container.field_lengths()
    flags = columns["flags"]
    annotated = (flags & schema.HAS_ANNOTATION) != 0
    parsed = annotated & ((flags & schema.UNPARSED_ANNOTATION) == 0)
    rules = (
        (
            lengths[:, schema.OBJECTS] != columns["num_objects"] * schema.OBJECT_DTYPE.itemsize,
            "num_objects rows of 24 bytes in its objects field",
        ),
        (
            ((flags & schema.HAS_MASK) != 0) != (lengths[:, schema.MASK] > 0),
            "a mask exactly when flag 2 is set",
        ),
        (
            ((flags & schema.HAS_OBJECT_MASK) != 0) != (lengths[:, schema.OBJECT_MASK] > 0),
            "an object mask exactly when flag 4 is set",
        ),
        (
            ~annotated & (lengths[:, schema.ANNOTATION] > 0),
            "annotation bytes only when flag 1 is set",
        ),
        (
            parsed & (lengths[:, schema.ANNOTATION] == 0),
            "annotation bytes when flag 1 is set without flag 16",
        ),
        (
            parsed != (lengths[:, schema.TARGET] > 0),
            "a target exactly when flag 1 is set without flag 16",
        ),
    )
    for wrong, expected in rules:
        if wrong.any():
            r = int(np.flatnonzero(wrong)[0])
            found = dict(zip(schema.FIELDS, lengths[r].tolist()))
            raise FormatError(
                f"{name or container.where}: record {first_record + r}'s columns contradict "
                f"its fields: expected {expected}, found flags {int(flags[r])}, num_objects "
                f"{int(columns['num_objects'][r])}, field lengths {found}; re-pack it"
            )
