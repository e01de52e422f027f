"""Records -> a pack: one container file, or a folder of shards plus a manifest. Output is atomic;
only a pack this package wrote is ever replaced (``replace_refusal``). Never imports torch."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..errors import WriteError
from . import spec as fmt
from .fileio import AtomicOutput, is_temporary, read_regular_file, write_synced
from .manifest import (
    CatalogEntry,
    ShardEntry,
    build_manifest,
    member_of,
    read_binding,
    read_manifest,
)
from .writer import CREATED_BY, ContainerWriter, Payload, check_options

__all__ = ["PackWriter", "replace_refusal", "check_output_name"]


def check_output_name(output: str | os.PathLike[str]) -> None:
    """Refuse (``ValueError``) an output path that names no file: ``""``, ``.`` or ``/``."""
    text = os.fspath(output)
    if Path(text).name == "":
        what = "the output path is empty" if text == "" else f"output {text!r} is a folder"
        example = os.path.join(text, "voc.tser")
        raise ValueError(
            f"{what}: pass the .tser file (or shard folder) to write, e.g. {example!r}"
        )


def replace_refusal(path: Path) -> str | None:
    """Why ``path`` may not be replaced by a new pack (what to do instead), or ``None``: only
    a valid pack we wrote may be, not a shard folder's member or a folder holding other files."""
    reason = _not_a_pack(path)
    if reason is not None:
        return (
            f"{path} exists and is not a torch_serialized pack: it {reason}. "
            "Refusing to replace it; remove it yourself or choose another output path"
        )
    member = member_of(path, read_binding(path)) if path.is_file() else None
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
        named = {fmt.MANIFEST_NAME, *manifest.files()}
        with os.scandir(path) as entries:
            for entry in entries:  # ours: its files, earlier generations' and temporaries
                listed = entry.name in named or fmt.is_member_name(entry.name)
                ours = is_temporary(entry.name) or listed and entry.is_file(follow_symlinks=False)
                if not ours:
                    return f"holds {entry.name!r}, which is not a file of the pack it lists"
        return None
    try:
        header = read_regular_file(path, fmt.HEADER_SIZE, "the file", prefix=True)
        fmt.unpack_header(header, str(path))
    except (OSError, ValueError):
        return "is not a torch_serialized file"
    return None


class PackWriter:
    """Writes records to ``output``: one file, or with ``max_records_per_shard``,
    ``max_shard_bytes`` or ``shard_ends`` (record counts ending a shard) a shard folder. As a
    context manager, an exception removes all temporary output. ``before_finish`` runs before each
    file is finished (``reserve``d bytes copied in by then); ``locked``: caller holds the lock."""

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
        limits = {
            "max_records_per_shard": max_records_per_shard,
            "max_shard_bytes": max_shard_bytes,
        }
        for name, limit in limits.items():
            if limit is not None and limit < 1:
                raise ValueError(f"{name} must be a positive integer, got {limit}")
        check_options(fields, alignment, columns)
        check_output_name(output)
        self.output = Path(output).absolute()
        self.sharded = any(v is not None for v in limits.values()) or bool(shard_ends)
        self._ends = frozenset(shard_ends)
        self._fields = list(fields)
        self._columns = columns
        self._alignment = alignment
        self._locked = locked
        self._max_records = max_records_per_shard
        self._max_bytes = max_shard_bytes
        if not self.output.parent.is_dir():
            msg = f"output folder {self.output.parent} does not exist; create it first"
            raise WriteError(errno.ENOENT, msg)
        refusal = replace_refusal(self.output)
        if refusal is not None:
            raise WriteError(errno.EEXIST, refusal)
        self.pack_id = pack_id or fmt.new_pack_id()
        self._token = token or fmt.new_token()
        self._shards: list[ShardEntry] = []
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
        except OSError as exc:
            raise self.write_error(exc) from exc

    # -- where files go (``append.GrowWriter`` writes into an existing folder instead) -----------
    def _open_output(self) -> None:
        self._out = AtomicOutput(self.output, folder=self.sharded, locked=self._locked)

    def _member_path(self, name: str) -> Path:
        return self._out.path / name

    def _commit(self) -> None:
        self._out.commit()

    def _discard(self) -> None:
        self._out.abort()

    # -- writing -------------------------------------------------------------------------
    def add(self, payloads: Sequence[Payload], row: tuple[Any, ...] | None = None) -> int:
        """Append one record; return its global index."""
        sizes = [memoryview(p).nbytes for p in payloads]
        return self._append(sizes, lambda writer: writer.add(payloads, row))

    def reserve(
        self, entries: np.ndarray, row: tuple[Any, ...] | None = None
    ) -> tuple[int, Path, int]:
        """Room for a record laid out elsewhere: its index, and file and offset to copy it to."""
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
        """A new private folder beside the output, removed with the temporary output."""
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
            path = self._member_path(fmt.shard_file_name(len(self._shards), self._token))
        else:
            path = self._out.path
        self._file = open(path, "wb", buffering=1 << 20)  # noqa: SIM115 - closed in _finish
        self._path = path
        self._writer = ContainerWriter(
            self._file, self._fields, alignment=self._alignment, columns=self._columns
        )
        return self._writer

    def _finish_shard(self, user: Mapping[str, Any] | None) -> None:
        """Close the current file (a single file with ``user`` and the arrays)."""
        writer, file, path = self._writer, self._file, self._path
        assert writer is not None and file is not None and path is not None
        if self._before_finish is not None:
            self._before_finish()  # records reserved in this file are copied in by now
        first = self.num_records - writer.num_records  # 0 in a single file
        if self.sharded:
            place = dict(
                index=len(self._shards), first_record=first, num_records=writer.num_records
            )
            pack = fmt.binding(fmt.ROLE_SHARD, self.pack_id, **place)
            self._rows.append(writer.rows())
            size = writer.finish({}, pack=pack)
        else:
            for name, array in self._arrays:
                writer.add_array(name, array)
            size = writer.finish(user or {}, pack=fmt.binding(fmt.ROLE_SINGLE, self.pack_id))
        self._sync_close(file)
        entry = ShardEntry(path.name, first, writer.num_records, size, writer.meta_crc32)
        self._shards.append(entry)
        self._writer = None
        self._file = None

    def _write_catalog(self, user: Mapping[str, Any]) -> CatalogEntry:
        """A container without records: metadata, dataset arrays and every record's columns."""
        name = fmt.catalog_file_name(self._token)
        with open(self._member_path(name), "wb", buffering=1 << 20) as file:
            writer = ContainerWriter(file, self._fields, alignment=self._alignment)
            if self._columns is not None:
                rows = np.concatenate(self._rows) if self._rows else np.empty(0, self._columns)
                writer.add_array("records", rows)
            for array_name, array in self._arrays:
                writer.add_array(array_name, array)
            place = dict(num_records=self.num_records, num_shards=len(self._shards))
            size = writer.finish(user, pack=fmt.binding(fmt.ROLE_CATALOG, self.pack_id, **place))
            self._sync_close(file)
        return CatalogEntry(name, size, writer.meta_crc32)

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

    def _manifest_bytes(self, catalog: CatalogEntry) -> bytes:
        return build_manifest(
            created_by=CREATED_BY,
            pack_id=self.pack_id,
            num_records=self.num_records,
            fields=self._fields,
            catalog=catalog,
            shards=self._shards,
        )

    def _write_manifest(self, catalog: CatalogEntry) -> None:
        write_synced(self._member_path(fmt.MANIFEST_NAME), self._manifest_bytes(catalog))

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
