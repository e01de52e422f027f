"""One container file: validated once at open, then O(1) zero-copy record access. A map belongs
to the process that made it: never pickled, made again in another process once the path still
holds the file validated. Reads use the mapped descriptor, never the path, so a replaced path
never mixes two files. Never imports torch."""

from __future__ import annotations

import mmap
import os
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ChecksumError, CorruptFileError, FileChangedError, FormatError
from . import spec as fmt
from .fileio import FileKindError, open_regular
from .manifest import Expected

__all__ = ["ContainerReader"]

#: ``mmap`` keeps no duplicate descriptor (Python >= 3.13).
_MMAP_OPTIONS: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}
HINT_CHUNK = 1 << 20  #: largest WILLNEED hint: Linux drops what is past the read-ahead


class _Mapped:
    """One process's map, its index and arrays, and the descriptor it owns. Never shared."""

    def __init__(
        self, fd: int, mm: mmap.mmap, index: np.ndarray, arrays: dict[str, np.ndarray]
    ) -> None:
        self.pid = os.getpid()
        self.view, self.arrays, self.index = memoryview(mm), arrays, index  # the view keeps mm
        self.offsets, self.lengths, self.crcs = index["offset"], index["length"], index["crc32"]
        self.fd = fd  # the file mapped and checked: its path may name another one by now
        weakref.finalize(self, os.close, fd)


