"""Writing a pack with several processes: records laid out apart, placed, then copied in.

Pack processes load chunks of jobs and lay each record out in a scratch file exactly as the
output will hold it (``spill_chunk``, a ``ContainerWriter`` per chunk). The writing process
takes the records in job order, fills in the one field only it can compute (the VOC packer's
class ids, assigned in dataset order), ``reserve``s each record in the output and hands the
copy back to a pack process (``copy_records``, with ``copy_range``). Every byte is read,
checksummed and written in the pack processes; the writing process only keeps the books, and
the output is byte-identical to a one-process pack. At most ``2 * processes`` chunks are in
flight, so scratch files hold a few chunks at a time. This module never imports torch.
"""

from __future__ import annotations

import errno
import multiprocessing.process
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
_T = TypeVar("_T")
#: Most jobs one task takes: large enough to amortise a task, small enough that scratch
#: space and the work lost to an error stay small.
_CHUNK = 64
#: ``copy_file_range`` errors that mean "not here" (cross-device, unsupported): copy by hand.
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


def pays_off(num_jobs: int, processes: int) -> bool:
    """Whether pack processes pay off: not for one process or a handful of jobs."""
    return processes > 1 and num_jobs >= 2 * processes


def check_spawnable(processes: int) -> None:
    """Refuse, before any work, to start pack processes where ``spawn`` cannot: each child
    runs the main module again from its file, and a ``__main__`` read from standard input
    (``python -``, a heredoc) has none, which fails in every child (``FileNotFoundError:
    '<stdin>'``, then ``BrokenProcessPool``) without a word about why. A notebook or an
    interactive session has no file to run, and ``python -m`` names a module: both work."""
    main = sys.modules.get("__main__")
    if main is None or getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return
    path = getattr(main, "__file__", None)
    if not isinstance(path, str):
        return
    origin = getattr(multiprocessing.process, "ORIGINAL_DIR", None)  # where spawn resolves it
    if not os.path.isabs(path) and origin is not None:
        path = os.path.join(origin, path)
    if not os.path.isfile(path):
        raise ValueError(
            f"workers={processes} starts pack processes with multiprocessing's spawn, which "
            f"runs the main script again in each of them, but this one was read from "
            f"{getattr(main, '__file__', None)!r}, not a file: call it from a script file "
            '(under `if __name__ == "__main__":`), use the command line '
            f"(`torch-serialized pack ... --workers {processes}`), or pass workers=1"
        )


@dataclass(frozen=True)
class Record:
    """A loader's result for a job that becomes a record: its payloads (one per field, a
    field the writing process fills in later as zero bytes of its final size) and ``info``,
    which goes back to the writing process (the payloads do not)."""

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
        """Put ``data`` in place of field ``field``'s zero bytes; return the index row for
        ``PackWriter.reserve``. A pack process writes ``data`` along with the record."""
        entry = self.entries[field]
        if len(data) != int(entry["length"]):
            raise RuntimeError(f"field {field} of a record changed size between processes")
        entry["crc32"] = fmt.crc32(data)
        self.patch = (field, data)
        return self.entries

    def span(self) -> tuple[int, int]:
        """Where the record's bytes start in the scratch file, and how many there are."""
        start = int(self.entries["offset"][0])
        return start, int(self.entries["offset"][-1] + self.entries["length"][-1]) - start


#: (scratch file, offset, output file, offset, length, patch offset, patch bytes): one
#: record for a pack process to copy into the output, with its patch written over it.
_CopyOrder = tuple[str, int, str, int, int, int, bytes]


