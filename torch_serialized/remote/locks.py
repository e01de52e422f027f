"""The cache folder on disk: its layout, its ``flock`` locks and the files of a pack folder.

A pack folder ``<cache_dir>/v1/<key>/`` holds ``pack.json``, the pack's objects under their
names, ``.locks/<name>.lock`` (held exclusively by the one process fetching ``name``, shared
as ``.pack.lock`` by every process writing in the folder) and ``.<name>.<random>.partial``
downloads. A reader holds an object with a shared ``flock`` on the object itself.
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
        os.close(fd)  # closing drops the lock; never LOCK_UN (a forked child shares the lock)


@contextmanager
def unless_locked(lock: Path, create: bool = False) -> Iterator[bool]:
    """Hold ``lock`` exclusively while the block runs if no process holds it (or it is
    absent); yields False, holding nothing, if some process does. ``create`` makes an absent
    lock and holds it, so a process about to take it waits for the block."""
    try:
        if create:
            lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, OPEN if create else os.O_RDONLY | os.O_CLOEXEC, 0o644)
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


def same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def close_inherited_locks(root: Path) -> None:
    """In a forked child, close the lock files of the cache at ``root`` that it inherited
    from parent threads holding them (a prefetch mid-download when a DataLoader forked). A
    ``flock`` belongs to the open file, which fork shares: the child's copy kept the lock
    after the parent let go, and the child then waited on it forever. Finds them in
    ``/proc/self/fd`` (Linux; elsewhere nothing is closed)."""
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
        try:
            fd = os.open(self.lock if self.partial else self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def remove(self) -> bool:
        """Delete it if no process holds it or is fetching it; True if deleted. The fetch
        lock is held while deleting: a new fetcher waits (and uses a fresh partial name)."""
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


def counted_bytes(entries: list[_Entry]) -> int:
    """What ``entries`` take against the limit: every object, and each object's partial
    files (its reservation and its download) as the largest of them, so a download counts
    at its full size from the moment room was made for it, once."""
    partials: dict[Path, int] = {}
    for entry in entries:
        if entry.partial:
            partials[entry.lock] = max(partials.get(entry.lock, 0), entry.size)
    return sum(e.size for e in entries if not e.partial) + sum(partials.values())


def pack_dirs(root: Path) -> list[Path]:
    try:
        return sorted(p for p in (root / LAYOUT).iterdir() if p.is_dir() and p.name[0] != ".")
    except FileNotFoundError:
        return []