class ContainerReader:
    """One ``.tser`` file, validated at open (docs/FORMAT.md, "Truncation and damage
    detection"). ``expect`` (a manifest's entry) adds its "Integrity rules"; ``checked=True``
    recomputes each field's CRC32 on every read (``ChecksumError``; for untrusted storage)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        checked: bool = False,
        expect: Expected | None = None,
    ) -> None:
        self.path = str(path)
        self.checked = checked
        self.member = None if expect is None else expect.member  # its place in its pack
        self.where = self.path if self.member is None else f"{self.path} ({self.member})"
        self.first_record = 0 if expect is None else expect.first_record  # in the pack
        self._local: _Mapped | None = None
        fd = self._open_fd()
        try:
            self.size = os.fstat(fd).st_size
            if expect is not None and self.size != expect.bytes:
                msg = f"{self.size} bytes, the manifest says {expect.bytes}"
                raise expect.mismatch(self.path, msg)
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
            if self.member is not None:
                raise CorruptFileError(f"{exc}; {fmt.DAMAGED}") from None
            if os.path.isdir(self.path):
                raise FormatError(
                    f"{self.path} is a folder without {fmt.MANIFEST_NAME}; pass a .tser file "
                    "or a shard folder written by torch_serialized"
                ) from None
            raise FormatError(str(exc)) from None

    def _read_arrays(self, fd: int, *, check: bool) -> _Mapped:
        """Map and view index and arrays (``check``: CRCs, index); the map then owns ``fd``."""
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ, **_MMAP_OPTIONS)
        views = []
        for name, desc in [("index", self.meta["index"]), *self.meta["arrays"].items()]:
            dtype = fmt.dtype_from_json(desc["dtype"], self.where)
            offset, nbytes, shape = desc["offset"], desc["nbytes"], tuple(desc["shape"])
            if check and fmt.crc32(memoryview(mm)[offset : offset + nbytes]) != desc["crc32"]:
                raise fmt.damaged(self.where, f"array {name!r} checksum mismatch (its crc32)")
            try:
                array = np.frombuffer(mm, dtype, nbytes // dtype.itemsize, offset)
                views.append(array.reshape(shape))
            except (ValueError, OverflowError) as exc:  # absurd shapes: > 64 axes, huge dims
                msg = f"array {name!r} has an unusable shape {shape}: {exc}"
                raise fmt.damaged(self.where, msg) from None
        if check:
            self._check_index(views[0])
        return _Mapped(fd, mm, views[0], dict(zip(self.meta["arrays"], views[1:])))

    def _check_index(self, index: np.ndarray) -> None:
        """Every field lies in the record data: the one bounds check, reads trust the index."""
        offsets, lengths = index["offset"], index["length"]
        ends = offsets + lengths
        outside = (offsets < fmt.HEADER_SIZE) | (ends > self.data_end) | (ends < offsets)
        if outside.any():
            i, k = (int(v) for v in np.argwhere(outside)[0])
            where = f"record {i} field {self.fields[k]!r} at offset {int(offsets[i, k])}"
            raise fmt.damaged(self.where, f"the record index places {where}, outside the data")

    # -- one process, one map -----------------------------------------------------------------
    def _mapped(self) -> _Mapped:
        """This process's map, made on first use in a process that has none: of the path again,
        once it still holds the file validated at creation (else ``FileChangedError``)."""
        local = self._local
        if local is not None and local.pid == os.getpid():
            return local
        try:
            fd = self._open_fd()
        except (FileNotFoundError, FormatError):  # a re-pack removed it: never read a mix
            raise FileChangedError(gone(self.path)) from None
        try:
            if not self.holds(fd):
                raise FileChangedError(gone(self.path, " (modified)"))
            local = self._local = self._read_arrays(fd, check=False)  # owns ``fd``
        except BaseException:
            os.close(fd)
            raise
        return local

    def holds(self, fd: int) -> bool:
        """Whether ``fd`` holds the file this reader validated (its size and ``meta_crc32``)."""
        size = os.fstat(fd).st_size
        tail = os.pread(fd, fmt.FOOTER_SIZE, max(size - fmt.FOOTER_SIZE, 0))
        try:
            footer = fmt.unpack_footer(tail, self.path)
        except CorruptFileError:
            return False
        return (size, footer["meta_crc32"]) == (self.size, self.meta_crc32)

    def close(self) -> None:
        """Drop this process's map (views handed out keep it); the next access maps anew."""
        self._local = None

    @property
    def mapped_by(self) -> int | None:
        """The process that holds the current map (``None`` until one maps it)."""
        return None if self._local is None else self._local.pid

    def reopen(self) -> None:
        """Map the file now rather than on first read."""
        self._mapped()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_local": None}

    # -- access --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_records

    def field(self, i: int, k: int) -> memoryview:
        """Bytes of field ``k`` of record ``i`` (a read-only view into the map)."""
        return self.record(i, (k,))[0]

    def record(self, i: int, fields: Sequence[int]) -> list[memoryview]:
        """Views of ``fields`` of record ``i``; no read hint: the fault's read-around suffices."""
        if not 0 <= i < self.num_records:  # numpy would wrap a negative one
            raise IndexError(f"record {i} out of range for {self.num_records} records")
        local = self._mapped()  # not views(): a map-style sample's own path, ~5x cheaper
        offsets, lengths, view = local.offsets[i].tolist(), local.lengths[i].tolist(), local.view
        out = [view[offsets[k] : offsets[k] + lengths[k]] for k in fields]
        if self.checked:
            self._check_crcs(local, [i], [out], fields)
        return out

    def views(
        self, records: Sequence[int] | np.ndarray, fields: Sequence[int]
    ) -> list[list[memoryview]]:
        """Views of ``fields`` of each of ``records`` (any order): ``record`` for a batch."""
        local, rows = self._mapped(), self._rows(records)
        cells = rows[:, None], np.asarray(fields, dtype=np.intp)
        starts, lengths = local.offsets[cells].tolist(), local.lengths[cells].tolist()
        out = [
            [local.view[o : o + n] for o, n in zip(row_starts, row_lengths)]
            for row_starts, row_lengths in zip(starts, lengths)
        ]
        if self.checked:
            self._check_crcs(local, rows.tolist(), out, fields)
        return out

    def _rows(self, records: Sequence[int] | np.ndarray) -> np.ndarray:
        """``records`` as int64 rows of this file (else ``IndexError``)."""
        rows = np.asarray(records, dtype=np.int64).reshape(-1)
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= self.num_records):
            raise IndexError(f"records must lie within 0..{self.num_records - 1}")
        return rows

    def _check_crcs(
        self, local: _Mapped, rows: Sequence[int], data: Sequence[Sequence[Any]], fields: Any
    ) -> None:
        """``ChecksumError`` naming the pack's record unless each ``data`` view matches its CRC."""
        for r, row in zip(rows, data):
            for k, value in zip(fields, row):
                if fmt.crc32(memoryview(value)) != int(local.crcs[r, k]):
                    record, field = self.first_record + r, self.fields[k]
                    raise ChecksumError(
                        f"{self.path}: record {record} field {field!r} fails its checksum; "
                        "the file is damaged: run `torch-serialized verify` and re-pack it",
                        path=self.path,
                        record=record,
                        field=field,
                    )

    def index_rows(self, records: Sequence[int] | np.ndarray) -> np.ndarray:
        """A copy of the index rows (``spec.INDEX_DTYPE``) of ``records``."""
        out = self._mapped().index[self._rows(records)]
        out["reserved"] = 0
        return out

    def arrays(self) -> Mapping[str, np.ndarray]:
        """The stored arrays by name (read-only views into the map)."""
        return self._mapped().arrays

    def field_lengths(self) -> np.ndarray:
        """The byte length of every field of every record: a uint64 ``[N, K]`` view."""
        return self._mapped().lengths

    def is_per_record(self, name: str) -> bool:
        return bool(self.meta["arrays"][name].get("per_record"))

    @property
    def user(self) -> dict[str, Any]:
        return self.meta["user"]

    def verify(self) -> list[int]:
        """Indices of records whose bytes fail their checksum (empty when all is well)."""
        local = self._mapped()
        rows = zip(local.offsets.tolist(), local.lengths.tolist(), local.crcs.tolist())
        return [
            i
            for i, (starts, lengths, crcs) in enumerate(rows)
            if any(fmt.crc32(local.view[o : o + n]) != c for o, n, c in zip(starts, lengths, crcs))
        ]

    # -- reads for batches and streams -------------------------------------------------------
    def read_records(
        self, records: Sequence[int] | np.ndarray, fields: Sequence[int]
    ) -> list[list[np.ndarray]]:
        """uint8 copies, for streams: a view would keep its shard's map alive after close."""
        return [[np.array(v, dtype=np.uint8) for v in row] for row in self.views(records, fields)]

    def prefetch(self, records: Sequence[int] | np.ndarray) -> None:
        """``WILLNEED``-hint the span of ``records`` so a stream's next reads overlap this block's
        use; skipped when its last byte is cached (a warm epoch: the hint costs ~5% for nothing)."""
        if not len(records) or not hasattr(os, "posix_fadvise"):
            return
        local, wanted = self._mapped(), np.asarray(records, dtype=np.int64)
        starts = local.offsets[wanted]
        start, end = int(starts.min()), int((starts + local.lengths[wanted]).max())
        if end <= start or _cached(local.fd, end - 1):
            return
        for at in range(start, end, HINT_CHUNK):
            os.posix_fadvise(local.fd, at, min(HINT_CHUNK, end - at), os.POSIX_FADV_WILLNEED)


def _cached(fd: int, offset: int) -> bool:
    """Whether byte ``offset`` is page-cached (``RWF_NOWAIT`` read); False if it cannot tell."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return False
    try:
        return os.preadv(fd, [bytearray(1)], offset, flag) == 1
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP and others: cannot tell
        return False


def gone(path: str, detail: str = "") -> str:
    """What a reader says of a pack no longer at its path (deleted, or replaced)."""
    return (
        f"{path} was removed or replaced after it was opened{detail}; create the dataset "
        "again to read the pack there now (re-pack it if it was deleted)"
    )
