"""``append_voc`` on a pack at a URL: stage it locally (in the cache folder, files hard-linked),
append there, upload what is new: a shard folder's new files, manifest last (old ones stay until
``prune_remote``), or a whole file. The URL must still hold the pack the append started from (a
check, not a lock). The grown pack is put in the cache."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..container import spec as fmt
from ..container.fileio import clean_stale, temp_sibling
from ..container.manifest import read_manifest
from ..errors import WriteError
from ..remote import upload
from ..remote.cache import Cache
from ..remote.packs import file_identity
from ..remote.store import RemoteStore, redact_url
from .packed import VOCPackReader
from .records import PackResult, size_on_disk

__all__ = ["append_to_url"]


def append_to_url(
    url: str,
    append: Callable[[Path], PackResult],
    compare: Callable[[VOCPackReader], object],
    *,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit_bytes: int | None = None,
) -> PackResult:
    """Grow the pack at ``url`` with ``append(local_pack)`` and upload it; its ``PackResult``,
    ``num_bytes`` the size at the URL. ``compare(reader)`` sorts the source against the pack as
    ``append`` will: the shards it reads are the only ones downloaded."""
    url = url.rstrip("/").removesuffix("/" + fmt.MANIFEST_NAME)  # a manifest names its folder
    upload.check_writable(url, "append")
    store = RemoteStore(url, storage_options)
    cache = Cache(cache_dir, cache_limit_bytes)
    with _staging(cache.directory) as folder:
        voc = VOCPackReader(
            url,
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )
        reader = before = voc.reader
        local = folder / (store.url.rsplit("/", 1)[-1] or "pack")
        try:
            if reader.manifest is None:
                started_from = reader.remote.identity if reader.remote is not None else ""
                shutil.copyfile(reader.path, local)  # a copy: the cache's file stays as it is
            else:
                started_from = reader.manifest_sha256 or ""
                compare(voc)  # downloads the shards whose records are compared by content
                local.mkdir()  # catalog and the shards cached (compare's among them) linked
                cached = Path(reader.path)
                (local / fmt.MANIFEST_NAME).write_bytes((cached / fmt.MANIFEST_NAME).read_bytes())
                for name in reader.manifest.files():
                    if (cached / name).is_file():
                        _link_or_copy(cached / name, local / name)
        finally:
            reader.close()
        with _naming(local, url):
            result = append(local)
        notes = [note.replace(str(local), redact_url(url)) for note in result.notes]
        # the size of the pack at the URL, not of the staged copy (new files and those read)
        result = dataclasses.replace(result, url=url, notes=notes, num_bytes=size_on_disk(local))
        if result.bytes_written == 0:  # up to date: nothing was written, nothing goes up
            return result
        if local.is_dir():
            assert before.manifest is not None
            old = set(before.manifest.files())
            new = [n for n in read_manifest(local / fmt.MANIFEST_NAME).files() if n not in old]
            upload.upload_folder(store, local, new, lambda: _check_unchanged(store, started_from))
        else:
            _check_unchanged(store, started_from)
            upload.upload_file(store, local)
        if result.report is not None:
            report = RemoteStore(store.url + upload.REPORT_SUFFIX, storage_options)
            upload.upload_file(report, result.report)
        _seed_cache(cache, store, local)
    return result


@contextlib.contextmanager
def _staging(cache_dir: Path) -> Iterator[Path]:
    """A private dot-folder in the cache (hard links work); removed after, killed appends' first."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    clean_stale(cache_dir / "append-staging")
    folder = temp_sibling(cache_dir / "append-staging")
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _link_or_copy(source: Path, target: Path) -> None:
    """Make ``target`` a hard link to ``source``, else a copy. Both targets are private until
    renamed in (the staging folder, the cache's staging file), so a partial copy is never read."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


@contextlib.contextmanager
def _naming(local: Path, url: str) -> Iterator[None]:
    """Errors of the local append name the URL, not the staged copy."""
    try:
        yield
    except Exception as exc:
        here, there = str(local), redact_url(url)
        if isinstance(exc, OSError):
            if isinstance(exc.strerror, str):
                exc.strerror = exc.strerror.replace(here, there)
            if isinstance(exc.filename, str):
                exc.filename = exc.filename.replace(here, there)
        exc.args = tuple(a.replace(here, there) if isinstance(a, str) else a for a in exc.args)
        raise


def _check_unchanged(store: RemoteStore, started_from: str) -> None:
    """Refuse to replace the pack at ``store`` if it is no longer the one this append read."""
    if store.url.endswith(fmt.FILE_SUFFIX):
        now = file_identity(store)[1]
    else:
        now = hashlib.sha256(store.read_bytes(fmt.MANIFEST_NAME)).hexdigest()
    if now != started_from:
        raise WriteError(
            errno.EBUSY,
            f"{store.url_of()} changed since this append read it (another append or pack "
            "wrote it); the pack there was left as the other writer made it. Append again; "
            "files this append uploaded are named by no manifest (`torch-serialized prune` "
            "removes them)",
        )


def _seed_cache(cache: Cache, store: RemoteStore, local: Path) -> None:
    """Cache the grown pack's files under its new identity, so readers here need no download."""
    with contextlib.suppress(OSError):
        if local.is_dir():
            data = (local / fmt.MANIFEST_NAME).read_bytes()
            pack = cache.pack(store.url, hashlib.sha256(data).hexdigest())
            pack.put(fmt.MANIFEST_NAME, data)
            files = {n: local / n for n in read_manifest(local / fmt.MANIFEST_NAME).files()}
        else:
            pack = cache.pack(store.url, file_identity(store)[1])  # as uploaded
            files = {local.name: local}
        try:
            for name, path in files.items():
                if path.is_file():  # not an old shard never downloaded here
                    pack.fetch(name, path.stat().st_size, functools.partial(_link_or_copy, path))
        finally:
            pack.close()
