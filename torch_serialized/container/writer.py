"""Records -> one container file, in one pass (the mirror of ``reader``). No torch."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO

import numpy as np

from .._version import __version__
from . import spec as fmt

__all__ = ["ContainerWriter", "Payload", "CREATED_BY", "check_options"]

CREATED_BY = f"torch_serialized {__version__}"

Payload = bytes | bytearray | memoryview


def check_options(fields: Sequence[str], alignment: int, columns: np.dtype | None) -> None:
    """Refuse (``ValueError``) options no container can be written with."""
    if not fields or len(set(fields)) != len(fields):
        raise ValueError(f"fields must be distinct names, got {list(fields)}")
    if alignment < 8 or alignment & (alignment - 1) or alignment > fmt.MAX_ALIGNMENT:
        raise ValueError(
            f"alignment must be a power of two from 8 to {fmt.MAX_ALIGNMENT}, got {alignment}"
        )
    if columns is not None:
        fmt.dtype_to_json(columns)  # refuse unstorable columns now, not after every record


class ContainerWriter:
    """Streams records into a binary file the caller owns; ``columns``: a row per record."""

    def __init__(
        self,
        file: BinaryIO,
        fields: Sequence[str],
        *,
        alignment: int = fmt.DEFAULT_ALIGNMENT,
        columns: np.dtype | None = None,
    ) -> None:
        check_options(fields, alignment, columns)
        self._file = file
        self.fields = list(fields)
        self.alignment = alignment
        self._columns = columns
        self._rows = np.empty(64, dtype=columns) if columns is not None else None
        self._index = np.zeros((64, len(fields)), dtype=fmt.INDEX_DTYPE)
        self._arrays: dict[str, tuple[np.ndarray, bool]] = {}
        self.num_records = 0
        self.position = 0
        self.meta_crc32 = 0  # of the metadata, once ``finish`` wrote it
        self._hole = 0  # bytes reserved after the file's current end, not yet skipped
        self._write(fmt.pack_header(alignment))

    def _write(self, data: Payload) -> None:
        if self._hole:  # skip reserved bytes (see ``reserve``) in one seek before writing on
            self._file.seek(self._hole, os.SEEK_CUR)
            self._hole = 0
        self._file.write(data)
        self.position += memoryview(data).nbytes

    def _align(self) -> None:
        pad = fmt.pad_to(self.position, self.alignment)
        if pad and self._hole:  # padding after reserved bytes: part of the hole, also zeros
            self._hole += pad
            self.position += pad
        elif pad:
            self._write(bytes(pad))

    def add(self, payloads: Sequence[Payload], row: tuple[Any, ...] | None = None) -> int:
        """Append one record (one payload per field); return its index in this file."""
        i = self._grow()
        entries = self._index[i]
        for k, payload in enumerate(payloads):
            view = memoryview(payload).cast("B")
            self._align()
            entries[k] = (self.position, view.nbytes, fmt.crc32(view), 0)
            if view.nbytes:
                self._write(view)
        if self._rows is not None:
            self._rows[i] = row
        self.num_records = i + 1
        return i

    def entries(self, i: int) -> np.ndarray:
        """Record ``i``'s index row (``INDEX_DTYPE``, one entry per field) in this file."""
        return self._index[i].copy()

    def reserve(self, entries: np.ndarray, row: tuple[Any, ...] | None = None) -> tuple[int, int]:
        """Room for a record laid out as ``entries`` (its index row in a file of the same
        fields and alignment): ``(index, offset)``. The caller copies its bytes to ``offset`` before
        ``finish``; the hole reads as zeros: byte-identical to a file written by ``add``."""
        # Python ints, not numpy: an append reserves every kept record, one call each
        offsets, lengths = entries["offset"].tolist(), entries["length"].tolist()
        ends = [o + n for o, n in zip(offsets, lengths)]
        overlap = any(o < e for o, e in zip(offsets[1:], ends))
        if len(offsets) != len(self.fields) or overlap or any(o % self.alignment for o in offsets):
            raise ValueError("entries are not a record laid out with this alignment and fields")
        self._align()
        i = self._grow()
        start = self.position
        reserved = self._index[i]
        reserved[:] = entries
        reserved["offset"] = [o - offsets[0] + start for o in offsets]
        span = ends[-1] - offsets[0]
        self.position += span
        self._hole += span
        if self._rows is not None:
            self._rows[i] = row
        self.num_records = i + 1
        return i, start

    def _grow(self) -> int:
        i = self.num_records
        if i == len(self._index):
            self._index = np.concatenate([self._index, np.zeros_like(self._index)])
            if self._rows is not None:
                self._rows = np.concatenate([self._rows, np.empty_like(self._rows)])
        return i

    def add_array(self, name: str, array: np.ndarray, *, per_record: bool = False) -> None:
        """Store a named numpy array (plain numbers only)."""
        if name in self._arrays or (name == "records" and self._columns is not None):
            raise ValueError(f"array {name!r} is already stored")
        array = np.asarray(array, order="C")  # not ascontiguousarray: it makes 0-d arrays 1-d
        fmt.dtype_to_json(array.dtype)  # refuse object and other unstorable dtypes early
        self._arrays[name] = (array, per_record)

    def rows(self) -> np.ndarray:
        """The per-record rows written so far (a copy), empty without columns."""
        if self._rows is None:
            return np.empty(0, dtype=np.uint8)
        return self._rows[: self.num_records].copy()

    def finish(self, user: Mapping[str, Any], *, pack: Mapping[str, Any] | None = None) -> int:
        """Write index, arrays, metadata and footer; return the file size. ``pack``: its binding."""
        arrays: dict[str, tuple[np.ndarray, bool]] = {}
        if self._rows is not None:
            arrays["records"] = (self._rows[: self.num_records], True)
        arrays.update(self._arrays)
        index = self._write_array(self._index[: self.num_records])
        descriptors = {
            name: {**self._write_array(array), "per_record": per_record}
            for name, (array, per_record) in arrays.items()
        }
        self._align()
        meta_offset = self.position
        data = fmt.build_metadata(
            created_by=CREATED_BY,
            num_records=self.num_records,
            fields=self.fields,
            alignment=self.alignment,
            index=index,
            arrays=descriptors,
            user=user,
            pack=pack,
        )
        self._write(data)
        size = self.position + fmt.FOOTER_SIZE
        self.meta_crc32 = fmt.crc32(data)
        footer = fmt.pack_footer(meta_offset, len(data), size, self.num_records, self.meta_crc32)
        self._write(footer)
        return size

    def _write_array(self, array: np.ndarray) -> dict[str, Any]:
        self._align()
        desc = fmt.array_descriptor(array, self.position)
        if array.nbytes:
            self._write(fmt.array_bytes(array))
        return desc
