"""The local cache of remote packs: one download per object, shared by every process.

Design
------
* **Where.** ``cache_dir``, else ``$TORCH_SERIALIZED_CACHE``, else ``~/.cache/torch_serialized``,
  read when a :class:`Cache` is made (never at import). It should be on a local filesystem:
  the locks below are ``flock`` locks.
* **Layout.** ``<cache_dir>/v1/<key>/`` holds one pack: ``pack.json`` (its URL, with any
  password and query string hidden as in messages, and identity),
  the objects under their names in the pack (``manifest.json``, shard files), ``.locks/`` and
  ``.<name>.<random>.partial`` files being downloaded. ``key`` hashes the URL **and** the pack's
  identity (the manifest's checksum), so a pack re-packed at the same URL gets a fresh folder and
  never mixes with stale shards.
* **One download per object, never a corrupt file.** A process that misses an object takes an
  exclusive ``flock`` on ``.locks/<name>.lock``, looks again (another process may just have
  finished), and only then downloads, to a temporary name renamed into place when complete and
  checked. Others wait on the lock and then find the object. A process that dies mid-download
  drops its lock with it; its partial file is deleted by the next one to take the lock.
* **Readers hold what they use.** :meth:`PackCache.fetch` returns the object's path while this
  process holds a shared ``flock`` on it, until :meth:`PackCache.release` (or ``close``).
* **Bounded, least recently used out.** With ``limit_bytes`` set, room for a download is made
  first (under ``<cache_dir>/.evict.lock``, so evictions do not race) and reserved until the
  download is in (a sparse partial file of its full size): partial files of killed
  downloads (in any pack: their object's lock is free) go first, then objects oldest use first
  (an object's mtime is its last fetch), each only if an exclusive non-blocking ``flock``
  succeeds, so an object some process holds is never removed. When what is held and in flight
  alone exceeds the limit, the cache grows past it and warns (:class:`CacheLimitWarning`) once per
  :class:`Cache`: a soft limit that stops an epoch would cost more than the bytes it saves. An
  object larger than the whole limit evicts nothing (it cannot fit anyway) and warns. A size
  that is a manifest's claim is checked with the source first (``fetch``'s ``confirm_size``),
  so a false one evicts nothing.
* **Old versions go.** A reader that opens a URL (``remote_pack.resolve``) deletes the folders
  of that very URL under other identities (:meth:`PackCache.remove_other_versions`), as
  ``clear`` would, but only folders with nothing in use: a reader of the old version keeps its.
* :func:`list_cache` and :func:`clear_cache` are what ``torch-serialized cache list|clear``
  shows and does; ``clear`` skips objects in use.
"""

# More than 400 lines: the cache's locking, eviction and listing rules belong together: each
# relies on the others' lock order.

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
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
from typing import Any

from ..errors import CacheLimitWarning
from .store import PerProcess, redact_url

__all__ = [
    "CACHE_ENV",
    "Cache",
    "CachedPack",
    "ClearResult",
    "PackCache",
    "cache_folder",
    "clear_cache",
    "default_cache_dir",
    "list_cache",
]

CACHE_ENV = "TORCH_SERIALIZED_CACHE"
_LAYOUT = "v1"
_PACK_INFO = "pack.json"
_LOCKS = ".locks"
_PARTIAL = ".partial"
_PACK_LOCK = ".pack.lock"  # in .locks/; held shared while writing in the folder (no object name)
_EVICT_LOCK = ".evict.lock"  # in the cache folder; held while evicting or clearing


