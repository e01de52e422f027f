"""Read containers and shard sets: validate at open, then O(1) zero-copy record access.

A reader validates the header, footer, metadata and index when it is created, then maps
the file with ``mmap``. The map belongs to one process: it is dropped when the reader is
pickled (spawn/forkserver DataLoader workers) and reopened by the first access in a process
whose pid differs from the one that mapped it (fork), so no setup is needed in workers.
A reopen checks that the file on disk is still the one that was validated. A map keeps the
descriptor it was made from, and every read of it (views, ``pread``, read hints, cache
probes) goes to that file, never to its path again: a process keeps reading the file it
opened after the path was replaced.

A shard folder opens from its manifest and its catalog alone; each shard is opened on first
use, checked then against its manifest entry and its own binding, and kept in a bounded
least-recently-used set, so a pack of any number of shards needs a bounded number of file
descriptors (each map holds its own, and before 3.13's ``trackfd=False`` Python's ``mmap``
keeps a duplicate: two). This module never imports torch.
"""

# More than 400 lines: the reading half of the format (ContainerReader, PackReader), the
# mirror of writer.py; its opening steps follow docs/FORMAT.md section by section.

from __future__ import annotations

import bisect
import contextlib
import errno
import hashlib
import mmap
import os
import stat
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import (
    ChecksumError,
    CorruptFileError,
    FileChangedError,
    FormatError,
    TruncatedFileError,
    UnsupportedVersionError,
)
from . import oscompat
from . import spec as fmt
from .atomic import pid_alive, temporaries
from .fileio import FileKindError, FileSizeError, open_regular, read_regular_file

if TYPE_CHECKING:
    from ..remote.packs import RemotePack

__all__ = [
    "ContainerReader",
    "PackReader",
    "open_pack",
    "default_max_open_shards",
    "read_manifest",
    "Member",
    "member_of",
    "read_binding",
]

#: Shards whose checked metadata a ``PackReader`` keeps after closing their maps, so opening
#: one again costs a map, not a validation (a few KB each).
_MAX_CLOSED_SHARDS = 4096
#: ``mmap`` keeps no duplicate descriptor (Python >= 3.13).
_MMAP_OPTIONS: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}

_IOV_MAX = getattr(os, "sysconf", lambda _name: 1024)("SC_IOV_MAX") or 1024
#: Bytes one ``preadv`` call asks for at most: a run is read as a sequence of such calls, so
#: the kernel's read-ahead streams the rest of the run while each piece is copied out (faster
#: than one whole-block call on a cold disk: benchmarks/README.md, "Measurements behind the
#: code").
_READ_SIZE = 1 << 20
#: The unit of read hints (``ContainerReader.advise``): a hint asks the kernel for whole
#: windows of this many bytes, each at most once per map (per process).
HINT_WINDOW = 4 << 20


class _Mapped:
    """What one process holds of a container: the map, the index columns, the arrays and
    the descriptor the map was made from (owned: closed when this object goes), which
    ``pread``, read hints and cache probes use. Never pickled, never shared."""

    __slots__ = (
        "pid",
        "mmap",
        "view",
        "offsets",
        "lengths",
        "crcs",
        "arrays",
        "fd",
        "hinted",
        "hinted_all",
        "where",
        "__weakref__",
    )

    def __init__(
        self,
        fd: int,
        mm: mmap.mmap,
        view: memoryview,
        index: np.ndarray,
        arrays: dict[str, np.ndarray],
    ) -> None:
        self.pid = os.getpid()
        self.mmap, self.view, self.arrays = mm, view, arrays
        self.offsets, self.lengths, self.crcs = index["offset"], index["length"], index["crc32"]
        #: the file that was mapped (and checked): reads never look its path up again, which
        #: may name another file by now (a re-pack or an append renames a new one into place)
        self.fd = fd
        weakref.finalize(self, os.close, fd)
        #: the windows (``HINT_WINDOW``) of the file this map has hinted (``advise``; made on
        #: first use, windows without record bytes counted as hinted), and whether all are
        self.hinted: np.ndarray | None = None
        self.hinted_all = False
        #: ``where[i, k, 0]`` / ``[i, k, 1]``: offset and length of field k of record i as
        #: Python ints, the per-sample lookup of ``record`` (numpy scalars cost twice as much);
        #: None on big-endian hosts, whose native integers are not the file's
        self.where: memoryview | None = None
        if sys.byteorder == "little" and index.size and index.flags.c_contiguous:
            self.where = index.view("<u8").reshape(*index.shape, 3).data


@dataclass(frozen=True)
class Expected:
    """What a manifest says about one of its containers (a shard or the catalog): checked
    when the container is opened, before its records are trusted."""

    manifest: str  # the manifest's path, named in errors
    bytes: int
    meta_crc32: int
    num_records: int
    fields: tuple[str, ...]
    #: the binding its metadata must hold; None (manifest version 1): it must hold none, since
    #: 0.1.0 never wrote one (a version-1 manifest over newer files is a downgrade)
    pack: dict[str, Any] | None
    what: str  # its place in the pack, named in errors: "shard 3", "the catalog"
    first_record: int = 0  # the pack's number of its first record

    @property
    def member(self) -> str:
        """What the file is, for messages: ``shard 3 named by data/voc/manifest.json``."""
        return f"{self.what} named by {self.manifest}"

    def mismatch(self, path: str, what: str) -> CorruptFileError:
        return CorruptFileError(
            f"{path} does not match {self.manifest}: {what}. A shard was swapped, renamed, "
            "copied from another pack or damaged; copy the pack again or re-pack it"
        )


