"""A packed VOC dataset seen through its schema: splits, ids, sizes and raw fields.

``VOCPackReader`` adds VOC meaning to a ``PackReader`` (see ``schema`` for the layout): the
reading side of ``pack_voc``, shared by the map-style and iterable datasets, ``export_voc``
and the command line. It holds numpy arrays only, never per-sample Python objects, so
DataLoader workers do not grow their memory by touching samples.

A pack is untrusted input: at open, ``check_metadata`` and ``check_arrays`` validate
everything the VOC layer reads from the metadata and the dataset-level arrays (types,
ranges, every image set's record numbers, the ids' offsets and encoding) and raise
``FormatError`` naming the file and the field, so no ``KeyError``, ``IndexError`` or silently
wrong label can come out of a damaged or crafted pack later. What varies per record (the
objects' class ids, a stored target's JSON) is checked by the decoder as it reads.
"""

# More than 400 lines: the reader and every check of what it reads at open, kept together
# so that nothing the reader trusts goes unchecked.

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..container.reader import ContainerReader, PackReader, member_of
from ..errors import ChecksumError, FormatError, SourceDataError, UnsupportedVersionError
from . import schema
from .classes import label_classes
from .layout import TASKS

__all__ = ["VOCPackReader"]


class VOCPackReader:
    """Read access to a pack written by ``pack_voc``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        checked: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit_bytes: int | None = None,
    ) -> None:
        self.reader = PackReader(
            path,
            checked=checked,
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
            check_records=check_record_fields,
        )
        meta = check_voc_pack(self.reader)
        self.meta: dict[str, Any] = meta
        self.year: str = meta["year"]
        self.base_dir: str = meta["base_dir"]
        self.classes: list[str] = list(meta["classes"])
        self.image_storage: str = meta["image_storage"]

    @property
    def path(self) -> str:
        """The local file or folder read: a URL's cached copy for a remote pack."""
        return self.reader.path

    @property
    def name(self) -> str:
        """What the user opened, for messages: the URL of a remote pack, else ``path``."""
        return self.reader.name

    def __len__(self) -> int:
        return len(self.reader)

    @property
    def retired(self) -> np.ndarray:
        """Record numbers retired by an append (replaced or dropped; ascending), usually none:
        their bytes stay in their shard until the next full pack, but no reader shows them."""
        array = self.reader.arrays().get(schema.RETIRED_ARRAY)
        return array if array is not None else np.empty(0, dtype="<i8")

    @property
    def live(self) -> np.ndarray:
        """The record numbers a reader shows, in storage order: every record not retired."""
        everything = np.arange(len(self), dtype=np.int64)
        retired = self.retired
        return np.delete(everything, retired) if len(retired) else everything

    def image_sets(self, task: str) -> list[str]:
        """Names of the image sets stored for ``task`` ("Main" or "Segmentation")."""
        return list(self.meta["splits"].get(task, {}))

    def split(self, task: str, image_set: str) -> np.ndarray:
        """Record numbers of ``image_set`` in list-file order (duplicates kept)."""
        name = schema.split_array_name(task, image_set)
        arrays = self.reader.arrays()
        if name not in arrays:
            folder = "Main" if task == "Main" else "Segmentation"
            raise ValueError(
                f"image_set {image_set!r} is not in {self.name} (ImageSets/{folder} had "
                f"{self.image_sets(task) or 'no lists'}); pick one of those or re-pack"
            )
        return arrays[name]

    @property
    def columns(self) -> np.ndarray:
        """The per-record ``schema.COLUMNS`` table."""
        return self.reader.arrays()["records"]

    def id(self, record: int) -> str:
        return schema.decode_id(*self.id_table(), record)

    def id_table(self) -> tuple[np.ndarray, np.ndarray]:
        """Every id as one UTF-8 byte array and its ``len + 1`` offsets (views of the map)."""
        arrays = self.reader.arrays()
        return arrays["ids"], arrays["id_offsets"]

    def objects(self, record: int) -> np.ndarray:
        """The ``schema.OBJECT_DTYPE`` rows of ``record``, checked: whole rows, class ids that
        name one of the pack's classes. A record whose objects have no rows
        (``schema.UNTYPED_OBJECTS``) or whose annotation did not parse
        (``schema.UNPARSED_ANNOTATION``) raises ``SourceDataError`` rather than give none."""
        flags = int(self.columns[record]["flags"])
        if flags & schema.UNTYPED_OBJECTS:
            raise SourceDataError(
                f"{self.where(record)}: its annotation's objects do not fit the object rows "
                "(no numeric box or no name); read its dict target instead"
            )
        if flags & schema.UNPARSED_ANNOTATION:
            raise SourceDataError(
                f"{self.where(record)}: its annotation did not parse when it was packed (the "
                "id is only in segmentation image sets), so it has no objects; fix the XML "
                "and append with replace_changed=True"
            )
        data = self.field(record, schema.OBJECTS)
        if len(data) % schema.OBJECT_DTYPE.itemsize:
            raise FormatError(
                f"{self.where(record)}: the stored objects are not whole rows; re-pack it"
            )
        rows = np.frombuffer(data, dtype=schema.OBJECT_DTYPE)
        ids = rows["class_id"]
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= len(self.classes)):
            raise FormatError(
                f"{self.where(record)}: class id {int(ids.min())}..{int(ids.max())} is not one "
                f"of the pack's {len(self.classes)} classes; the pack is damaged, re-pack it"
            )
        return rows

    def object_classes(self) -> tuple[np.ndarray, np.ndarray]:
        """The class id of every stored object of every record (retired ones included), in
        record order, and how many objects each record has (int64 both): from the catalog's
        ``objects/class_id``, so no shard is read; a pack written before that array (0.1.0)
        has its shards read instead, each shard's objects field in one pass (a pack at a URL:
        every shard downloaded). Raises ``FormatError`` when they disagree with the records."""
        stored = self.reader.arrays().get(schema.OBJECT_CLASSES_ARRAY)
        if stored is None:
            classes, counts = self._object_classes_from_shards()
        else:
            counts = self.columns["num_objects"].astype(np.int64)
            if (
                stored.ndim != 1
                or stored.dtype.kind not in "iu"
                or int(counts.sum()) != len(stored)
            ):
                raise FormatError(
                    f"{self.name}: {schema.OBJECT_CLASSES_ARRAY} is not one integer class id "
                    f"per stored object ({len(stored)} {stored.dtype} values, "
                    f"{int(counts.sum())} objects counted by the records); re-pack it"
                )
            classes = stored.astype(np.int64)
        if len(classes) and (int(classes.min()) < 0 or int(classes.max()) >= len(self.classes)):
            raise FormatError(
                f"{self.name}: a stored object names a class the pack does not have; re-pack it"
            )
        return classes, counts

    def _object_classes_from_shards(self) -> tuple[np.ndarray, np.ndarray]:
        parts: list[bytes] = []
        lengths: list[np.ndarray] = []
        for s in range(self.reader.num_shards):
            shard = self.reader.shard(s)
            everything = np.arange(len(shard))
            lengths.append(shard.index_rows(everything)["length"][:, schema.OBJECTS])
            parts.append(b"".join([v[0] for v in shard.views(everything, [schema.OBJECTS])]))
        size = schema.OBJECT_DTYPE.itemsize
        sizes = np.concatenate(lengths).astype(np.int64) if lengths else np.empty(0, np.int64)
        if np.any(sizes % size):
            raise FormatError(
                f"{self.name}: a record's stored objects are not whole rows; re-pack it"
            )
        rows = np.frombuffer(b"".join(parts), dtype=schema.OBJECT_DTYPE)
        return rows["class_id"].astype(np.int64), sizes // size

    def where(self, record: int) -> str:
        """``"<pack>: record 5 (id '2008_000123')"``, for messages about one record."""
        return f"{self.name}: record {record} (id {self.id(record)!r})"

    def field(self, record: int, k: int) -> memoryview:
        return self.reader.field(record, k)

    def named(self, error: ChecksumError) -> ChecksumError:
        """``error``, a record's field failing its checksum (``checked=True``), again naming
        the sample: the pack, the record and its id, not only the file's record number."""
        if error.record is None:
            return error
        member = f" (in {error.path})" if error.path != self.path else ""  # a shard's
        if self.reader.url is not None:  # checked in full when downloaded: the copy changed
            advice = (
                "the cached copy is damaged: clear it (`torch-serialized cache clear`, "
                "clear_cache) and read again"
            )
        else:
            advice = "the pack is damaged: run `torch-serialized verify` and re-pack it"
        return ChecksumError(
            f"{self.where(error.record)}: its {error.field} field fails its checksum{member}; "
            f"{advice}",
            path=error.path,
            record=error.record,
            field=error.field,
        )

    def files(self) -> dict[str, bytes]:
        """Raw ImageSets list files stored at pack time, by devkit-relative path."""
        return {
            name[len("file/") :]: array.tobytes()
            for name, array in self.reader.arrays().items()
            if name.startswith("file/")
        }


