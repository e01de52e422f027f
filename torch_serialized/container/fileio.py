"""Opening files that may not be what their names promise: regular files only, size-capped.

A FIFO (named pipe) blocks ``open()`` until a writer appears, and ``/dev/zero`` reads forever;
either can sit anywhere in a source tree or a pack folder, by accident or on purpose. So every
file torch_serialized reads is opened with ``O_NONBLOCK`` (a FIFO's open returns at once), checked
with ``fstat`` on the open descriptor (no race with a rename in between) to be a regular file,
and read up to a cap. The errors are ``OSError`` subclasses that name the file; callers turn
them into their own kind (``SourceDataError`` on the packing side, ``FormatError`` on the
reading side). This module never imports torch.
"""

from __future__ import annotations

import os
import stat

__all__ = [
    "DEFAULT_MAX_FILE_BYTES",
    "FileKindError",
    "FileSizeError",
    "open_regular",
    "read_regular_file",
    "read_regular_file_stat",
]

#: The default cap on one source file (``pack_voc(max_file_bytes=...)``): 1 GiB, far above
#: any VOC image or annotation, far below what would exhaust a machine's memory.
DEFAULT_MAX_FILE_BYTES = 1 << 30

_KINDS = {
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
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
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
        size = st.st_size
        want = min(size, max_bytes) + 1
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
    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    if len(data) > max_bytes:
        if prefix:
            return data[:max_bytes], st
        raise FileSizeError(
            f"{os.fspath(path)}: {what} is larger than the {max_bytes:,}-byte limit "
            f"({max(size, len(data)):,} bytes or more)",
        )
    return data, st
