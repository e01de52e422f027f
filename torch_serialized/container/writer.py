"""Records -> one container file, or a folder of shards plus a manifest.

Output is atomic (see ``atomic``): on any failure or interruption the destination keeps
whatever it held before (nothing, or the previous complete pack). This module never imports
torch.
"""

# More than 400 lines: the writing half of the format (ContainerWriter, PackWriter), the
# mirror of reader.py; the layout arithmetic of add() and reserve() must stay in one place.

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .._version import __version__
from ..errors import WriteError
from . import spec as fmt
from .atomic import AtomicOutput, is_temporary
from .fileio import read_regular_file
from .reader import member_of, read_binding, read_manifest

__all__ = [
    "ContainerWriter",
    "PackWriter",
    "Payload",
    "CREATED_BY",
    "replace_refusal",
    "member_refusal",
    "check_output_name",
]

#: The ``created_by`` of every container and manifest written here.
CREATED_BY = f"torch_serialized {__version__}"

Payload = bytes | bytearray | memoryview
_PAD = bytes(1 << 16)


def _check_options(fields: Sequence[str], alignment: int, columns: np.dtype | None) -> None:
    if not fields or len(set(fields)) != len(fields):
        raise ValueError(f"fields must be distinct names, got {list(fields)}")
    if alignment < 8 or alignment & (alignment - 1) or alignment > fmt.MAX_ALIGNMENT:
        raise ValueError(
            f"alignment must be a power of two from 8 to {fmt.MAX_ALIGNMENT}, got {alignment}"
        )
    if columns is not None:
        fmt.dtype_to_json(columns)  # refuse unstorable columns now, not after every record


class ContainerWriter:
    """Streams records into one open binary file in the container format.

    The caller owns the file object (see ``PackWriter`` for atomic output). ``columns``
    is an optional structured dtype: one fixed-size row of it is stored per record, in the
    per-record array ``"records"``.
    """

    def __init__(
        self,
        file: BinaryIO,
        fields: Sequence[str],
        *,
        alignment: int = fmt.DEFAULT_ALIGNMENT,
        columns: np.dtype | None = None,
    ) -> None:
        _check_options(fields, alignment, columns)
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
            self._write(_PAD[:pad])

    def add(self, payloads: Sequence[Payload], row: tuple[Any, ...] | None = None) -> int:
        """Append one record (one payload per field); return its index in this file."""
        if len(payloads) != len(self.fields):
            raise ValueError(f"expected {len(self.fields)} payloads, got {len(payloads)}")
        if (row is None) != (self._columns is None):
            raise ValueError("pass a row exactly when the writer was given columns")
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
        if not 0 <= i < self.num_records:
            raise IndexError(f"record {i} is not written (0..{self.num_records - 1})")
        return self._index[i].copy()

    def reserve(self, entries: np.ndarray, row: tuple[Any, ...] | None = None) -> tuple[int, int]:
        """Leave room for a record laid out as ``entries`` describe (its index row in a file
        written by a writer with the same fields and alignment); return ``(index, offset)``.

        The caller copies the record's bytes (``entries``' first offset to its last end,
        padding between fields included) to ``offset`` of this file before it is finished
        (``parallel.copy_range`` does); the alignment padding before the record is left as a hole,
        which reads as the zeros ``add`` writes. This is how parallel packing stays
        byte-identical to one process while the bytes move in pack processes.
        """
        if len(entries) != len(self.fields):
            raise ValueError(f"expected {len(self.fields)} entries, got {len(entries)}")
        if (row is None) != (self._columns is None):
            raise ValueError("pass a row exactly when the writer was given columns")
        # Python ints, not numpy: an append reserves every kept record, one call each
        offsets, lengths = entries["offset"].tolist(), entries["length"].tolist()
        ends = [o + n for o, n in zip(offsets, lengths)]
        if any(o % self.alignment for o in offsets) or any(
            o < e for o, e in zip(offsets[1:], ends)
        ):
            raise ValueError(
                "entries are not a record laid out by a writer with this alignment and fields"
            )
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
        """The next record's number, with room for its index entry and row."""
        i = self.num_records
        if i == len(self._index):
            self._index = np.concatenate([self._index, np.zeros_like(self._index)])
            if self._rows is not None:
                self._rows = np.concatenate([self._rows, np.empty_like(self._rows)])
        return i

    def add_array(self, name: str, array: np.ndarray, *, per_record: bool = False) -> None:
        """Store a named numpy array (plain numbers only) in this file."""
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
        """Write index, arrays, metadata and footer; return the file size. ``pack`` is the
        file's binding to its pack (``format.binding``)."""
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


