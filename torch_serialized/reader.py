"""Read containers and shard sets: validate at open, then O(1) zero-copy record access.

A reader validates the header, footer, metadata and index when it is created, then maps
the file with ``mmap``. The map belongs to one process: it is dropped when the reader is
pickled (spawn/forkserver DataLoader workers) and reopened by the first access in a process
whose pid differs from the one that mapped it (fork), so no setup is needed in workers.
A reopen checks that the file on disk is still the one that was validated. This module
never imports torch.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import stat
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import format as fmt
from .errors import (
    ChecksumError,
    CorruptFileError,
    FileChangedError,
    FormatError,
    TruncatedFileError,
    UnsupportedVersionError,
)

__all__ = ["ContainerReader", "PackReader", "open_pack"]

_MAX_META_BYTES = 1 << 30
_IOV_MAX = getattr(os, "sysconf", lambda _name: 1024)("SC_IOV_MAX") or 1024
#: Bytes one ``preadv`` call asks for at most: a run is read as a sequence of such calls, so
#: the kernel's read-ahead streams the rest of the run while each piece is copied out (on a
#: cold disk 1 MiB calls move ~1.7x the bytes per second of one whole-block call).
_READ_SIZE = 1 << 20


class ContainerReader:
    """One ``.tser`` container file.

    ``checked=True`` recomputes each field's CRC32 on every read and raises
    ``ChecksumError`` on a mismatch (slower; for untrusted storage).
    """

    def __init__(self, path: str | os.PathLike[str], *, checked: bool = False) -> None:
        self.path = str(path)
        self.checked = checked
        self._pid: int | None = None
        self._mmap: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._offsets: np.ndarray | None = None
        self._lengths: np.ndarray | None = None
        self._arrays: dict[str, np.ndarray] = {}
        fd = self._open_fd()
        try:
            self._validate(fd)
            self._map(fd, check=True)
        finally:
            os.close(fd)

    # -- opening -------------------------------------------------------------------------
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

    def _validate(self, fd: int) -> None:
        path = self.path
        size = os.fstat(fd).st_size
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
        data_end = size - fmt.FOOTER_SIZE
        if (
            meta_offset < fmt.HEADER_SIZE
            or meta_offset + meta_length != data_end
            or meta_length > _MAX_META_BYTES
        ):
            raise CorruptFileError(f"{path}: metadata location in the footer is invalid")
        raw = os.pread(fd, meta_length, meta_offset)
        if fmt.crc32(raw) != footer["meta_crc32"]:
            raise CorruptFileError(f"{path}: metadata checksum mismatch; the file is damaged")
        try:
            meta = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise CorruptFileError(f"{path}: metadata is not valid JSON: {exc}") from None
        if not isinstance(meta, dict):
            raise CorruptFileError(f"{path}: metadata is not a JSON object")
        fields = meta.get("fields")
        num = meta.get("num_records")
        if (
            meta.get("format") != "torch_serialized"
            or not isinstance(fields, list)
            or not fields
            or not all(isinstance(f, str) for f in fields)
            or type(num) is not int
            or num != footer["num_records"]
        ):
            raise CorruptFileError(f"{path}: metadata does not describe a torch_serialized file")
        arrays = meta.get("arrays")
        user = meta.get("user")
        if not isinstance(arrays, dict) or not isinstance(user, dict):
            raise CorruptFileError(f"{path}: metadata lacks its arrays or user sections")
        dtype, shape, *_ = fmt.check_descriptor(meta.get("index"), "index", meta_offset, path)
        if dtype != fmt.INDEX_DTYPE or shape != (num, len(fields)):
            raise CorruptFileError(f"{path}: record index has dtype {dtype}, shape {shape}")
        for name, desc in arrays.items():
            fmt.check_descriptor(desc, name, meta_offset, path)
            if desc.get("per_record") and desc["shape"][:1] != [num]:
                raise CorruptFileError(f"{path}: per-record array {name!r} has the wrong length")
        self.version = (major, minor)
        self.meta: dict[str, Any] = meta
        self.fields: list[str] = fields
        self.num_records: int = num
        self.data_end = meta_offset
        self._identity = (size, footer["meta_crc32"])

    def _map(self, fd: int, *, check: bool) -> None:
        """Map the file; with ``check``, verify index and array checksums and bounds."""
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
        arrays = {name: array for (name, _), array in zip(descs[1:], views[1:])}
        offsets, lengths = index["offset"], index["length"]
        if check and index.size:
            ends = offsets + lengths
            if (
                int(offsets.min()) < fmt.HEADER_SIZE
                or int(ends.max()) > self.data_end
                or bool((ends < offsets).any())
            ):
                raise CorruptFileError(
                    f"{self.path}: record index points outside the data; the file is damaged"
                )
        self._mmap, self._view, self._arrays = mm, view, arrays
        self._offsets, self._lengths, self._crcs = offsets, lengths, index["crc32"]
        self._pid = os.getpid()

    def _reopen(self) -> None:
        fd = self._open_same_file()
        try:
            self._map(fd, check=False)
        finally:
            os.close(fd)

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
            same = (size, fmt.unpack_footer(tail, self.path)["meta_crc32"]) == self._identity
        except CorruptFileError:
            same = False
        if not same:
            os.close(fd)
            raise FileChangedError(
                f"{self.path} was replaced or modified after it was opened; "
                "create the dataset again to read the new file"
            )
        return fd

    def reopen(self) -> None:
        """Map the file again in this process (idempotent within one process)."""
        if self._pid != os.getpid():
            self._reopen()

    # -- pickling: the map never crosses a process boundary --------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_mmap", "_view", "_offsets", "_lengths", "_crcs", "_fd", "_fd_pid"):
            state[key] = None
        state["_arrays"] = {}
        state["_pid"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- access --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_records

    def field(self, i: int, k: int) -> memoryview:
        """Bytes of field ``k`` of record ``i`` (a read-only view into the map)."""
        if self._pid != os.getpid():
            self._reopen()
        offset = int(self._offsets[i, k])  # type: ignore[index]
        view = self._view[offset : offset + int(self._lengths[i, k])]  # type: ignore[index]
        if self.checked and fmt.crc32(view) != int(self._crcs[i, k]):
            raise ChecksumError(
                f"{self.path}: record {i} field {self.fields[k]!r} fails its checksum; "
                "the file is damaged: run `torch-serialized verify` and re-pack it"
            )
        return view

    def arrays(self) -> Mapping[str, np.ndarray]:
        """The stored arrays by name (read-only views into the map)."""
        if self._pid != os.getpid():
            self._reopen()
        return self._arrays

    def is_per_record(self, name: str) -> bool:
        return bool(self.meta["arrays"][name].get("per_record"))

    @property
    def user(self) -> dict[str, Any]:
        return self.meta["user"]

    def verify(self) -> list[int]:
        """Indices of records whose bytes fail their checksum (empty when all is well)."""
        if self._pid != os.getpid():
            self._reopen()
        assert self._view is not None  # noqa: S101
        view, offsets, lengths, crcs = self._view, self._offsets, self._lengths, self._crcs
        bad: list[int] = []
        num_fields = len(self.fields)
        for i in range(self.num_records):
            for k in range(num_fields):
                off = int(offsets[i, k])  # type: ignore[index]
                if fmt.crc32(view[off : off + int(lengths[i, k])]) != int(crcs[i, k]):  # type: ignore[index]
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
        if self._pid != os.getpid():
            self._reopen()
        wanted = [int(r) for r in records]
        if not wanted:
            return []
        if wanted != sorted(wanted) or wanted[0] < 0 or wanted[-1] >= self.num_records:
            raise IndexError(f"records must ascend within 0..{self.num_records - 1}")
        offsets, lengths = self._offsets, self._lengths
        order = sorted(fields, key=lambda k: int(offsets[wanted[0], k]))  # type: ignore[index]
        out: list[list[np.ndarray]] = []
        pieces: list[tuple[int, np.ndarray]] = []  # (file offset, destination), ascending
        for r in wanted:
            by_field: dict[int, np.ndarray] = {}
            for k in order:
                array = np.empty(int(lengths[r, k]), dtype=np.uint8)  # type: ignore[index]
                pieces.append((int(offsets[r, k]), array))  # type: ignore[index]
                by_field[k] = array
            out.append([by_field[k] for k in fields])
        self._scatter_read(pieces)
        if self.checked:
            for r, row in zip(wanted, out):
                for k, array in zip(fields, row):
                    if fmt.crc32(array.data) != int(self._crcs[r, k]):  # type: ignore[index]
                        raise ChecksumError(
                            f"{self.path}: record {r} field {self.fields[k]!r} fails its "
                            "checksum; the file is damaged: run `torch-serialized verify` "
                            "and re-pack it"
                        )
        return out

    def prefetch(self, records: Sequence[int] | np.ndarray) -> None:
        """Start reading the span of ``records`` (a run of neighbours) into the page cache
        and return at once (``POSIX_FADV_WILLNEED``): a streaming reader hints its next
        block so that block's disk reads overlap this one's."""
        if not len(records) or not hasattr(os, "posix_fadvise"):
            return
        if self._pid != os.getpid():
            self._reopen()
        wanted = np.asarray(records, dtype=np.int64)
        starts = self._offsets[wanted]  # type: ignore[index]
        start, end = int(starts.min()), int((starts + self._lengths[wanted]).max())  # type: ignore[index]
        os.posix_fadvise(self._descriptor(), start, end - start, os.POSIX_FADV_WILLNEED)

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
            if position > start and os.preadv(fd, buffers, start) != position - start:
                raise TruncatedFileError(
                    f"{self.path}: the file ended before byte {position}; it was truncated "
                    "after it was opened: re-copy or re-pack it"
                )

    def _descriptor(self) -> int:
        """This process's file descriptor for ``pread``, checked to be the validated file."""
        if getattr(self, "_fd_pid", None) != os.getpid():
            fd = self._open_same_file()
            weakref.finalize(self, os.close, fd)
            self._fd, self._fd_pid = fd, os.getpid()
        return self._fd