class SpillPool(Generic[_J]):
    """Pack processes that load ``jobs`` with ``load`` and lay out their records.

    ``load(job)`` runs in a spawned process (so it must be picklable: a module-level
    function or a ``functools.partial`` of one) and returns a ``Record``, or anything else
    (a note that the job was skipped, say), which ``items`` passes through in its place.
    """

    def __init__(
        self,
        load: Callable[[_J], Any],
        jobs: Sequence[_J],
        fields: Sequence[str],
        processes: int,
    ) -> None:
        check_spawnable(processes)
        size = max(1, min(_CHUNK, len(jobs) // (processes * 4)))
        self._chunks = [jobs[i : i + size] for i in range(0, len(jobs), size)]
        self._load = load
        self._fields = list(fields)
        self._window = 2 * processes
        self._pool = ProcessPoolExecutor(processes, mp_context=get_context("spawn"))
        self._writer: PackWriter | None = None
        self._scratch = Path()
        self._orders: list[_CopyOrder] = []  # placed, not yet handed to a process
        self._copies: deque[Future[None]] = deque()

    def items(self, writer: PackWriter) -> Iterator[Spilled | Any]:
        """Every job's ``Spilled`` record (or what ``load`` returned instead), in job order."""
        self._writer, self._scratch = writer, writer.scratch()
        loads: deque[tuple[str, Future[list[Any]]]] = deque()

        def load(k: int) -> None:
            path = str(self._scratch / f"chunk-{k:06d}")
            task = self._pool.submit(spill_chunk, self._load, self._fields, self._chunks[k], path)
            loads.append((path, task))

        for k in range(min(len(self._chunks), self._window)):
            load(k)
        for k in range(len(self._chunks)):
            path, future = loads.popleft()
            items = self._result(future)
            if k + self._window < len(self._chunks):
                load(k + self._window)
            for item in items:
                if isinstance(item, Spilled):
                    item.path = path
                yield item
            self._send(path)
            self._wait(self._window)

    def place(self, item: Spilled, target: Path, at: int) -> None:
        """Copy ``item``'s record to ``at`` in ``target`` (soon, in a pack process)."""
        start, length = item.span()
        field, data = item.patch if item.patch is not None else (0, b"")
        patch_at = at + int(item.entries["offset"][field]) - start
        self._orders.append((item.path, start, str(target), at, length, patch_at, data))

    def drain(self) -> None:
        """Return once every placed record is in the output (before a file is finished)."""
        self._send(None)
        self._wait(0)

    def close(self) -> None:
        """Stop the processes; on an error, without waiting for the rest of the jobs."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _send(self, done: str | None) -> None:
        """Hand the placed records to a process; ``done``: a scratch file it then deletes (no
        earlier copy from it is still running: a ``drain`` waited for those)."""
        orders, self._orders = self._orders, []
        if orders or done is not None:
            self._copies.append(self._pool.submit(copy_records, orders, done))

    def _wait(self, pending: int) -> None:
        """Wait for the oldest copies until at most ``pending`` remain."""
        while len(self._copies) > pending:
            self._result(self._copies.popleft())

    def _result(self, future: Future[_T]) -> _T:
        """A process's result; its write errors (disk full...) said as the writer says them."""
        try:
            return future.result()
        except OSError as exc:
            if self._writer is None or isinstance(exc, TorchSerializedError):
                raise  # ours already says what failed (a missing source file, say)
            raise self._writer.write_error(exc) from exc


def spill_chunk(
    load: Callable[[Any], Any], fields: Sequence[str], jobs: Sequence[Any], path: str
) -> list[Spilled | Any]:
    """Load ``jobs`` and write their records to ``path`` laid out as the output will hold them
    (runs in a pack process)."""
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


def copy_records(orders: Sequence[_CopyOrder], done: str | None) -> None:
    """Copy records from scratch files into the output, then delete the scratch file
    ``done`` (runs in a pack process)."""
    fds: dict[tuple[str, int], int] = {}
    try:
        for source, offset, target, at, length, patch_at, patch in orders:
            for path, flags in ((source, os.O_RDONLY), (target, os.O_WRONLY)):
                if (path, flags) not in fds:
                    fds[path, flags] = os.open(path, flags)
            out = fds[target, os.O_WRONLY]
            copy_range(fds[source, os.O_RDONLY], offset, out, at, length)
            if patch and os.pwrite(out, patch, patch_at) != len(patch):
                raise OSError(errno.EIO, f"short write to {target}")
    finally:
        for fd in fds.values():
            os.close(fd)
    if done is not None:
        os.unlink(done)


def copy_range(source: int, offset: int, target: int, at: int, length: int) -> None:
    """Copy ``length`` bytes of file ``source`` from ``offset`` to file ``target`` at ``at``
    (descriptors; their positions are left alone): ``copy_file_range`` where the file system
    allows it (no user-space copy; a reflink where extents can be shared), else pread/pwrite.
    """
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
