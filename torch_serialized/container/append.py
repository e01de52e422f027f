"""Appending to a shard folder in place (manifest version 2): new shards, a new catalog, the
manifest (the commit point) last. No shard is rewritten and the previous catalog is kept, so
open readers keep working. One writer at a time (``flock``)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from ..errors import WriteError
from . import spec as fmt
from .fileio import (
    AtomicOutput,
    clean_stale,
    fsync_dir,
    read_regular_file,
    remove,
    write_synced,
)
from .manifest import CatalogEntry, Manifest
from .shardwriter import PackWriter

log = logging.getLogger(__name__)

__all__ = ["GrowWriter", "strays"]


def strays(folder: Path, keep: Iterable[str]) -> list[Path]:
    """Member-named files (shards, catalogs) in ``folder`` that ``keep`` does not name."""
    wanted = set(keep)
    with os.scandir(folder) as entries:
        return [
            Path(entry.path)
            for entry in entries
            if fmt.is_member_name(entry.name)
            and entry.name not in wanted
            and entry.is_file(follow_symlinks=False)
        ]


class GrowWriter(PackWriter):
    """Adds records to the shard folder ``output``; ``close(metadata)`` commits. ``keep``: a
    previous catalog to leave; ``manifest_sha256``: the manifest read, refused if changed since."""

    def __init__(
        self,
        output: str | os.PathLike[str],
        manifest: Manifest,
        rows: np.ndarray,
        fields: Sequence[str],
        *,
        columns: np.dtype | None,
        max_records_per_shard: int | None,
        max_shard_bytes: int | None,
        before_finish: Callable[[], None] | None = None,
        keep: Sequence[str] = (),
        token: str | None = None,
        manifest_sha256: str | None = None,
    ) -> None:
        if manifest.version < 2 or manifest.pack_id is None or manifest.catalog is None:
            msg = f"{output} has manifest version {manifest.version}: it cannot grow in place"
            raise WriteError(errno.EINVAL, f"{msg}; pack it again with this version first")
        if max_records_per_shard is None and max_shard_bytes is None:
            max_records_per_shard = max(entry.num_records for entry in manifest.shards)
        self._old_catalog = manifest.catalog.file
        self._manifest_sha256 = manifest_sha256
        self._keep = [*manifest.files(), *keep]  # what is there before this writer
        self._lock: int | None = None
        self._committed = False
        super().__init__(
            output,
            fields,
            columns=columns,
            max_records_per_shard=max_records_per_shard,
            max_shard_bytes=max_shard_bytes,
            before_finish=before_finish,
            pack_id=manifest.pack_id,
            token=token,
        )
        self._shards = list(manifest.shards)
        self._rows = [np.asarray(rows).copy()]
        self.num_records = manifest.num_records

    # -- PackWriter's hooks ----------------------------------------------------------------------
    def _open_output(self) -> None:
        fd = os.open(self.output, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            msg = f"{self.output} is being written by another process; wait for it to finish"
            raise WriteError(errno.EBUSY, msg) from None
        self._lock = fd
        if self._manifest_sha256 is not None:  # another writer may have committed meanwhile
            manifest = self.output / fmt.MANIFEST_NAME
            data = read_regular_file(manifest, fmt.MAX_MANIFEST_BYTES, "the manifest")
            if hashlib.sha256(data).hexdigest() != self._manifest_sha256:
                self._unlock()
                msg = "changed since it was opened; nothing was written: append again"
                raise WriteError(errno.EBUSY, f"{self.output} {msg}")
        self._out = AtomicOutput(self.output, folder=False, locked=True)  # for scratch folders
        clean_stale(self.output / fmt.MANIFEST_NAME)  # manifest temporaries inside it
        for path in strays(self.output, self._keep):
            remove(path)

    def _member_path(self, name: str) -> Path:
        path = self.output / name
        if os.path.lexists(path):  # a token collision: never write over a file a reader holds
            raise WriteError(errno.EEXIST, f"{path} exists; try again")
        return path

    def _write_manifest(self, catalog: CatalogEntry) -> None:
        out = AtomicOutput(self.output / fmt.MANIFEST_NAME, folder=False, locked=True)
        try:
            write_synced(out.path, self._manifest_bytes(catalog), "xb")
            fsync_dir(self.output)  # the new shards and catalog are durable before the commit
            out.commit()  # the commit point
        except BaseException:
            out.abort()
            raise
        self._committed = True

    def _commit(self) -> None:
        """After the commit: a cleanup failure is logged, not raised; the next writer cleans up."""
        new = [s.file for s in self._shards] + [fmt.catalog_file_name(self._token)]
        try:
            self._out.abort()  # its scratch folders
            for path in strays(self.output, [*new, self._old_catalog]):  # the generation before
                remove(path)
        except OSError as exc:
            log.warning(
                "%s: appended, but files it no longer needs could not be removed (%s); the "
                "next append or pack removes them",
                self.output,
                exc,
            )
        finally:
            self._unlock()

    def _discard(self) -> None:
        if not self._committed:
            with contextlib.suppress(OSError):  # what this writer wrote: strays since its lock
                for path in strays(self.output, self._keep):
                    remove(path)
            self._out.abort()
        self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None
