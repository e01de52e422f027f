"""Writing a pack with several processes: pack processes lay out each chunk's records in scratch
files as the output holds them; the writing process fills in the one field only it can compute
and copies each in (``copy_file_range``): byte-identical to a one-process pack. No torch."""

from __future__ import annotations

import errno
import os
import sys
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from ..errors import TorchSerializedError
from . import spec as fmt
from .shardwriter import PackWriter
from .writer import ContainerWriter, Payload

__all__ = ["Record", "Spilled", "SpillPool", "pays_off", "copy_range"]

_J = TypeVar("_J")
_CHUNK = 64  #: jobs per task: amortises a task; keeps scratch and error losses small
#: ``copy_file_range`` errors meaning "not here" (cross-device, unsupported): copy by hand.
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


def pays_off(num_jobs: int, processes: int) -> bool:
    """Whether pack processes pay off: not for one process or a handful of jobs."""
    return processes > 1 and num_jobs >= 2 * processes


@dataclass(frozen=True)
class Record:
    """A loader's record: ``payloads`` (one to fill in later, zeros now) and ``info``."""

    payloads: Sequence[Payload]
    info: Any


@dataclass
class Spilled:
    """A record a pack process laid out in a scratch file."""

    info: Any  # the loader's ``Record.info``
    entries: np.ndarray  # its index row in the scratch file
    path: str = ""  # the scratch file
    patch: tuple[int, bytes] | None = None  # (field, bytes) the writing process filled in

    def fill(self, field: int, data: bytes) -> np.ndarray:
        """Put ``data`` in place of field ``field``'s zero bytes; return the index row."""
        self.entries[field]["crc32"] = fmt.crc32(data)
        self.patch = (field, data)
        return self.entries


class SpillPool(Generic[_J]):
    """Spawned pack processes running ``load`` on ``jobs``; a non-``Record`` result is passed on."""

    def __init__(
        self,
        load: Callable[[_J], Any],
        jobs: Sequence[_J],
        fields: Sequence[str],
        processes: int,
    ) -> None:
        # ``spawn`` runs the main script again in each child: one read from standard input
        # (``python -``) has no file to run, and the child fails without a word
        if getattr(sys.modules.get("__main__"), "__file__", None) == "<stdin>":
            raise ValueError(
                f"workers={processes} starts pack processes that run the main script again, but "
                "it was read from '<stdin>', not a file: run a script file or pass workers=1"
            )
        size = max(1, min(_CHUNK, len(jobs) // (processes * 4)))
        self._chunks = [jobs[i : i + size] for i in range(0, len(jobs), size)]
        self._load = load
        self._fields = list(fields)
        self._window = 2 * processes
        self._pool = ProcessPoolExecutor(processes, mp_context=get_context("spawn"))
        self._writer: PackWriter | None = None
        self._fds: dict[tuple[str, int], int] = {}  # open scratch and output files

    def items(self, writer: PackWriter) -> Iterator[Spilled | Any]:
        """Every job's ``Spilled`` record (or what ``load`` returned instead), in job order."""
        self._writer, scratch = writer, writer.scratch()
        loads: deque[tuple[str, Future[list[Any]]]] = deque()

        def load(k: int) -> None:
            path = str(scratch / f"chunk-{k:06d}")
            task = self._pool.submit(spill_chunk, self._load, self._fields, self._chunks[k], path)
            loads.append((path, task))

        for k in range(min(len(self._chunks), self._window)):
            load(k)
        for k in range(len(self._chunks)):
            path, future = loads.popleft()
            try:
                items = future.result()
            except OSError as exc:
                if isinstance(exc, TorchSerializedError):
                    raise  # ours already says what failed (a missing source file, say)
                raise writer.write_error(exc) from exc
            if k + self._window < len(self._chunks):
                load(k + self._window)
            for item in items:
                if isinstance(item, Spilled):
                    item.path = path
                yield item
            self.drain()
            os.unlink(path)

    def place(self, item: Spilled, target: Path, at: int) -> None:
        """Copy ``item``'s record to ``at`` in ``target``, its patch written over it."""
        offsets, lengths = item.entries["offset"], item.entries["length"]
        start, length = int(offsets[0]), int(offsets[-1] + lengths[-1] - offsets[0])
        try:
            out = self._fd(str(target), os.O_WRONLY)
            copy_range(self._fd(item.path, os.O_RDONLY), start, out, at, length)
            if item.patch is not None:
                field, data = item.patch
                os.pwrite(out, data, at + int(offsets[field]) - start)
        except OSError as exc:
            assert self._writer is not None
            raise self._writer.write_error(exc) from exc

    def _fd(self, path: str, flags: int) -> int:
        if (path, flags) not in self._fds:
            self._fds[path, flags] = os.open(path, flags | os.O_CLOEXEC)
        return self._fds[path, flags]

    def drain(self) -> None:
        """Close the files placed records were copied between (before a file is finished)."""
        while self._fds:
            os.close(self._fds.popitem()[1])

    def close(self) -> None:
        """Stop the processes; on an error, without waiting for the rest of the jobs."""
        self.drain()
        self._pool.shutdown(wait=True, cancel_futures=True)


def spill_chunk(
    load: Callable[[Any], Any], fields: Sequence[str], jobs: Sequence[Any], path: str
) -> list[Spilled | Any]:
    """Load ``jobs`` and lay out their records in ``path`` (in a pack process)."""
    out: list[Spilled | Any] = []
    with open(path, "wb", buffering=1 << 20) as f:
        writer = ContainerWriter(f, fields)
        for job in jobs:
            result = load(job)
            if not isinstance(result, Record):
                out.append(result)
                continue
            writer.add(result.payloads)
            out.append(Spilled(result.info, writer.entries(writer.num_records - 1)))
    return out


def copy_range(source: int, offset: int, target: int, at: int, length: int) -> None:
    """Copy ``length`` bytes between descriptors: ``copy_file_range``, else pread/pwrite."""
    copy = getattr(os, "copy_file_range", None)
    done = 0
    while done < length:
        if copy is not None:
            try:
                n = copy(source, target, length - done, offset + done, at + done)
            except OSError as exc:
                if exc.errno not in _NO_COPY_RANGE:
                    raise
                copy = None  # another file system, or a kernel without it: copy by hand
                continue
        else:
            data = os.pread(source, min(length - done, 1 << 20), offset + done)
            n = os.pwrite(target, data, at + done) if data else 0
        if n == 0:
            raise OSError(errno.EIO, f"the source file ended {length - done} bytes early")
        done += n