def default_cache_dir() -> Path:
    """``$TORCH_SERIALIZED_CACHE`` if set, else ``~/.cache/torch_serialized``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "torch_serialized"


def cache_folder(cache_dir: str | os.PathLike[str] | None) -> Path:
    """The cache folder ``cache_dir`` names (default: :func:`default_cache_dir`), which may not
    exist yet (it is made on first download), but must not be something else: a path that
    exists and is not a folder raises ``NotADirectoryError`` naming it, before anything under
    it is looked up."""
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
    """The folder name of a pack: a hash of its URL and its identity.

    The whole URL, credentials included: nothing secret can be read back from the hash, and
    URLs that differ in credentials or signed query (which may grant different access) never
    share a folder.
    """
    return hashlib.sha256(f"{url.rstrip('/')}\n{identity}".encode()).hexdigest()[:32]


def _check_name(name: str) -> None:
    if not name or "/" in name or "\\" in name or name.startswith(".") or name == _PACK_INFO:
        raise ValueError(f"{name!r} cannot be a cached object's name (a plain file name)")


@contextmanager
def _flocked(path: Path, operation: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, operation)
        yield
    finally:
        os.close(fd)  # closing drops the lock; never LOCK_UN (a forked child shares the lock)


def _close_inherited_locks(root: Path) -> None:
    """In a forked child, close the lock files of the cache at ``root`` that it inherited
    from threads of its parent holding them (a prefetch mid-download when a DataLoader forked
    its workers). A ``flock`` belongs to the open file, which fork shares: the child's copy
    kept the lock after the parent's thread closed its own, and the child then waited on it
    forever. Closing our copies leaves the parent's locks in place; no thread of the child has
    opened a lock yet (each one's first call to the cache comes here first). Finds them in
    ``/proc/self/fd``; where that is missing (not Linux) nothing is closed."""
    where = "/proc/self/fd"
    try:
        names = os.listdir(where)
    except OSError:
        return
    locks = os.path.join(os.path.realpath(root), "")  # every lock file lies below it
    for name in names:
        try:
            target = os.readlink(os.path.join(where, name))
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            continue
        lock = os.sep + _LOCKS + os.sep in target or os.path.basename(target) == _EVICT_LOCK
        if target.startswith(locks) and lock:
            with suppress(OSError):
                os.close(int(name))


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


@contextmanager
def _unless_locked(lock: Path, create: bool = False) -> Iterator[bool]:
    """Hold ``lock`` exclusively while the block runs if no process holds it (or it is absent).

    Yields False, holding nothing, if some process holds it. With ``create`` an absent lock
    is made and held, so a process about to take it waits for the block (or, for the pack
    lock, finds its folder moved and makes it again).
    """
    try:
        if create:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        else:
            fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:  # nobody ever locked it: nobody holds it
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _try_remove(path: Path) -> bool:
    """Delete object ``path`` if no process holds it or is fetching it; True if deleted.

    A fetching process holds the object's lock from before its download until it holds the
    object, so the object is never removed between its rename into place and its first use.
    """
    with _unless_locked(path.parent / _LOCKS / f"{path.name}.lock") as free:
        return free and _try_remove_unlocked(path)


def _try_remove_unlocked(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if not _same_file(fd, path):
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Entry:
    path: Path
    size: int
    mtime: float
    partial: bool


def _objects(pack_dir: Path) -> list[_Entry]:
    """The objects and partial downloads of one pack folder."""
    out = []
    try:
        items = list(os.scandir(pack_dir))
    except FileNotFoundError:
        return []
    for item in items:
        if item.name in (_PACK_INFO, _LOCKS) or not item.is_file(follow_symlinks=False):
            continue
        partial = item.name.startswith(".") and item.name.endswith(_PARTIAL)
        if item.name.startswith(".") and not partial:
            continue
        try:
            st = item.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        out.append(_Entry(Path(item.path), st.st_size, st.st_mtime, partial))
    return out


def _counted_bytes(entries: list[_Entry]) -> int:
    """What ``entries`` take against the limit: every object, and each object's partial files
    (its download's reservation and the download itself) as the largest of them, so a
    download is counted at its full size from the moment room was made for it, once."""
    partials: dict[Path, int] = {}
    total = 0
    for entry in entries:
        if entry.partial:
            lock = _download_lock(entry.path)
            partials[lock] = max(partials.get(lock, 0), entry.size)
        else:
            total += entry.size
    return total + sum(partials.values())


def _download_lock(partial: Path) -> Path:
    """The lock a partial file's writer holds: that of its object (``.<name>.<random>.partial``)."""
    name = partial.name[1:].rsplit(".", 2)[0]
    return partial.parent / _LOCKS / f"{name}.lock"


def _try_remove_partial(partial: Path) -> bool:
    """Delete a partial download whose writer is gone (its lock is free); True if deleted.

    Every writer holds its object's lock from before it creates its partial file until it has
    renamed or deleted it, so a free lock means a writer killed mid-download. The lock is held
    while deleting: a new writer of the object waits, and uses a fresh name anyway.
    """
    with _unless_locked(_download_lock(partial)) as free:
        if not free:
            return False
        try:
            os.unlink(partial)
        except FileNotFoundError:
            return False
        return True


def _pack_dirs(root: Path) -> list[Path]:
    layout = root / _LAYOUT
    try:
        return sorted(p for p in layout.iterdir() if p.is_dir() and not p.name.startswith("."))
    except FileNotFoundError:
        return []


class Cache:
    """A cache folder shared by every process on the machine, optionally bounded.

    ``limit_bytes`` (None: unbounded) bounds the bytes of all packs in the folder together.
    """

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
        """The cache of one pack, identified by its URL and identity (its manifest's checksum)."""
        return PackCache(self, url, identity)

    def make_room(self, need: int, reserve: Path | None = None) -> None:
        """Evict least recently used objects no process holds until ``need`` more bytes fit.

        ``reserve``: a partial file's name for the download the room is for, created (sparse,
        ``need`` bytes long) before the eviction lock is let go, so that the next download's
        room counts this one at its full size while its own partial file is still short:
        two downloads at once never fit the limit on the same free bytes. The caller removes
        it once the download is in (a killed one's goes as any partial file does)."""
        if self.limit_bytes is None:
            return
        if need > self.limit_bytes:
            # Evicting cannot make it fit, so evict nothing: the size may also be a manifest's
            # claim, wrong or hostile, that would otherwise empty the cache of every other pack.
            self._warn(
                f"{self.directory}: an object of {need} bytes is larger than "
                f"cache_limit_bytes={self.limit_bytes}; the cache grows past the limit while it "
                "is held (nothing else is evicted for it). Raise the limit if that size is real; "
                "else the pack's manifest (which gives it) is wrong"
            )
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        with _flocked(self.directory / _EVICT_LOCK, fcntl.LOCK_EX):
            entries = [e for d in _pack_dirs(self.directory) for e in _objects(d)]
            # partial files of killed downloads first: nobody wants them
            gone = {e.path for e in entries if e.partial and _try_remove_partial(e.path)}
            entries = [e for e in entries if e.path not in gone]
            total = _counted_bytes(entries)
            for entry in sorted((e for e in entries if not e.partial), key=lambda e: e.mtime):
                if total + need <= self.limit_bytes:
                    break
                if _try_remove(entry.path):
                    total -= entry.size
            if total + need > self.limit_bytes:
                self._warn(
                    f"{self.directory}: the cache needs {total + need} bytes, more than "
                    f"cache_limit_bytes={self.limit_bytes}, because that much is in use or "
                    "being downloaded right now (by every process sharing this cache). It "
                    "grows past the limit; raise the limit or read fewer shards at once "
                    "(fewer workers or less prefetch)"
                )
            if reserve is not None and need > 0:
                fd = os.open(reserve, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
                try:
                    os.ftruncate(fd, need)  # sparse: counted, not written
                finally:
                    os.close(fd)

    def _warn(self, message: str) -> None:
        """Warn that the limit is exceeded, once per :class:`Cache`."""
        if not self._warned:
            self._warned = True
            warnings.warn(CacheLimitWarning(message), stacklevel=5)


class PackCache(PerProcess):
    """The cached objects of one pack; get them with :meth:`fetch`.

    Thread-safe. After a fork the child holds nothing (the parent keeps its locks); pickling
    drops what this process holds.
    """

    def __init__(self, cache: Cache, url: str, identity: str) -> None:
        self.cache = cache
        self.url = url
        self.identity = identity
        self.directory = cache.directory / _LAYOUT / pack_key(url, identity)
        self._start()

    _PER_PROCESS = ("_pid", "_mutex", "_held", "_finalizer")

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._mutex = threading.Lock()
        self._held: dict[str, int] = {}
        # Close what is still held when this object goes away, even without close().
        self._finalizer = weakref.finalize(self, _close_all, self._held)

    def __repr__(self) -> str:
        return f"PackCache({str(self.directory)!r})"

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            # Closing our copies of the parent's descriptors leaves the parent's locks in place.
            self._finalizer()
            _close_inherited_locks(self.cache.directory)
            self._reset()

    def path(self, name: str) -> Path:
        """Where object ``name`` is (or will be) cached."""
        _check_name(name)
        return self.directory / name

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Hold the pack folder (shared) so :func:`clear_cache` cannot move it away meanwhile.

        Makes the folder and its ``pack.json`` if needed. clear_cache moves a folder aside only
        while it holds this lock exclusively; a lock file found moved with its folder is dropped
        and the folder made again.
        """
        lock = self.directory / _LOCKS / _PACK_LOCK
        for _ in range(100):
            lock.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:  # moved aside between mkdir and open
                continue
            fcntl.flock(fd, fcntl.LOCK_SH)
            if _same_file(fd, lock):
                break
            os.close(fd)
        else:
            raise OSError(
                f"{self.directory}: the cache folder kept disappearing; is another program "
                "deleting files in the cache folder?"
            )
        try:
            self._write_info()
            yield
        finally:
            os.close(fd)

    def _write_info(self) -> None:
        url = redact_url(self.url)  # pack.json is world-readable: never a password or token
        if _info(self.directory).get("url") == url:
            return
        # Under a lock, as objects are: clear_cache leaves a locked partial file alone.
        with _flocked(self.directory / _LOCKS / f"{_PACK_INFO}.lock", fcntl.LOCK_EX):
            if _info(self.directory).get("url") != url:  # new, or written by an older version
                _write_atomic(
                    self.directory / _PACK_INFO,
                    json.dumps(
                        {"url": url, "identity": self.identity, "created": time.time()}
                    ).encode(),
                )

    def remove_other_versions(self) -> ClearResult:
        """Delete the folders of this pack's URL under another identity, unless in use.

        For a reader that found this identity at the URL: the others are versions the URL
        held before (or after, if it changed since), of use only to readers that opened them,
        which hold what they read. A folder with anything in use (held, being downloaded or
        written) is left whole; the others are removed as :func:`clear_cache` removes them,
        under the same locks. Only the very same URL matches (credentials and query string
        included: they may name another version, as S3's ``versionId`` does).
        """

        def other_version(pack_dir: Path) -> bool:
            identity = _info(pack_dir).get("identity")
            return (
                pack_dir != self.directory
                and isinstance(identity, str)
                and pack_dir.name == pack_key(self.url, identity)
                and not _in_use(pack_dir)
            )

        return _clear_packs(self.cache.directory, other_version)

    def put(self, name: str, data: bytes) -> Path:
        """Store small ``data`` (a manifest) as object ``name``, atomically, and hold it."""
        self._check_fork()
        path = self.path(name)
        with self._writing(), _flocked(self.directory / _LOCKS / f"{name}.lock", fcntl.LOCK_EX):
            fd = self._open_held(path, len(data))
            if fd is None or _read_fd(fd) != data:
                if fd is not None:
                    os.close(fd)
                self.cache.make_room(len(data))
                _write_atomic(path, data)
                fd = self._open_held(path, len(data))
        if fd is None:  # evicted between the rename and the lock: only under extreme pressure
            raise FileNotFoundError(f"{path}: removed from the cache as soon as it was written")
        return self._keep(name, fd)

    def fetch(
        self,
        name: str,
        expected_size: int | None,
        download: Callable[[Path], object],
        confirm_size: Callable[[], bool] | None = None,
    ) -> Path:
        """The local path of object ``name``, downloaded first if it is not cached.

        ``download(dest)`` must create ``dest`` atomically with the whole object
        (:meth:`RemoteStore.download <torch_serialized.remote.store.RemoteStore.download>` does);
        several processes asking for one object make one call between them. The object stays
        held (never evicted) until :meth:`release`. A cached file whose size is not
        ``expected_size`` is downloaded again.

        ``expected_size`` may be a claim (a manifest's) rather than a fact: then pass
        ``confirm_size()``, called before a download and before room is made for it, which
        raises if the source's size differs (the download would fail) and returns False if
        the source does not tell it. Room is then made only for a confirmed size, or, for an
        unconfirmed one, once the download is in and its bytes are real: a false size never
        evicts other objects.
        """
        self._check_fork()
        path = self.path(name)
        with self._mutex:
            if name in self._held:
                _touch(path)
                return path
        for _ in range(3):
            fd = self._open_held(path, expected_size)
            if fd is None:
                with (
                    self._writing(),
                    _flocked(self.directory / _LOCKS / f"{name}.lock", fcntl.LOCK_EX),
                ):
                    fd = self._open_held(path, expected_size)
                    if fd is None:
                        for stale in self.directory.glob(f".{name}.*{_PARTIAL}"):
                            stale.unlink(missing_ok=True)  # its writer died: we hold the lock
                        confirmed = confirm_size is None or confirm_size()
                        reservation = self.directory / f".{name}.reserved{_PARTIAL}"
                        if confirmed:
                            self.cache.make_room(expected_size or 0, reservation)
                        try:
                            download(path)
                        finally:
                            reservation.unlink(missing_ok=True)
                        if not confirmed:  # its bytes are in: room for them (our lock keeps it)
                            self.cache.make_room(0)
                        fd = self._open_held(path, expected_size)
            if fd is not None:
                return self._keep(name, fd)
        raise OSError(
            f"{path}: the cached object kept disappearing or changing size right after its "
            "download; is another program deleting files in the cache folder?"
        )

    def _keep(self, name: str, fd: int) -> Path:
        with self._mutex:
            if name in self._held:
                os.close(fd)
            else:
                self._held[name] = fd
        path = self.directory / name
        _touch(path)
        return path

    def _open_held(self, path: Path, expected_size: int | None) -> int | None:
        """A descriptor of ``path`` holding a shared lock, if it is there and complete."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while an evictor unlinks it
            if _same_file(fd, path) and (
                expected_size is None or os.fstat(fd).st_size == expected_size
            ):
                fd, keep = -1, fd
                return keep
            return None
        finally:
            if fd >= 0:
                os.close(fd)

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
        _, fd = held.popitem()
        with suppress(OSError):
            os.close(fd)


def _touch(path: Path) -> None:
    with suppress(FileNotFoundError):
        os.utime(path)  # the mtime is the last use: the LRU order


def _read_fd(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, size, 0) if size else b""


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}{_PARTIAL}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# --------------------------------------------------------------------------- list and clear


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


def _is_busy(entry: _Entry) -> bool:
    """Whether some process holds the object ``entry``, or is writing the partial file."""
    if entry.partial:  # busy while its writer holds the object's download lock
        try:
            fd = os.open(_download_lock(entry.path), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
    else:
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _info(pack_dir: Path) -> dict[str, Any]:
    try:
        info = json.loads((pack_dir / _PACK_INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _same_url(stored: str, given: str) -> bool:
    """Whether a pack.json URL is ``given``, both as shown (redacted), trailing slash aside."""
    return redact_url(stored).rstrip("/") == redact_url(given).rstrip("/")


def list_cache(cache_dir: str | os.PathLike[str] | None = None) -> list[CachedPack]:
    """Every pack in the cache folder (default: :func:`default_cache_dir`), by URL."""
    root = cache_folder(cache_dir)
    out = []
    for pack_dir in _pack_dirs(root):
        info = _info(pack_dir)
        entries = _objects(pack_dir)
        done = [e for e in entries if not e.partial]
        out.append(
            CachedPack(
                directory=pack_dir,
                url=redact_url(str(info.get("url", "?"))),  # pack.json of an older version
                identity=str(info.get("identity", "?")),
                objects=len(done),
                bytes=sum(e.size for e in done),
                last_used=max((e.mtime for e in done), default=0.0),
                in_use=sum(_is_busy(e) for e in entries),
                partial_bytes=sum(e.size for e in entries if e.partial),
            )
        )
    return sorted(out, key=lambda p: (p.url, -p.last_used))


def clear_cache(
    cache_dir: str | os.PathLike[str] | None = None, *, url: str | None = None
) -> ClearResult:
    """Delete the cached packs (only those of ``url`` if given), except objects in use.

    A pack folder is removed once nothing in it is in use; objects that some process holds or is
    downloading are left, and counted in ``objects_in_use``. ``url`` matches as
    :func:`list_cache` shows it: passwords and query strings are not compared.
    """
    root = cache_folder(cache_dir)
    return _clear_packs(
        root,
        lambda pack_dir: url is None or _same_url(str(_info(pack_dir).get("url", "")), url),
    )


def _clear_packs(root: Path, wanted: Callable[[Path], bool]) -> ClearResult:
    """``_clear_pack`` of each pack folder under ``root`` that ``wanted`` accepts (asked under
    ``.evict.lock``, so nothing is evicted meanwhile); what was done, in all."""
    totals = [0, 0, 0, 0]
    if not (root / _LAYOUT).is_dir():
        return ClearResult(*totals)
    with _flocked(root / _EVICT_LOCK, fcntl.LOCK_EX):
        for pack_dir in _pack_dirs(root):
            if wanted(pack_dir):
                done = astuple(_clear_pack(pack_dir))
                totals = [total + n for total, n in zip(totals, done)]
    return ClearResult(*totals)


def _clear_pack(pack_dir: Path) -> ClearResult:
    """Delete the objects of one pack folder that are not in use, then the folder if that was
    all of them. The caller holds ``.evict.lock``."""
    objects = freed = busy = 0
    for entry in _objects(pack_dir):
        if _is_busy(entry):
            busy += 1
        elif entry.partial:
            if _try_remove_partial(entry.path):
                freed += entry.size
        elif _try_remove(entry.path):
            objects += 1
            freed += entry.size
    if busy:
        return ClearResult(0, objects, freed, busy)
    # Move aside first: a process starting on this pack now recreates a clean one.
    # Not while a process writes in it (it holds the pack lock shared).
    trash = pack_dir.parent / f".trash-{uuid.uuid4().hex[:12]}"
    # made if absent: a writer between its mkdir and its lock then waits for
    # the move and makes its folder again, instead of losing it under rmtree
    with _unless_locked(pack_dir / _LOCKS / _PACK_LOCK, create=True) as free:
        if not free:
            return ClearResult(0, objects, freed, busy)
        try:
            pack_dir.rename(trash)
        except OSError:
            return ClearResult(0, objects, freed, busy)
    shutil.rmtree(trash, ignore_errors=True)
    return ClearResult(1, objects, freed, busy)


def _in_use(pack_dir: Path) -> bool:
    """Whether some process holds, downloads or writes anything in a pack folder."""
    if any(_is_busy(entry) for entry in _objects(pack_dir)):
        return True
    with _unless_locked(pack_dir / _LOCKS / _PACK_LOCK) as free:
        return not free
