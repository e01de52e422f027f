"""What the container needs from the operating system: safe opens, atomic output, reads.

**Regular files only.** A FIFO (named pipe) blocks ``open()`` until a writer appears, and
``/dev/zero`` reads forever; either can sit anywhere in a source tree or a pack folder. So
every file torch_serialized reads is opened with ``O_NONBLOCK`` (a FIFO's open returns at
once), checked with ``fstat`` on the open descriptor (no race with a rename) to be a regular
file, and read up to a cap. The errors are ``OSError`` subclasses that name the file.

**Atomic output.** Output is written under a hidden temporary sibling of the destination,
``.{name}.tmp-{pid}-{8 hex digits}`` (a file, or a folder for shards), fsynced, then renamed
over the destination. A folder cannot be renamed over another one, so a folder that replaces
an existing one is first moved aside to ``.{name}.old-{pid}-{hex}``, and moved back if the
second rename fails. On any failure the temporaries are removed and the destination keeps
what it held. Temporaries left by a killed process are removed by the next writer of the same
destination (``clean_stale``), which also moves a folder stranded between the two renames back
into place. docs/FORMAT.md, "Writing safely", states the same for readers of the format.

**Reads.** Packs are read with positional reads (``os.pread``: no shared file position, so
threads and DataLoader workers never race) and scatter reads (``preadv``: ``os.preadv``, or one
``pread`` per buffer where the Python build lacks it). Windows has neither: importing this
module there raises an ``ImportError`` that says so. Page-cache hints (``willneed``,
``page_cached``) are optional: callers check for ``posix_fadvise`` and skip the hint.
This module imports nothing of ours but errors, and never imports torch.
"""

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
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from ..errors import TruncatedFileError

log = logging.getLogger(__name__)

if not hasattr(os, "pread"):
    raise ImportError(
        f"torch_serialized reads packs with positional reads (os.pread), which this platform "
        f"({sys.platform}) does not have; it runs on Linux and macOS (on Windows, use WSL2)"
    )

# -- regular files only ---------------------------------------------------------------------------
#: The default cap on one source file (``pack_voc(max_file_bytes=...)``): 1 GiB, far above
#: any VOC image or annotation, far below what would exhaust a machine's memory.
DEFAULT_MAX_FILE_BYTES = 1 << 30

