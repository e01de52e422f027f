"""The machine: page cache eviction (``mincore``), ``/proc`` memory, read-ahead, environment."""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import mmap
import os
import platform
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from tsbench.core import MB, MIB


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

    def page_cached(self, fd: int, offset: int) -> bool | None:
        """Whether the page holding byte ``offset`` of ``fd``'s file is cached (``mincore``:
        a pure query, unlike a read, which may start the kernel's read-ahead), or None if
        unknown."""
        if not self.can_check:
            return None
        page = os.sysconf("SC_PAGE_SIZE")
        start = offset - offset % page
        vec = self.mincore(fd, start, min(page, os.fstat(fd).st_size - start))
        return None if vec is None else bool(vec[0] & 1)


def files_under(folder: Path) -> list[str]:
    """Every file under ``folder``."""
    return [os.path.join(d, f) for d, _, files in os.walk(folder) for f in files]


def pack_file_paths(path: Path) -> list[str]:
    return files_under(path) if path.is_dir() else [str(path)]


def read_all(paths: Iterable[str], chunk: int = 4 * MIB) -> None:
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(chunk):
                pass


def read_advised(paths: Iterable[str], chunk: int = MIB) -> None:
    """Read each file front to back in ``chunk`` calls into one buffer, after
    ``POSIX_FADV_SEQUENTIAL`` (Linux then reads ahead twice the device's ``read_ahead_kb``)."""
    buffer = bytearray(chunk)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            offset = 0
            while n := os.preadv(fd, [buffer], offset):
                offset += n
        finally:
            os.close(fd)


def walk_map(paths: Iterable[str]) -> None:
    """Touch one byte of every page of a read-only map of each file, front to back: reads
    through page faults and the kernel's read-around, as a cursor walk over LMDB's map."""
    page = mmap.PAGESIZE
    for path in paths:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                continue
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                pages = np.frombuffer(mm, dtype=np.uint8)[::page]
                int(pages.sum())
                del pages  # the map cannot close while numpy holds its buffer
            finally:
                mm.close()


def _read_stripe(fd: int, size: int, chunk: int, stride: int, first: int) -> None:
    buffer = bytearray(chunk)
    for offset in range(first, size, stride):
        os.preadv(fd, [buffer], offset)


def read_parallel(paths: Iterable[str], chunk: int = 4 * MIB, threads: int = 4) -> None:
    """Read each file with ``threads`` threads, each ``pread``-ing every ``threads``-th
    ``chunk`` into its own buffer: several large requests in flight at once."""
    with ThreadPoolExecutor(threads) as pool:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                read = partial(_read_stripe, fd, os.fstat(fd).st_size, chunk, threads * chunk)
                list(pool.map(read, range(0, threads * chunk, chunk)))
            finally:
                os.close(fd)


#: Ways to read a file front to back; the disk's sequential bandwidth in a run is the best of
#: them (which one wins depends on the device: a local NVMe drive likes several requests in
#: flight, a VM's virtual disk often one stream of large read-ahead).
SEQUENTIAL_READERS: dict[str, tuple[str, Callable[[Iterable[str]], None]]] = {
    "read": ("read() in 1 MiB calls after POSIX_FADV_SEQUENTIAL", read_advised),
    "map": ("a map walked page by page (fault read-around)", walk_map),
    "threads": ("4 threads of 4 MiB preads", read_parallel),
}


def smaps(pid: int) -> dict[str, float]:
    """Memory of a process in MB: USS, PSS, RSS, anonymous (``smaps_rollup``) and ``heap``.

    ``heap`` is the private dirty memory of anonymous mappings (heap, stacks, anonymous
    mmaps), from ``/proc/PID/smaps``: what the process allocated or copied on write from its
    parent. It leaves out file mappings (the pack) and shared memory (``/dev/shm`` segments of
    batches in flight to the main process), both of which move USS and PSS.
    """
    kb: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                kb[parts[0][:-1]] = int(parts[1])
    heap = 0
    anonymous = False
    with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as f:
        for line in f:
            first = line.split(maxsplit=6)
            if first and not first[0].endswith(":"):  # a mapping's header line
                name = first[5].strip() if len(first) > 5 else ""
                anonymous = not name or (name.startswith("[") and name != "[vvar]")
            elif anonymous and first[0] == "Private_Dirty:":
                heap += int(first[1])
    return {
        "uss": (kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)) * 1024 / MB,
        "pss": kb.get("Pss", 0) * 1024 / MB,
        "rss": kb.get("Rss", 0) * 1024 / MB,
        "anon": kb.get("Anonymous", 0) * 1024 / MB,
        "heap": heap * 1024 / MB,
    }


def read_ahead_kb(path: Path) -> int | None:
    """Read-ahead of the block device holding ``path`` (None where unknown, e.g. overlayfs)."""
    dev = os.stat(path).st_dev
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for candidate in (base / "queue" / "read_ahead_kb", base / ".." / "queue" / "read_ahead_kb"):
        try:
            return int(candidate.read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def environment(work: Path) -> dict[str, Any]:
    import PIL
    import torch
    import torchvision
    from PIL import features

    from torch_serialized import __version__

    cpu_model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu_model = next((ln.split(":", 1)[1].strip() for ln in f if "model name" in ln), None)
    except OSError:
        pass
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = None
    try:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        memory_gb = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch_serialized": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "numpy": np.__version__,
        "pillow": PIL.__version__,
        "libjpeg_turbo": features.version("libjpeg_turbo"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "cpu_model": cpu_model,
        "memory_gb": round(memory_gb, 1) if memory_gb else None,
        "read_ahead_kb": read_ahead_kb(work),
        "torch_threads": torch.get_num_threads(),
    }