# -- validation at open ---------------------------------------------------------------------------
def check_voc_pack(reader: PackReader) -> dict[str, Any]:
    """The VOC layer's checks of an open pack (schema, version, fields, ``check_metadata``,
    ``check_arrays``, and a single file's ``check_record_fields``), as every VOC reader makes
    them at open and ``verify`` too; returns the VOC metadata. Raises ``FormatError`` naming
    the pack, or for one shard or catalog file of a shard folder (no pack by itself) the
    folder to pass instead."""
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
    text = repr(found)
    text = text if len(text) <= 60 else text[:57] + "..."
    return FormatError(
        f"{path}: VOC metadata field {field!r} is invalid: expected {expected}, found {text}; "
        "the pack is damaged or was not written by pack_voc: re-pack it"
    )


def _is_int(value: Any, low: int = 0) -> bool:
    return type(value) is int and value >= low


def check_metadata(meta: dict[str, Any], num_records: int, path: str) -> None:
    """Every metadata value the VOC layer reads has the type and range ``pack_voc`` writes."""
    year = meta.get("year")
    if not isinstance(year, str) or len(year) != 4 or not year.isdigit():
        raise _bad(path, "year", "a 4-digit string", year)
    for key in ("base_dir", "voc_folder"):
        if not isinstance(meta.get(key), str):
            raise _bad(path, key, "a string", meta.get(key))
    if meta.get("num_samples") != num_records:
        raise _bad(
            path, "num_samples", f"the pack's {num_records} records", meta.get("num_samples")
        )
    classes = meta.get("classes")
    if (
        not isinstance(classes, list)
        or not all(isinstance(c, str) for c in classes)
        or len(set(classes)) != len(classes)
    ):
        raise _bad(path, "classes", "a list of distinct class names", classes)
    if meta.get("image_storage") not in ("original", "raw"):
        raise _bad(path, "image_storage", "'original' or 'raw'", meta.get("image_storage"))
    max_size = meta.get("max_size")
    if max_size is not None and not _is_int(max_size, 1):
        raise _bad(path, "max_size", "null or a positive integer", max_size)
    splits = meta.get("splits")
    if not isinstance(splits, dict) or not set(splits) <= set(TASKS):
        raise _bad(path, "splits", f"an object with keys among {TASKS}", splits)
    for task, sets in splits.items():
        if not isinstance(sets, dict) or not all(_is_int(n) for n in sets.values()):
            raise _bad(path, f"splits.{task}", "image set names -> record counts", sets)
    counts = meta.get("class_counts", {})
    if not isinstance(counts, dict) or not all(
        isinstance(per, dict) and all(name in classes and _is_int(n) for name, n in per.items())
        for per in counts.values()
    ):
        raise _bad(path, "class_counts", "'task/set' -> class name -> count", counts)
    for key, kind in (("options", dict), ("skipped", list)):
        if not isinstance(meta.get(key, kind()), kind):
            raise _bad(path, key, f"a JSON {kind.__name__}", meta.get(key))
    for key in ("max_samples_per_shard", "max_shard_bytes"):  # an append writes with them
        limit = meta.get("options", {}).get(key)
        if limit is not None and not _is_int(limit, 1):
            raise _bad(path, f"options.{key}", "null or a positive integer", limit)
    source_bytes = meta.get("source_bytes")
    if source_bytes is not None and not _is_int(source_bytes):
        raise _bad(path, "source_bytes", "null or a non-negative integer", source_bytes)
    stats = meta.get("source_stats")
    if stats is not None and stats != schema.SOURCE_STATS_VERSION:
        raise _bad(path, "source_stats", f"null or {schema.SOURCE_STATS_VERSION}", stats)
    base = meta.get("label_base")
    if base is not None and not (
        isinstance(base, dict)
        and set(base) == {"default", "packed"}
        and all(
            isinstance(v, list) and all(isinstance(c, str) for c in v) and len(set(v)) == len(v)
            for v in base.values()
        )
    ):
        raise _bad(path, "label_base", "'default' and 'packed' lists of class names", base)
    if base is not None:  # the lists of the classes before the first append (a prefix: ids stay)
        before = classes[: len(base["packed"])]
        if base != {rule: label_classes(rule, before, None) for rule in ("default", "packed")}:
            raise _bad(
                path,
                "label_base",
                "the label lists of the pack's first classes (as the first append wrote them)",
                base,
            )
    history = meta.get("history", [])
    if not isinstance(history, list) or not all(
        isinstance(e, dict) and isinstance(e.get("action"), str) for e in history
    ):
        raise _bad(path, "history", "a list of objects with an 'action'", history)


