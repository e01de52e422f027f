"""A pack at a URL, read through the local cache: what a reader holds instead of a local path.

:func:`resolve` opens a pack location: for a shard folder it reads ``manifest.json`` fresh from
the server (it is small, and it is what changes when the pack is re-packed), names the pack by
the sha256 of those bytes and stores them in the cache, where the reader parses them; for a
single ``.tser`` object it downloads the whole file. The :class:`RemotePack` it returns gives
shards on demand (:meth:`~RemotePack.fetch_shard`) or ahead of time
(:meth:`~RemotePack.prefetch`, background threads, so downloading overlaps reading).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..container.spec import FILE_SUFFIX, MANIFEST_NAME
from ..errors import (
    ChecksumError,
    CorruptFileError,
    FileChangedError,
    RemoteError,
    RemoteNotFoundError,
)
from .cache import Cache, PackCache
from .store import PerProcess, RemoteStore, RetryPolicy, redact_url

__all__ = ["RemotePack", "ShardRequest", "file_identity", "file_tail", "resolve"]

log = logging.getLogger(__name__)
_TAIL = 64  # a container's footer: its identity, as a manifest is a shard folder's


@dataclass(frozen=True)
class ShardRequest:
    """A shard to download: its name in the pack, its size and checksum test from the manifest."""

    name: str
    size: int | None = None
    verify: Callable[[Path], bool] | None = None


def resolve(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit_bytes: int | None = None,
    *,
    retry: RetryPolicy | None = None,
    prefetch_threads: int = 2,
    verify_file: Callable[[Path], bool] | None = None,
) -> RemotePack:
    """Open the pack at ``url`` through the cache: a shard folder, or one ``.tser`` object.

    A URL ending in ``.tser`` is a single-file pack, downloaded whole now (``verify_file``, if
    given, must pass on the download before it enters the cache); any other URL is a shard
    folder whose ``manifest.json`` is read now and whose shards are downloaded when asked.
    """
    store = RemoteStore(url, storage_options, retry=retry)
    cache = Cache(cache_dir, cache_limit_bytes)
    if store.url.endswith(FILE_SUFFIX):
        return _resolve_file(store, cache, prefetch_threads, verify_file)
    try:
        manifest = store.read_bytes(MANIFEST_NAME)
    except RemoteNotFoundError as exc:
        raise RemoteNotFoundError(
            f"{exc}. A shard folder's URL must contain {MANIFEST_NAME}; a single-file "
            f"pack's URL ends with {FILE_SUFFIX}"
        ) from exc.__cause__
    pack_cache = cache.pack(store.url, hashlib.sha256(manifest).hexdigest())
    manifest_path = pack_cache.put(MANIFEST_NAME, manifest)
    _remove_other_versions(pack_cache)
    return RemotePack(store, pack_cache, pack_cache.directory, manifest_path, prefetch_threads)


def _remove_other_versions(pack_cache: PackCache) -> None:
    """Free the cache of the versions the URL held before this one (unless in use). Best
    effort: opening never fails for it."""
    try:
        done = pack_cache.remove_other_versions()
    except OSError as exc:
        log.info("%s: older versions left in the cache (%s)", pack_cache.directory, exc)
        return
    if done.packs_removed:
        log.info(
            "%s: removed %d older version(s) from the cache (%d bytes)",
            *(redact_url(pack_cache.url), done.packs_removed, done.bytes_freed),
        )


def _resolve_file(
    store: RemoteStore,
    cache: Cache,
    prefetch_threads: int,
    verify_file: Callable[[Path], bool] | None,
) -> RemotePack:
    """``resolve`` of a single-file pack: download it whole. A download that fails because
    the object was replaced meanwhile (its size or footer changed: a re-pack racing the open)
    opens the new object instead, once."""
    opened = file_tail(store)
    name = store.url.rsplit("/", 1)[-1]
    for round_ in (1, 2):
        size, tail = opened
        pack_cache = cache.pack(store.url, file_identity(size, tail))

        def check(path: Path, tail: bytes = tail) -> bool:
            if _tail_of(path)[1] != tail:  # the object was replaced while we downloaded
                return False
            return verify_file is None or verify_file(path)

        def download(dest: Path, size: int = size, check: Callable[[Path], bool] = check) -> Path:
            return store.download("", dest, expected_size=size, verify=check)

        try:
            path = pack_cache.fetch(name, size, download)
        except (CorruptFileError, RemoteError) as exc:
            now = file_tail(store)
            if now == opened and isinstance(exc, ChecksumError):  # no manifest to blame
                raise ChecksumError(
                    f"{store.url_of()}: the downloaded file failed its checks twice (its size, "
                    "footer or checksums): the file on the server is damaged. Upload it again, "
                    "or pack it again"
                ) from exc
            if now == opened:
                raise
            if round_ == 2:
                raise FileChangedError(
                    f"{store.url_of()}: the file was replaced on the server twice while it was "
                    "being opened (is it being uploaded now?): open it again once the upload is "
                    "done"
                ) from exc
            log.warning("%s: replaced on the server while opened; opening the new file", name)
            opened = now
            continue
        _remove_other_versions(pack_cache)
        return RemotePack(store, pack_cache, path, None, prefetch_threads)
    raise AssertionError("unreachable")  # pragma: no cover


def file_tail(store: RemoteStore) -> tuple[int, bytes]:
    """The size of the single-file pack at ``store`` and its footer's bytes (two requests)."""
    size = store.size()
    return size, store.read_bytes("", max(0, size - _TAIL), size) if size else b""


