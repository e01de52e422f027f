"""A pack at a URL, read through the local cache: what a reader holds instead of a local path.
A shard folder's ``manifest.json`` is read fresh (a re-pack changes it) and its sha256 names the
pack; a ``.tser`` object is downloaded whole. Shards come on demand or prefetched by threads."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ..container.locate import intact
from ..container.manifest import Expected
from ..container.reader import ContainerReader
from ..container.spec import FILE_SUFFIX, HEADER_SIZE, MANIFEST_NAME
from ..errors import (
    ChecksumError,
    CorruptFileError,
    FileChangedError,
    FormatError,
    RemoteError,
    RemoteNotFoundError,
)
from .arrival import Arrival, ArrivingShard
from .cache import Cache, PackCache, touch
from .locks import LOCKS, PARTIAL, STAGING
from .store import RemoteStore, RetryPolicy

__all__ = ["RemotePack", "ShardRequest", "file_identity", "resolve"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardRequest:
    """A shard to download: its name in the pack, its size and checksum test from the manifest,
    and how many bytes at its end hold its index and metadata at most (0: unknown)."""

    name: str
    size: int | None = None
    verify: Callable[[Path], bool] | None = None
    tail: int = 0
    expect: Expected | None = None  # its manifest entry: read early, checked as it arrives


def resolve(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit_bytes: int | None = None,
    *,
    retry: RetryPolicy | None = None,
    verify_file: Callable[[Path], bool] | None = None,
) -> RemotePack:
    """Open the pack at ``url`` through the cache: a ``.tser`` object, downloaded and checked by
    ``verify_file`` now, or a shard folder whose shards are downloaded when asked."""
    store = RemoteStore(url, storage_options, retry=retry)
    cache = Cache(cache_dir, cache_limit_bytes)
    if store.url.endswith(FILE_SUFFIX):
        return _resolve_file(store, cache, verify_file)
    try:
        manifest = store.read_bytes(MANIFEST_NAME)
    except RemoteNotFoundError as exc:
        raise RemoteNotFoundError(
            f"{exc}. A shard folder's URL must contain {MANIFEST_NAME}; a single-file "
            f"pack's URL ends with {FILE_SUFFIX}"
        ) from exc.__cause__
    pack = RemotePack(store, cache, hashlib.sha256(manifest).hexdigest())
    pack.manifest, pack.manifest_path = manifest, pack.put(MANIFEST_NAME, manifest)
    pack.remove_other_versions()
    return pack


def _resolve_file(
    store: RemoteStore, cache: Cache, verify_file: Callable[[Path], bool] | None
) -> RemotePack:
    """``resolve`` of a single-file pack; if replaced during the download, the new one, once."""
    opened = file_identity(store)
    for round_ in (1, 2):
        size, identity = opened
        pack = RemotePack(store, cache, identity)
        try:
            pack.path = pack._fetch(
                ShardRequest(store.url.rsplit("/", 1)[-1], size, verify_file), ""
            )
        except (CorruptFileError, RemoteError) as exc:
            now = file_identity(store)
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
                    "being opened (is it being uploaded now?): open it again once it is done"
                ) from exc
            log.warning("%s: replaced on the server while opened; opening the new file", store)
            opened = now
            continue
        pack.remove_other_versions()
        return pack
    raise AssertionError("unreachable")  # pragma: no cover


class Elsewhere(Exception):
    """A prefetch found another process downloading its object: left to that download."""


def _leave() -> None:
    raise Elsewhere


def _elsewhere(future: Future[Path]) -> bool:
    return future.done() and not future.cancelled() and isinstance(future.exception(), Elsewhere)


def _before_boot(path: Path) -> bool:
    """Whether ``path`` is missing or older than this boot (Linux; elsewhere never)."""
    try:
        with open("/proc/stat", "rb") as f:
            boot = next((float(line.split()[1]) for line in f if line.startswith(b"btime ")), 0.0)
    except OSError:
        boot = 0.0
    try:
        return os.lstat(path).st_mtime < boot
    except OSError:
        return True


def file_identity(store: RemoteStore) -> tuple[int, str]:
    """The size of the single-file pack at ``store`` and its identity (cache key; append's
    check): a hash of what the server says of it (size, ETag, modification time...)."""
    info = store.info()
    return int(info["size"]), hashlib.sha256(
        json.dumps(info, sort_keys=True, default=str).encode()
    ).hexdigest()


class RemotePack(PackCache):
    """A pack at a URL and its cache folder, made by :func:`resolve`. ``path`` is what a reader
    opens: the cache folder with ``manifest.json`` (shards appear as fetched) or the cached
    ``.tser`` file (then ``manifest_path`` and ``manifest`` are None). ``identity``: see
    :func:`file_identity`, or the manifest's sha256. Pickles without threads and locks."""

    def __init__(self, store: RemoteStore, cache: Cache, identity: str) -> None:
        self.store = store
        self.prefetch_threads = 2  # prefetches at once, unless a reader waits for them (now)
        self.manifest: bytes | None = None
        self.manifest_path: Path | None = None
        super().__init__(cache, store.url, identity)
        self.path = self.directory

    _PER_PROCESS = (
        *PackCache._PER_PROCESS,
        *("_pool", "_rush", "_pending", "_arrivals", "_requests", "_early", "_asked", "_left"),
    )

    def _reset(self) -> None:  # also in a forked child: the parent's threads do not exist there
        super()._reset()
        self._pool: ThreadPoolExecutor | None = None
        self._rush: ThreadPoolExecutor | None = None  # prefetches a reader waits for
        self._pending: dict[str, Future[Path]] = {}
        self._arrivals: dict[str, Arrival] = {}
        self._requests: dict[str, ShardRequest] = {}
        self._early: dict[str, Future[Path]] = {}  # downloads in flight a reader reads early
        self._asked: Counter[str] = Counter()  # requests per object: a release is for the last
        self._left: dict[str, int] = {}  # downloads released while running: requests by then

    def __repr__(self) -> str:
        return f"RemotePack({self.store.url_of()!r}, cache={str(self.directory)!r})"

    def __enter__(self) -> RemotePack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fetch_shard(
        self,
        name: str,
        expected_size: int | None = None,
        verify: Callable[[Path], bool] | None = None,
        future: Future[Path] | None = None,
    ) -> Path:
        """Shard ``name``'s local path: cached, prefetched (``future``: its prefetch, taken by
        ``early``) or downloaded now (a failed one too)."""
        self._check_fork()
        with self._mutex:
            self._asked[name] += 1
            self._early.pop(name, None)  # its reader holds it from here, as any fetch's
            if future is None:
                future = self._forget(name)
        if future is not None and not future.cancel():  # not started: fetched first, now
            try:
                return future.result()
            except Elsewhere:
                pass
            except Exception as exc:
                log.info("%s: prefetch failed (%s); fetching it again", name, exc)
        return self._fetch(ShardRequest(name, expected_size, verify))

    def early(self, name: str, expect: Expected, checked: bool) -> ContainerReader | None:
        """Shard ``name`` read from its prefetch in flight, once its head and tail are in
        (:class:`ArrivingShard`); None when there is none, it is done, or it cannot be."""
        self._check_fork()
        with self._mutex:
            arrival = self._arrivals.get(name)
            self._hurry(name)
        if arrival is None or not arrival.wait(HEADER_SIZE) or arrival.ok:
            return None
        with self._mutex:
            future = self._forget(name)
            if future is not None:
                self._early[name] = future
        if future is None:
            return None

        def whole() -> ContainerReader:
            path = self.fetch_shard(name, expect.bytes, intact(expect), future)
            return ContainerReader(path, checked=checked, expect=expect)

        try:
            return ArrivingShard(arrival, expect, checked, whole)
        except (FormatError, FileNotFoundError):  # its tail is not the manifest's, or the
            pass  # download just ended: the whole file decides
        return whole()  # not in the handler: its errors would carry this one as their cause

    def _fetch(
        self,
        shard: ShardRequest,
        key: str | None = None,
        arrival: Arrival | None = None,
        busy: Callable[[], object] | None = None,
    ) -> Path:
        """``fetch`` of ``shard`` (at ``key``, default its name). Its ``arrival`` follows another
        process's download of it (unless ``busy``, called instead), or publishes this one's
        (see :class:`Arrival`). Downloads are not fsynced, so a copy older than the last boot
        is verified (a crash may leave holes), refetched if bad."""
        whole = self.directory / LOCKS / f"{shard.name}.lock"  # mtime: when last known whole
        progress = self.directory / STAGING / f".{shard.name}.progress{PARTIAL}"

        def download(dest: Path) -> Path:
            name = shard.name if key is None else key
            # a following arrival's readers map the other process's file: this one is not theirs
            ours = None if arrival is None or arrival.following else arrival
            if ours is not None:
                ours.share(progress)
            try:
                path = self.store.download(
                    name, dest, expected_size=shard.size, verify=shard.verify, arrival=ours
                )
            finally:
                if ours is not None:
                    ours.share(None)
            touch(whole)
            return path

        if busy is None and arrival is not None:
            busy = partial(arrival.follow, progress)
        wanted = partial(self._wanted, shard.name)
        path = self.fetch(shard.name, shard.size, download, wanted, busy)
        if shard.verify is None or not _before_boot(whole):
            return path
        if shard.verify(path):
            touch(whole)
            return path
        log.warning("%s: the cached copy is damaged (by a crash?); downloading it again", path)
        self.release(shard.name)
        path.unlink(missing_ok=True)
        return self.fetch(shard.name, shard.size, download)

    def prefetch(self, shards: Iterable[ShardRequest | str], *, now: bool = False) -> None:
        """Start downloading ``shards`` in background threads; returns at once. At most
        ``prefetch_threads`` run at a time, in order, unless ``now``: awaited, they start now
        (those queued too), as each shard a reader waits for does (a first batch needing three
        shards: 0.95 -> 0.68 s, netlink wan)."""
        self._check_fork()
        with self._mutex:
            for shard in shards:
                request = ShardRequest(shard) if isinstance(shard, str) else shard
                name = request.name
                self._asked[name] += 1
                if name in self._pending:
                    if now:
                        self._hurry(name)
                    continue
                arrival = self._arrivals[name] = Arrival(request.tail, request.expect)
                self._requests[name] = request
                self._pending[name] = self._submit(request, arrival, now)

    def _hurry(self, name: str) -> None:
        """Start ``name``'s prefetch now if it waits for a thread, or left it to another
        process's download: it follows that one then (``_mutex`` held)."""
        future = self._pending.get(name)
        if future is not None and (future.cancel() or _elsewhere(future)):
            arrival = self._arrivals[name]
            arrival.update(ended=False)
            self._pending[name] = self._submit(self._requests[name], arrival, True)

    def _submit(self, request: ShardRequest, arrival: Arrival, now: bool) -> Future[Path]:
        """Run ``_fetch`` in a thread: at once if ``now``, else among the ``prefetch_threads``,
        whose thread is not held waiting for another process's download of it (it ends with
        ``Elsewhere``; a reader asking for it then follows that download)."""
        if self._pool is None or self._rush is None:
            self._pool = ThreadPoolExecutor(self.prefetch_threads, "torch_serialized-fetch")
            self._rush = ThreadPoolExecutor(8, "torch_serialized-now")
        if now:
            future = self._rush.submit(self._fetch, request, None, arrival)
        else:
            future = self._pool.submit(self._fetch, request, None, arrival, _leave)
        future.add_done_callback(arrival.end)
        return future

    def release(self, name: str) -> None:
        """Stop holding object ``name``. Its prefetch is cancelled if queued; a download still
        running (one read early too) is released when it ends, unless asked for again by then
        (and dropped if a bounded cache has no room for it): a stream moving on from a shard in
        flight held it until ``close`` (a bounded cache grew past its limit)."""
        with self._mutex:
            running, asked = self._early.pop(name, None), self._asked[name]
            queued = self._pending.get(name) if running is None else None
            if queued is not None and queued.cancel():
                self._forget(name)
            elif queued is not None:
                running = queued
            if running is not None:
                self._left[name] = asked
        if running is not None:
            running.add_done_callback(lambda done: self._release_if(name, done))
        super().release(name)

    def _wanted(self, name: str) -> bool:
        """Whether a download of ``name`` has a reader: not released, or asked for since."""
        with self._mutex:
            return self._left.get(name) != self._asked[name]

    def _release_if(self, name: str, done: Future[Path]) -> None:
        """A download released while it ran has ended: release it too, unless asked for since
        its last release (whoever asked holds it now)."""
        with self._mutex:
            if self._left.pop(name, None) != self._asked[name]:
                return
            if self._pending.get(name) is done:
                self._forget(name)
            fd = self._held.pop(name, None)
        if fd is not None:
            os.close(fd)

    def _forget(self, name: str) -> Future[Path] | None:
        """Drop ``name``'s prefetch, returned (``_mutex`` held)."""
        self._arrivals.pop(name, None)
        self._requests.pop(name, None)
        return self._pending.pop(name, None)

    def close(self, keep: Iterable[str] = ()) -> None:
        """Cancel pending prefetches, wait for running ones, release held objects but ``keep``."""
        self._check_fork()
        with self._mutex:
            pools, self._pool, self._rush = (self._pool, self._rush), None, None
            for table in (self._pending, self._arrivals, self._requests, self._early, self._left):
                table.clear()
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        for name in set(self.held()) - set(keep):
            self.release(name)
