"""``append_voc`` on a pack at a URL: stage it locally, append there, upload what is new.

The pack at the URL is opened through the cache and staged in a private folder of the cache
folder: its manifest, catalog and the shards the append compares by content (hard links to
the cached copies where possible), or a copy of a single ``.tser`` file. The local
``append_voc`` grows the staged pack with its own rules, so the URL ends up holding what a
local append, or a full re-pack, would give. Then a shard folder uploads only the files the
new manifest names and the old one did not (older files stay for readers of the previous
manifest; ``prune_remote`` removes them); a single file is uploaded whole over the old one.

Before the manifest (or the single file) is replaced, the URL must still hold the pack the
append started from (the manifest's sha256; a single file's size and footer), else another
writer got there first and this append stops. Without conditional writes this is a check,
not a lock. The grown pack's files are put in the cache, so reading the URL afterwards
downloads nothing this machine has. This module never imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..container import spec as fmt
from ..container.fileio import clean_stale, temp_sibling
from ..container.manifest import Manifest, read_manifest
from ..container.shards import PackReader
from ..errors import WriteError
from ..remote.cache import Cache
from ..remote.packs import file_identity, file_tail, local_file_identity
from ..remote.store import RemoteStore, is_url, redact_url
from ..remote.upload import check_writable
from .packed import VOCPackReader
from .records import REPORT_SUFFIX, PackResult, size_on_disk

__all__ = ["append_to_url"]

_UPLOAD_THREADS = 4
#: The name staging folders in the cache folder are temporaries of (``atomic.temp_sibling``).
_STAGING = "append-staging"


def append_to_url(
    url: str,
    append: Callable[[Path], PackResult],
    compare: Callable[[VOCPackReader], object],
    *,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit_bytes: int | None = None,
) -> PackResult:
    """Grow the pack at ``url`` with ``append(local_pack)`` (the local ``append_voc``, bound to
    its source and options) and upload the result; return its ``PackResult`` with ``url`` set
    and ``num_bytes`` the size of the pack at the URL (``path`` and ``report`` are the staged
    copies, removed by then). ``compare(reader)`` sorts
    the source against the pack at the URL as ``append`` will (the quick check): the shards it
    reads to compare contents are the only ones downloaded and staged."""
    if not is_url(url):
        raise ValueError(f"{url!r} is not a URL")
    url = _pack_url(url)
    check_writable(url, "append")
    store = RemoteStore(url, storage_options)
    cache = Cache(cache_dir, cache_limit_bytes)
    with _staging(cache.directory) as folder:
        voc = VOCPackReader(
            url,
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )
        reader = voc.reader
        try:
            local = folder / (store.url.rsplit("/", 1)[-1] or "pack")
            if reader.manifest is None:
                started_from = reader.remote.identity if reader.remote is not None else ""
                shutil.copyfile(reader.path, local)  # a copy: the cache's file stays as it is
            else:
                started_from = reader.manifest_sha256 or ""
                compare(voc)  # downloads the shards whose records are compared by content
                _stage_folder(reader, local)
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
            _upload_growth(store, reader.manifest, local, started_from)
        else:
            _check_unchanged(store, started_from, single=True)
            store.upload_file(local)
        if result.report is not None:
            RemoteStore(store.url + REPORT_SUFFIX, storage_options).upload_file(result.report)
        _seed_cache(cache, store, local)
    return result


def _pack_url(url: str) -> str:
    """``url`` as the readers take it: a manifest's URL names its folder."""
    url = url.rstrip("/")
    suffix = "/" + fmt.MANIFEST_NAME
    return url[: -len(suffix)] if url.endswith(suffix) else url


@contextlib.contextmanager
def _staging(cache_dir: Path) -> Iterator[Path]:
    """A private folder inside the cache folder (same file system: hard links work), removed
    afterwards; its leading dot keeps it out of ``cache list`` and ``cache clear``. Folders of
    appends that were killed (their process is gone) are removed first."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    clean_stale(cache_dir / _STAGING)
    folder = temp_sibling(cache_dir / _STAGING)
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _stage_folder(reader: PackReader, local: Path) -> None:
    """The shard folder ``reader`` opened at a URL, as a local folder: its manifest's bytes,
    its catalog, and the shards already in the cache (each checked when it entered it). The
    others are not needed: an append reads old shards only to compare contents (``compare``
    fetched those), and never writes to them."""
    assert reader.manifest is not None and reader.manifest_path is not None
    local.mkdir()
    (local / fmt.MANIFEST_NAME).write_bytes(Path(reader.manifest_path).read_bytes())
    cached = Path(reader.path)
    if reader.manifest.catalog is not None:
        _link_or_copy(cached / reader.manifest.catalog.file, local / reader.manifest.catalog.file)
    for entry in reader.manifest.shards:
        if (cached / entry.file).is_file():
            _link_or_copy(cached / entry.file, local / entry.file)


def _link_or_copy(source: Path, target: Path) -> None:
    """``target`` made, in one step, a hard link to ``source`` or else a copy of it."""
    try:
        os.link(source, target)
    except OSError:
        temp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.partial")
        try:
            shutil.copyfile(source, temp)
            os.replace(temp, target)
        finally:
            temp.unlink(missing_ok=True)


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


def _upload_growth(
    store: RemoteStore, before: Manifest | None, local: Path, started_from: str
) -> None:
    """Upload the files of the grown folder ``local`` that the manifest ``before`` did not
    name, then, if the URL's manifest is still ``started_from`` (checked before the uploads,
    to waste none, and again just before the manifest goes up), the new manifest."""
    assert before is not None
    after = read_manifest(local / fmt.MANIFEST_NAME)
    new = [name for name in after.files() if name not in set(before.files())]
    _check_unchanged(store, started_from, single=False)  # lost already: upload nothing
    with ThreadPoolExecutor(_UPLOAD_THREADS) as pool:
        for future in [pool.submit(store.upload_file, local / n, n) for n in new]:
            future.result()
    _check_unchanged(store, started_from, single=False)
    store.upload_file(local / fmt.MANIFEST_NAME, fmt.MANIFEST_NAME)
    store.fs.invalidate_cache()


def _check_unchanged(store: RemoteStore, started_from: str, *, single: bool) -> None:
    """Refuse to replace the pack at ``store`` if it is no longer the one this append read."""
    if single:
        now = file_identity(*file_tail(store))
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
    """Put the grown pack's files in the cache under its new identity (computed from the local
    bytes, which are what was uploaded), so a reader of the URL on this machine downloads
    none of them again. Best effort: a failure here costs a download later, nothing else."""
    with contextlib.suppress(OSError):
        if local.is_dir():
            data = (local / fmt.MANIFEST_NAME).read_bytes()
            pack = cache.pack(store.url, hashlib.sha256(data).hexdigest())
            pack.put(fmt.MANIFEST_NAME, data)
            files = {n: local / n for n in read_manifest(local / fmt.MANIFEST_NAME).files()}
        else:
            pack = cache.pack(store.url, local_file_identity(local))
            files = {local.name: local}
        try:
            for name, path in files.items():
                if not path.is_file():  # an old shard never downloaded here
                    continue
                size = path.stat().st_size
                pack.fetch(name, size, functools.partial(_link_or_copy, path))
        finally:
            pack.close()