def _tail_of(path: str | os.PathLike[str]) -> tuple[int, bytes]:
    """``file_tail`` of a local file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - _TAIL))
        return size, f.read()


def file_identity(size: int, tail: bytes) -> str:
    """A single-file pack's identity (its cache key and what an append checks has not
    changed): the sha256 of its size and footer, which holds the pack id and checksums."""
    return hashlib.sha256(f"{size}\n".encode() + tail).hexdigest()


def local_file_identity(path: str | os.PathLike[str]) -> str:
    """``file_identity`` of a local file: what the object holds once ``path`` is uploaded."""
    return file_identity(*_tail_of(path))


class RemotePack(PerProcess):
    """A remote pack and its cache. Build it with :func:`resolve`.

    ``path`` is what a reader opens: the cache folder holding ``manifest.json`` (shards appear in
    it as they are fetched) or the cached ``.tser`` file. ``manifest_path`` is None for a
    single file. Objects this process fetched stay held (never evicted) until released.
    Pickles without its threads and locks: each process fetches for itself.
    """

    def __init__(
        self,
        store: RemoteStore,
        cache: PackCache,
        path: Path,
        manifest_path: Path | None,
        prefetch_threads: int = 2,
    ) -> None:
        if prefetch_threads < 1:
            raise ValueError(f"prefetch_threads must be >= 1, got {prefetch_threads}")
        self.store = store
        self.cache = cache
        self.path = path
        self.manifest_path = manifest_path
        self.prefetch_threads = prefetch_threads
        self._start()

    _PER_PROCESS = ("_pid", "_mutex", "_pool", "_pending")

    def _reset(self) -> None:  # also in a forked child: the parent's threads do not exist there
        self._pid = os.getpid()
        self._mutex = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future[Path]] = {}

    def __repr__(self) -> str:
        return f"RemotePack({self.store.url_of()!r}, cache={str(self.cache.directory)!r})"

    def __enter__(self) -> RemotePack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def identity(self) -> str:
        """sha256 of the manifest (a shard folder) or of the size and footer (a single file)."""
        return self.cache.identity

    def fetch_shard(
        self,
        name: str,
        expected_size: int | None = None,
        verify: Callable[[Path], bool] | None = None,
    ) -> Path:
        """The local path of shard ``name``, downloaded now unless cached or prefetched.

        ``verify(path)`` (the manifest's checksum) runs on each download. A prefetch of
        ``name`` that failed is tried once more now (an outage may be over by then).
        """
        self._check_fork()
        with self._mutex:
            future = self._pending.pop(name, None)
        if future is not None:
            try:
                return future.result()
            except Exception as exc:
                log.info("%s: prefetch failed (%s); fetching it again", name, exc)
        return self._fetch(ShardRequest(name, expected_size, verify))

    def _fetch(self, shard: ShardRequest) -> Path:
        name, size = shard.name, shard.size
        return self.cache.fetch(
            name,
            size,
            lambda dest: self.store.download(name, dest, expected_size=size, verify=shard.verify),
            None if size is None else lambda: self._confirm_size(name, size),
        )

    def _confirm_size(self, name: str, expected: int) -> bool:
        """Whether the server says shard ``name`` has the ``expected`` bytes its manifest
        claims (False: it does not tell); raises at once if it has another size. One HEAD,
        so that a wrong manifest neither evicts other files for bytes that never come nor
        has a download retried as if the missing bytes were an outage."""
        size = self.store.reported_size(name)
        if size is not None and size != expected:
            raise RemoteError(
                f"{self.store.url_of(name)}: the object has {size} bytes, expected {expected}. "
                "The manifest and the object disagree: re-upload the pack (nothing was "
                "downloaded)"
            )
        return size is not None

    def prefetch(self, shards: Iterable[ShardRequest | str]) -> None:
        """Start downloading ``shards`` in background threads; returns at once."""
        self._check_fork()
        with self._mutex:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.prefetch_threads, "torch_serialized-fetch")
            for shard in shards:
                request = ShardRequest(shard) if isinstance(shard, str) else shard
                if request.name not in self._pending:
                    self._pending[request.name] = self._pool.submit(self._fetch, request)

    def release(self, name: str) -> None:
        """Done with shard ``name`` for now: the cache may evict it when space is needed."""
        self._check_fork()
        self.cache.release(name)

    def close(self, keep: Iterable[str] = ()) -> None:
        """Cancel pending prefetches, wait for running ones, release every held object (but
        those named in ``keep``)."""
        self._check_fork()
        with self._mutex:
            pool, self._pool = self._pool, None
            self._pending.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        kept = set(keep)
        for name in self.cache.held():
            if name not in kept:
                self.cache.release(name)
