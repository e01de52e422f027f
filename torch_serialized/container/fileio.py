"""What the container needs from the OS: regular-file reads under a cap (a FIFO or ``/dev/zero``
would block or never end), and atomic output: a hidden sibling, fsynced, renamed over the
destination (docs/FORMAT.md, "Writing safely"). POSIX only (``fcntl``, ``pread``)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

# -- regular files only ---------------------------------------------------------------------------
DEFAULT_MAX_FILE_BYTES = 1 << 30  # pack_voc(max_file_bytes=...)

_FILE_KINDS = {
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


class FileKindError(OSError):
    """A path names something other than a regular file (a FIFO, a device, a folder...)."""


class FileSizeError(OSError):
    """A file is larger than the cap its reader allows."""


def open_regular(
    path: str | os.PathLike[str], what: str, flags: int = os.O_RDONLY | os.O_CLOEXEC
) -> int:
    """An fd (read-only unless ``flags`` say) of the regular file ``path``, never blocking on a
    FIFO (else ``FileKindError``); ``what``: its role."""
    fd = os.open(path, flags | os.O_NONBLOCK, 0o644)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")
            raise FileKindError(
                f"{os.fspath(path)}: {what} is {kind}, not a regular file; refusing to read it",
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular_file(
    path: str | os.PathLike[str], max_bytes: int, what: str, *, prefix: bool = False
) -> bytes:
    """The bytes, reading at most ``max_bytes + 1``; more: ``FileSizeError`` (``prefix``: cut)."""
    return read_regular_file_stat(path, max_bytes, what, prefix=prefix)[0]


def read_regular_file_stat(
    path: str | os.PathLike[str], max_bytes: int, what: str, *, prefix: bool = False
) -> tuple[bytes, os.stat_result]:
    """``read_regular_file`` and the file's ``fstat`` taken before its first byte was read."""
    with os.fdopen(open_regular(path, what), "rb") as file:
        st = os.fstat(file.fileno())
        want = min(st.st_size, max_bytes) + 1
        data = file.read(want)
        if len(data) == want <= max_bytes:  # the file grew while we read it
            data += file.read(max_bytes + 1 - want)
    if len(data) > max_bytes:
        if prefix:
            return data[:max_bytes], st
        raise FileSizeError(
            f"{os.fspath(path)}: {what} is larger than the {max_bytes:,}-byte limit "
            f"({max(st.st_size, len(data)):,} bytes or more)",
        )
    return data, st


# -- atomic output --------------------------------------------------------------------------------
#: ``.{name}.{kind}-{pid}-{hex}``: a writer's temporary ``kind`` of ``name`` (``temp_sibling``).
_TEMPORARY = re.compile(r"\.(.+)\.(tmp|old)-(\d+)-[0-9a-f]{8}", re.S)


def temp_sibling(final: Path, kind: str = "tmp") -> Path:
    return final.parent / f".{final.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def is_temporary(name: str) -> bool:
    return _TEMPORARY.fullmatch(name) is not None


def temporaries(final: Path) -> list[tuple[str, int, Path]]:
    """The temporaries of ``final`` there are now: ``(kind, pid, path)``."""
    return [
        (match[2], int(match[3]), entry)
        for entry in final.parent.glob(f".{glob.escape(final.name)}.*-*-*")
        if (match := _TEMPORARY.fullmatch(entry.name)) and match[1] == final.name
    ]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no pid is that large
        return False
    except PermissionError:  # it runs, as another user
        pass
    return True


def clean_stale(final: Path) -> None:
    """Remove dead writers' temporaries of ``final``, moving back an ``old`` one if it is gone."""
    stale = [
        (kind, entry)
        for kind, pid, entry in temporaries(final)
        if pid != os.getpid() and not pid_alive(pid)
    ]
    olds = [entry for kind, entry in stale if kind == "old"]
    if olds and not os.path.lexists(final):
        with contextlib.suppress(FileNotFoundError):  # another writer got there first
            newest = max(olds, key=lambda entry: entry.lstat().st_ctime)
            os.replace(newest, final)
            fsync_dir(final.parent)
    for _, entry in stale:
        remove(entry)  # absent (moved back) is fine


class AtomicOutput:
    """A hidden temporary file (created by the caller at ``path``) or folder, renamed over
    ``final`` on ``commit``, under the appenders' ``flock`` unless ``locked`` (caller holds it)."""

    def __init__(self, final: Path, *, folder: bool, locked: bool = False) -> None:
        self.final = final
        self.folder = folder
        self.locked = locked
        clean_stale(final)
        self.path = temp_sibling(final)
        self._scratch: list[Path] = []
        if folder:
            os.mkdir(self.path)

    def scratch(self) -> Path:
        """A new private folder beside the output, removed on commit or abort."""
        path = temp_sibling(self.final)
        os.mkdir(path)
        self._scratch.append(path)
        return path

    def commit(self) -> None:
        """Move the temporary over ``final``; the caller fsynced its files."""
        if self.folder:
            fsync_dir(self.path)
        self._remove_scratch()
        final, temp = self.final, self.path
        with contextlib.nullcontext() if self.locked else _writers_lock(final):
            if not (final.exists() if self.folder else final.is_dir()):
                os.replace(temp, final)
                fsync_dir(final.parent)
                return
            old = temp_sibling(final, "old")
            os.replace(final, old)
            try:
                os.replace(temp, final)
            except BaseException:
                os.replace(old, final)
                raise
        fsync_dir(final.parent)
        try:  # the new output is in place: a failure to remove the old one is not the write's
            remove(old)
        except OSError as exc:
            log.warning("%s: written, but the old output could not be removed: %s", final, exc)

    def abort(self) -> None:
        """Remove the temporary output and scratch folders; ``final`` is left untouched."""
        remove(self.path)
        self._remove_scratch()

    def _remove_scratch(self) -> None:
        while self._scratch:
            remove(self._scratch.pop())


@contextlib.contextmanager
def _writers_lock(final: Path) -> Iterator[None]:
    """Hold an append's ``flock`` on ``final`` if it exists: a replacement waits for a
    running append rather than swapping the pack from under it."""
    try:
        fd = os.open(final, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.EACCES):
            yield  # nothing there (or nothing an append can have locked)
            return
        raise
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # say why we wait, not hang silently
            log.warning("%s is being appended to; waiting for that to end to replace it", final)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def replace_file(target: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to a temporary sibling, then rename it over ``target`` (not fsynced)."""
    replace_file_at(None, str(target), data)


def replace_file_at(folder: int | None, name: str, data: bytes | memoryview) -> None:
    """``replace_file`` inside the folder open as ``folder``, following no symbolic link."""
    temp = str(temp_sibling(Path(name)))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, 0o666, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(temp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=folder)
        raise


def write_synced(path: Path, data: bytes, mode: str = "wb") -> None:
    """Write and fsync a new file (``mode="xb"`` refuses an existing one)."""
    with open(path, mode) as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Remove a file, link or folder tree; absent is fine."""
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
