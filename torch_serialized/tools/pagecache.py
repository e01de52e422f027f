"""Drop files from the page cache and check that they left it, for cold-read timings.

``PageCache.evict`` writes dirty pages back and asks the kernel to drop every page of the
files (``posix_fadvise(DONTNEED)``); ``resident`` counts the pages still cached (``mincore``
through ctypes, Linux only), so a figure measured "cold" can say how cold it was. The demo and
``bench`` use it (and the full benchmark in ``benchmarks/``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["PageCache", "files_under"]


class PageCache:
    """Evict files from the page cache and count their resident pages (Linux)."""

    def __init__(self) -> None:
        self.fadvise = hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")
        self._libc: Any = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_long,
            ]
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            self._libc = libc
        except (OSError, AttributeError):
            self._libc = None

    @property
    def can_check(self) -> bool:
        return self._libc is not None and sys.platform.startswith("linux")

    def evict(self, paths: Iterable[str]) -> None:
        """Write back dirty pages, then drop every file's cached pages."""
        if not self.fadvise:
            return
        os.sync()  # DONTNEED leaves dirty pages in place
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def resident(self, paths: Iterable[str]) -> float | None:
        """Fraction of the files' pages in the page cache (``mincore``), or None if unknown."""
        if not self.can_check:
            return None
        total = cached = 0
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                if size == 0:
                    continue
                vec = self.mincore(fd, 0, size)
                if vec is None:
                    return None
                cached += sum(v & 1 for v in vec)
                total += len(vec)
            finally:
                os.close(fd)
        return cached / total if total else 0.0

    def mincore(self, fd: int, offset: int, length: int) -> bytes | None:
        """``mincore`` of ``length`` bytes of ``fd``'s file from ``offset`` (a multiple of the
        page size): one byte per page, bit 0 set when cached; None if it fails."""
        libc = self._libc
        addr = libc.mmap(None, length, 1, 1, fd, offset)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
            return None if libc.mincore(addr, length, vec) != 0 else bytes(vec)
        finally:
            libc.munmap(addr, length)


def files_under(folder: Path) -> list[str]:
    """Every file under ``folder``."""
    return [os.path.join(d, f) for d, _, files in os.walk(folder) for f in files]
