"""Appending to a shard folder in place: new shards and a new catalog, then a new manifest.

``GrowWriter`` is a ``PackWriter`` whose output is an existing shard folder (manifest
version 2). Shards already there are never opened for writing: new records go into new
shards numbered after them (same pack id, a new per-write token in every new name), the new
catalog holds the columns of every record, and the manifest, the commit point, is replaced
last (temporary file, fsync, rename, fsync of the folder). Until then a reader sees the pack
as it was; a reader that opened it before keeps working after, since the previous catalog is
kept (``previous_catalog``) and every shard it knows is still there. The generation before
that is removed after the commit, and files of interrupted writes (member names no manifest
lists) when the next writer starts. One writer at a time: an exclusive ``flock`` on the folder.
This module never imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..errors import WriteError
from . import spec as fmt
from .fileio import clean_stale, fsync_dir, read_regular_file, remove, temp_sibling, write_synced
from .manifest import CatalogEntry, Manifest, read_manifest
from .shardwriter import PackWriter

log = logging.getLogger(__name__)

__all__ = ["GrowWriter", "strays"]


def strays(folder: Path, manifest: Manifest, keep: Sequence[str] = ()) -> list[Path]:
    """Files in ``folder`` named as pack members that neither ``manifest`` nor ``keep`` names:
    left by a write that was interrupted, or catalogs of older generations."""
    wanted = {fmt.MANIFEST_NAME, *manifest.files(), *keep}
    with os.scandir(folder) as entries:
        return [
            Path(entry.path)
            for entry in entries
            if fmt.is_member_name(entry.name)
            and entry.name not in wanted
            and entry.is_file(follow_symlinks=False)
        ]


class GrowWriter(PackWriter):
    """Adds records to the shard folder ``output`` whose manifest is ``manifest`` and whose
    catalog holds ``rows`` (every existing record's columns). Records are numbered after the
    existing ones; ``close(metadata)`` writes the new catalog with ``metadata`` and commits.
    ``keep`` names a catalog of the previous generation to leave in place;
    ``manifest_sha256``, the manifest the caller read ``manifest`` from: when the one on disk
    differs once the folder is locked, another writer got there first (``WriteError``)."""

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
            raise WriteError(
                errno.EINVAL,
                f"{output} is a shard folder of manifest version {manifest.version}: it cannot "
                "grow in place; pack it again with this version first",
            )
        if max_records_per_shard is None and max_shard_bytes is None:
            max_records_per_shard = max(entry.num_records for entry in manifest.shards)
        self._manifest_before = manifest
        self._manifest_sha256 = manifest_sha256
        self._keep = list(keep)
        self._lock: int | None = None
        self._written: list[Path] = []
        self._scratch_dirs: list[Path] = []
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
            raise WriteError(
                errno.EBUSY,
                f"{self.output} is being written by another process; wait for it to finish",
            ) from None
        self._lock = fd
        if self._manifest_sha256 is not None:  # another writer may have committed meanwhile
            data = read_regular_file(
                self.output / fmt.MANIFEST_NAME, fmt.MAX_MANIFEST_BYTES, "the manifest"
            )
            if hashlib.sha256(data).hexdigest() != self._manifest_sha256:
                self._unlock()
                raise WriteError(
                    errno.EBUSY,
                    f"{self.output} changed since it was opened for this append (another "
                    "process wrote it); nothing was written: append again",
                )
        clean_stale(self.output)  # scratch folders of killed writers, beside the folder
        clean_stale(self.output / fmt.MANIFEST_NAME)  # manifest temporaries inside it
        for path in strays(self.output, self._manifest_before, self._keep):
            remove(path)

    def _member_path(self, name: str) -> Path:
        path = self.output / name
        if os.path.lexists(path):  # a token collision: never write over a file a reader holds
            raise WriteError(errno.EEXIST, f"{path} exists; try again")
        if name != fmt.MANIFEST_NAME:
            self._written.append(path)
        return path

    def scratch(self) -> Path:
        path = temp_sibling(self.output)
        os.mkdir(path)
        self._scratch_dirs.append(path)
        return path

    def _write_manifest(self, catalog: CatalogEntry) -> None:
        data = self._manifest_bytes(catalog)
        final = self.output / fmt.MANIFEST_NAME
        temp = temp_sibling(final)
        try:
            write_synced(temp, data, "xb")
            fsync_dir(self.output)  # the new shards and catalog are durable before the commit
            os.replace(temp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                temp.unlink()
            raise
        self._committed = True
        fsync_dir(self.output)

    def _commit(self) -> None:
        """Clean up after the manifest's rename, which made the append take effect: what
        cannot be removed now (scratch folders, the generation before the last) is logged,
        not raised, so an append that took effect is never reported as failed; the next
        writer removes such leftovers."""
        keep = [self._manifest_before.catalog.file] if self._manifest_before.catalog else []
        try:
            self._remove_scratch()
            manifest = read_manifest(self.output / fmt.MANIFEST_NAME)
            for path in strays(self.output, manifest, keep):  # the generation before the last
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
        if self._committed:
            self._unlock()
            return
        for path in self._written:
            with contextlib.suppress(OSError):
                remove(path)
        self._remove_scratch()
        self._unlock()

    # -- helpers -------------------------------------------------------------------------------
    def _remove_scratch(self) -> None:
        while self._scratch_dirs:
            remove(self._scratch_dirs.pop())

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None
