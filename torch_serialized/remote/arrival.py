"""A shard read while it downloads: :class:`Arrival`, what a download in flight tells its
readers, in this process or, by a progress file, in the others sharing the cache;
:class:`Checker`, its CRC32s checked as its bytes come; :class:`ArrivingShard`, the reader
over the partial file, whose records are served once their bytes are in and match their
CRC32s. How the bytes come (the GETs): ``transfer``."""

from __future__ import annotations

import logging
import math
import os
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np

from ..container import spec as fmt
from ..container.manifest import Expected
from ..container.reader import ContainerReader
from ..errors import ChecksumError, FormatError
from .locks import open_own
from .retry import ShortReadError

log = logging.getLogger(__name__)


class Arrival:
    """A download in flight, for readers that start before it ends: ``path`` (the partial file, at
    its full size) holds its last ``tail`` bytes once ``tail_in`` (None: not yet known) and the
    first ``have`` bytes of the current attempt. ``ended``: the download returned (``ok``) or
    failed; an ``ok`` file is whole and checked. ``get(start, end)``, set by the download, starts
    a ranged GET of the object: readers ask for bytes far ahead of the body (``want``). With
    ``expect`` (its manifest entry), the fields among the first ``sound`` bytes match their
    CRC32s: they are checked as they arrive, so the whole file needs no pass of its own.

    Across processes: the download publishes ``path``, ``have``, ``sound`` and its tail in a
    progress file (:meth:`share`); the arrival of a process waiting for that download reads them
    (:meth:`follow`), so a rank's DataLoader workers read each shard early from the one download
    of it, whichever worker runs it."""

    def __init__(self, tail: int = 0, expect: Expected | None = None) -> None:
        self.tail, self.path, self.have, self.expect, self.sound = tail, "", 0, expect, 0
        self._checker: Checker | None = None
        self.tail_in: bool | None = None
        self.ended = self.ok = False
        self.get: Callable[[int, int], Future[bytes]] | None = None
        self._spans: list[tuple[int, int]] = []  # fetched for readers ahead of the body
        self._asked: list[tuple[int, int]] = []  # being fetched
        self._cond = threading.Condition()
        self._want = math.inf  # the fewest bytes a waiter waits for: ``arrived`` wakes it then
        self._shared: tuple[int, Path] | None = None  # the progress file this download writes
        self._follow: Path | None = None  # the progress file of another process's download

    def update(self, **state: Any) -> None:
        with self._cond:
            self.__dict__.update(state)
            self._publish()
            self._cond.notify_all()

    def tail_arrived(self, size: int | None) -> None:
        """The last ``tail`` bytes of the ``size``-byte object are in (None: not before the
        body); readers may read records among them."""
        with self._cond:
            self.tail_in = size is not None
            if size is not None:
                self._spans = [*self._spans, (size - min(self.tail, size), size)]
            self._publish()
            self._cond.notify_all()

    def share(self, progress: Path | None) -> None:
        """Write this download's progress to file ``progress`` from now on, for the processes
        waiting for it (:meth:`follow`); None: stop, and remove the file. Best effort: a file
        that cannot be written leaves them waiting for the whole download, never fails it."""
        shared = None
        with suppress(OSError):
            if progress is not None and (fd := open_own(progress, _WRITE)) is not None:
                shared = (fd, progress)
        with self._cond:
            done, self._shared = self._shared, shared
            self._publish()
        if done is not None:
            os.close(done[0])
            done[1].unlink(missing_ok=True)

    def _publish(self) -> None:
        """Write ``path``, ``have``, ``sound`` and the tail's span to the progress file, framed
        and checksummed: a reader may catch it half written (``_cond`` held)."""
        if self._shared is None:
            return
        tail = self._spans[0] if self.tail_in and self._spans else (-1, -1)
        body = _PROGRESS.pack(self.have, self.sound, *tail) + str(self.path).encode()
        record = struct.pack("<I", len(body)) + body + struct.pack("<I", fmt.crc32(body))
        with suppress(OSError):  # a full disk: its followers wait for the whole download
            os.pwrite(self._shared[0], record, 0)

    def follow(self, progress: Path) -> None:
        """Read the download another process runs of this object, as its ``progress`` file
        tells, until this process's own fetch (waiting for that download) ends; bytes it would
        ask for ahead come with that download's body."""
        self.update(_follow=progress)

    @property
    def following(self) -> bool:
        return self._follow is not None

    def _look(self) -> None:
        """Take the progress of the download followed from its file (``_cond`` held): records
        half written are skipped, and so is a later download of the object than the one whose
        partial file is read."""
        assert self._follow is not None
        try:
            fd = open_own(self._follow)
            if fd is None:
                return
            try:
                record = os.pread(fd, _MAX_RECORD, 0)
            finally:
                os.close(fd)
            (n,) = struct.unpack_from("<I", record)
            body, (crc,) = record[4 : 4 + n], struct.unpack_from("<I", record, 4 + n)
        except (OSError, struct.error):
            return
        if fmt.crc32(body) != crc or len(body) < _PROGRESS.size:
            return
        have, sound, *tail = _PROGRESS.unpack_from(body)
        path = body[_PROGRESS.size :].decode(errors="replace")
        if not path or (self.path and path != self.path):
            return
        self.path, self.have, self.sound = path, have, sound
        if tail[0] >= 0 and not self.tail_in:
            self.tail_in, self._spans = True, [(tail[0], tail[1])]

    def end(self, *_: object) -> None:
        """The download is over (or will never start): waiters stop waiting."""
        self.update(ended=True)

    def arrived(self, have: int) -> None:
        """The first ``have`` bytes are in (0: a new attempt): their fields are checked once the
        head and tail are (``Damaged`` if one fails); waiters wake only once what they wait
        for is, not at every chunk."""
        if have == 0:
            self._checker, self.sound = None, 0
        elif self._checker is None and self.expect and self.tail_in and have >= fmt.HEADER_SIZE:
            try:
                self._checker = Checker(self.path, self.expect)
            except (FormatError, OSError):  # not the manifest's tail: readers will not start,
                self.expect = None  # the whole file's check decides
        if self._checker is not None:
            self.sound = self._checker.upto(have)
        self.have = have
        if self._shared is not None:
            with self._cond:
                self._publish()
        if have >= self._want:
            self.update(_want=math.inf)

    def checked(self, size: int) -> bool:
        """Whether every field was checked as it arrived and the whole file of ``size`` bytes
        opens against its manifest entry (its tail may have come twice): no pass is needed."""
        if self._checker is None or not self._checker.done or self.sound < size:
            return False
        try:
            ContainerReader(self.path, expect=self.expect).close()
        except (FormatError, OSError):
            return False
        return True

    def wait(self, end: int, start: int = 0) -> bool:
        """Wait until the tail and bytes ``start..end`` are in (True), or they never will be;
        asks for them first if they are far ahead of the body (``want``)."""
        self.want(start, end)
        with self._cond:
            while True:
                self._want = min(self._want, end)  # set before ``have`` is read: none is missed
                if self._follow is not None and not self.ended:
                    self._look()
                if self.ended or self.tail_in is False or self._has(start, end):
                    return self.ok or self._has(start, end)
                self._cond.wait(None if self._follow is None else FOLLOW_POLL)

    def want(self, start: int, end: int) -> None:
        """Bytes ``start..end`` will be read: if more than ``FAR`` ahead of the body, GET them
        now by a range of their own, in the background; any failure leaves them to the body.
        A block at the end of a shard: first batch 0.96 -> 0.43 s (netlink wan; with ``FAR``
        at 1 MB instead of 8 the rate fell 5%, its bytes read twice)."""
        with self._cond:
            get, asked = self.get, self._asked
            if get is None or self.ended or not self.tail_in or start <= self.have + FAR:
                return
            for a, b in [*asked, *self._spans]:
                if a <= start and end <= b:
                    return
                if start < a < end <= b:  # its end is in or coming: GET the rest
                    end = a
            asked.append((start, end))
        get(start, end).add_done_callback(lambda done: self._got(start, end, done))

    def _got(self, start: int, end: int, done: Future[bytes]) -> None:
        span: list[tuple[int, int]] = []
        try:
            data = done.result()
            if len(data) == end - start:
                write_at(self.path, data, start)  # gone if the download ended: it has them
                span.append((start, end))
        except Exception as exc:
            log.debug("%s: bytes %d-%d not read ahead (%s)", self.path, start, end, exc)
        with self._cond:  # spans grow under the lock: two ranges ending together both count
            self._asked.remove((start, end))
            self._spans = [*self._spans, *span]
            self._cond.notify_all()

    def _has(self, start: int, end: int) -> bool:
        if not self.tail_in:
            return False
        at = self.have if start <= self.have else start
        for a, b in sorted(self._spans):  # bytes fetched for readers, and the tail
            if a <= at < b:
                at = b
        return at >= end