def check_output_name(output: str | os.PathLike[str]) -> None:
    """Refuse an output path that names no file of its own: ``""`` (which ``Path`` reads as the
    current folder), ``.`` or ``/``. A pack is a file or folder written beside its siblings
    and renamed into place, so its path must end in a name (``ValueError``, saying so)."""
    text = os.fspath(output)
    if text == "":
        raise ValueError(
            "the output path is empty: pass the .tser file (or shard folder) to write, "
            "e.g. 'voc.tser'"
        )
    if Path(text).name == "":
        raise ValueError(
            f"output {text!r} is a folder itself, not a name in it: pass the .tser file "
            f"(or shard folder) to write, e.g. {os.path.join(text, 'voc.tser')!r}"
        )


def replace_refusal(path: Path) -> str | None:
    """Why ``path`` may not be replaced by a new pack (a message saying what to do instead),
    or ``None`` when it may.

    Only a pack this package wrote may be replaced, verified rather than sniffed: a file with a
    valid torch_serialized header that is no shard or catalog of a shard folder (replacing
    one breaks its pack; ``reader.member_of``), or a folder whose manifest parses and checks
    and that holds nothing but the files that manifest names, shard and catalog files named
    as this package names them (an earlier generation's, kept by an append) and our own
    temporaries. Anything else might be someone's data.
    """
    reason = _not_a_pack(path)
    if reason is not None:
        return (
            f"{path} exists and is not a torch_serialized pack: it {reason}. "
            "Refusing to replace it; remove it yourself or choose another output path"
        )
    return member_refusal(path)


def member_refusal(path: Path) -> str | None:
    """Why the file ``path`` may not be replaced when it is a shard or catalog of a shard
    folder (``reader.member_of``: replacing it alone breaks that pack), else ``None``."""
    if not path.is_file():
        return None
    member = member_of(path, read_binding(path))
    if member is None:
        return None
    return (
        f"{path} is {member}, not a pack by itself: a new pack there would break that pack. "
        f"Refusing to replace it; to replace the whole pack, {member.advice}, or choose "
        "another output path"
    )


def _not_a_pack(path: Path) -> str | None:
    """Why ``path`` is no pack this package wrote (see ``replace_refusal``), or ``None``."""
    if not os.path.lexists(path):
        return None
    if path.is_dir():
        manifest_path = path / fmt.MANIFEST_NAME
        if not os.path.lexists(manifest_path):
            return f"is a folder without {fmt.MANIFEST_NAME}"
        try:
            manifest = read_manifest(manifest_path)
        except (OSError, ValueError) as exc:
            return f"has a {fmt.MANIFEST_NAME} that is not a valid manifest ({exc})"
        ours = {fmt.MANIFEST_NAME, *manifest.files()}
        with os.scandir(path) as entries:
            for entry in entries:
                if is_temporary(entry.name) or (
                    fmt.is_member_name(entry.name) and entry.is_file(follow_symlinks=False)
                ):
                    continue  # ours: a temporary, or a file of an earlier generation
                if entry.name not in ours or not entry.is_file(follow_symlinks=False):
                    return f"holds {entry.name!r}, which is not a file of the pack it lists"
        return None
    try:
        header = read_regular_file(path, fmt.HEADER_SIZE, "the file", prefix=True)
        fmt.unpack_header(header, str(path))
    except (OSError, ValueError):
        return "is not a torch_serialized file"
    return None