def _check_flags(columns: np.ndarray, meta: dict[str, Any], path: str) -> None:
    """Every record's flags known, and records whose objects have no rows (``tv_tensors``
    targets refused) marked only in packs of the version that says so, with no rows."""
    flags = columns["flags"]
    unknown = np.flatnonzero(flags & np.uint32(~schema.KNOWN_FLAGS & 0xFFFFFFFF))
    if len(unknown):
        r = int(unknown[0])
        found = f"{int(flags[r])} in record {r}"
        raise _bad(path, "records", f"flags within {schema.KNOWN_FLAGS}", found)
    _check_unparsed_flags(columns, meta, path)
    untyped = (flags & schema.UNTYPED_OBJECTS) != 0
    if not untyped.any():
        return
    if meta["schema_version"] < schema.UNTYPED_SCHEMA_VERSION:
        expected = f"{schema.UNTYPED_SCHEMA_VERSION} with objects without rows"
        raise _bad(path, "schema_version", expected, meta["schema_version"])
    claimed = np.flatnonzero(untyped & (columns["num_objects"] != 0))
    if len(claimed):
        r = int(claimed[0])
        found = f"{int(columns['num_objects'][r])} objects in record {r}"
        raise _bad(path, "records", "no objects counted for flag 8 (objects without rows)", found)