class PackReader:
    """A packed dataset: one container file, or a shard folder with ``manifest.json``.

    Records are numbered globally across shards. Per-record arrays are concatenated in shard
    order; dataset-level arrays are found in whichever shard stores them.
    """

    def __init__(self, path: str | os.PathLike[str], *, checked: bool = False) -> None:
        p = Path(path)
        if p.name == fmt.MANIFEST_NAME and p.is_file():
            p = p.parent
        self.path = str(p)
        if p.is_dir() and (p / fmt.MANIFEST_NAME).is_file():
            self.manifest: dict[str, Any] | None = _read_manifest(p)
            self.shards = [
                ContainerReader(p / shard["file"], checked=checked)
                for shard in self.manifest["shards"]
            ]
            for shard, entry in zip(self.shards, self.manifest["shards"]):
                if (shard.num_records, shard._identity[1]) != (
                    entry["num_records"],
                    entry["meta_crc32"],
                ):
                    raise CorruptFileError(
                        f"{shard.path} does not match {p / fmt.MANIFEST_NAME} (records or "
                        "checksum differ): a shard was replaced; re-pack the dataset"
                    )
            self.user: dict[str, Any] = self.manifest["user"]
        elif p.exists():
            self.manifest = None
            self.shards = [ContainerReader(p, checked=checked)]
            self.user = self.shards[0].user
        else:
            raise FileNotFoundError(
                f"{p} does not exist; pack a VOC dataset first with torch_serialized.pack_voc "
                "or `torch-serialized pack`"
            )
        self.fields = self.shards[0].fields
        if any(s.fields != self.fields for s in self.shards):
            raise CorruptFileError(f"{self.path}: shards disagree on their fields")
        counts = [s.num_records for s in self.shards]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.num_records = int(self.starts[-1])
        self._field_index = {name: k for k, name in enumerate(self.fields)}
        self._arrays: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.num_records

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_arrays"] = None
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
        """All arrays: per-record ones concatenated across shards, dataset-level ones as stored."""
        if self._arrays is None or any(s._pid != os.getpid() for s in self.shards):
            merged: dict[str, list[np.ndarray]] = {}
            single: dict[str, np.ndarray] = {}
            for shard in self.shards:
                for name, array in shard.arrays().items():
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
            self._arrays = out
        return self._arrays

    def reopen(self) -> None:
        """Map every shard again in this process (idempotent)."""
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
        total = sum(s._identity[0] for s in self.shards)
        if self.manifest is not None:
            total += (Path(self.path) / fmt.MANIFEST_NAME).stat().st_size
        return total


