"""The cache folder on disk: its layout, its ``flock`` locks, the files of a pack folder.

A pack folder ``<cache_dir>/v1/<key>/`` holds ``pack.json``, the objects, ``.locks/<name>.lock``
(held by the one process fetching ``name``; ``.pack.lock`` held shared by every process
writing in the folder) and ``.<name>.<random>.partial`` downloads. A reader holds an object
with a shared ``flock`` on the object itself.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

LAYOUT = "v1"
PACK_INFO = "pack.json"
LOCKS = ".locks"
PARTIAL = ".partial"
PACK_LOCK = ".pack.lock"  # in .locks/; held shared while writing in the folder
EVICT_LOCK = ".evict.lock"  # in the cache folder; held while evicting or clearing
OPEN = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC


@contextmanager
def flocked(path: Path, operation: int) -> Iterator[None]:
    fd = os.open(path, OPEN, 0o644)
    try:
        fcntl.flock(fd, operation)
        yield
    finally:
        os.close(fd)  # drops the lock; never LOCK_UN (a forked child shares the lock)


@contextmanager
def unless_locked(lock: Path, create: bool = False) -> Iterator[bool]:
    """Hold ``lock`` exclusively while the block runs and yield True if no process holds it
    (or it is absent); else yield False. ``create`` makes an absent lock and holds it, so a
    process about to take it waits for the block."""
    try:
        if create:
            lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, OPEN if create else os.O_RDONLY | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:  # never locked: nobody holds it
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
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def close_inherited_locks(root: Path) -> None:
    """In a forked child, close the cache's lock files inherited from parent threads holding
    them: a ``flock`` belongs to the open file, so the child's copy would keep the lock after
    the parent let go (found in ``/proc/self/fd``; elsewhere nothing is closed)."""
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
    """An object of a pack folder, or a partial download (``.<name>.<random>.partial``)."""

    path: Path
    size: int
    mtime: float
    partial: bool

    @property
    def lock(self) -> Path:
        """The lock its fetcher holds from before the download until it holds the object."""
        name = self.path.name[1:].rsplit(".", 2)[0] if self.partial else self.path.name
        return self.path.parent / LOCKS / f"{name}.lock"

    def busy(self) -> bool:
        """Whether some process holds the object, or is writing the partial file."""
        with unless_locked(self.lock if self.partial else self.path) as free:
            return not free

    def remove(self) -> bool:
        """Delete it unless a process holds or fetches it (its fetch lock is held meanwhile:
        a new fetcher waits); True if deleted."""
        with unless_locked(self.lock) as free:
            if not free:
                return False
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
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
    """The objects and partial downloads of one pack folder."""
    try:
        items = list(os.scandir(pack_dir))
    except FileNotFoundError:
        return []
    out = []
    for item in items:
        partial = item.name.startswith(".") and item.name.endswith(PARTIAL)
        if item.name == PACK_INFO or (item.name.startswith(".") and not partial):
            continue
        with suppress(FileNotFoundError):
            st = item.stat(follow_symlinks=False)
            if item.is_file(follow_symlinks=False):
                out.append(_Entry(Path(item.path), st.st_size, st.st_mtime, partial))
    return out


def pack_dirs(root: Path) -> list[Path]:
    try:
        return sorted(p for p in (root / LAYOUT).iterdir() if p.is_dir() and p.name[0] != ".")
    except FileNotFoundError:
        return []
