"""Read containers and shard sets: validate at open, then O(1) zero-copy record access.

A reader validates the header, footer, metadata and index when it is created, then maps
the file with ``mmap``. The map belongs to one process: it is dropped when the reader is
pickled (spawn/forkserver DataLoader workers) and reopened by the first access in a process
whose pid differs from the one that mapped it (fork), so no setup is needed in workers.
A reopen checks that the file on disk is still the one that was validated. This module
never imports torch.
"""

# More than 400 lines: the reading half of the format (ContainerReader, PackReader), the
# mirror of writer.py; its opening steps follow docs/FORMAT.md section by section.

from __future__ import annotations

import errno
import mmap
import os
import stat
import sys
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import format as fmt
from . import oscompat
from .errors import (
    ChecksumError,
    CorruptFileError,
    FileChangedError,
    FormatError,
    TruncatedFileError,
    UnsupportedVersionError,
)

__all__ = ["ContainerReader", "PackReader", "open_pack"]

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
    (opened on first use) a descriptor for ``pread``. Never pickled, never shared."""

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
        self, mm: mmap.mmap, view: memoryview, index: np.ndarray, arrays: dict[str, np.ndarray]
    ) -> None:
        self.pid = os.getpid()
        self.mmap, self.view, self.arrays = mm, view, arrays
        self.offsets, self.lengths, self.crcs = index["offset"], index["length"], index["crc32"]
        self.fd: int | None = None
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


class ContainerReader:
    """One ``.tser`` container file.

    Opening validates the file in the order of docs/FORMAT.md ("Truncation and damage
    detection"): ``_read_header``, ``_read_footer``, ``_read_metadata``, then ``_read_arrays``
    maps the record index and the arrays and checks them. ``checked=True`` recomputes each
    field's CRC32 on every read and raises ``ChecksumError`` on a mismatch (slower; for
    untrusted storage).
    """

    def __init__(self, path: str | os.PathLike[str], *, checked: bool = False) -> None:
        self.path = str(path)
        self.checked = checked
        self._local: _Mapped | None = None
        fd = self._open_fd()
        try:
            self.size = os.fstat(fd).st_size
            self._read_header(fd)
            footer = self._read_footer(fd)
            self._read_metadata(fd, footer)
            self._local = self._read_arrays(fd, check=True)
        finally:
            os.close(fd)

    # -- opening: one step per section of docs/FORMAT.md ---------------------------------------
    def _open_fd(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            # Linux opens a folder read-only without complaint; only reading it fails.
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.close(fd)
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), self.path)
            return fd
        except IsADirectoryError:
            raise FormatError(
                f"{self.path} is a folder without {fmt.MANIFEST_NAME}; pass a .tser file "
                "or a shard folder written by torch_serialized"
            ) from None

    def _read_header(self, fd: int) -> None:
        """Header: magic, checksum, alignment, and a major version this package reads."""
        path, size = self.path, self.size
        if size < fmt.HEADER_SIZE + fmt.FOOTER_SIZE:
            raise TruncatedFileError(
                f"{path}: {size} bytes is too short for a torch_serialized file "
                "(truncated or not a pack); re-copy or re-pack it"
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
        path, size = self.path, self.size
        tail = os.pread(fd, fmt.FOOTER_SIZE, size - fmt.FOOTER_SIZE)
        if tail[-len(fmt.MAGIC) :] != fmt.MAGIC:
            raise TruncatedFileError(
                f"{path}: the file does not end with the torch_serialized footer: it was "
                "truncated (interrupted copy or write); re-copy or re-pack it"
            )
        footer = fmt.unpack_footer(tail, path)
        if footer["file_size"] != size:
            raise TruncatedFileError(
                f"{path}: file has {size} bytes but its footer says {footer['file_size']}; "
                "re-copy or re-pack it"
            )
        meta_offset, meta_length = footer["meta_offset"], footer["meta_length"]
        if (
            meta_offset < fmt.HEADER_SIZE
            or meta_offset + meta_length != size - fmt.FOOTER_SIZE
            or meta_length > fmt.MAX_META_BYTES
        ):
            raise CorruptFileError(f"{path}: metadata location in the footer is invalid")
        self.meta_crc32 = footer["meta_crc32"]
        return footer

    def _read_metadata(self, fd: int, footer: dict[str, int]) -> None:
        """Metadata: its checksum, then its content (``format.parse_metadata``)."""
        raw = os.pread(fd, footer["meta_length"], footer["meta_offset"])
        if fmt.crc32(raw) != footer["meta_crc32"]:
            raise CorruptFileError(f"{self.path}: metadata checksum mismatch; the file is damaged")
        self.data_end = footer["meta_offset"]
        self.meta: dict[str, Any] = fmt.parse_metadata(
            raw, num_records=footer["num_records"], data_end=self.data_end, path=self.path
        )
        self.fields: list[str] = self.meta["fields"]
        self.num_records: int = self.meta["num_records"]

    def _read_arrays(self, fd: int, *, check: bool) -> _Mapped:
        """Arrays: map the file and view the record index and every array in it; with
        ``check``, verify their checksums and that the index points inside the data."""
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        view = memoryview(mm)
        # The record index is kept apart: a user array may also be called "index".
        descs = [("index", self.meta["index"]), *self.meta["arrays"].items()]
        views: list[np.ndarray] = []
        for name, desc in descs:
            dtype, shape, offset, nbytes, crc = fmt.check_descriptor(
                desc, name, self.data_end, self.path
            )
            if check and fmt.crc32(view[offset : offset + nbytes]) != crc:
                raise CorruptFileError(
                    f"{self.path}: {name} checksum mismatch; the file is damaged, re-pack it"
                )
            count = nbytes // dtype.itemsize
            try:
                array = np.frombuffer(view, dtype, count=count, offset=offset).reshape(shape)
            except (ValueError, OverflowError) as exc:  # absurd shapes: > 64 axes, huge dims
                raise CorruptFileError(
                    f"{self.path}: array {name!r} has an unusable shape: {exc}; the file is "
                    "damaged, re-pack it"
                ) from None
            views.append(array)
        index = views[0]
        if check:
            self._check_index(index)
        arrays = {name: array for (name, _), array in zip(descs[1:], views[1:])}
        return _Mapped(mm, view, index, arrays)

    def _check_index(self, index: np.ndarray) -> None:
        """The record index: every field lies between the header and the metadata."""
        if not index.size:
            return
        offsets, lengths = index["offset"], index["length"]
        ends = offsets + lengths
        if (
            int(offsets.min()) < fmt.HEADER_SIZE
            or int(ends.max()) > self.data_end
            or bool((ends < offsets).any())
        ):
            raise CorruptFileError(
                f"{self.path}: record index points outside the data; the file is damaged"
            )

    # -- one process, one map -----------------------------------------------------------------
    def _mapped(self) -> _Mapped:
        """This process's map, made on first use in a process that has none: the one check
        that a reader forked or unpickled into another process maps the file again."""
        local = self._local
        if local is None or local.pid != os.getpid():
            fd = self._open_same_file()
            try:
                local = self._local = self._read_arrays(fd, check=False)
            finally:
                os.close(fd)
        return local

    def _open_same_file(self) -> int:
        """Open the path again, checking it still holds the file validated at creation."""
        try:
            fd = self._open_fd()
        except FileNotFoundError:  # a re-pack removed this shard: never read a mix of packs
            raise FileChangedError(
                f"{self.path} was removed or replaced after it was opened; "
                "create the dataset again to read the new pack"
            ) from None
        size = os.fstat(fd).st_size
        tail = os.pread(fd, fmt.FOOTER_SIZE, max(size - fmt.FOOTER_SIZE, 0))
        try:
            same = (size, fmt.unpack_footer(tail, self.path)["meta_crc32"]) == (
                self.size,
                self.meta_crc32,
            )
        except CorruptFileError:
            same = False
        if not same:
            os.close(fd)
            raise FileChangedError(
                f"{self.path} was replaced or modified after it was opened; "
                "create the dataset again to read the new file"
            )
        return fd

    def _descriptor(self) -> int:
        """This process's file descriptor for ``pread``, checked to be the validated file."""
        local = self._mapped()
        if local.fd is None:
            local.fd = self._open_same_file()
            weakref.finalize(local, os.close, local.fd)
        return local.fd

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
            raise ChecksumError(
                f"{self.path}: record {i} field {self.fields[k]!r} fails its checksum; "
                "the file is damaged: run `torch-serialized verify` and re-pack it"
            )
        return view

    def record(self, i: int, fields: Sequence[int]) -> list[memoryview]:
        """Views of ``fields`` of record ``i``: ``field`` for several fields at once, the
        per-sample lookup of map-style ``__getitem__``. No hint: for one record at a time the
        kernel's own read-around on the page fault reads at least as much (measured:
        benchmarks/README.md, "Measurements behind the code")."""
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
                        raise ChecksumError(
                            f"{self.path}: record {r} field {self.fields[k]!r} fails its "
                            "checksum; the file is damaged: run `torch-serialized verify` "
                            "and re-pack it"
                        )
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
        fd = self._descriptor()
        breaks = np.flatnonzero(np.diff(windows) != 1) + 1
        for run in np.split(windows, breaks):
            _willneed(fd, int(run[0]) * HINT_WINDOW, len(run) * HINT_WINDOW)

    def arrays(self) -> Mapping[str, np.ndarray]:
        """The stored arrays by name (read-only views into the map)."""
        return self._mapped().arrays

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
        self._scatter_read(pieces)
        if self.checked:
            for r, row in zip(wanted, out):
                for k, array in zip(fields, row):
                    if fmt.crc32(array.data) != int(local.crcs[r, k]):
                        raise ChecksumError(
                            f"{self.path}: record {r} field {self.fields[k]!r} fails its "
                            "checksum; the file is damaged: run `torch-serialized verify` "
                            "and re-pack it"
                        )
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
        wanted = np.asarray(records, dtype=np.int64)
        where, fields = local.where, range(len(self.fields))
        if where is not None:  # a record's fields lie between its first and last ones
            first, last = int(wanted.min()), int(wanted.max())
            start = min(where[first, k, 0] for k in fields)
            end = max(where[last, k, 0] + where[last, k, 1] for k in fields)
        else:
            starts = local.offsets[wanted]
            start, end = int(starts.min()), int((starts + local.lengths[wanted]).max())
        fd = self._descriptor()
        if end > start and _cached(fd, end - 1):
            return
        _willneed(fd, start, end - start)

    def _scatter_read(self, pieces: list[tuple[int, np.ndarray]]) -> None:
        """Fill each destination array from the file at its offset, in few ``preadv`` calls."""
        fd = self._descriptor()
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

    Records are numbered globally across shards. Per-record arrays are concatenated in shard
    order; dataset-level arrays are found in whichever shard stores them.
    """

    def __init__(self, path: str | os.PathLike[str], *, checked: bool = False) -> None:
        location, self.manifest, files = _locate(Path(path))
        self.path = str(location)
        self.shards = [ContainerReader(file, checked=checked) for file in files]
        if self.manifest is not None:
            _check_manifest_bindings(self.manifest, self.shards, location / fmt.MANIFEST_NAME)
            self.user: dict[str, Any] = self.manifest["user"]
        else:
            self.user = self.shards[0].user
        self.fields = self.shards[0].fields
        if any(s.fields != self.fields for s in self.shards):
            raise CorruptFileError(f"{self.path}: shards disagree on their fields")
        counts = [s.num_records for s in self.shards]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.num_records = int(self.starts[-1])
        self._field_index = {name: k for k, name in enumerate(self.fields)}
        # merged arrays, and the shard array dicts they were merged from (see ``arrays``)
        self._arrays: dict[str, np.ndarray] | None = None
        self._arrays_from: list[Mapping[str, np.ndarray]] = []

    def __len__(self) -> int:
        return self.num_records

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_arrays"], state["_arrays_from"] = None, []
        return state

    def field_index(self, name: str) -> int:
        try:
            return self._field_index[name]
        except KeyError:
            raise KeyError(f"{self.path} has no field {name!r} (fields: {self.fields})") from None

    def locate(self, i: int) -> tuple[ContainerReader, int]:
        """The shard holding global record ``i`` and the record's index inside it."""
        if not 0 <= i < self.num_records:
            raise IndexError(f"record {i} out of range for {self.num_records} records")
        if len(self.shards) == 1:
            return self.shards[0], i
        s = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.shards[s], i - int(self.starts[s])

    def field(self, i: int, k: int) -> memoryview:
        """Bytes of field number ``k`` of global record ``i``."""
        shard, j = self.locate(i)
        return shard.field(j, k)

    def arrays(self) -> dict[str, np.ndarray]:
        """All arrays: per-record ones concatenated across shards, dataset-level ones as stored.

        Merged again whenever a shard's arrays are not those merged before (the shard was
        mapped again in this process), so the result always views this process's maps.
        """
        sources = [shard.arrays() for shard in self.shards]
        if self._arrays is not None and all(
            a is b for a, b in zip(sources, self._arrays_from, strict=True)
        ):
            return self._arrays
        merged: dict[str, list[np.ndarray]] = {}
        single: dict[str, np.ndarray] = {}
        for shard, arrays in zip(self.shards, sources):
            for name, array in arrays.items():
                if shard.is_per_record(name):
                    merged.setdefault(name, []).append(array)
                else:
                    single[name] = array
        out = dict(single)
        for name, parts in merged.items():
            if len(parts) != len(self.shards) or name in single:
                raise CorruptFileError(
                    f"{self.path}: per-record array {name!r} is missing from some shards; "
                    "the pack is damaged, re-pack it"
                )
            try:
                out[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
            except (ValueError, TypeError) as exc:  # shapes or dtypes differ by shard
                raise CorruptFileError(
                    f"{self.path}: shards disagree on array {name!r} ({exc}); "
                    "the pack is damaged, re-pack it"
                ) from None
        self._arrays, self._arrays_from = out, sources
        return out

    def reopen(self) -> None:
        """Map every shard in this process now rather than on first read (idempotent)."""
        for shard in self.shards:
            shard.reopen()

    def verify(self) -> list[int]:
        """Global indices of damaged records (empty when all is well)."""
        bad: list[int] = []
        for start, shard in zip(self.starts, self.shards):
            bad.extend(int(start) + i for i in shard.verify())
        return bad

    @property
    def nbytes(self) -> int:
        """Bytes on disk, all files included."""
        total = sum(s.size for s in self.shards)
        if self.manifest is not None:
            total += (Path(self.path) / fmt.MANIFEST_NAME).stat().st_size
        return total


def _locate(path: Path) -> tuple[Path, dict[str, Any] | None, list[Path]]:
    """Where the files of the pack at ``path`` live: the pack's own path, its manifest (shard
    sets only) and its container files in record order."""
    if path.name == fmt.MANIFEST_NAME and path.is_file():
        path = path.parent
    manifest_path = path / fmt.MANIFEST_NAME
    if path.is_dir() and manifest_path.is_file():
        manifest = fmt.parse_manifest(manifest_path.read_bytes(), str(manifest_path))
        return path, manifest, [path / shard["file"] for shard in manifest["shards"]]
    if path.exists():
        return path, None, [path]
    raise FileNotFoundError(
        f"{path} does not exist; pack a VOC dataset first with torch_serialized.pack_voc "
        "or `torch-serialized pack`"
    )


def _check_manifest_bindings(
    manifest: Mapping[str, Any], shards: Sequence[ContainerReader], manifest_path: Path
) -> None:
    """Each shard is the file the manifest was written with (its records and checksum)."""
    for shard, entry in zip(shards, manifest["shards"]):
        if (shard.num_records, shard.meta_crc32) != (entry["num_records"], entry["meta_crc32"]):
            raise CorruptFileError(
                f"{shard.path} does not match {manifest_path} (records or "
                "checksum differ): a shard was replaced; re-pack the dataset"
            )


def open_pack(path: str | os.PathLike[str], *, checked: bool = False) -> PackReader:
    """Open a packed dataset (a ``.tser`` file or a shard folder)."""
    return PackReader(path, checked=checked)