class ContainerReader:
    """One ``.tser`` container file.

    Opening validates the file in the order of docs/FORMAT.md ("Truncation and damage
    detection"): ``_read_header``, ``_read_footer``, ``_read_metadata``, then ``_read_arrays``
    maps the record index and the arrays and checks them. ``expect`` (a shard or catalog of a
    manifest) adds the checks of docs/FORMAT.md, "Integrity rules": size, ``meta_crc32``,
    fields, records and binding; every error at open then names the manifest as well, and a
    file that is not a regular file is a damaged pack (``CorruptFileError``). ``checked=True``
    recomputes each field's CRC32 on every read and raises ``ChecksumError`` on a mismatch
    (slower; for untrusted storage).
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
            self._read_header(fd)
            footer = self._read_footer(fd)
            if expect is not None and footer["meta_crc32"] != expect.meta_crc32:
                raise expect.mismatch(self.path, "its metadata checksum differs")
            self._read_metadata(fd, footer)
            if expect is not None:
                self._check_expected(expect)
            self._local = self._read_arrays(fd, check=True)  # owns ``fd`` from here
        except BaseException:
            os.close(fd)
            raise

    # -- opening: one step per section of docs/FORMAT.md ---------------------------------------
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
            if exc.errno in _NO_MORE_FILES:
                raise _too_many_files(self.path, exc) from None
            raise

    def _read_header(self, fd: int) -> None:
        """Header: magic, checksum, alignment, and a major version this package reads."""
        path, size = self.where, self.size
        if size < fmt.HEADER_SIZE + fmt.FOOTER_SIZE:
            raise fmt.damaged(
                path,
                f"{size} bytes, too short for a torch_serialized file (truncated?)",
                TruncatedFileError,
            )
        major, minor, self.alignment = fmt.unpack_header(os.pread(fd, fmt.HEADER_SIZE, 0), path)
        if major > fmt.FORMAT_MAJOR:
            raise UnsupportedVersionError(
                f"{path}: format version {major}.{minor} is newer than this torch_serialized "
                f"reads ({fmt.FORMAT_MAJOR}.{fmt.FORMAT_MINOR}); upgrade torch_serialized"
            )
        self.version = (major, minor)

    def _read_footer(self, fd: int) -> dict[str, int]:
        """Footer: present (no truncation), intact, the file's size, the metadata's place."""
        path, size = self.where, self.size
        tail = os.pread(fd, fmt.FOOTER_SIZE, size - fmt.FOOTER_SIZE)
        if tail[-len(fmt.MAGIC) :] != fmt.MAGIC:
            raise fmt.damaged(
                path,
                "the file does not end with the torch_serialized footer: it was truncated "
                "(an interrupted copy or write?) or appended to",
                TruncatedFileError,
            )
        footer = fmt.unpack_footer(tail, path)
        if (footer["major"], footer["minor"]) != self.version:
            raise fmt.damaged(
                path,
                f"its footer says format version {footer['major']}.{footer['minor']}, its "
                f"header {self.version[0]}.{self.version[1]}",
            )
        if footer["file_size"] != size:
            raise fmt.damaged(
                path,
                f"the file has {size} bytes, its footer says {footer['file_size']} "
                f"(file_size): {'truncated' if size < footer['file_size'] else 'appended to'}",
                TruncatedFileError,
            )
        meta_offset, meta_length = footer["meta_offset"], footer["meta_length"]
        if (
            meta_offset < fmt.HEADER_SIZE
            or meta_offset + meta_length != size - fmt.FOOTER_SIZE
            or meta_length > fmt.MAX_META_BYTES
        ):
            raise fmt.damaged(
                path,
                f"the footer's meta_offset {meta_offset} and meta_length {meta_length} do not "
                f"place the metadata between the header and the footer (at most "
                f"{fmt.MAX_META_BYTES} bytes)",
            )
        self.meta_crc32 = footer["meta_crc32"]
        return footer

    def _read_metadata(self, fd: int, footer: dict[str, int]) -> None:
        """Metadata: its checksum, then its content (``format.parse_metadata``)."""
        raw = os.pread(fd, footer["meta_length"], footer["meta_offset"])
        if fmt.crc32(raw) != footer["meta_crc32"]:
            raise fmt.damaged(self.where, "metadata checksum mismatch (the footer's meta_crc32)")
        self.data_end = footer["meta_offset"]
        self.meta: dict[str, Any] = fmt.parse_metadata(
            raw,
            version=self.version,
            num_records=footer["num_records"],
            data_end=self.data_end,
            path=self.where,
        )
        self.fields: list[str] = self.meta["fields"]
        self.num_records: int = self.meta["num_records"]

    def _check_expected(self, expect: Expected) -> None:
        """The manifest's view of this file: its fields, its records and its binding."""
        if tuple(self.fields) != expect.fields:
            raise expect.mismatch(self.path, "its fields differ from the manifest's")
        if self.num_records != expect.num_records:
            raise expect.mismatch(
                self.path, f"{self.num_records} records, the manifest says {expect.num_records}"
            )
        if self.meta.get("pack") != expect.pack:
            found = self.meta.get("pack")
            raise expect.mismatch(
                self.path,
                f"it is bound to {_describe_binding(found)}, the manifest expects "
                f"{_describe_binding(expect.pack)}",
            )

    def _read_arrays(self, fd: int, *, check: bool) -> _Mapped:
        """Arrays: map the file and view the record index and every array in it; with
        ``check`` (at creation), verify their descriptors and checksums and that the index
        points inside the data, and keep the checked layout for later maps. The map returned
        owns ``fd``; on an error the caller still does."""
        try:
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ, **_MMAP_OPTIONS)
        except OSError as exc:  # mmap's duplicate descriptor: an error naming no file
            if exc.errno in _NO_MORE_FILES:
                raise _too_many_files(self.path, exc) from None
            raise
        view = memoryview(mm)
        if check:
            self._layout = self._check_layout(view)
        views: list[np.ndarray] = []
        for _name, dtype, shape, offset, count in self._layout:
            views.append(np.frombuffer(view, dtype, count=count, offset=offset).reshape(shape))
        index = views[0]
        if check:
            self._check_index(index)
        arrays = {layout[0]: array for layout, array in zip(self._layout[1:], views[1:])}
        return _Mapped(fd, mm, view, index, arrays)

    def _check_layout(
        self, view: memoryview
    ) -> list[tuple[str, np.dtype, tuple[int, ...], int, int]]:
        """Every array's descriptor (the record index first, kept apart: a user array may also
        be called "index"), its checksum and a shape numpy can build; the checked layout."""
        layout = []
        for name, desc in [("index", self.meta["index"]), *self.meta["arrays"].items()]:
            dtype, shape, offset, nbytes, crc = fmt.check_descriptor(
                desc, name, self.data_end, self.where
            )
            if fmt.crc32(view[offset : offset + nbytes]) != crc:
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
        """The record index: every field lies between the header and the metadata."""
        if not index.size:
            return
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
            raise FileChangedError(_gone(self.path)) from None
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

    # -- pickling: the map never crosses a process boundary --------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_local"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- access --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_records

    def field(self, i: int, k: int) -> memoryview:
        """Bytes of field ``k`` of record ``i`` (a read-only view into the map)."""
        local = self._mapped()
        offset = int(local.offsets[i, k])
        view = local.view[offset : offset + int(local.lengths[i, k])]
        if self.checked and fmt.crc32(view) != int(local.crcs[i, k]):
            raise self._damaged_field(i, k)
        return view

    def index_rows(self, records: Sequence[int] | np.ndarray) -> np.ndarray:
        """The index rows (``format.INDEX_DTYPE``, one entry per field) of ``records``, a copy:
        where each record's fields lie in this file, for copying records to another file."""
        local = self._mapped()
        rows = np.asarray(records, dtype=np.int64).reshape(-1)
        out = np.zeros((len(rows), len(self.fields)), dtype=fmt.INDEX_DTYPE)
        out["offset"] = local.offsets[rows]
        out["length"] = local.lengths[rows]
        out["crc32"] = local.crcs[rows]
        return out

    def record(self, i: int, fields: Sequence[int]) -> list[memoryview]:
        """Views of ``fields`` of record ``i``: ``field`` for several fields at once, the
        per-sample lookup of map-style ``__getitem__``. No hint: for one record at a time the
        kernel's own read-around on the page fault reads at least as much (measured:
        benchmarks/README.md, "Measurements behind the code")."""
        local = self._local  # ``_mapped`` inlined: this is the per-sample path
        if local is None or local.pid != os.getpid():
            local = self._mapped()
        where = local.where
        if where is None or self.checked or not 0 <= i < self.num_records:
            return [self.field(i, k) for k in fields]
        view = local.view
        out = []
        for k in fields:
            offset = where[i, k, 0]
            out.append(view[offset : offset + where[i, k, 1]])
        return out

    def views(
        self, records: Sequence[int] | np.ndarray, fields: Sequence[int]
    ) -> list[list[memoryview]]:
        """Read-only views of ``fields`` of each of ``records`` (any order), in one lookup of
        the index: the batch form of ``field``, for the datasets' and iterable's read paths."""
        local = self._mapped()
        rows = np.asarray(records, dtype=np.int64).reshape(-1)
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= self.num_records):
            raise IndexError(f"records must lie within 0..{self.num_records - 1}")
        where, view = local.where, local.view
        if where is not None and not self.checked:  # Python ints: ~2x faster than numpy here
            out: list[list[memoryview]] = []
            for r in rows.tolist():
                row = []
                for k in fields:
                    offset = where[r, k, 0]
                    row.append(view[offset : offset + where[r, k, 1]])
                out.append(row)
            return out
        cols = np.asarray(fields, dtype=np.intp)
        starts = local.offsets[rows[:, None], cols].tolist()
        lengths = local.lengths[rows[:, None], cols].tolist()
        out = [
            [view[o : o + n] for o, n in zip(row_starts, row_lengths)]
            for row_starts, row_lengths in zip(starts, lengths)
        ]
        if self.checked:
            crcs = local.crcs[rows[:, None], cols].tolist()
            for r, row, row_crcs in zip(rows.tolist(), out, crcs):
                for k, data, crc in zip(fields, row, row_crcs):
                    if fmt.crc32(data) != crc:
                        raise self._damaged_field(r, k)
        return out

    def advise(self, records: int | Sequence[int] | np.ndarray) -> None:
        """Ask the kernel to read the file around ``records`` now (``POSIX_FADV_WILLNEED``,
        asynchronous), in whole ``HINT_WINDOW`` windows, each window at most once per map.

        For batches of random reads (a DataLoader's ``__getitems__``) on a cold cache: the
        kernel reads the windows of a whole batch at once, where page faults would read
        around one page at a time and wait for each. A window already hinted costs a bit
        lookup, no system call, so warm reads pay nothing. Once a process hinted a window
        it relies on the kernel's own read-ahead for it (packs larger than memory in later
        epochs). A hint is only a hint: correctness never depends on it.
        """
        local = self._mapped()
        if isinstance(records, int):
            records = (records,)
        if not len(records) or not hasattr(os, "posix_fadvise") or local.hinted_all:
            return
        hinted = local.hinted
        if hinted is None:
            ends = local.offsets + local.lengths
            last = -(-int(ends.max()) // HINT_WINDOW) if ends.size else 0
            hinted = local.hinted = np.zeros(-(-len(local.mmap) // HINT_WINDOW), dtype=bool)
            hinted[last:] = True
        rows = np.asarray(records, dtype=np.int64).reshape(-1)
        offsets = local.offsets[rows].astype(np.int64)
        ends = offsets + local.lengths[rows].astype(np.int64)
        first = offsets.min(axis=1) // HINT_WINDOW
        last = (ends.max(axis=1) - 1) // HINT_WINDOW
        if int((last - first).max()) <= 1:
            windows = np.unique(np.concatenate([first, last]))
        else:  # records larger than a window (raw pixels): every window they cover
            windows = np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(first, last)]))
        windows = windows[~hinted[windows]]
        if not len(windows):
            return
        hinted[windows] = True
        local.hinted_all = bool(hinted.all())
        fd = local.fd
        breaks = np.flatnonzero(np.diff(windows) != 1) + 1
        for run in np.split(windows, breaks):
            _willneed(fd, int(run[0]) * HINT_WINDOW, len(run) * HINT_WINDOW)

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
        num_fields = len(self.fields)
        for i in range(self.num_records):
            for k in range(num_fields):
                off = int(offsets[i, k])
                if fmt.crc32(view[off : off + int(lengths[i, k])]) != int(crcs[i, k]):
                    bad.append(i)
                    break
        return bad

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
        order = sorted(fields, key=lambda k: int(offsets[wanted[0], k]))
        out: list[list[np.ndarray]] = []
        pieces: list[tuple[int, np.ndarray]] = []  # (file offset, destination), ascending
        for r in wanted:
            by_field: dict[int, np.ndarray] = {}
            for k in order:
                array = np.empty(int(lengths[r, k]), dtype=np.uint8)
                pieces.append((int(offsets[r, k]), array))
                by_field[k] = array
            out.append([by_field[k] for k in fields])
        self._scatter_read(local, pieces)
        if self.checked:
            for r, row in zip(wanted, out):
                for k, array in zip(fields, row):
                    if fmt.crc32(array.data) != int(local.crcs[r, k]):
                        raise self._damaged_field(r, k)
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
        fd = local.fd
        if end > start and _cached(fd, end - 1):
            return
        _willneed(fd, start, end - start)

    def cached(self, records: Sequence[int] | np.ndarray) -> bool:
        """Whether the first and the last byte of the span of ``records`` are in the page
        cache: two probes with ``RWF_NOWAIT``, which never wait for the disk (False where the
        system cannot tell). A stream asks it before planning a block's read hints, which on
        a warm cache cost more than the block's lookups (benchmarks/README.md)."""
        if not len(records):
            return True
        local = self._mapped()
        start, end = self._span(local, records)
        if end <= start:
            return True
        fd = local.fd
        return _cached(fd, start) and _cached(fd, end - 1)

    def _span(self, local: _Mapped, records: Sequence[int] | np.ndarray) -> tuple[int, int]:
        """Bytes ``[start, end)`` of the file from the first byte of the lowest of
        ``records`` to the last byte of the highest."""
        wanted = np.asarray(records, dtype=np.int64)
        where, fields = local.where, range(len(self.fields))
        if where is not None:  # a record's fields lie between its first and last ones
            first, last = int(wanted.min()), int(wanted.max())
            start = min(where[first, k, 0] for k in fields)
            end = max(where[last, k, 0] + where[last, k, 1] for k in fields)
            return start, end
        starts = local.offsets[wanted]
        return int(starts.min()), int((starts + local.lengths[wanted]).max())

    def _scatter_read(self, local: _Mapped, pieces: list[tuple[int, np.ndarray]]) -> None:
        """Fill each destination array from the file at its offset, in few ``preadv`` calls."""
        fd = local.fd
        pieces.sort(key=lambda piece: piece[0])
        gaps = [b[0] - (a[0] + len(a[1])) for a, b in zip(pieces, pieces[1:])]
        scratch = np.empty(max([0, *gaps]), dtype=np.uint8)
        i = 0
        while i < len(pieces):
            start = position = pieces[i][0]
            buffers: list[memoryview] = []
            while i < len(pieces) and len(buffers) < _IOV_MAX - 1 and position - start < _READ_SIZE:
                offset, data = pieces[i]
                if offset < position:  # overlapping fields (never written so): read apart
                    break
                if offset > position:
                    buffers.append(scratch.data[: offset - position])
                buffers.append(data.data)
                position = offset + len(data)
                i += 1
            if not buffers:  # an overlap at the start of a call: read that piece alone
                offset, data = pieces[i]
                buffers, start, position = [data.data], offset, offset + len(data)
                i += 1
            if position > start and oscompat.preadv(fd, buffers, start) != position - start:
                raise TruncatedFileError(
                    f"{self.path}: the file ended before byte {position}; it was truncated "
                    "after it was opened: re-copy or re-pack it"
                )