_FILE_KINDS = {
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


class FileKindError(OSError):
    """A path names something other than a regular file (a FIFO, a device, a folder...).
    Its message (``str``) names the file."""


class FileSizeError(OSError):
    """A file is larger than the cap its reader allows. Its message names the file."""


def open_regular(path: str | os.PathLike[str], what: str) -> int:
    """A read-only descriptor of the regular file at ``path`` (symlinks followed).

    Raises ``FileKindError`` for anything else, and what ``os.open`` raises (e.g.
    ``FileNotFoundError``). ``what`` names the file's role in messages ("the image").
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
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
    """The bytes of the regular file at ``path``, at most ``max_bytes`` of them.

    A longer file raises ``FileSizeError`` naming it and the cap, before more than
    ``max_bytes + 1`` bytes are read; with ``prefix`` its first ``max_bytes`` are returned
    instead. Memory allocated is bounded by the file's size and the cap, whatever the file does
    while it is read.
    """
    return read_regular_file_stat(path, max_bytes, what, prefix=prefix)[0]


def read_regular_file_stat(
    path: str | os.PathLike[str], max_bytes: int, what: str, *, prefix: bool = False
) -> tuple[bytes, os.stat_result]:
    """``read_regular_file``, and the file's ``fstat`` taken before its first byte was read
    (a change while it is read then shows as a newer time at the next look, never as an old
    time beside new bytes)."""
    fd = open_regular(path, what)
    try:
        st = os.fstat(fd)
        want = min(st.st_size, max_bytes) + 1
        chunks: list[bytes] = []
        total = 0
        while total < want:
            chunk = os.read(fd, min(want - total, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total == want and total <= max_bytes:  # the file grew while we read it
                want = max_bytes + 1
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        if prefix:
            return data[:max_bytes], st
        raise FileSizeError(
            f"{os.fspath(path)}: {what} is larger than the {max_bytes:,}-byte limit "
            f"({max(st.st_size, len(data)):,} bytes or more)",
        )
    return data, st


# -- atomic output --------------------------------------------------------------------------------
_TEMP_KINDS = ("tmp", "old")
_TEMPORARY = re.compile(r"\..+\.(?:tmp|old)-\d+-[0-9a-f]{8}", re.S)


def temp_sibling(final: Path, kind: str = "tmp") -> Path:
    """A new hidden name beside ``final``: ``.{name}.{kind}-{pid}-{hex}``."""
    if kind not in _TEMP_KINDS:
        raise ValueError(f"kind must be one of {_TEMP_KINDS}, got {kind!r}")
    return final.parent / f".{final.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def is_temporary(name: str) -> bool:
    """Whether ``name`` is one of ours from ``temp_sibling``: ``.{name}.{tmp|old}-{pid}-{hex}``."""
    return _TEMPORARY.fullmatch(name) is not None


def temporaries(final: Path) -> list[tuple[str, int, Path]]:
    """The temporaries of ``final`` there are now (``temp_sibling``): ``(kind, pid, path)``.
    A reader uses it too: a missing ``final`` with an ``old`` one is a replacement under way."""
    found = []
    for entry in final.parent.glob(f".{glob.escape(final.name)}.*-*-*"):
        kind_pid = entry.name[len(final.name) + 2 :].split("-")
        if len(kind_pid) != 3 or kind_pid[0] not in _TEMP_KINDS or not kind_pid[1].isdigit():
            continue
        found.append((kind_pid[0], int(kind_pid[1]), entry))
    return found


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (a writer named in a temporary's name:
    one that is gone left its temporaries behind)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no pid is that large
        return False
    except PermissionError:  # it runs, as another user
        pass
    return True


def clean_stale(final: Path) -> None:
    """Remove the temporaries of ``final`` left by processes that no longer run.

    A writer killed between the two renames of a folder replacement leaves ``final``
    missing and the previous output under its ``.old-*`` name: that is moved back first.
    """
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
        if os.path.lexists(entry):
            remove(entry)


class AtomicOutput:
    """A hidden temporary file or folder beside ``final`` that replaces ``final`` on commit.

    Creating one removes stale temporaries of ``final`` (see ``clean_stale``). With
    ``folder=True`` the temporary is created as an empty folder; otherwise the caller creates
    the file at ``path``. ``scratch`` folders (for intermediate files) follow the same naming,
    so they are removed with the output, or by the next writer after a kill. The commit holds
    the appenders' ``flock`` on an existing ``final`` (``_writers_lock``) unless ``locked``
    says the caller holds it already (an append replacing the file it grows).
    """

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
        """Move the (fsynced) temporary over ``final``; the caller fsynced its files."""
        if self.folder:
            fsync_dir(self.path)
        self._remove_scratch()
        final, temp = self.final, self.path
        with contextlib.nullcontext() if self.locked else _writers_lock(final):
            if not (final.exists() if self.folder else final.is_dir()):
                os.replace(temp, final)
                fsync_dir(final.parent)
                return
            # A directory cannot be renamed over another one: move the old one aside first.
            old = temp_sibling(final, "old")
            os.replace(final, old)
            try:
                os.replace(temp, final)
            except BaseException:
                os.replace(old, final)  # put the previous output back, then report the failure
                raise
        fsync_dir(final.parent)
        try:  # the new output is in place: a failure to remove the old one is not the write's
            remove(old)
        except OSError as exc:
            log.warning(
                "%s: written, but the output it replaced (moved to %s) could not be removed "
                "(%s); remove it, or a write of %s after this process has ended removes it",
                final,
                old,
                exc,
                final.name,
            )

    def abort(self) -> None:
        """Remove the temporary output and scratch folders; ``final`` is left untouched."""
        remove(self.path)
        self._remove_scratch()

    def _remove_scratch(self) -> None:
        while self._scratch:
            remove(self._scratch.pop())


@contextlib.contextmanager
def _writers_lock(final: Path) -> Iterator[None]:
    """Hold the exclusive ``flock`` an append holds on the pack it grows (the single file, or
    the shard folder), if ``final`` exists: a replacement waits for a running append to end
    rather than swapping the pack from under it (whose later writes, made by path, would
    then land in the new pack), and an append that starts meanwhile is refused."""
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
        except BlockingIOError:
            log.warning("%s is being appended to; waiting for that to end to replace it", final)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def replace_file(target: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to a hidden temporary sibling, then rename it over ``target``.

    Not fsynced (callers write thousands of small files): a crash leaves each file whole or
    absent, never cut. On an error the temporary is removed and the error raised.
    """
    folder = os.open(target.parent, os.O_RDONLY | os.O_CLOEXEC)
    try:
        replace_file_at(folder, target.name, data)
    finally:
        os.close(folder)


def replace_file_at(folder: int, name: str, data: bytes | memoryview) -> None:
    """``replace_file`` inside the folder open as descriptor ``folder``: nothing is resolved by
    path, so no symbolic link along the way is followed (the temporary is created with
    ``O_NOFOLLOW | O_EXCL``; ``rename`` replaces a link at ``name`` itself)."""
    temp = temp_sibling(Path(name)).name
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
    """Write ``data`` to a new file at ``path`` and fsync it (``mode``: ``"xb"`` refuses an
    existing file)."""
    with open(path, mode) as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def fsync_dir(path: Path) -> None:
    """Make the entries of the folder ``path`` (renames, new files) durable."""
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


# -- reads ----------------------------------------------------------------------------------------
def preadv_by_pread(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
    """``os.preadv`` for platforms without it: fill ``buffers`` in turn from ``offset`` with
    one ``os.pread`` each; return the bytes read (short at the end of the file)."""
    total = 0
    for buffer in buffers:
        view = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
        data = os.pread(fd, len(view), offset + total)
        view[: len(data)] = data
        total += len(data)
        if len(data) < len(view):
            break
    return total


#: ``os.preadv`` where the platform has it, else :func:`preadv_by_pread`.
preadv = getattr(os, "preadv", None) or preadv_by_pread

#: Largest single ``POSIX_FADV_WILLNEED`` request: Linux reads at most the device's read-ahead
#: (or its largest request) per call and drops the rest, so longer spans are hinted in pieces.
HINT_CHUNK = 1 << 20


def willneed(fd: int, start: int, length: int) -> None:
    """Ask the kernel to read ``length`` bytes from ``start`` into the page cache now
    (``POSIX_FADV_WILLNEED``, asynchronous), in ``HINT_CHUNK`` pieces."""
    for offset in range(start, start + length, HINT_CHUNK):
        os.posix_fadvise(
            fd, offset, min(HINT_CHUNK, start + length - offset), os.POSIX_FADV_WILLNEED
        )


def page_cached(fd: int, offset: int) -> bool:
    """Whether the byte at ``offset`` is in the page cache, asked without waiting for the disk
    (``preadv`` with ``RWF_NOWAIT``); False where the system cannot tell."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return False
    try:
        return os.preadv(fd, [bytearray(1)], offset, flag) == 1
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP and others: cannot tell
        return False


#: Bytes one ``preadv`` call of ``read_into`` asks for at most: a run is read as a sequence of
#: such calls, so the kernel's read-ahead streams the rest of the run while each piece is
#: copied out (faster than one whole-block call on a cold disk: benchmarks/README.md,
#: "Measurements behind the code").
READ_SIZE = 1 << 20
_IOV_MAX = max(os.sysconf("SC_IOV_MAX"), 0) or 1024


def read_into(fd: int, pieces: list[tuple[int, np.ndarray]], path: str) -> None:
    """Fill each ``(offset, array)`` of ``pieces`` (uint8 arrays) from the file open as ``fd``
    (``path``, named in errors), in few ``preadv`` calls of about ``READ_SIZE`` bytes that
    follow each other through the file; the bytes between pieces land in a scratch buffer."""
    pieces.sort(key=lambda piece: piece[0])
    gaps = [b[0] - (a[0] + len(a[1])) for a, b in zip(pieces, pieces[1:])]
    scratch = np.empty(max([0, *gaps]), dtype=np.uint8)
    i = 0
    while i < len(pieces):
        start = position = pieces[i][0]
        buffers: list[memoryview] = []
        while i < len(pieces) and len(buffers) < _IOV_MAX - 1 and position - start < READ_SIZE:
            offset, data = pieces[i]
            if offset < position:  # overlapping pieces (never written so): read apart
                break
            if offset > position:
                buffers.append(scratch.data[: offset - position])
            buffers.append(data.data)
            position = offset + len(data)
            i += 1
        if position > start and preadv(fd, buffers, start) != position - start:
            raise TruncatedFileError(
                f"{path}: the file ended before byte {position}; it was truncated "
                "after it was opened: re-copy or re-pack it"
            )


def out_of_files(exc: OSError) -> bool:
    """Whether ``exc`` says the descriptor table is full: this process's (``ulimit -n``) or
    the system's."""
    return exc.errno in (errno.EMFILE, errno.ENFILE)


def too_many_files(path: str | os.PathLike[str], exc: OSError) -> OSError:
    """``exc`` (EMFILE or ENFILE, raised opening or mapping ``path``) as an ``OSError`` of the
    same errno that names the file and says what to do."""
    limit = ""
    try:
        import resource

        limit = f" (`ulimit -n` is {resource.getrlimit(resource.RLIMIT_NOFILE)[0]})"
    except (ImportError, OSError, ValueError):
        pass
    return OSError(
        exc.errno,
        f"{os.fspath(path)}: cannot open or map it: {exc.strerror}{limit}. Each open pack file "
        "holds two descriptors (one from Python 3.13): raise the limit (`ulimit -n`, "
        "`resource.setrlimit`), keep fewer datasets open at once, or pass `open_pack` a lower "
        "`max_open_shards`",
    )
