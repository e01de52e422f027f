"""Atomic output: nothing is ever visible at a destination path but a complete result.

Output is written under a hidden temporary sibling of the destination,
``.{name}.tmp-{pid}-{8 hex digits}`` (a file, or a folder for shards), fsynced, then renamed
over the destination. A folder cannot be renamed over another one, so a folder that replaces
an existing one is first moved aside to ``.{name}.old-{pid}-{hex}``, and moved back if the
second rename fails. On any failure the temporaries are removed and the destination keeps
what it held (nothing, or the previous complete output). Temporaries left by a killed
process are removed by the next writer of the same destination (``clean_stale``), which also
moves a folder stranded between the two renames back into place. docs/FORMAT.md, "Writing
safely", states the same for readers of the format. This module never imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "AtomicOutput",
    "temp_sibling",
    "is_temporary",
    "clean_stale",
    "replace_file",
    "replace_file_at",
    "remove",
    "temporaries",
    "pid_alive",
]

log = logging.getLogger(__name__)

_KINDS = ("tmp", "old")
_TEMPORARY = re.compile(r"\..+\.(?:tmp|old)-\d+-[0-9a-f]{8}", re.S)


def temp_sibling(final: Path, kind: str = "tmp") -> Path:
    """A new hidden name beside ``final``: ``.{name}.{kind}-{pid}-{hex}``."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    return final.parent / f".{final.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def is_temporary(name: str) -> bool:
    """Whether ``name`` is one of ours from ``temp_sibling``: ``.{name}.{tmp|old}-{pid}-{hex}``."""
    return _TEMPORARY.fullmatch(name) is not None


def temporaries(final: Path) -> list[tuple[str, int, Path]]:
    """The temporaries of ``final`` there are now (``temp_sibling``): ``(kind, pid, path)``.
    A reader uses it too: a missing ``final`` with an ``old`` one is a replacement under way."""
    found = []
    for entry in final.parent.glob(f".{_glob_escape(final.name)}.*-*-*"):
        kind_pid = entry.name[len(final.name) + 2 :].split("-")
        if len(kind_pid) != 3 or kind_pid[0] not in _KINDS or not kind_pid[1].isdigit():
            continue
        found.append((kind_pid[0], int(kind_pid[1]), entry))
    return found


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
            _fsync_dir(final.parent)
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
            _fsync_dir(self.path)
        self._remove_scratch()
        final, temp = self.final, self.path
        with contextlib.nullcontext() if self.locked else _writers_lock(final):
            if not (final.exists() if self.folder else final.is_dir()):
                os.replace(temp, final)
                _fsync_dir(final.parent)
                return
            # A directory cannot be renamed over another one: move the old one aside first.
            old = temp_sibling(final, "old")
            os.replace(final, old)
            try:
                os.replace(temp, final)
            except BaseException:
                os.replace(old, final)  # put the previous output back, then report the failure
                raise
        _fsync_dir(final.parent)
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
        fd = os.open(final, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
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
    temp = temp_sibling(target)
    try:
        with open(temp, "xb") as file:
            file.write(data)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise


def replace_file_at(folder: int, name: str, data: bytes | memoryview) -> None:
    """``replace_file`` inside the folder open as descriptor ``folder``: nothing is resolved by
    path, so no symbolic link along the way is followed (the temporary is created with
    ``O_NOFOLLOW | O_EXCL``; ``rename`` replaces a link at ``name`` itself)."""
    temp = f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(temp, flags | getattr(os, "O_CLOEXEC", 0), 0o666, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(temp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=folder)
        raise


def remove(path: Path) -> None:
    """Remove a file, link or folder tree; absent is fine."""
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _glob_escape(name: str) -> str:
    """Escape glob metacharacters in a file name."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (a writer named in a temporary's name:
    one that is gone left its temporaries behind)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no pid is that large
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