#: Largest single ``POSIX_FADV_WILLNEED`` request: Linux reads at most the device's read-ahead
#: (or its largest request) per call and drops the rest, so longer spans are hinted in pieces.
_HINT_CHUNK = 1 << 20


def _willneed(fd: int, start: int, length: int) -> None:
    """Hint ``length`` bytes from ``start`` in ``_HINT_CHUNK`` pieces (asynchronous reads)."""
    for offset in range(start, start + length, _HINT_CHUNK):
        os.posix_fadvise(
            fd, offset, min(_HINT_CHUNK, start + length - offset), os.POSIX_FADV_WILLNEED
        )


def _cached(fd: int, offset: int) -> bool:
    """Whether the byte at ``offset`` is in the page cache, asked without waiting for the disk
    (``preadv`` with ``RWF_NOWAIT``); False where the system cannot tell."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return False
    try:
        return os.preadv(fd, [bytearray(1)], offset, flag) == 1
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP and others: cannot tell
        return False


class PackReader:
    """A packed dataset: one container file, or a shard folder with ``manifest.json``.

    Records are numbered globally across shards. The dataset-level arrays, the per-record
    columns (``arrays``) and the metadata (``user``) come from one file: the catalog of a
    version-2 shard folder, the single file, or (manifest version 1) the last shard plus the
    columns every shard holds, read once at open. Shards are opened on first use (``shard``),
    checked against their manifest entry and binding, and at most ``max_open_shards`` stay
    open (least recently used closed first); the catalog stays open.

    ``path`` may be an fsspec URL (``s3://``, ``gs://``, ``https://``, ``file://``...): the
    pack is then read through the local cache (``storage_options``, ``cache_dir`` and
    ``cache_limit_bytes``: see ``remote_pack.resolve``; they are ignored for a local path).
    Its manifest and catalog are downloaded at open, each shard on first use (or ahead of use,
    ``prefetch_shards``), checked in full before it is renamed into the cache; ``path`` is then
    the cache folder, ``url`` the URL.

    ``check_records(shard, first_record)`` is a schema's check of a shard's records (its
    columns against its fields' lengths, say; ``first_record``: the pack's number of the
    shard's first record), called once per shard when it is first opened; it raises to refuse
    the shard. A single file (``single``) is there at open: its check is the caller's.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        checked: bool = False,
        max_open_shards: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit_bytes: int | None = None,
        check_records: Callable[[ContainerReader, int], None] | None = None,
    ) -> None:
        if max_open_shards is None:
            max_open_shards = default_max_open_shards()
        if max_open_shards < 1:
            raise ValueError(f"max_open_shards must be >= 1, got {max_open_shards}")
        location, manifest_path, data, self.remote = _locate(
            path, storage_options, cache_dir, cache_limit_bytes
        )
        #: the pack's URL, None for a local pack
        self.url: str | None = None if self.remote is None else self.remote.store.url_of()
        self.path = str(location)
        self.checked = checked
        self.max_open_shards = max_open_shards
        self.manifest: fmt.Manifest | None = None
        self.manifest_path = manifest_path
        #: sha256 of the manifest's bytes: the pack's identity, and how a reader tells a
        #: replaced pack (``FileChangedError``) from a damaged one
        self.manifest_sha256: str | None = None
        self._per_record: dict[str, np.ndarray] = {}  # manifest v1: columns merged at open
        self._check_records = check_records
        self._expected: list[Expected | None] = []
        self._reset_open()
        if manifest_path is None:
            self._catalog = ContainerReader(location, checked=checked)
            self.entries: tuple[fmt.ShardEntry, ...] = (
                fmt.ShardEntry(
                    location.name,
                    0,
                    self._catalog.num_records,
                    self._catalog.size,
                    self._catalog.meta_crc32,
                ),
            )
            self._expected = [None]
            self.user: dict[str, Any] = self._catalog.user
        else:
            assert data is not None
            self.manifest_sha256 = hashlib.sha256(data).hexdigest()
            manifest = self.manifest = fmt.parse_manifest(data, str(manifest_path))
            self.entries = manifest.shards
            if manifest.version >= 2:
                self._open_catalog(manifest)
            else:
                self._open_v1(manifest)
        self.fields = list(self._catalog.fields)
        counts = [entry.num_records for entry in self.entries]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.num_records = int(self.starts[-1])
        self._starts: list[int] = self.starts.tolist()  # for ``locate``
        #: the one container holding every record, when it is the catalog (a single file)
        self._single = self._catalog if self._expected == [None] else None
        self._field_index = {name: k for k, name in enumerate(self.fields)}
        self._arrays: dict[str, np.ndarray] | None = None
        self._arrays_from: Mapping[str, np.ndarray] | None = None

    # -- opening ---------------------------------------------------------------------------
    def _open_catalog(self, manifest: fmt.Manifest) -> None:
        """Manifest version 2: the catalog holds the metadata, the dataset-level arrays and a
        copy of every record's columns; no shard is opened yet."""
        assert manifest.catalog is not None and manifest.pack_id is not None
        entry = manifest.catalog
        expect = Expected(
            self._manifest_name(),
            entry.bytes,
            entry.meta_crc32,
            0,
            manifest.fields,
            fmt.binding(
                fmt.ROLE_CATALOG,
                manifest.pack_id,
                num_records=manifest.num_records,
                num_shards=len(manifest.shards),
            ),
            "the catalog",
        )
        catalog = self._open_listed(entry.file, expect)
        for name, array in catalog.arrays().items():
            if catalog.is_per_record(name):
                raise expect.mismatch(catalog.path, f"the catalog holds per-record array {name!r}")
            if name == "records" and array.shape[:1] != (manifest.num_records,):
                raise expect.mismatch(catalog.path, "its record columns do not cover every record")
        self._catalog = catalog
        self.user = catalog.user
        self._expected = [
            Expected(
                self._manifest_name(),
                shard.bytes,
                shard.meta_crc32,
                shard.num_records,
                manifest.fields,
                fmt.binding(
                    fmt.ROLE_SHARD,
                    manifest.pack_id,
                    index=k,
                    first_record=shard.first_record,
                    num_records=shard.num_records,
                ),
                f"shard {k}",
                shard.first_record,
            )
            for k, shard in enumerate(manifest.shards)
        ]

    def _manifest_name(self) -> str:
        """The manifest as messages about the pack's files name it: the URL's for a remote
        pack (the cached copy is not what the user opened), else its path."""
        if self.remote is not None:
            return self.remote.store.url_of(fmt.MANIFEST_NAME)
        return str(self.manifest_path)

    def _open_v1(self, manifest: fmt.Manifest) -> None:
        """Manifest version 1 (0.1.0): every shard is checked now, since the per-record columns
        are spread across them (merged into private arrays here) and the manifest has no
        checksum of its own: its ``user`` must equal the copy in the last shard."""
        self._expected = [
            Expected(
                self._manifest_name(),
                shard.bytes,
                shard.meta_crc32,
                shard.num_records,
                manifest.fields,
                None,
                f"shard {k}",
                shard.first_record,
            )
            for k, shard in enumerate(manifest.shards)
        ]
        parts: dict[str, list[np.ndarray]] = {}
        last = len(manifest.shards) - 1
        for k in range(last + 1):
            shard = self._open_shard(k)
            for name, array in shard.arrays().items():
                if shard.is_per_record(name):
                    parts.setdefault(name, []).append(array)
            if k == last:
                self._catalog = shard
            else:
                self._remember(k, shard)
        assert self.manifest_path is not None and manifest.user is not None
        if self._catalog.user != manifest.user:
            raise CorruptFileError(
                f"{self.manifest_path}: its metadata differs from the copy in "
                f"{self._catalog.path}: the manifest was damaged or edited; re-pack the dataset"
            )
        self.user = manifest.user
        for name, arrays in parts.items():
            if len(arrays) != len(manifest.shards) or not self._catalog.is_per_record(name):
                raise CorruptFileError(
                    f"{self.path}: per-record array {name!r} is missing from some shards; "
                    "the pack is damaged, re-pack it"
                )
            try:
                self._per_record[name] = np.concatenate(arrays)
            except (ValueError, TypeError) as exc:  # shapes or dtypes differ by shard
                raise CorruptFileError(
                    f"{self.path}: shards disagree on array {name!r} ({exc}); "
                    "the pack is damaged, re-pack it"
                ) from None

    # -- shards: opened on first use, a bounded number kept ------------------------------------
    def _reset_open(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        #: shards mapped in this process, least recently used first
        self._open: OrderedDict[int, ContainerReader] = OrderedDict()
        #: shards checked before whose maps were closed: opened again without a validation
        self._closed: OrderedDict[int, ContainerReader] = OrderedDict()
        self._recent = -1  # the most recently used shard (last in ``_open``)

    def _check_process(self) -> None:
        """In a forked child, close the maps inherited from the parent (they are not this
        process's; each holds a descriptor) and keep what was checked."""
        if self._pid == os.getpid():
            return
        known = [*self._closed.items(), *self._open.items()]
        self._reset_open()
        for s, shard in known:
            shard.close()
            if self.remote is None:  # a remote shard is fetched (held) again by this process
                self._closed[s] = shard

    @property
    def num_shards(self) -> int:
        return len(self.entries)

    def shard_path(self, s: int) -> str:
        """Where shard ``s`` is (the file itself for a single-file pack)."""
        if self.manifest_path is None:
            return self.path
        return os.path.join(self.path, self.entries[s].file)

    def shard(self, s: int) -> ContainerReader:
        """Shard ``s``, opened and checked on first use. At most ``max_open_shards`` stay
        mapped: the least recently used one is closed (its checked metadata kept, so mapping it
        again is cheap) when another is needed."""
        if self._pid == os.getpid():  # the per-sample path: one dict lookup
            shard = self._open.get(s)
            if shard is not None:
                if self._recent != s:
                    with self._lock:
                        if s in self._open:
                            self._open.move_to_end(s)
                    self._recent = s
                return shard
        if not 0 <= s < len(self.entries):
            raise IndexError(f"shard {s} out of range for {len(self.entries)} shards")
        if self._expected[s] is None or self._catalog.path == self.shard_path(s):
            return self._catalog  # the single file, or a v1 pack's last shard
        self._check_process()
        with self._lock:
            shard = self._open.get(s)
            if shard is not None:
                self._open.move_to_end(s)
                return shard
            shard = self._closed.pop(s, None)
            if shard is not None:
                shard.reopen()  # FileChangedError if the file is no longer the one checked
            else:
                shard = self._open_shard(s)
            self._remember(s, shard)
            self._recent = s
            return shard

    def _remember(self, s: int, shard: ContainerReader) -> None:
        self._open[s] = shard
        while len(self._open) > self.max_open_shards:
            old, closing = self._open.popitem(last=False)
            closing.close()  # the map goes once no view of it is left
            if self.remote is not None:  # evictable now; fetched (and checked) again if needed
                self.remote.release(self.entries[old].file)
                continue
            self._closed[old] = closing
            while len(self._closed) > _MAX_CLOSED_SHARDS:
                self._closed.popitem(last=False)

    # -- remote packs: where the files come from -------------------------------------------
    def _local_file(self, name: str, expect: Expected) -> Path:
        """The local path of the pack's file ``name``: itself for a local pack; for a URL,
        the cached copy, downloaded and checked in full (``intact``) unless cached."""
        if self.remote is None:
            return Path(self.path) / name
        return self.remote.fetch_shard(name, expect.bytes, intact(expect))

    def prefetch_shards(self, shards: Iterable[int]) -> None:
        """Start downloading ``shards`` of a remote pack in the background (a no-op for a
        local pack or shards already open here), so that reading them later does not wait."""
        if self.remote is None or self.manifest_path is None:
            return
        from ..remote.packs import ShardRequest

        self._check_process()
        requests = []
        for s in shards:
            expect = self._expected[s]
            if expect is not None and s not in self._open:
                requests.append(ShardRequest(self.entries[s].file, expect.bytes, intact(expect)))
        self.remote.prefetch(requests)

    def release_shard(self, s: int) -> None:
        """Done with shard ``s`` for now: close its map and, for a remote pack, let the cache
        evict it (it is fetched again if read again). Views handed out stay valid."""
        if self.remote is None or self._expected[s] is None:
            return
        if self._catalog.path == self.shard_path(s):  # a version-1 pack's last shard
            return
        self._check_process()
        with self._lock:
            shard = self._open.pop(s, None)
        if shard is not None:
            shard.close()
        self.remote.release(self.entries[s].file)

    def close(self) -> None:
        """Close every shard's map and, for a remote pack, stop prefetching and release the
        shards this process holds in the cache (not the manifest and catalog, which stay in
        use). The reader maps (and fetches) shards again on next use."""
        self._check_process()
        with self._lock:
            opened = list(self._open.items())
            self._open.clear()
        for s, shard in opened:
            shard.close()
            if self.remote is None:
                self._closed[s] = shard
        if self.remote is not None:
            keep = [fmt.MANIFEST_NAME, os.path.basename(self._catalog.path)]
            self.remote.close(keep=keep)

    def _open_shard(self, s: int) -> ContainerReader:
        expect = self._expected[s]
        assert expect is not None
        shard = self._open_listed(self.entries[s].file, expect)
        if self.manifest is not None and self.manifest.version >= 2:
            self._check_columns(s, shard)
        if self._check_records is not None:
            self._check_records(shard, self.entries[s].first_record)
        return shard

    def _open_listed(self, name: str, expect: Expected) -> ContainerReader:
        """The manifest's file ``name`` (``expect.what``: "shard 3", "the catalog"), opened
        and checked against ``expect``. Missing or not the file listed: ``FileChangedError`` if
        the manifest changed since it was read (the pack was replaced: its files are the new
        pack's), else the pack is incomplete or damaged."""
        path = os.path.join(self.path, name)
        try:
            if self.remote is not None:
                path = str(self._local_file(name, expect))
            return ContainerReader(path, checked=self.checked, expect=expect)
        except (FileNotFoundError, FormatError) as exc:
            if self._manifest_changed():
                assert self.manifest_path is not None
                if self.remote is None and not os.path.lexists(self.manifest_path):
                    raise FileChangedError(_gone(self.path, f" ({name} is gone)")) from None
                raise FileChangedError(
                    f"{self.name} was replaced after it was opened ({name} is not the "
                    "file its manifest named then); create the dataset again to read the new pack"
                ) from None
            if isinstance(exc, FileNotFoundError) and self.remote is None:
                raise FileNotFoundError(
                    f"{path}: {expect.member} is missing; the pack is "
                    "incomplete: copy it again or re-pack the dataset"
                ) from None
            raise

    def _check_columns(self, s: int, shard: ContainerReader) -> None:
        """A shard holds its rows of the catalog's ``records`` (and no other per-record
        array), equal to the catalog's copy."""
        catalog = self._catalog.arrays()
        first, count = self.entries[s].first_record, self.entries[s].num_records
        expect = self._expected[s]
        assert expect is not None
        names = {name for name in shard.arrays() if shard.is_per_record(name)}
        wanted = {"records"} & set(catalog)
        if names != wanted:
            raise expect.mismatch(
                shard.path,
                f"it holds per-record arrays {sorted(names)}, the catalog {sorted(wanted)}",
            )
        for name in names:
            rows, copy = shard.arrays()[name], catalog[name]
            if copy.dtype != rows.dtype or copy[first : first + count].tobytes() != rows.tobytes():
                raise expect.mismatch(
                    shard.path, f"its array {name!r} differs from the catalog's copy"
                )

    def _manifest_changed(self) -> bool:
        """Whether the manifest on disk (at the URL, for a remote pack) is no longer the one
        this reader opened."""
        assert self.manifest_path is not None
        if self.remote is not None:  # the cached copy never changes: ask the URL
            try:
                data = self.remote.store.read_bytes(fmt.MANIFEST_NAME)
            except OSError:  # cannot tell: the caller's own error stands
                return False
            return hashlib.sha256(data).hexdigest() != self.manifest_sha256
        try:
            data = read_regular_file(self.manifest_path, fmt.MAX_MANIFEST_BYTES, "manifest")
        except OSError:
            return True
        return hashlib.sha256(data).hexdigest() != self.manifest_sha256

    def __len__(self) -> int:
        return self.num_records

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_pid", "_lock", "_open", "_closed"):
            del state[name]
        state["_arrays"], state["_arrays_from"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_open()

    def field_index(self, name: str) -> int:
        try:
            return self._field_index[name]
        except KeyError:
            raise KeyError(f"{self.path} has no field {name!r} (fields: {self.fields})") from None

    def locate(self, i: int) -> tuple[ContainerReader, int]:
        """The shard holding global record ``i`` and the record's index inside it."""
        if not 0 <= i < self.num_records:
            raise IndexError(f"record {i} out of range for {self.num_records} records")
        if self._single is not None:
            return self._single, i
        starts = self._starts
        s = bisect.bisect_right(starts, i) - 1  # a tenth of np.searchsorted's cost per call
        return self.shard(s), i - starts[s]

    def field(self, i: int, k: int) -> memoryview:
        """Bytes of field number ``k`` of global record ``i``."""
        shard, j = self.locate(i)
        return shard.field(j, k)

    def arrays(self) -> dict[str, np.ndarray]:
        """The dataset-level arrays and the per-record columns of all records.

        Views of this process's map of the catalog (rebuilt when it is mapped again, after a
        fork), plus for a version-1 shard folder the columns merged at open.
        """
        source = self._catalog.arrays()
        if self._arrays is not None and self._arrays_from is source:
            return self._arrays
        if self.manifest is not None and self.manifest.version == 1:
            out = {n: a for n, a in source.items() if not self._catalog.is_per_record(n)}
            out.update(self._per_record)
        else:
            out = dict(source)
        self._arrays, self._arrays_from = out, source
        return out

    def reopen(self) -> None:
        """Map the catalog in this process now rather than on first read (idempotent);
        shards are mapped on first use."""
        self._check_process()
        self._catalog.reopen()

    def verify(self) -> list[int]:
        """Global indices of damaged records (empty when all is well); opens every shard in
        turn."""
        bad: list[int] = []
        for s, start in enumerate(self.starts[:-1]):
            bad.extend(int(start) + i for i in self.shard(s).verify())
        return bad

    @property
    def version(self) -> tuple[int, int]:
        """The container format version of the catalog (or single file)."""
        return self._catalog.version

    @property
    def name(self) -> str:
        """What the user opened, for messages: the URL of a remote pack, else ``path`` (the
        local file or folder read: a URL's cached copy)."""
        return self.url or self.path

    @property
    def single(self) -> ContainerReader | None:
        """The one file holding every record of a single-file pack; None for a shard folder."""
        return self._single

    @property
    def binding(self) -> dict[str, Any] | None:
        """The catalog's (or single file's) binding to its pack (``format.binding``: the
        ``pack_id`` a full pack draws and an append keeps); None in packs written by 0.1.0."""
        value = self._catalog.meta.get("pack")
        return value if isinstance(value, dict) else None

    @property
    def nbytes(self) -> int:
        """Bytes on disk, all files included (as the manifest lists them)."""
        if self.manifest is None:
            return sum(entry.bytes for entry in self.entries)
        assert self.manifest_path is not None
        return self.manifest.files_bytes() + self.manifest_path.stat().st_size


#: ``errno`` values of a full descriptor table: this process's (``ulimit -n``) or the system's.
_NO_MORE_FILES = (errno.EMFILE, errno.ENFILE)


def _too_many_files(path: str | os.PathLike[str], exc: OSError) -> OSError:
    """``exc`` (EMFILE or ENFILE, raised opening or mapping ``path``) as an ``OSError`` of the
    same errno that names the file and says what to do."""
    limit = ""
    try:
        import resource

        limit = f" (`ulimit -n` is {resource.getrlimit(resource.RLIMIT_NOFILE)[0]})"
    except (ImportError, OSError, ValueError):
        pass
    return OSError(
        exc.errno,
        f"{os.fspath(path)}: cannot open or map it: {exc.strerror}{limit}. Each open pack file "
        "holds two descriptors (one from Python 3.13): raise the limit (`ulimit -n`, "
        "`resource.setrlimit`), keep fewer datasets open at once, or pass `open_pack` a lower "
        "`max_open_shards`",
    )


def _gone(path: str, detail: str = "") -> str:
    """What a reader says of a pack no longer at its path: deleted, or a re-pack under way
    (a new pack may be there, or none)."""
    return (
        f"{path} was removed or replaced after it was opened{detail}; create the dataset "
        "again to read the pack there now (re-pack it if it was deleted)"
    )


def _describe_binding(value: Any) -> str:
    if not isinstance(value, dict):
        return "no pack (written before format 1.1)"
    parts = [f"{key} {value[key]}" for key in ("role", "index", "first_record") if key in value]
    return f"pack {str(value.get('pack_id'))[:12]}... as " + ", ".join(parts)


def _locate(
    location: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit_bytes: int | None = None,
) -> tuple[Path, Path | None, bytes | None, RemotePack | None]:
    """Where the pack at ``location`` lives: its local path, for a shard folder its manifest's
    path and bytes (read as a regular file of bounded size), and for a URL the ``RemotePack``
    that fetches its files into the cache (the local path is then the cache's copy)."""
    from ..remote.store import is_url

    remote = None
    if is_url(location):
        from ..remote.packs import resolve

        url = str(location)
        if url.rstrip("/").endswith("/" + fmt.MANIFEST_NAME):
            url = url.rstrip("/")[: -len(fmt.MANIFEST_NAME) - 1]
        remote = resolve(
            url,
            storage_options,
            cache_dir,
            cache_limit_bytes,
            verify_file=intact(),
            verify_manifest=fmt.parse_manifest,
        )
        path = remote.path
    else:
        path = Path(location)
    for pause in (*_SWAP_PAUSES, None):
        found = _look(path)
        if found is not None:
            return (*found, remote)
        if pause is not None:
            _pause(pause)
    if path.name == fmt.MANIFEST_NAME:
        path = path.parent
    moved = _moved_aside(path)
    if moved is None:  # swapped at every look: re-packed again and again
        raise FileChangedError(
            f"{path} is being replaced by new packs faster than it can be opened; open it again"
        )
    aside, pid = moved
    real = aside.parent / _real(path).name  # a link's target is what was swapped
    if not pid_alive(pid):  # killed between its two renames, or the new pack deleted since
        missing = f"{path} links to {real}, which" if os.path.islink(path) else f"{path}"
        raise FileNotFoundError(
            f"{missing} does not exist, and {aside} holds the pack that a re-pack (process "
            f"{pid}, not running on this machine) moved aside to replace it and never "
            f"replaced: rename it to {real} to read that pack (the next pack of {real} does "
            f"so before it writes), or delete it if {real.name} was removed on purpose. If a "
            "pack on another machine is writing it, open it again"
        )
    raise FileChangedError(
        f"{path} is being replaced: a re-pack (process {pid}) moved the previous pack aside "
        f"to {aside} and has not renamed the new one into place yet; open it again. If no pack "
        f"of it is running (process {pid} is another program now), rename {aside.name} back "
        f"to {real.name} (the next pack of {real} does)"
    )


#: The pauses (seconds) between looks at a shard folder that a re-pack is swapping: about
#: 31 ms in all. ``atomic.AtomicOutput.commit`` moves the old folder aside and renames the new
#: one into place right after (two renames, nothing between), so the folder is missing for
#: microseconds, unless the writer is descheduled between them; an open that sees the swap
#: looks again rather than calling the path empty or no pack. Only taken when a swap is seen.
_SWAP_PAUSES = (0.001, 0.002, 0.004, 0.008, 0.016)


def _pause(seconds: float) -> None:
    """Wait between two looks at a folder being swapped (a seam for the tests)."""
    time.sleep(seconds)


def _look(path: Path) -> tuple[Path, Path | None, bytes | None] | None:
    """One look at the local pack at ``path``: ``(path, manifest path, manifest bytes)`` for
    a shard folder, ``(path, None, None)`` for anything else (a file, a folder without a
    manifest: ``ContainerReader`` says what it is). ``None`` when a re-pack is swapping the
    folder right now: it is missing and moved aside, or it was swapped while its manifest
    was read. ``path`` may also be a shard folder's ``manifest.json``."""
    if path.name == fmt.MANIFEST_NAME and not path.is_dir() and os.path.lexists(path):
        path = path.parent
    try:
        before = os.stat(path)
    except (FileNotFoundError, NotADirectoryError) as exc:  # others (EACCES) say themselves
        folder = path.parent if path.name == fmt.MANIFEST_NAME else path
        if isinstance(exc, FileNotFoundError) and _moved_aside(folder) is not None:
            return None  # a swap under way (its writer may run on another machine): look again
        if os.path.lexists(path):  # a dangling link, say: opening it names what is wrong
            return path, None, None
        raise FileNotFoundError(
            f"{path} does not exist; pack a VOC dataset first with torch_serialized.pack_voc "
            "or `torch-serialized pack`"
        ) from None
    if not stat.S_ISDIR(before.st_mode):
        return path, None, None
    manifest_path = path / fmt.MANIFEST_NAME
    try:
        data = read_regular_file(manifest_path, fmt.MAX_MANIFEST_BYTES, "the manifest")
    except (FileKindError, FileSizeError) as exc:
        raise CorruptFileError(f"{exc}; {fmt.DAMAGED}") from None
    except FileNotFoundError:
        if not _same_file(path, before):
            return None  # the folder was swapped while it was read: look again
        if os.path.lexists(manifest_path):  # a dangling link named manifest.json
            raise
        return path, None, None
    except OSError as exc:
        if exc.errno in _NO_MORE_FILES:
            raise _too_many_files(manifest_path, exc) from None
        raise
    return path, manifest_path, data


def _same_file(path: Path, before: os.stat_result) -> bool:
    """Whether ``path`` is still the file or folder ``before`` describes."""
    try:
        now = os.stat(path)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (before.st_dev, before.st_ino)


def _real(path: Path) -> Path:
    """``path`` with its links followed, as far as they lead (a link to a folder being
    swapped points at a name that is missing for the moment)."""
    return Path(os.path.realpath(path))


def _moved_aside(path: Path) -> tuple[Path, int] | None:
    """The folder (or file) a writer moved aside to replace ``path`` (a link: its target)
    with a new pack, and the writer's pid, if there is one: ``.{name}.old-{pid}-{hex}``
    beside it (``atomic.temp_sibling``); one whose writer runs first."""
    found = [(entry, pid) for kind, pid, entry in temporaries(_real(path)) if kind == "old"]
    return max(found, key=lambda moved: pid_alive(moved[1]), default=None)


def intact(expect: Expected | None = None) -> Callable[[Path], bool]:
    """A download check: the file at a path is a whole container (of ``expect``, a manifest
    entry, when given) whose arrays and records all match their CRC32s."""

    def check(path: Path) -> bool:
        try:
            container = ContainerReader(path, expect=expect)
        except FormatError:
            return False
        try:
            return not container.verify()
        finally:
            container.close()

    return check


def read_manifest(path: str | os.PathLike[str]) -> fmt.Manifest:
    """The parsed and checked manifest at ``path`` (a local ``manifest.json``), read as every
    pack file is: a regular file only, at most ``MAX_MANIFEST_BYTES``."""
    data = read_regular_file(path, fmt.MAX_MANIFEST_BYTES, "the manifest")
    return fmt.parse_manifest(data, os.fspath(path))


@dataclass(frozen=True)
class Member:
    """A shard or catalog file of a shard folder: part of a pack, never a pack by itself."""

    role: str  # ``format.ROLE_SHARD`` or ``format.ROLE_CATALOG``
    #: the shard folder to pass instead; None when the file is not in it (copied out)
    folder: str | None
    index: int | None = None  # a shard's number from 0 (None for a catalog)
    #: the shards of the folder's manifest, which names this file; None when it does not
    num_shards: int | None = None

    def __str__(self) -> str:
        """What the file is: ``shard 2 of 3 of the pack at data/voc``, ``the catalog of...``."""
        shard = self.role == fmt.ROLE_SHARD
        number = f"shard {self.index + 1}" if shard and self.index is not None else "a shard"
        if self.folder is None:
            what = number if shard else "a catalog"
            return f"{what} of a shard folder (its metadata says so)"
        if self.num_shards is None:  # the folder's earlier generation: an append kept it
            kind = "a shard" if shard else "a catalog"
            return f"{kind} of an earlier version of the pack at {self.folder}"
        what = f"{number} of {self.num_shards}" if shard else "the catalog"
        return f"{what} of the pack at {self.folder}"

    @property
    def advice(self) -> str:
        """What to pass instead of the file."""
        if self.folder is None:
            return "pass the shard folder it belongs to (the folder with its manifest.json)"
        return f"pass the folder {self.folder}"


def member_of(path: str | os.PathLike[str], binding: Mapping[str, Any] | None) -> Member | None:
    """What ``path`` is when it is a file of a shard folder rather than a pack: a file the
    ``manifest.json`` beside it names, or one its metadata's ``binding`` (``format.binding``;
    None when it has none) makes a shard or a catalog. A URL's folder is not read."""
    from ..remote.store import is_url

    role = binding.get("role") if binding is not None else None
    role = role if role in (fmt.ROLE_SHARD, fmt.ROLE_CATALOG) else None
    index = binding.get("index") if binding is not None and role == fmt.ROLE_SHARD else None
    file = Path(path)
    manifest = None
    if not is_url(path) and file.name != fmt.MANIFEST_NAME:
        with contextlib.suppress(OSError, ValueError):  # no manifest, or none that reads
            manifest = read_manifest(file.parent / fmt.MANIFEST_NAME)
    if manifest is not None:
        folder = str(file.parent)
        names = [entry.file for entry in manifest.shards]
        if file.name in names:
            return Member(fmt.ROLE_SHARD, folder, names.index(file.name), len(names))
        if manifest.catalog is not None and file.name == manifest.catalog.file:
            return Member(fmt.ROLE_CATALOG, folder, None, len(names))
        if role is not None and binding is not None and binding.get("pack_id") == manifest.pack_id:
            return Member(role, folder, index)
    return Member(role, None, index) if role is not None else None


def read_binding(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``pack`` metadata of the container at ``path``; None when it has none, or when
    the file is no readable container."""
    try:
        container = ContainerReader(path)
    except (OSError, ValueError):
        return None
    try:
        value = container.meta.get("pack")
        return value if isinstance(value, dict) else None
    finally:
        container.close()


def default_max_open_shards() -> int:
    """How many shards a reader keeps mapped unless told: an eighth of this process's
    descriptor limit (each open shard holds up to two), between 4 and 512 (64 where the limit
    cannot be read)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 64
    if soft == resource.RLIM_INFINITY:
        return 512
    return max(4, min(512, soft // 8))


def open_pack(
    path: str | os.PathLike[str],
    *,
    checked: bool = False,
    max_open_shards: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit_bytes: int | None = None,
) -> PackReader:
    """Open a packed dataset (a ``.tser`` file or a shard folder, local or at a URL). A shard
    folder keeps at most ``max_open_shards`` shards mapped (default:
    ``default_max_open_shards()``). A URL is read through the local cache: see ``PackReader``.
    """
    return PackReader(
        path,
        checked=checked,
        max_open_shards=max_open_shards,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_limit_bytes=cache_limit_bytes,
    )
