"""The local cache of remote packs: one download per object, shared by every process.

A pack folder (layout: ``locks``) is keyed by URL and identity (manifest sha256), so a re-packed
pack never mixes with stale shards. All rules are ``flock``s: a fetcher takes the object's fetch
lock, looks again, then downloads to a temporary renamed in when whole; readers hold objects with
a shared lock until :meth:`PackCache.release`; ``clear`` never moves a folder a writer holds.
With ``limit_bytes``, a download's bytes get room under ``.evict.lock`` before they join the
cache: killed downloads go first, then unheld objects by LRU (mtime: last fetch). Downloads in
flight are not counted; if held objects exceed the limit it grows past it, warning once."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..container.fileio import write_synced
from ..errors import CacheLimitWarning
from .locks import (
    EVICT_LOCK,
    LAYOUT,
    LOCKS,
    OPEN,
    PACK_INFO,
    PACK_LOCK,
    PARTIAL,
    STAGING,
    close_inherited_locks,
    drop_links,
    flocked,
    objects,
    open_own,
    pack_dirs,
    same_file,
    unless_locked,
)
from .store import PerProcess, redact_url

log = logging.getLogger(__name__)
CACHE_ENV = "TORCH_SERIALIZED_CACHE"


def default_cache_dir() -> Path:
    """``$TORCH_SERIALIZED_CACHE`` if set, else ``~/.cache/torch_serialized``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "torch_serialized"


def cache_folder(cache_dir: str | os.PathLike[str] | None) -> Path:
    """``cache_dir`` or :func:`default_cache_dir`; ``NotADirectoryError`` if not a folder."""
    folder = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    if os.path.lexists(folder) and not folder.is_dir():
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"{folder} is not a folder: the cache of remote packs is a folder (cache_dir, "
            f"--cache-dir or ${CACHE_ENV}); pass a folder, or a path where one can be made",
            str(folder),
        )
    return folder


def pack_key(url: str, identity: str) -> str:
    """A hash of URL (credentials too: differing access never shares a folder) and identity."""
    return hashlib.sha256(f"{url.rstrip('/')}\n{identity}".encode()).hexdigest()[:32]


class Cache:
    """A cache folder shared by all processes; ``limit_bytes`` (None: unbounded) bounds its size."""

    def __init__(
        self, cache_dir: str | os.PathLike[str] | None = None, limit_bytes: int | None = None
    ) -> None:
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"cache_limit_bytes must be >= 0 or None, got {limit_bytes}")
        self.directory = cache_folder(cache_dir)
        self.limit_bytes = limit_bytes
        self._warned = False

    def __repr__(self) -> str:
        return f"Cache({str(self.directory)!r}, limit_bytes={self.limit_bytes!r})"

    def pack(self, url: str, identity: str) -> PackCache:
        """The cache of one pack, identified by its URL and identity (its manifest's sha256)."""
        return PackCache(self, url, identity)

    def make_room(self, need: int = 0) -> None:
        """Evict unheld objects, LRU first, until the finished objects and ``need`` more bytes fit
        in the limit (partial files of killed downloads go first); an object larger than the
        limit evicts nothing, as nothing makes it fit."""
        with self.room(need):
            pass

    @contextmanager
    def room(self, need: int, wanted: Callable[[], bool] = lambda: True) -> Iterator[None]:
        """:meth:`make_room` for ``need`` bytes, kept (``.evict.lock`` held) while the block adds
        them, so two downloads never count the same free bytes. Past the limit, ``Unwanted`` if
        ``wanted()`` is false: a prefetch its reader left is dropped, not kept over the limit."""
        limit = self.limit_bytes
        if limit is None or need > limit:
            if limit is not None:
                self._warn(
                    f"{self.directory}: an object of {need} bytes is larger than cache_limit_bytes"
                    f"={limit}; the cache grows past it while it is held (raise it)"
                )
            yield
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        with flocked(self.directory / EVICT_LOCK, fcntl.LOCK_EX):
            entries = [e for d in pack_dirs(self.directory) for e in objects(d)]
            done = [e for e in entries if not e.partial]
            for e in entries:
                if e.partial:
                    e.remove()  # only if its writer is dead
            total = sum(e.size for e in done)
            for entry in sorted(done, key=lambda e: e.mtime):
                if total + need <= limit:
                    break
                if entry.remove():
                    total -= entry.size
            if total + need > limit:
                if not wanted():
                    raise Unwanted(f"{self.directory}: no room for a download no one waits for")
                self._warn(
                    f"{self.directory}: the cache needs {total + need} bytes, more than "
                    f"cache_limit_bytes={limit}, in use or being downloaded now by the processes "
                    "sharing it; raise the limit or read fewer shards at once"
                )
            yield

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(CacheLimitWarning(message), stacklevel=5)


