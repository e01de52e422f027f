"""A packed VOC dataset seen through its schema: splits, ids, sizes and raw fields.

``VOCPackReader`` adds VOC meaning to a ``PackReader`` (see ``schema`` for the layout): the
reading side of ``pack_voc``, shared by the map-style and iterable datasets, ``export_voc``
and the command line. It holds numpy arrays only, never per-sample Python objects, so
DataLoader workers do not grow their memory by touching samples.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import FormatError
from ..reader import PackReader
from . import schema

__all__ = ["VOCPackReader"]


class VOCPackReader:
    """Read access to a pack written by ``pack_voc``."""

    def __init__(self, path: str | os.PathLike[str], *, checked: bool = False) -> None:
        self.reader = PackReader(path, checked=checked)
        meta = self.reader.user
        if meta.get("schema") != schema.SCHEMA:
            raise FormatError(
                f"{self.reader.path} is a torch_serialized file but not a VOC pack "
                f"(schema {meta.get('schema')!r}); pack it with torch_serialized.pack_voc"
            )
        version = meta.get("schema_version")
        if not isinstance(version, int) or version > schema.SCHEMA_VERSION:
            raise FormatError(
                f"{self.reader.path}: VOC schema version {version!r} is newer than this "
                f"torch_serialized reads ({schema.SCHEMA_VERSION}); upgrade torch_serialized"
            )
        if tuple(self.reader.fields) != schema.FIELDS:
            raise FormatError(f"{self.reader.path}: unexpected fields {self.reader.fields}")
        self.meta: dict[str, Any] = meta
        self.year: str = meta["year"]
        self.base_dir: str = meta["base_dir"]
        self.classes: list[str] = list(meta["classes"])
        self.image_storage: str = meta["image_storage"]

    @property
    def path(self) -> str:
        return self.reader.path

    def __len__(self) -> int:
        return len(self.reader)

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
                f"image_set {image_set!r} is not in {self.path} (ImageSets/{folder} had "
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

    def field(self, record: int, k: int) -> memoryview:
        return self.reader.field(record, k)

    def files(self) -> dict[str, bytes]:
        """Raw ImageSets list files stored at pack time, by devkit-relative path."""
        return {
            name[len("file/") :]: array.tobytes()
            for name, array in self.reader.arrays().items()
            if name.startswith("file/")
        }