def _check_unparsed_flags(columns: np.ndarray, meta: dict[str, Any], path: str) -> None:
    """Records whose annotations did not parse marked only in packs of the version that says
    so, each with its annotation's bytes and nothing parsed: no objects, no flag 8."""
    flags = columns["flags"]
    unparsed = (flags & schema.UNPARSED_ANNOTATION) != 0
    if not unparsed.any():
        return
    if meta["schema_version"] < schema.UNPARSED_SCHEMA_VERSION:
        expected = f"{schema.UNPARSED_SCHEMA_VERSION} with unparsed annotations"
        raise _bad(path, "schema_version", expected, meta["schema_version"])
    wrong = unparsed & (
        ((flags & schema.HAS_ANNOTATION) == 0)
        | ((flags & schema.UNTYPED_OBJECTS) != 0)
        | (columns["num_objects"] != 0)
    )
    if wrong.any():
        r = int(np.flatnonzero(wrong)[0])
        found = f"flags {int(flags[r])}, {int(columns['num_objects'][r])} objects in record {r}"
        raise _bad(path, "records", "flag 16 (unparsed) with flag 1, no flag 8, no objects", found)


def _check_unparsed_listed(
    columns: np.ndarray, arrays: Mapping[str, np.ndarray], meta: dict[str, Any], path: str
) -> None:
    """No ``Main`` image set names a record whose annotation did not parse: its target is
    what ``VOCDetection`` returns, and there is none."""
    unparsed = np.flatnonzero(columns["flags"] & schema.UNPARSED_ANNOTATION)
    if not len(unparsed):
        return
    for name in meta["splits"].get("Main", {}):
        records = arrays[schema.split_array_name("Main", name)]
        listed = np.intersect1d(records, unparsed)
        if len(listed):
            field = schema.split_array_name("Main", name)
            found = f"record {int(listed[0])}"
            raise _bad(path, field, "no record whose annotation did not parse (flag 16)", found)


def check_record_fields(
    container: ContainerReader, first_record: int, name: str | None = None
) -> None:
    """The ``records`` columns of a file of a VOC pack agree with its records' fields
    (docs/FORMAT.md, "Record columns"), so that no reader (export, counts, ``tv_tensors``
    targets) trusts a column the bytes contradict: ``num_objects`` rows in ``objects``, a
    class or object mask exactly where its flag says, annotation bytes only with flag 1, and a
    target exactly where an annotation parsed. Run once per file, on the index alone (no
    record is read); a file without VOC fields and columns is not checked here (a pack of
    it is refused by ``check_voc_pack``). ``name``: the file as messages name it (the URL of
    a remote single-file pack), by default ``container.where``."""
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
            raise FormatError(
                f"{name or container.where}: record {first_record + r}'s columns contradict "
                'its fields (docs/FORMAT.md, "Record columns"): expected '
                f"{expected}, found flags {int(flags[r])}, num_objects "
                f"{int(columns['num_objects'][r])} and field lengths "
                f"{dict(zip(schema.FIELDS, lengths[r].tolist()))}; the pack is damaged or was "
                "not written by pack_voc: re-pack it"
            )