class Unwanted(Exception):
    """A finished download dropped: a bounded cache has no room for it, and no reader for it."""


class PackCache(PerProcess):
    """One pack's cached objects (:meth:`fetch`). Thread-safe; forking or pickling drops holds."""

    def __init__(self, cache: Cache, url: str, identity: str) -> None:
        self.cache = cache
        self.url = url
        self.identity = identity
        self.directory = cache.directory / LAYOUT / pack_key(url, identity)
        self._start()

    _PER_PROCESS: ClassVar[tuple[str, ...]] = ("_pid", "_mutex", "_held", "_finalizer")

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._mutex = threading.Lock()
        self._held: dict[str, int] = {}
        self._finalizer = weakref.finalize(self, _close_all, self._held)

    def __repr__(self) -> str:
        return f"PackCache({str(self.directory)!r})"

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            self._finalizer()  # our copies of the parent's descriptors: its locks stay
            close_inherited_locks(self.cache.directory)
            self._reset()

    def object_path(self, name: str) -> Path:
        """Where object ``name`` is (or will be) cached."""
        if not name or "/" in name or "\\" in name or name[0] == "." or name == PACK_INFO:
            raise ValueError(f"{name!r} cannot be a cached object's name (a plain file name)")
        return self.directory / name

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Hold the pack folder shared (:func:`clear_cache` cannot move it), made if needed."""
        lock = self.directory / LOCKS / PACK_LOCK
        for _ in range(100):
            drop_links(lock.parent)
            lock.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = open_own(lock, OPEN)
            except FileNotFoundError:  # moved aside between mkdir and open
                continue
            assert fd is not None
            fcntl.flock(fd, fcntl.LOCK_SH)
            if same_file(fd, lock):
                break
            os.close(fd)
        else:
            raise OSError(
                f"{self.directory}: the cache folder kept disappearing; is another program "
                "deleting files in the cache folder?"
            )
        try:
            url = redact_url(self.url)  # pack.json is world-readable: never a password
            if _info(self.directory).get("url") != url:  # new, or written by an older version
                info = {"url": url, "identity": self.identity, "created": time.time()}
                # locked as objects are: clear_cache leaves a locked partial file alone
                with flocked(self.directory / LOCKS / f"{PACK_INFO}.lock", fcntl.LOCK_EX):
                    _write_atomic(self.directory / PACK_INFO, json.dumps(info).encode())
            yield
        finally:
            os.close(fd)

    def remove_other_versions(self) -> ClearResult:
        """Delete this URL's folders of other identities not in use; ``OSError`` is only logged."""

        def other_version(pack_dir: Path) -> bool:
            identity = _info(pack_dir).get("identity")
            return (
                pack_dir != self.directory
                and isinstance(identity, str)
                and pack_dir.name == pack_key(self.url, identity)
                and not _in_use(pack_dir)
            )

        try:
            done = _clear_packs(self.cache.directory, other_version)
        except OSError as exc:
            log.info("%s: older versions left in the cache (%s)", self.directory, exc)
            return ClearResult(0, 0, 0, 0)
        if done.packs_removed:
            log.info(
                "%s: removed %d older version(s) from the cache (%d bytes)",
                *(redact_url(self.url), done.packs_removed, done.bytes_freed),
            )
        return done

    def put(self, name: str, data: bytes) -> Path:
        """Store small ``data`` (a manifest) as object ``name``, atomically, and hold it."""
        return self.fetch(name, len(data), lambda dest: _write_atomic(dest, data))

    def fetch(
        self,
        name: str,
        expected_size: int | None,
        download: Callable[[Path], object],
        wanted: Callable[[], bool] = lambda: True,
        busy: Callable[[], object] | None = None,
    ) -> Path:
        """The local path of object ``name``, calling ``download(dest)`` (which writes ``dest``
        atomically) first if needed, once for all processes (``busy()`` is called if another
        one is downloading it: this one waits for it); room is made for its bytes before it
        joins the cache (``wanted``: see :meth:`Cache.room`). Held until :meth:`release`; a
        cached file whose size is not ``expected_size`` is downloaded again."""
        self._check_fork()
        path = self.object_path(name)
        with self._mutex:
            if name in self._held:
                touch(path)
                return path
        drop_links(self.directory.parent, self.directory)
        for _ in range(3):
            fd = self._open_held(path, expected_size)
            if fd is None:
                fetch_lock = self.directory / LOCKS / f"{name}.lock"
                with self._writing(), flocked(fetch_lock, fcntl.LOCK_EX, busy):
                    fd = self._open_held(path, expected_size)
                    if fd is None:
                        staging = self.directory / STAGING  # not counted until renamed in
                        drop_links(staging)
                        staging.mkdir(exist_ok=True)
                        pattern = f".{name}.*{PARTIAL}"  # a tmp of name (or its staged copy)
                        stale = [*self.directory.glob(pattern), *staging.glob(pattern)]
                        for file in [*stale, staging / name]:
                            file.unlink(missing_ok=True)  # its writer died: we hold the lock
                        try:
                            download(staging / name)
                            with self.cache.room(os.stat(staging / name).st_size, wanted):
                                os.replace(staging / name, path)
                        finally:
                            (staging / name).unlink(missing_ok=True)
                        fd = self._open_held(path, expected_size)
            if fd is not None:
                with self._mutex:
                    if name in self._held:
                        os.close(fd)
                    else:
                        self._held[name] = fd
                touch(path)
                return path
        raise OSError(
            f"{path}: the cached object kept disappearing or changing size right after its "
            "download; is another program deleting files in the cache folder?"
        )

    def _open_held(self, path: Path, expected_size: int | None) -> int | None:
        """A shared-locked descriptor of ``path`` if it is there and complete, else None."""
        fd = open_own(path)
        if fd is None:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while an evictor unlinks it
        if same_file(fd, path) and expected_size in (None, os.fstat(fd).st_size):
            return fd
        os.close(fd)
        return None

    def held(self) -> list[str]:
        """Names of the objects this process holds."""
        self._check_fork()
        with self._mutex:
            return sorted(self._held)

    def release(self, name: str) -> None:
        """Stop holding object ``name``: it may be evicted once no process holds it."""
        self._check_fork()
        with self._mutex:
            fd = self._held.pop(name, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Release every object this process holds."""
        self._check_fork()
        with self._mutex:
            _close_all(self._held)


def _close_all(held: dict[str, int]) -> None:
    while held:
        with suppress(OSError):
            os.close(held.popitem()[1])


def touch(path: Path) -> None:
    """Set ``path``'s mtime, its last use (the LRU order), never a link's target's."""
    with suppress(OSError):
        os.utime(path, follow_symlinks=False)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}{PARTIAL}"
    try:
        write_synced(tmp, data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class CachedPack:
    """One pack in a cache folder, as ``torch-serialized cache list`` shows it."""

    directory: Path
    url: str
    identity: str
    objects: int
    bytes: int
    last_used: float  # seconds since the epoch; 0.0 if it holds no object
    in_use: int  # objects some process holds or is downloading right now
    partial_bytes: int = 0  # of unfinished downloads: running ones, or left by killed ones


@dataclass(frozen=True)
class ClearResult:
    """What :func:`clear_cache` did."""

    packs_removed: int
    objects_removed: int
    bytes_freed: int  # partial files of killed downloads included
    objects_in_use: int  # skipped: some process holds or is downloading them


def _info(pack_dir: Path) -> dict[str, Any]:
    try:
        fd = open_own(pack_dir / PACK_INFO)
        if fd is None:
            return {}
        with os.fdopen(fd, "rb") as f:
            info = json.loads(f.read(1 << 16))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def list_cache(cache_dir: str | os.PathLike[str] | None = None) -> list[CachedPack]:
    """Every pack in the cache folder (default: :func:`default_cache_dir`), by URL."""
    out = []
    for pack_dir in pack_dirs(cache_folder(cache_dir)):
        info = _info(pack_dir)
        entries = objects(pack_dir)
        done = [e for e in entries if not e.partial]
        out.append(
            CachedPack(
                directory=pack_dir,
                url=redact_url(str(info.get("url", "?"))),  # pack.json of an older version
                identity=str(info.get("identity", "?")),
                objects=len(done),
                bytes=sum(e.size for e in done),
                last_used=max((e.mtime for e in done), default=0.0),
                in_use=sum(e.busy() for e in entries),
                partial_bytes=sum(e.size for e in entries if e.partial),
            )
        )
    return sorted(out, key=lambda p: (p.url, -p.last_used))


def clear_cache(
    cache_dir: str | os.PathLike[str] | None = None, *, url: str | None = None
) -> ClearResult:
    """Delete the cached packs (only ``url``'s if given) but objects in use (``objects_in_use``).

    ``url`` matches as :func:`list_cache` shows it: passwords and query strings are not compared.
    """
    shown = None if url is None else redact_url(url).rstrip("/")

    def wanted(pack_dir: Path) -> bool:
        stored = redact_url(str(_info(pack_dir).get("url", ""))).rstrip("/")
        return shown is None or stored == shown

    return _clear_packs(cache_folder(cache_dir), wanted)


def _clear_packs(root: Path, wanted: Callable[[Path], bool]) -> ClearResult:
    """Clear the pack folders ``wanted`` accepts (asked under ``.evict.lock``); the totals."""
    totals = [0, 0, 0, 0]
    if not (root / LAYOUT).is_dir():
        return ClearResult(*totals)
    with flocked(root / EVICT_LOCK, fcntl.LOCK_EX):
        for pack_dir in filter(wanted, pack_dirs(root)):
            totals = [t + n for t, n in zip(totals, astuple(_clear_pack(pack_dir)))]
    return ClearResult(*totals)


def _clear_pack(pack_dir: Path) -> ClearResult:
    """Delete the objects of one pack folder not in use, then the folder if that was all."""
    removed = freed = busy = 0
    for entry in objects(pack_dir):
        if entry.busy():
            busy += 1
        elif entry.remove():
            removed += not entry.partial
            freed += entry.size
    kept = ClearResult(0, removed, freed, busy)
    if busy:
        return kept
    # Moved aside first unless a writer holds the pack lock; the lock is made if absent, so
    # a writer between its mkdir and its lock waits and then makes its folder again.
    trash = pack_dir.parent / f".trash-{uuid.uuid4().hex[:12]}"
    with unless_locked(pack_dir / LOCKS / PACK_LOCK, create=True) as free:
        if not free:
            return kept
        try:
            pack_dir.rename(trash)
        except OSError:
            return kept
    shutil.rmtree(trash, ignore_errors=True)
    return ClearResult(1, removed, freed, busy)


def _in_use(pack_dir: Path) -> bool:
    """Whether some process holds, downloads or writes anything in a pack folder."""
    if any(entry.busy() for entry in objects(pack_dir)):
        return True
    with unless_locked(pack_dir / LOCKS / PACK_LOCK) as free:
        return not free
