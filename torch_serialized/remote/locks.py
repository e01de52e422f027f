"""The cache folder on disk: its layout, its ``flock`` locks, the files of a pack folder:
a pack folder ``<cache_dir>/v1/<key>/`` holds ``pack.json``, the objects, ``.locks/<name>.lock``
(held by the one fetcher of ``name``; ``.pack.lock`` held shared by every writer) and
``.<name>.<random>.partial`` downloads (a shard's in ``.staging/``, beside its progress file
``.<name>.progress.partial``); readers ``flock`` an object shared. Nothing is followed:
a link, FIFO or device where our file should be is removed (never its target) and taken as
absent; a link for a pack folder is skipped. The cache folder itself may be a link."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from ..container.fileio import FileKindError, open_regular

LAYOUT = "v1"
PACK_INFO = "pack.json"
LOCKS = ".locks"
PARTIAL = ".partial"
PACK_LOCK = ".pack.lock"  # in .locks/; held shared while writing in the folder
STAGING = ".staging"  # downloads, whole and checked, wait here for room in the cache
EVICT_LOCK = ".evict.lock"  # in the cache folder; held while evicting or clearing
OPEN = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
_ODD = (errno.ELOOP, errno.ENXIO, errno.EISDIR)  # a link, a socket or reader-less FIFO, a folder


def open_own(path: Path, flags: int = os.O_RDONLY | os.O_CLOEXEC) -> int | None:
    """``fileio.open_regular`` for a file of the cache, never through a link; None if absent.
    Anything else there is removed, taken as absent (made under ``O_CREAT``); a folder raises."""
    for _ in range(3):
        try:
            return open_regular(path, "a file of the cache", flags | os.O_NOFOLLOW)
        except FileNotFoundError:
            if flags & os.O_CREAT:
                raise
            return None
        except OSError as exc:
            if not isinstance(exc, FileKindError) and exc.errno not in _ODD:
                raise
        with suppress(FileNotFoundError):
            if stat.S_ISDIR(os.lstat(path).st_mode):
                raise IsADirectoryError(
                    errno.EISDIR,
                    f"{path}: a folder where the cache keeps a file; delete it (or clear the "
                    "cache: torch-serialized cache clear)",
                )
            os.unlink(path)  # not a regular file: never one of ours
        if not flags & os.O_CREAT:
            return None
    raise OSError(
        f"{path}: kept being replaced by something other than a file; is another "
        "program writing in the cache folder?"
    )


def drop_links(*folders: Path) -> None:
    """Remove those of ``folders`` that are links, so files below are made in the cache itself."""
    for folder in folders:
        with suppress(FileNotFoundError):
            if folder.is_symlink():
                os.unlink(folder)


@contextmanager
def flocked(path: Path, operation: int, busy: Callable[[], object] | None = None) -> Iterator[None]:
    """Hold ``flock`` ``operation`` on ``path`` (made if absent); ``busy()`` is called first if
    another process holds it, then the lock is waited for."""
    fd = open_own(path, OPEN)
    assert fd is not None  # O_CREAT: made if absent
    try:
        try:
            fcntl.flock(fd, operation | (fcntl.LOCK_NB if busy else 0))
        except BlockingIOError:
            assert busy is not None
            busy()
            fcntl.flock(fd, operation)
        yield
    finally:
        os.close(fd)  # drops the lock; never LOCK_UN (a forked child shares the lock)


@contextmanager
def unless_locked(lock: Path, create: bool = False) -> Iterator[bool]:
    """Yield True, holding ``lock`` exclusively, if no process holds it (or it is absent), else
    False. ``create`` makes and holds an absent lock, so a process about to take it waits."""
    try:
        if create:
            drop_links(lock.parent)
            lock.parent.mkdir(parents=True, exist_ok=True)
        fd = open_own(lock, OPEN) if create else open_own(lock)
    except FileNotFoundError:
        fd = None
    if fd is None:  # never locked: nobody holds it
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


def same_file(fd: int, path: Path) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def close_inherited_locks(root: Path) -> None:
    """In a forked child, close lock files inherited from parent threads: a ``flock`` belongs to
    the open file, so the copy would keep it after the parent let go (Linux ``/proc`` only)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    below = os.path.join(os.path.realpath(root), "")
    for name in names:
        try:
            target = os.readlink(os.path.join("/proc/self/fd", name))
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            continue
        lock = os.sep + LOCKS + os.sep in target or os.path.basename(target) == EVICT_LOCK
        if target.startswith(below) and lock:
            with suppress(OSError):
                os.close(int(name))


@dataclass(frozen=True)
class _Entry:
    """An object of a pack folder, or a partial download: ``.<name>.<random>.partial``, or a
    whole one waiting in ``.staging/`` for room."""

    path: Path
    size: int
    mtime: float
    partial: bool

    @property
    def lock(self) -> Path:
        """The lock its fetcher holds from before the download until it holds the object."""
        name, folder = self.path.name, self.path.parent
        if name.startswith(".") and name.endswith(PARTIAL):
            name = name[1:].rsplit(".", 2)[0]
        pack_dir = folder.parent if folder.name == STAGING else folder
        return pack_dir / LOCKS / f"{name}.lock"

    def busy(self) -> bool:
        """Whether some process holds the object, or is writing the partial file."""
        with unless_locked(self.lock if self.partial else self.path) as free:
            return not free

    def remove(self) -> bool:
        """Delete it unless held or fetched (holding its fetch lock meanwhile); True if deleted."""
        with unless_locked(self.lock) as free:
            if not free:
                return False
            fd = open_own(self.path)
            if fd is None:
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a reader's shared lock
                if not same_file(fd, self.path):
                    return False
                os.unlink(self.path)
                return True
            except BlockingIOError:
                return False
            finally:
                os.close(fd)


def objects(pack_dir: Path) -> list[_Entry]:
    """The objects and partial downloads (``.staging/``'s included) of one pack folder."""
    drop_links(pack_dir / LOCKS, pack_dir / STAGING)
    out = []
    for folder in (pack_dir, pack_dir / STAGING):
        try:
            items = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            continue
        staged = folder != pack_dir
        for item in items:
            partial = staged or (item.name.startswith(".") and item.name.endswith(PARTIAL))
            if (item.name == PACK_INFO and not staged) or (item.name[0] == "." and not partial):
                continue
            with suppress(FileNotFoundError):
                st = item.stat(follow_symlinks=False)
                if item.is_file(follow_symlinks=False):
                    out.append(_Entry(Path(item.path), st.st_size, st.st_mtime, partial))
    return out


def pack_dirs(root: Path) -> list[Path]:
    """The pack folders under ``root``: real folders only, never a link to one."""
    layout = root / LAYOUT
    if layout.is_symlink():
        return []
    try:
        items = list(os.scandir(layout))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(
        Path(p.path) for p in items if p.is_dir(follow_symlinks=False) and p.name[0] != "."
    )