class PackWriter:
    """Writes records to ``output``: one file, or shards plus manifest when a limit is set.

    With ``max_records_per_shard``, ``max_shard_bytes`` or ``shard_ends`` (the record
    counts after which a shard ends: shards of chosen sizes), ``output`` becomes a folder of
    ``shard-NNNNN-<token>.tser`` files, a ``catalog-<token>.tser`` and ``manifest.json``
    (version 2; ``token`` is new for every write, so no name is ever reused). Arrays added
    with ``add_array`` are dataset-level: they go into the single file, or into the catalog
    with a copy of every record's columns. Every file is bound to the pack by its metadata
    (``format.binding``). Use as a context manager: leaving the block
    with an exception removes all temporary output. ``before_finish`` is called before each
    file is finished: a caller that ``reserve``s records copies their bytes in by then.
    ``pack_id`` and ``token`` are random unless given (a writer that grows a pack keeps its
    id; tests pin both to compare bytes). ``locked``: the caller holds the appenders'
    ``flock`` on the ``output`` it replaces (an append rewriting a single file), which the
    commit would otherwise wait for (``atomic.AtomicOutput``).
    """

    def __init__(
        self,
        output: str | os.PathLike[str],
        fields: Sequence[str],
        *,
        columns: np.dtype | None = None,
        max_records_per_shard: int | None = None,
        max_shard_bytes: int | None = None,
        shard_ends: Sequence[int] = (),
        alignment: int = fmt.DEFAULT_ALIGNMENT,
        before_finish: Callable[[], None] | None = None,
        pack_id: str | None = None,
        token: str | None = None,
        locked: bool = False,
    ) -> None:
        for name, limit in (
            ("max_records_per_shard", max_records_per_shard),
            ("max_shard_bytes", max_shard_bytes),
        ):
            if limit is not None and limit < 1:
                raise ValueError(f"{name} must be a positive integer, got {limit}")
        _check_options(fields, alignment, columns)
        check_output_name(output)
        self.output = Path(output).absolute()
        self.sharded = (
            max_records_per_shard is not None or max_shard_bytes is not None or bool(shard_ends)
        )
        #: with ``shard_ends``, a shard ends after exactly these record counts (the limits
        #: above are then only recorded)
        self._ends = frozenset(shard_ends)
        self._fields = list(fields)
        self._columns = columns
        self._alignment = alignment
        self._locked = locked
        self._max_records = max_records_per_shard
        self._max_bytes = max_shard_bytes
        if not self.output.parent.is_dir():
            raise WriteError(
                errno.ENOENT,
                f"output folder {self.output.parent} does not exist; create it first",
            )
        refusal = replace_refusal(self.output)
        if refusal is not None:
            raise WriteError(errno.EEXIST, refusal)
        self.pack_id = pack_id or fmt.new_pack_id()
        #: in every file name this write makes, so no name a reader may hold is ever reused
        self._token = token or fmt.new_token()
        self._shards: list[fmt.ShardEntry] = []
        self._rows: list[np.ndarray] = []  # each finished shard's rows, for the catalog
        self._arrays: list[tuple[str, np.ndarray]] = []
        self._file: BinaryIO | None = None
        self._path: Path | None = None  # the file being written
        self._writer: ContainerWriter | None = None
        self._before_finish = before_finish
        self.num_records = 0
        self.bytes_written = 0
        self._closed = False
        try:
            self._open_output()
        except WriteError:
            raise  # says what is wrong already
        except OSError as exc:
            raise WriteError(
                exc.errno, f"cannot create {exc.filename or self.output}: {exc.strerror}"
            ) from exc

    # -- where files go (``grow.GrowWriter`` writes into an existing folder instead) -----------
    def _open_output(self) -> None:
        self._out = AtomicOutput(self.output, folder=self.sharded, locked=self._locked)

    def _member_path(self, name: str) -> Path:
        """Where the shard folder's file ``name`` is written."""
        return self._out.path / name

    def _commit(self) -> None:
        self._out.commit()

    def _discard(self) -> None:
        self._out.abort()

    # -- writing -------------------------------------------------------------------------
    def add(self, payloads: Sequence[Payload], row: tuple[Any, ...] | None = None) -> int:
        """Append one record; return its global index."""
        if self._closed:
            raise ValueError(f"writer for {self.output} is closed or was aborted")
        sizes = [memoryview(p).nbytes for p in payloads]
        return self._append(sizes, lambda writer: writer.add(payloads, row))

    def reserve(
        self, entries: np.ndarray, row: tuple[Any, ...] | None = None
    ) -> tuple[int, Path, int]:
        """Leave room for a record laid out elsewhere (see ``ContainerWriter.reserve``);
        return its global index, and the file and offset its bytes must be copied to before
        that file is finished (``before_finish``)."""
        sizes = entries["length"].tolist()
        placed: list[int] = []
        index = self._append(sizes, lambda writer: placed.append(writer.reserve(entries, row)[1]))
        assert self._path is not None
        return index, self._path, placed[0]

    def _append(self, sizes: Sequence[int], add: Callable[[ContainerWriter], Any]) -> int:
        if self._closed:
            raise ValueError(f"writer for {self.output} is closed or was aborted")
        try:
            writer = self._writer
            if writer is None or self._shard_full(writer, sizes):
                writer = self._next_shard()
            before = writer.position
            add(writer)
            self.bytes_written += writer.position - before
        except OSError as exc:
            self.abort()
            raise self.write_error(exc) from exc
        self.num_records += 1
        return self.num_records - 1

    def scratch(self) -> Path:
        """A new private folder beside the output for intermediate files (e.g. records laid
        out by pack processes). It is removed with the temporary output on close or abort,
        and by the next writer of this output if this process is killed."""
        return self._out.scratch()

    def add_array(self, name: str, array: np.ndarray) -> None:
        """Store a dataset-level array (in the last shard of a shard set)."""
        if name == "records" or any(name == other for other, _ in self._arrays):
            raise ValueError(f"array {name!r} is already stored")
        fmt.dtype_to_json(np.asarray(array).dtype)  # refuse unstorable dtypes now, not at close
        self._arrays.append((name, array))

    def _shard_full(self, writer: ContainerWriter, sizes: Sequence[int]) -> bool:
        if not self.sharded or writer.num_records == 0:
            return False
        if self._ends:
            return self.num_records in self._ends
        if self._max_records is not None and writer.num_records >= self._max_records:
            return True
        if self._max_bytes is not None:
            size = sum(n + self._alignment for n in sizes)
            return writer.position + size > self._max_bytes
        return False

    def _next_shard(self) -> ContainerWriter:
        if self._writer is not None:
            self._finish_shard(None)
        if self.sharded:
            name = fmt.shard_file_name(len(self._shards), self._token)
            path = self._member_path(name)
        else:
            name, path = self.output.name, self._out.path
        self._file = open(path, "wb", buffering=1 << 20)  # noqa: SIM115 - closed in _finish
        self._path = path
        self._writer = ContainerWriter(
            self._file, self._fields, alignment=self._alignment, columns=self._columns
        )
        return self._writer

    def _finish_shard(self, user: Mapping[str, Any] | None) -> None:
        """Close the current file; for a single file (``user`` given) with its metadata and
        arrays (a shard folder keeps those for the catalog)."""
        writer, file, path = self._writer, self._file, self._path
        if writer is None or file is None or path is None:
            raise RuntimeError("no shard is open")
        if self._before_finish is not None:
            self._before_finish()  # records reserved in this file are copied in by now
        if self.sharded:
            first = (
                self._shards[-1].first_record + self._shards[-1].num_records if self._shards else 0
            )
            pack = fmt.binding(
                fmt.ROLE_SHARD,
                self.pack_id,
                index=len(self._shards),
                first_record=first,
                num_records=writer.num_records,
            )
            self._rows.append(writer.rows())
            size = writer.finish({}, pack=pack)
        else:
            first = 0
            for name, array in self._arrays:
                writer.add_array(name, array)
            size = writer.finish(user or {}, pack=fmt.binding(fmt.ROLE_SINGLE, self.pack_id))
        self._sync_close(file)
        entry = fmt.ShardEntry(path.name, first, writer.num_records, size, writer.meta_crc32)
        self._shards.append(entry)
        self._writer = None
        self._file = None

    def _write_catalog(self, user: Mapping[str, Any]) -> fmt.CatalogEntry:
        """The catalog of a shard folder: a container without records holding the dataset-level
        arrays, a copy of every record's columns (``records``) and the metadata, so a reader
        opens the dataset from the manifest and this one small file."""
        name = fmt.catalog_file_name(self._token)
        with open(self._member_path(name), "wb", buffering=1 << 20) as file:
            writer = ContainerWriter(file, self._fields, alignment=self._alignment)
            if self._columns is not None:
                rows = np.concatenate(self._rows) if self._rows else np.empty(0, self._columns)
                writer.add_array("records", rows)
            for array_name, array in self._arrays:
                writer.add_array(array_name, array)
            pack = fmt.binding(
                fmt.ROLE_CATALOG,
                self.pack_id,
                num_records=self.num_records,
                num_shards=len(self._shards),
            )
            size = writer.finish(user, pack=pack)
            self._sync_close(file)
        return fmt.CatalogEntry(name, size, writer.meta_crc32)

    @staticmethod
    def _sync_close(file: BinaryIO) -> None:
        file.flush()
        os.fsync(file.fileno())
        file.close()

    def close(self, metadata: Mapping[str, Any] | None = None) -> Path:
        """Finish every file, then move the output into place atomically; return its path."""
        if self._closed:
            raise ValueError("writer is already closed")
        user = dict(metadata or {})
        try:
            if self._writer is None and not (self.sharded and self._shards):
                self._next_shard()  # an empty pack still has one (empty) file
            if self._writer is not None:
                self._finish_shard(user)
            if self.sharded:
                self._write_manifest(self._write_catalog(user))
            self._commit()
        except BaseException as exc:
            self.abort()
            if isinstance(exc, OSError) and not isinstance(exc, WriteError):
                raise self.write_error(exc) from exc
            raise
        self._closed = True
        return self.output

    def _manifest_bytes(self, catalog: fmt.CatalogEntry) -> bytes:
        return fmt.build_manifest(
            created_by=CREATED_BY,
            pack_id=self.pack_id,
            num_records=self.num_records,
            fields=self._fields,
            catalog=catalog,
            shards=self._shards,
        )

    def _write_manifest(self, catalog: fmt.CatalogEntry) -> None:
        data = self._manifest_bytes(catalog)
        with open(self._member_path(fmt.MANIFEST_NAME), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def abort(self) -> None:
        """Remove all temporary output; the destination is left untouched."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        self._writer = None
        self._closed = True
        self._discard()

    def write_error(self, exc: OSError) -> WriteError:
        """``exc``, raised while writing this output, as a ``WriteError`` that says what to do."""
        if isinstance(exc, WriteError):
            return exc
        reason = exc.strerror or str(exc)
        hint = {
            errno.ENOSPC: "free disk space or write elsewhere",
            errno.EFBIG: "the file size limit was reached; raise it or use shards",
            errno.EDQUOT: "the disk quota is exhausted",
            errno.EACCES: "check the folder's permissions",
        }.get(exc.errno or 0, "check the output folder")
        return WriteError(
            exc.errno or errno.EIO,
            f"writing {self.output} failed: {reason}; {hint}. No partial output was left",
        )

    def __enter__(self) -> PackWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._closed:
            return
        if exc_type is not None:
            self.abort()
        else:
            self.close()
