"""One container file: validated once at open, then O(1) zero-copy record access.

A reader validates the header, footer and metadata (``spec.read_head``, ``spec.read_metadata``),
then maps the file with ``mmap`` and checks the arrays' checksums and that the record index
points inside the record data. Nothing is checked again per record unless ``checked=True``.

The map belongs to one process (``_Mapped``, tagged with its pid): it is dropped when the
reader is pickled (spawn/forkserver DataLoader workers) and made again by the first access in
a process whose pid differs from the one that mapped it (fork), so no setup is needed in
workers. A remap checks that the file on disk is still the one validated. A map keeps the
descriptor it was made from, and every read of it (views, ``pread``, read hints, cache probes)
goes to that file, never to its path again: a process keeps reading the file it opened after
the path was replaced. This module never imports torch.
"""

from __future__ import annotations

import mmap
import os
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import (
    ChecksumError,
    CorruptFileError,
    FileChangedError,
    FormatError,
)
from . import fileio
from . import spec as fmt
from .fileio import FileKindError, open_regular
from .manifest import Expected

__all__ = ["ContainerReader"]

#: ``mmap`` keeps no duplicate descriptor (Python >= 3.13).
_MMAP_OPTIONS: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}


class _Mapped:
    """What one process holds of a container: the map, the index columns, the arrays and
    the descriptor the map was made from (owned: closed when this object goes), which
    ``pread``, read hints and cache probes use. Never pickled, never shared."""

    def __init__(
        self, fd: int, mm: mmap.mmap, index: np.ndarray, arrays: dict[str, np.ndarray]
    ) -> None:
        self.pid = os.getpid()
        self.mmap, self.view, self.arrays = mm, memoryview(mm), arrays
        self.offsets, self.lengths, self.crcs = index["offset"], index["length"], index["crc32"]
        #: the file that was mapped (and checked): reads never look its path up again, which
        #: may name another file by now (a re-pack or an append renames a new one into place)
        self.fd = fd
        weakref.finalize(self, os.close, fd)