FAR = 8 << 20  #: bytes ahead of the body past which a reader GETs its own range
FOLLOW_POLL = 0.005  #: seconds between looks at another process's download progress
_PROGRESS = struct.Struct("<qqqq")  # have, sound, the tail's span (-1, -1: not in yet)
_MAX_RECORD = 8 + _PROGRESS.size + 4096  # its frame, and a path
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC


def write_at(path: str | Path, data: bytes, offset: int) -> int:
    """Write ``data`` at ``offset`` of the partial file ``path`` through a descriptor of its own
    (the download's may close meanwhile); the bytes written."""
    fd = os.open(path, os.O_WRONLY)
    try:
        return os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


class Damaged(ShortReadError):
    """A download's bytes do not match their checksums (retried once, then ``ChecksumError``)."""


class Checker:
    """The CRC32s of a download's fields, checked in the order their bytes end: built once its
    head and tail are in, by opening it against its manifest entry (as any opening checks)."""

    def __init__(self, path: str, expect: Expected) -> None:
        reader = ContainerReader(path, expect=expect)
        local = reader._mapped()  # the map lives as long as its view
        ends = (local.offsets + local.lengths).ravel()
        order = np.argsort(ends, kind="stable")
        self._starts = local.offsets.ravel()[order].tolist()
        self._ends, self._crcs = ends[order].tolist(), local.crcs.ravel()[order].tolist()
        self._view, self._next = local.view, 0

    @property
    def done(self) -> bool:
        return self._next == len(self._ends)

    def upto(self, have: int) -> int:
        """Check the fields that lie in the first ``have`` bytes; ``have``."""
        i, starts, ends, crcs, view = self._next, self._starts, self._ends, self._crcs, self._view
        while i < len(ends) and ends[i] <= have:
            if fmt.crc32(view[starts[i] : ends[i]]) != crcs[i]:
                raise Damaged(f"the download does not match its checksum at byte {starts[i]}")
            i += 1
        self._next = i
        return have


