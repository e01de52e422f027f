"""A packed VOC dataset seen through its schema: splits, ids, sizes and raw fields. Checked once
at open (``checks``); numpy arrays only, never per-sample objects, so workers do not grow."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..container.shards import PackReader
from ..errors import ChecksumError, FormatError
from . import schema
from .checks import check_record_fields, check_voc_pack

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
        check_files: bool = True,
    ) -> None:
        self.reader = PackReader(
            path,
            checked=checked,
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
            check_records=check_record_fields,
            check_files=check_files,
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
        """Record numbers an append retired (ascending; usually none): no reader shows them."""
        return self.reader.arrays().get(schema.RETIRED_ARRAY, np.empty(0, dtype="<i8"))

    @property
    def live(self) -> np.ndarray:
        """The record numbers a reader shows, in storage order: every record not retired."""
        return np.delete(np.arange(len(self), dtype=np.int64), self.retired)

    def image_sets(self, task: str) -> list[str]:
        """Names of the image sets stored for ``task`` ("Main" or "Segmentation")."""
        return list(self.meta["splits"].get(task, {}))

    def split(self, task: str, image_set: str) -> np.ndarray:
        """Record numbers of ``image_set`` in list-file order (duplicates kept)."""
        name = schema.split_array_name(task, image_set)
        arrays = self.reader.arrays()
        if name not in arrays:
            raise ValueError(
                f"image_set {image_set!r} is not in {self.name} (ImageSets/{task} had "
                f"{self.image_sets(task) or 'no lists'}); pick one of those or re-pack"
            )
        return arrays[name]

    @property
    def columns(self) -> np.ndarray:
        """The per-record ``schema.COLUMNS`` table."""
        return self.reader.arrays()["records"]

    def id(self, record: int) -> str:
        """The id of ``record``."""
        return schema.decode_id(*self.id_table(), record)

    def id_table(self) -> tuple[np.ndarray, np.ndarray]:
        """Every id as one UTF-8 byte array and its ``len + 1`` offsets (views of the map)."""
        arrays = self.reader.arrays()
        return arrays["ids"], arrays["id_offsets"]

    def object_classes(self) -> tuple[np.ndarray, np.ndarray]:
        """Each stored object's class id (records in order, retired too) and each record's object
        count, int64 (older packs: read from every record); ``FormatError`` for unknown classes."""
        stored = self.reader.arrays().get(schema.OBJECT_CLASSES_ARRAY)  # checked at open
        if stored is None:  # whole rows: check_records
            rows = b"".join(self.field(r, schema.OBJECTS) for r in range(len(self)))
            stored = np.frombuffer(rows, dtype=schema.OBJECT_DTYPE)["class_id"]
        classes, counts = stored.astype(np.int64), self.columns["num_objects"].astype(np.int64)
        if len(classes) and (int(classes.min()) < 0 or int(classes.max()) >= len(self.classes)):
            raise FormatError(
                f"{self.name}: a stored object names a class the pack does not have; re-pack it"
            )
        return classes, counts

    def where(self, record: int) -> str:
        """``"<pack>: record 5 (id '2008_000123')"``, for messages about one record."""
        return f"{self.name}: record {record} (id {self.id(record)!r})"

    def field(self, record: int, k: int) -> memoryview:
        """Field ``k`` of ``record``, a view of the map."""
        return self.reader.field(record, k)

    def named(self, error: ChecksumError) -> ChecksumError:
        """``error`` (a field failing its checksum) again, naming the pack, record and id."""
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