class ContainerReader:
    """One ``.tser`` container file.

    Opening validates the file in the order of docs/FORMAT.md ("Truncation and damage
    detection"): header and footer, metadata, then ``_read_arrays`` maps the record index and
    the arrays and checks them. ``expect`` (a shard or catalog of a manifest) adds the checks of
    docs/FORMAT.md, "Integrity rules": size, ``meta_crc32``, fields, records and binding; every
    error at open then names the manifest as well, and a file that is not a regular file is a
    damaged pack (``CorruptFileError``). ``checked=True`` recomputes each field's CRC32 on every
    read and raises ``ChecksumError`` on a mismatch (slower; for untrusted storage).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        checked: bool = False,
        expect: Expected | None = None,
    ) -> None:
        self.path = str(path)
        self.checked = checked
        #: what the file is in its pack (``Expected.member``), None for a pack of its own
        self.member = None if expect is None else expect.member
        #: the file as errors at open name it: its path, and for a member its manifest
        self.where = self.path if self.member is None else f"{self.path} ({self.member})"
        #: the pack's number of this file's record 0 (a shard's first record)
        self.first_record = 0 if expect is None else expect.first_record
        self._local: _Mapped | None = None
        fd = self._open_fd()
        try:
            self.size = os.fstat(fd).st_size
            if expect is not None and self.size != expect.bytes:
                raise expect.mismatch(
                    self.path, f"{self.size} bytes, the manifest says {expect.bytes}"
                )
            self.version, self.alignment, footer = fmt.read_head(fd, self.size, self.where)
            self.meta_crc32 = footer["meta_crc32"]
            if expect is not None and self.meta_crc32 != expect.meta_crc32:
                raise expect.mismatch(self.path, "its metadata checksum differs")
            self.meta: dict[str, Any] = fmt.read_metadata(fd, self.version, footer, self.where)
            self.data_end = footer["meta_offset"]
            self.fields: list[str] = self.meta["fields"]
            self.num_records: int = self.meta["num_records"]
            if expect is not None:
                expect.check(self.path, self.fields, self.num_records, self.meta.get("pack"))
            self._local = self._read_arrays(fd, check=True)  # owns ``fd`` from here
        except BaseException:
            os.close(fd)
            raise

    # -- opening -------------------------------------------------------------------------------
    def _open_fd(self) -> int:
        try:
            return open_regular(self.path, self.member or "the pack")
        except FileKindError as exc:
            if self.member is not None:  # the message names the file, its place and its kind
                raise CorruptFileError(f"{exc}; {fmt.DAMAGED}") from None
            if os.path.isdir(self.path):
                raise FormatError(
                    f"{self.path} is a folder without {fmt.MANIFEST_NAME}; pass a .tser file "
                    "or a shard folder written by torch_serialized"
                ) from None
            raise FormatError(str(exc)) from None
        except OSError as exc:
            if fileio.out_of_files(exc):
                raise fileio.too_many_files(self.path, exc) from None
            raise

    def _read_arrays(self, fd: int, *, check: bool) -> _Mapped:
        """Map the file and view the record index and every array in it; with ``check`` (at
        creation), verify the arrays' checksums and shapes and that the index points inside
        the record data, and keep the layout for later maps. The map returned owns ``fd``; on
        an error the caller still does."""
        try:
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ, **_MMAP_OPTIONS)
        except OSError as exc:  # mmap's duplicate descriptor: an error naming no file
            if fileio.out_of_files(exc):
                raise fileio.too_many_files(self.path, exc) from None
            raise
        if check:
            self._layout = self._check_layout(memoryview(mm))
        views = [
            np.frombuffer(mm, dtype, count=count, offset=offset).reshape(shape)
            for _name, dtype, shape, offset, count in self._layout
        ]
        if check:
            self._check_index(views[0])
        arrays = {layout[0]: array for layout, array in zip(self._layout[1:], views[1:])}
        return _Mapped(fd, mm, views[0], arrays)

    def _check_layout(
        self, view: memoryview
    ) -> list[tuple[str, np.dtype, tuple[int, ...], int, int]]:
        """Every array's checksum and a shape numpy can build (the record index first, kept
        apart: a user array may also be called "index"); their descriptors were checked with
        the metadata (``spec.check_descriptor``). Returns the layout."""
        layout = []
        for name, desc in [("index", self.meta["index"]), *self.meta["arrays"].items()]:
            dtype = fmt.dtype_from_json(desc["dtype"], self.where)
            shape, offset, nbytes = tuple(desc["shape"]), desc["offset"], desc["nbytes"]
            if fmt.crc32(view[offset : offset + nbytes]) != desc["crc32"]:
                raise fmt.damaged(self.where, f"array {name!r} checksum mismatch (its crc32)")
            count = nbytes // dtype.itemsize
            try:
                np.frombuffer(view, dtype, count=count, offset=offset).reshape(shape)
            except (ValueError, OverflowError) as exc:  # absurd shapes: > 64 axes, huge dims
                raise fmt.damaged(
                    self.where, f"array {name!r} has an unusable shape {shape}: {exc}"
                ) from None
            layout.append((name, dtype, shape, offset, count))
        return layout

    def _check_index(self, index: np.ndarray) -> None:
        """The record index: every field lies between the header and the metadata (the one
        bounds check: reads trust the index after it)."""
        offsets, lengths = index["offset"], index["length"]
        ends = offsets + lengths
        outside = (offsets < fmt.HEADER_SIZE) | (ends > self.data_end) | (ends < offsets)
        if outside.any():
            i, k = (int(v) for v in np.argwhere(outside)[0])
            raise fmt.damaged(
                self.where,
                f"the record index places record {i} field {self.fields[k]!r} at offset "
                f"{int(offsets[i, k])}, length {int(lengths[i, k])}: outside the record data "
                f"(bytes {fmt.HEADER_SIZE} to {self.data_end})",
            )

    # -- one process, one map -----------------------------------------------------------------
    def _mapped(self) -> _Mapped:
        """This process's map, made on first use in a process that has none: the one check
        that a reader forked or unpickled into another process maps the file again."""
        local = self._local
        if local is None or local.pid != os.getpid():
            fd = self._open_same_file()
            try:
                local = self._local = self._read_arrays(fd, check=False)  # owns ``fd``
            except BaseException:
                os.close(fd)
                raise
        return local

    def _open_same_file(self) -> int:
        """Open the path again, checking it still holds the file validated at creation."""
        try:
            fd = self._open_fd()
        except (FileNotFoundError, FormatError):  # a re-pack removed it: never read a mix
            raise FileChangedError(gone(self.path)) from None
        if not self.holds(fd):
            os.close(fd)
            raise FileChangedError(
                f"{self.path} was replaced or modified after it was opened; "
                "create the dataset again to read the new file"
            )
        return fd

    def holds(self, fd: int) -> bool:
        """Whether ``fd`` holds the file this reader validated: its size and its footer's
        metadata checksum (which tell another pack of the same size, or a rewrite)."""
        size = os.fstat(fd).st_size
        tail = os.pread(fd, fmt.FOOTER_SIZE, max(size - fmt.FOOTER_SIZE, 0))
        try:
            footer = fmt.unpack_footer(tail, self.path)
        except CorruptFileError:
            return False
        return (size, footer["meta_crc32"]) == (self.size, self.meta_crc32)

    def close(self) -> None:
        """Drop this process's map (and descriptors) of the file; the next access maps it
        again, checking that the file is still the one validated (``FileChangedError``).
        Views handed out keep the map alive until they are gone."""
        self._local = None

    @property
    def mapped_by(self) -> int | None:
        """The process that holds the current map (``None`` until one maps it)."""
        return None if self._local is None else self._local.pid

    def reopen(self) -> None:
        """Map the file in this process now rather than on first read (idempotent)."""
        self._mapped()

    def __getstate__(self) -> dict[str, Any]:
        """The map never crosses a process boundary."""
        return {**self.__dict__, "_local": None}

    # -- access --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_records

    def field(self, i: int, k: int) -> memoryview:
        """Bytes of field ``k`` of record ``i`` (a read-only view into the map)."""
        return self.record(i, (k,))[0]

    def record(self, i: int, fields: Sequence[int]) -> list[memoryview]:
        """Views of ``fields`` of record ``i``: the per-sample lookup of map-style
        ``__getitem__``. No hint: for one record at a time the kernel's own read-around on the
        page fault reads at least as much (measured: benchmarks/README.md, "Measurements
        behind the code")."""
        if not 0 <= i < self.num_records:
            raise IndexError(f"record {i} out of range for {self.num_records} records")
        local = self._mapped()
        offsets, lengths, view = local.offsets[i].tolist(), local.lengths[i].tolist(), local.view
        out = [view[offsets[k] : offsets[k] + lengths[k]] for k in fields]
        if self.checked:
            self._check_crcs(local, [i], [out], fields)
        return out

    def views(
        self, records: Sequence[int] | np.ndarray, fields: Sequence[int]
    ) -> list[list[memoryview]]:
        """Read-only views of ``fields`` of each of ``records`` (any order), in one lookup of
        the index: the batch form of ``record``, for the datasets' and iterable's read paths."""
        local = self._mapped()
        rows = self._rows(records)
        cols = np.asarray(fields, dtype=np.intp)
        starts = local.offsets[rows[:, None], cols].tolist()
        lengths = local.lengths[rows[:, None], cols].tolist()
        view = local.view
        out = [
            [view[o : o + n] for o, n in zip(row_starts, row_lengths)]
            for row_starts, row_lengths in zip(starts, lengths)
        ]
        if self.checked:
            self._check_crcs(local, rows.tolist(), out, fields)
        return out

    def _rows(self, records: Sequence[int] | np.ndarray) -> np.ndarray:
        """``records`` as an int64 array, each a record of this file (else ``IndexError``)."""
        rows = np.asarray(records, dtype=np.int64).reshape(-1)
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= self.num_records):
            raise IndexError(f"records must lie within 0..{self.num_records - 1}")
        return rows

    def _check_crcs(
        self, local: _Mapped, rows: Sequence[int], data: Sequence[Sequence[Any]], fields: Any
    ) -> None:
        """``checked`` reads: ``data[j][n]`` (field ``fields[n]`` of record ``rows[j]``) matches
        its CRC32 in the index, else ``ChecksumError``."""
        for r, row in zip(rows, data):
            for k, value in zip(fields, row):
                if fmt.crc32(memoryview(value)) != int(local.crcs[r, k]):
                    raise self._damaged_field(r, k)

    def index_rows(self, records: Sequence[int] | np.ndarray) -> np.ndarray:
        """The index rows (``spec.INDEX_DTYPE``, one entry per field) of ``records``, a copy:
        where each record's fields lie in this file, for copying records to another file."""
        local = self._mapped()
        rows = np.asarray(records, dtype=np.int64).reshape(-1)
        out = np.zeros((len(rows), len(self.fields)), dtype=fmt.INDEX_DTYPE)
        out["offset"] = local.offsets[rows]
        out["length"] = local.lengths[rows]
        out["crc32"] = local.crcs[rows]
        return out

    def _damaged_field(self, i: int, k: int) -> ChecksumError:
        """The error for field ``k`` of this file's record ``i`` failing its checksum, naming
        the pack's record number (``ChecksumError.record``)."""
        record, field = self.first_record + i, self.fields[k]
        return ChecksumError(
            f"{self.path}: record {record} field {field!r} fails its checksum; the file is "
            "damaged: run `torch-serialized verify` and re-pack it",
            path=self.path,
            record=record,
            field=field,
        )

    def arrays(self) -> Mapping[str, np.ndarray]:
        """The stored arrays by name (read-only views into the map)."""
        return self._mapped().arrays

    def field_lengths(self) -> np.ndarray:
        """The byte length of every field of every record, uint64 ``[N, K]`` (a view of the
        mapped index): what a schema checks its record columns against."""
        return self._mapped().lengths

    def is_per_record(self, name: str) -> bool:
        return bool(self.meta["arrays"][name].get("per_record"))

    @property
    def user(self) -> dict[str, Any]:
        return self.meta["user"]

    def verify(self) -> list[int]:
        """Indices of records whose bytes fail their checksum (empty when all is well)."""
        local = self._mapped()
        view, offsets, lengths, crcs = local.view, local.offsets, local.lengths, local.crcs
        bad: list[int] = []
        for i in range(self.num_records):
            for k in range(len(self.fields)):
                off = int(offsets[i, k])
                if fmt.crc32(view[off : off + int(lengths[i, k])]) != int(crcs[i, k]):
                    bad.append(i)
                    break
        return bad

    # -- reads for batches and streams -------------------------------------------------------
    def read_records(
        self, records: Sequence[int] | np.ndarray, fields: Sequence[int]
    ) -> list[list[np.ndarray]]:
        """Private copies of ``fields`` of ``records`` (ascending), read with one scatter read.

        For streaming: one ``preadv`` over the records' span puts each field straight into
        its own writable uint8 array (the bytes between them land in a scratch buffer), so a
        run of neighbouring records costs one sequential read and no extra copy. On a cold
        cache this reaches disk bandwidth where page faults on the map issue many small reads.
        """
        local = self._mapped()
        wanted = [int(r) for r in records]
        if not wanted:
            return []
        if wanted != sorted(wanted) or wanted[0] < 0 or wanted[-1] >= self.num_records:
            raise IndexError(f"records must ascend within 0..{self.num_records - 1}")
        offsets, lengths = local.offsets, local.lengths
        out: list[list[np.ndarray]] = []
        pieces: list[tuple[int, np.ndarray]] = []  # (file offset, destination)
        for r in wanted:
            row = [np.empty(int(lengths[r, k]), dtype=np.uint8) for k in fields]
            pieces.extend((int(offsets[r, k]), array) for k, array in zip(fields, row))
            out.append(row)
        fileio.read_into(local.fd, pieces, self.path)
        if self.checked:
            self._check_crcs(local, wanted, out, fields)
        return out

    def prefetch(self, records: Sequence[int] | np.ndarray) -> None:
        """Start reading the span of ``records`` (a run of neighbours) into the page cache
        and return at once (``POSIX_FADV_WILLNEED``): a streaming reader hints its next
        blocks so their disk reads overlap the use of this one.

        Skipped when the span's last byte is already cached (probed with ``RWF_NOWAIT``,
        which never waits for the disk): on a warm cache the hint would cost a walk of the
        page cache over the whole span for nothing.
        """
        if not len(records) or not hasattr(os, "posix_fadvise"):
            return
        local = self._mapped()
        start, end = self._span(local, records)
        if end > start and not _cached(local.fd, end - 1):
            fileio.willneed(local.fd, start, end - start)

    def _span(self, local: _Mapped, records: Sequence[int] | np.ndarray) -> tuple[int, int]:
        """Bytes ``[start, end)`` of the file from the first byte of ``records`` to their
        last."""
        wanted = np.asarray(records, dtype=np.int64)
        starts = local.offsets[wanted]
        return int(starts.min()), int((starts + local.lengths[wanted]).max())


def _cached(fd: int, offset: int) -> bool:
    """``fileio.page_cached``: a seam for the tests, which pretend pages are resident."""
    return fileio.page_cached(fd, offset)


def gone(path: str, detail: str = "") -> str:
    """What a reader says of a pack no longer at its path: deleted, or a re-pack under way
    (a new pack may be there, or none)."""
    return (
        f"{path} was removed or replaced after it was opened{detail}; create the dataset "
        "again to read the pack there now (re-pack it if it was deleted)"
    )
