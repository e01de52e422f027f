"""Records -> a pack: one container file, or a folder of shards plus a manifest.

Output is atomic (``fileio.AtomicOutput``): on any failure or interruption the destination
keeps whatever it held before (nothing, or the previous complete pack). Only a pack this
package wrote is ever replaced (``replace_refusal``). This module never imports torch.
"""

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

__all__ = ["PackWriter", "replace_refusal", "member_refusal", "check_output_name"]


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
    one breaks its pack; ``manifest.member_of``), or a folder whose manifest parses and checks
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
    folder (``manifest.member_of``: replacing it alone breaks that pack), else ``None``."""
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
    (``spec.binding``). Use as a context manager: leaving the block
    with an exception removes all temporary output. ``before_finish`` is called before each
    file is finished: a caller that ``reserve``s records copies their bytes in by then.
    ``pack_id`` and ``token`` are random unless given (a writer that grows a pack keeps its
    id; tests pin both to compare bytes). ``locked``: the caller holds the appenders'
    ``flock`` on the ``output`` it replaces (an append rewriting a single file), which the
    commit would otherwise wait for (``fileio.AtomicOutput``).
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
        check_options(fields, alignment, columns)
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
        except WriteError:
            raise  # says what is wrong already
        except OSError as exc:
            raise WriteError(
                exc.errno, f"cannot create {exc.filename or self.output}: {exc.strerror}"
            ) from exc

    # -- where files go (``append.GrowWriter`` writes into an existing folder instead) -----------
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
        entry = ShardEntry(path.name, first, writer.num_records, size, writer.meta_crc32)
        self._shards.append(entry)
        self._writer = None
        self._file = None

    def _write_catalog(self, user: Mapping[str, Any]) -> CatalogEntry:
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