class ArrivingShard(ContainerReader):
    """A shard opened from its partial download once its header and tail (index, metadata) are
    in and pass the checks of any opening (``meta_crc32`` from the manifest vouches for the
    index). Until the download is whole and checked, each read waits for its records' bytes and
    checks their CRC32s unless the download did (``Arrival.sound``); should the download fail,
    or a CRC32 not match, reads go to the copy ``whole()`` opens, downloaded again."""

    def __init__(
        self,
        arrival: Arrival,
        expect: Expected,
        checked: bool,
        whole: Callable[[], ContainerReader],
    ) -> None:
        super().__init__(arrival.path, checked=True, expect=expect)  # until ``sound`` vouches
        self._arrival, self._checked, self._whole = arrival, checked, whole
        self._copy: ContainerReader | None = None

    def _span(self, rows: np.ndarray) -> tuple[int, int]:
        """The bytes ``rows`` lie in: ``(start, end)``."""
        local = self._mapped()
        end = int((local.offsets[rows] + local.lengths[rows]).max(initial=0))
        return int(local.offsets[rows].min(initial=end)), end

    def _source(self, rows: np.ndarray) -> ContainerReader:
        """Where ``rows`` are read: here once their bytes are in, else the whole copy."""
        if self._copy is None and not self._arrival.ok:
            start, end = self._span(rows)
            if not self._arrival.wait(end, start):
                self._copy = self._whole()
            self.checked = self._checked or end > self._arrival.sound  # not checked as it came
        if self._arrival.ok:
            self.checked = self._checked  # the file is whole and was checked
        return self if self._copy is None else self._copy

    def views(
        self, records: Sequence[int] | np.ndarray, fields: Sequence[int]
    ) -> list[list[memoryview]]:
        rows = self._rows(records)
        if (source := self._source(rows)) is not self:
            return source.views(rows, fields)
        try:
            return super().views(rows, fields)
        except ChecksumError:
            if self._arrival.ok:  # the whole file's own check: its error stands
                raise
            log.info("%s: a record read early fails its CRC32; reading the whole copy", self.path)
            self._copy = self._whole()
            return self._copy.views(rows, fields)

    def record(self, i: int, fields: Sequence[int]) -> list[memoryview]:
        return self.views([i], fields)[0]  # one path for the waits and the fallback

    def verify(self) -> list[int]:
        source = self._source(np.arange(self.num_records))
        return super().verify() if source is self else source.verify()

    def prefetch(self, records: Sequence[int] | np.ndarray) -> None:
        if self._copy is not None:
            self._copy.prefetch(records)
        elif self._arrival.ok:
            super().prefetch(records)
        elif len(records):  # far ahead of the body: asked for now
            self._arrival.want(*self._span(self._rows(records)))
