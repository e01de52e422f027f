"""What reading a pack needs from the operating system, and what happens where it is missing.

Packs are read with positional reads (``os.pread``; no shared file position, so threads and
DataLoader workers never race) and scatter reads (``os.preadv``: one call fills many buffers).
Linux and the BSDs have both. macOS has ``pread`` and, depending on the Python build and OS
version, ``preadv``: without it :func:`preadv` does the same with one ``pread`` per buffer.
Windows has neither; importing the reader there raises ``ImportError`` that says so, instead
of an ``AttributeError`` deep inside a DataLoader worker. ``posix_fadvise`` (cache hints,
missing on macOS and Windows) is optional: callers check for it and skip the hint.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["preadv", "preadv_by_pread"]

if not hasattr(os, "pread"):
    raise ImportError(
        f"torch_serialized reads packs with positional reads (os.pread), which this platform "
        f"({sys.platform}) does not have; it runs on Linux and macOS (on Windows, use WSL2)"
    )


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
