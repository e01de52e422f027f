"""Lazy, read-only sequences of an image set's ids and paths (``images``, ``targets``...): each
string is built on access from the pack's mapped id table, not held in N-item lists, so workers
do not grow by touching N Python strings and nothing is copied per process."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from .packed import VOCPackReader

__all__ = ["ChainedNames", "RecordNames"]

_SHOWN = 3  # items at each end of the repr


class _Names(Sequence[str]):
    """Equal to a list of the same strings; unhashable, as a list."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (_Names, list)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]


class RecordNames(_Names):
    """``prefix + id + suffix`` for each record of ``records``, in order, made on access.

    A read-only ``list`` of ``str``: ``len``, indexing, slicing (O(1), again a ``RecordNames``),
    iteration, ``in``, ``index``, ``count`` and ``==`` with lists. Unhashable, as a list."""

    __slots__ = ("_pack", "_records", "_prefix", "_suffix", "_table")

    def __init__(
        self, pack: VOCPackReader, records: np.ndarray, prefix: str = "", suffix: str = ""
    ) -> None:
        self._pack = pack
        self._records = records
        self._prefix = prefix
        self._suffix = suffix
        #: (id bytes, id offsets, records) memoryviews: Python ints, not numpy scalars
        self._table: tuple[memoryview, memoryview, memoryview] | None = None

    def _lookup(self) -> tuple[memoryview, memoryview, memoryview]:
        table = self._table
        if table is None:
            blob, offsets = self._pack.id_table()
            records = np.ascontiguousarray(self._records, dtype=np.int64)
            table = self._table = (blob.data, offsets.data, records.data)
        return table

    def __len__(self) -> int:
        return len(self._records)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> RecordNames: ...

    def __getitem__(self, index: int | slice) -> str | RecordNames:
        if isinstance(index, slice):
            return RecordNames(self._pack, self._records[index], self._prefix, self._suffix)
        blob, offsets, records = self._table or self._lookup()
        r = records[index]  # IndexError, negative indices and TypeError as a list's
        return self._prefix + str(blob[offsets[r] : offsets[r + 1]], "utf-8") + self._suffix

    def __iter__(self) -> Iterator[str]:
        blob, offsets, records = self._table or self._lookup()
        prefix, suffix = self._prefix, self._suffix
        for r in records:
            yield prefix + str(blob[offsets[r] : offsets[r + 1]], "utf-8") + suffix

    def __repr__(self) -> str:
        n = len(self)
        if n <= 2 * _SHOWN:
            return f"RecordNames({list(self)!r})"
        head = ", ".join(repr(self[i]) for i in range(_SHOWN))
        tail = ", ".join(repr(self[i]) for i in range(n - _SHOWN, n))
        return f"RecordNames([{head}, ..., {tail}], {n} items)"

    def __reduce__(self) -> tuple[Any, ...]:  # pickled without the table, made again on use
        return RecordNames, (self._pack, self._records, self._prefix, self._suffix)


class ChainedNames(_Names):
    """Several ``RecordNames`` read as one list (a dataset of several packs); slices are lists."""

    __slots__ = ("_parts", "_starts")

    def __init__(self, parts: Sequence[RecordNames]) -> None:
        self._parts = list(parts)
        self._starts = np.cumsum([0, *map(len, parts)])

    @classmethod
    def of(cls, parts: Sequence[RecordNames]) -> Sequence[str]:
        """``parts[0]`` if it is the only one, else the parts chained."""
        return parts[0] if len(parts) == 1 else cls(parts)

    def __len__(self) -> int:
        return int(self._starts[-1])

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = range(len(self))[index]  # IndexError, negative indices and TypeError as a list's
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self._parts[k][i - int(self._starts[k])]

    def __iter__(self) -> Iterator[str]:
        return itertools.chain.from_iterable(self._parts)

    def __repr__(self) -> str:
        return f"ChainedNames({self._parts!r})"


def record_names(
    pack: VOCPackReader, records: np.ndarray, folder: str | None = None, ext: str = ""
) -> RecordNames:
    """The ids of ``records`` (``folder=None``), or their root-relative paths in ``folder``,
    as torchvision builds them (``os.path.join``)."""
    if folder is None:
        return RecordNames(pack, records)
    return RecordNames(pack, records, os.path.join(pack.base_dir, folder, ""), ext)