def _read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / fmt.MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptFileError(f"{path}: not valid JSON ({exc}); re-pack the dataset") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt.MANIFEST_FORMAT:
        raise CorruptFileError(f"{path}: not a torch_serialized shard manifest")
    version = manifest.get("version")
    if not isinstance(version, int) or version > fmt.MANIFEST_VERSION:
        raise UnsupportedVersionError(
            f"{path}: manifest version {version!r} is newer than this torch_serialized reads "
            f"({fmt.MANIFEST_VERSION}); upgrade torch_serialized"
        )
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not shards or not isinstance(manifest.get("user"), dict):
        raise CorruptFileError(f"{path}: manifest lists no shards")
    for entry in shards:
        name = entry.get("file") if isinstance(entry, dict) else None
        if (
            not isinstance(name, str)
            or Path(name).name != name
            or name in ("", ".", "..")
            or not isinstance(entry.get("num_records"), int)
            or not isinstance(entry.get("meta_crc32"), int)
        ):
            raise CorruptFileError(f"{path}: invalid shard entry {entry!r}")
    return manifest


def open_pack(path: str | os.PathLike[str], *, checked: bool = False) -> PackReader:
    """Open a packed dataset (a ``.tser`` file or a shard folder)."""
    return PackReader(path, checked=checked)