def check_arrays(
    arrays: Mapping[str, np.ndarray], meta: dict[str, Any], num_records: int, path: str
) -> None:
    """The dataset-level arrays: the columns, the ids and their offsets, one record list per
    image set with every record number in range, and the raw list files."""
    columns = arrays.get("records")
    if columns is None or columns.dtype != schema.COLUMNS or columns.shape != (num_records,):
        raise _bad(path, "records", f"{num_records} rows of {schema.COLUMNS}", _shape(columns))
    _check_flags(columns, meta, path)
    ids, offsets = arrays.get("ids"), arrays.get("id_offsets")
    if ids is None or ids.dtype != np.uint8 or ids.ndim != 1:
        raise _bad(path, "ids", "a 1-D uint8 array", _shape(ids))
    if offsets is None or offsets.dtype != np.dtype("<u8") or offsets.shape != (num_records + 1,):
        raise _bad(path, "id_offsets", f"{num_records + 1} uint64 offsets", _shape(offsets))
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
    named = {name for name in arrays if name.startswith("split/")}
    listed = {schema.split_array_name(t, n) for t, sets in meta["splits"].items() for n in sets}
    if named != listed:
        raise _bad(path, "splits", f"the image sets stored ({sorted(named)})", sorted(listed))
    for task, sets in meta["splits"].items():
        for name, count in sets.items():
            records = arrays[schema.split_array_name(task, name)]
            if records.dtype != np.dtype("<i8") or records.shape != (count,):
                raise _bad(path, f"split/{task}/{name}", f"{count} int64 records", _shape(records))
            if count and (int(records.min()) < 0 or int(records.max()) >= num_records):
                raise _bad(
                    path,
                    f"split/{task}/{name}",
                    f"record numbers below {num_records}",
                    [int(records.min()), int(records.max())],
                )
    _check_unparsed_listed(columns, arrays, meta, path)
    for name, array in arrays.items():
        if name.startswith("file/") and (array.dtype != np.uint8 or array.ndim != 1):
            raise _bad(path, name, "a 1-D uint8 array", _shape(array))
    _check_append_arrays(arrays, meta, num_records, path)


def _check_append_arrays(
    arrays: Mapping[str, np.ndarray], meta: dict[str, Any], num_records: int, path: str
) -> None:
    """The source statistics and the retired records (see ``schema``): shapes, ranges, and no
    image set naming a retired record."""
    files = len(schema.SOURCE_FILES)
    wanted = {schema.SIZE_ARRAY, schema.MTIME_ARRAY} if meta.get("source_stats") else set()
    for name in (schema.SIZE_ARRAY, schema.MTIME_ARRAY):
        array = arrays.get(name)
        if (array is None) != (name not in wanted) or (
            array is not None
            and (array.dtype != np.dtype("<i8") or array.shape != (num_records, files))
        ):
            raise _bad(path, name, f"{num_records}x{files} int64 with source_stats", _shape(array))
    digests = arrays.get(schema.DIGEST_ARRAY)
    if digests is not None and (digests.dtype != np.uint8 or digests.shape != (num_records, 32)):
        raise _bad(path, schema.DIGEST_ARRAY, f"{num_records}x32 uint8", _shape(digests))
    retired = arrays.get(schema.RETIRED_ARRAY)
    if retired is None:
        return
    if meta.get("schema_version", 1) < schema.RETIRED_SCHEMA_VERSION:
        raise _bad(path, "schema_version", "2 with retired records", meta.get("schema_version"))
    if (
        retired.dtype != np.dtype("<i8")
        or retired.ndim != 1
        or (len(retired) and (int(retired[0]) < 0 or int(retired[-1]) >= num_records))
        or bool((retired[1:] <= retired[:-1]).any())
    ):
        raise _bad(path, "retired", f"ascending record numbers below {num_records}", "others")
    for task, sets in meta["splits"].items():
        for name in sets:
            records = arrays[schema.split_array_name(task, name)]
            if np.isin(records, retired).any():
                raise _bad(path, f"split/{task}/{name}", "live records only", "a retired one")


def _shape(array: np.ndarray | None) -> str:
    return "nothing" if array is None else f"{array.dtype} {array.shape}"
