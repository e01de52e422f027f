"""How a shard's bytes come in, in place, for the readers of its :class:`Arrival`: the
:class:`Writer` every body goes into; over HTTP its tail by a ranged GET (:func:`get_tail`) and
its body by streamed GETs (:func:`get_body`); from S3 the same (:func:`stream_in`); from GCS
ranged GETs of parts (:func:`fill_parts`)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from .arrival import Arrival, write_at
from .retry import ShortReadError, causes, http_status

log = logging.getLogger(__name__)


class Writer:
    """Where the body's GETs go: in place from offset 0, reported to ``arrival``. The body ends
    at ``end``, before the tail once that is in, and goes around a reader's ``first`` span once
    that is in: none of their bytes come twice (``within``, ``skip``). The two go side by side:
    holding the body until the span was in gained 0.02 s of first batch over 20 ms + 100 MB/s
    and cost 15% of the rate over 20 ms with no cap (shuffled epochs, medians of 5)."""

    def __init__(self, fd: int, size: int, arrival: Arrival, refute: Callable[[int], None]):
        self.fd, self.size, self.arrival, self.refute, self.at = fd, size, arrival, refute, 0
        self.end = self.stop = size
        arrival.arrived(0)

    def within(self) -> dict[str, str] | None:
        """The next GET's ``Range`` header (None: the body is in): from ``at`` up to the tail,
        or first up to the ``first`` span (a server ignoring Range sends everything at once)."""
        tail_in, tail = self.arrival.tail_in, min(self.arrival.tail, self.size)
        self.end = self.size - tail if tail_in else self.size
        first = self.arrival.first
        inside = first and self.at < first[0] and first[1] <= self.end
        self.stop = first[0] if first and inside else self.end
        if self.at >= self.stop:
            return None
        whole = self.at == 0 and self.stop == self.size
        return {} if whole else {"Range": f"bytes={self.at}-{self.stop - 1}"}

    def skip(self) -> bool:
        """After a GET that reached a stop: past the ``first`` span if its bytes are in, else
        on through it. True: the body goes on with another GET."""
        if self.at != self.stop or self.stop >= self.end:
            return False
        past = self.arrival.past(self.at)  # the span, and what readers asked for after it
        if past > self.at:
            self.at = past
            self.arrival.arrived(past)
        return True

    def stated(self, content_range: str, length: int | None) -> None:
        """Refute the object's size the GET's answer states if it is not the manifest's."""
        total = content_range.rpartition("/")[2]
        self.refute(int(total) if total.isdigit() else length or self.size)

    def write(self, data: bytes) -> int:
        if self.at + len(data) > self.size:
            self.refute(self.at + len(data))
        self.at += os.pwrite(self.fd, data, self.at)
        self.arrival.arrived(self.at)
        return len(data)

    def whole(self) -> int:
        """The bytes in: ``size`` once the body reached the tail (whose fields are checked now)."""
        if self.end <= self.at < self.size:  # a reader's span may run into the tail
            self.arrival.arrived(self.size)
            return self.size
        return self.at


def get_body(
    fs: Any,
    path: str,
    size: int,
    writer: Writer,
    options: Mapping[str, Any],
) -> int:
    """Object ``path``'s body into ``writer`` by streamed GETs (HTTP, ``Writer.within``).
    Returns the bytes in, ``size`` once whole; fsspec's ``options`` (a timeout) go to each GET."""

    async def get() -> int:
        session = await fs.set_session()
        kw = {**fs.kwargs, **options}
        headers = kw.pop("headers", {})
        while (within := writer.within()) is not None:
            url = fs.encode_url(path)
            async with session.get(url, headers={**headers, **within}, **kw) as r:
                if r.status == 404:
                    raise FileNotFoundError(errno.ENOENT, "not found", path)
                r.raise_for_status()
                writer.stated(r.headers.get("Content-Range", ""), r.content_length)
                while data := await r.content.read(1 << 20):
                    writer.write(data)
            if not writer.skip():
                break
        return writer.whole()

    return int(asyncio.run_coroutine_threadsafe(get(), fs.loop).result())


def get_tail(
    fs: Any,
    path: str,
    size: int,
    tmp: Path,
    arrival: Arrival,
    skip: bool,
    ignored: Callable[[], None],
) -> Future[None] | None:
    """Start a ranged GET of object ``path``'s last ``arrival.tail`` bytes into ``tmp`` (HTTP,
    before the body's GET); None, and ``tail_in`` False, if ``skip`` or there is nothing to get.
    A 200 answer calls ``ignored()``: the server ignores ``Range``."""
    n = min(arrival.tail, size)
    if arrival.tail_in or not n or skip:
        if not arrival.tail_in:
            arrival.tail_arrived(None)
        return None

    async def get() -> None:
        got = False
        try:
            body = await http_range(fs, path, size - n, size, ignored)
            got = len(body) == n and write_at(tmp, body, size - n) == n
        except Exception as exc:  # the body's GET still brings every byte
            log.debug("%s: its tail could not be read first (%s)", tmp.name, exc)
        finally:
            arrival.tail_arrived(size if got else None)

    return asyncio.run_coroutine_threadsafe(get(), fs.loop)


async def http_range(fs: Any, path: str, a: int, b: int, ignored: Callable[[], None]) -> bytes:
    """Bytes ``a..b`` of object ``path`` over HTTP; ``b""`` from a server that ignores ``Range``
    (it calls ``ignored()``; the whole object it sends is left unread)."""
    session = await fs.set_session()
    kw = dict(fs.kwargs)
    headers = {**kw.pop("headers", {}), "Range": f"bytes={a}-{b - 1}"}
    async with session.get(fs.encode_url(path), headers=headers, **kw) as r:
        if r.status == 200:
            ignored()
            return b""
        r.raise_for_status()
        return await r.read()


def stream_in(
    fs: Any,
    path: str,
    size: int,
    fd: int,
    arrival: Arrival,
    refute: Callable[[int], None],
    deadline: float | None,
) -> int:
    """Object ``path`` into ``fd`` from S3 (s3fs): its tail by a ranged GET, then the body by
    streamed GETs, as over HTTP (``Writer.within``; first batch from S3 over 20 ms + 100 MB/s:
    1.14-1.44 s by ``fill_parts``, 0.76-0.81 s streamed, at the same rate). A body cut short
    raises ``ShortReadError`` (retried: the backend retries only the request). Returns the
    bytes in, ``size`` once whole."""
    tail = min(arrival.tail, size)

    async def run() -> int:
        if tail and not arrival.tail_in:
            data = await ranged(fs, path, size - tail, size, refute)
            os.pwrite(fd, data, size - tail)
            arrival.tail_arrived(size if len(data) == tail else None)
        elif not tail:
            arrival.tail_arrived(None)
        writer = Writer(fd, size, arrival, refute)
        bucket, key, _ = fs.split_path(path)
        while (within := writer.within()) is not None:
            answer = await fs._call_s3("get_object", Bucket=bucket, Key=key, **within)
            writer.stated(answer.get("ContentRange", ""), answer.get("ContentLength"))
            await _stream(answer["Body"], writer)
            if not writer.skip():
                break
        return writer.whole()

    arrival.arrived(0)
    wanted = asyncio.wait_for(run(), deadline)
    return int(asyncio.run_coroutine_threadsafe(wanted, fs.loop).result())


async def _stream(body: Any, writer: Writer) -> None:
    """An S3 answer's body into ``writer``; a body cut short raises ``ShortReadError``."""
    try:
        while True:
            try:
                data = await body.read(1 << 20)
            except Exception as exc:
                if any(http_status(e) for e in causes(exc)):
                    raise  # an answer: the backend's own retries were spent on it
                raise ShortReadError(f"the body was cut at byte {writer.at}: {exc}") from exc
            if not data:
                break
            writer.write(data)
    finally:
        body.close()  # its connection


async def ranged(fs: Any, path: str, a: int, b: int, refute: Callable[[int], None]) -> bytes:
    """Bytes ``a..b`` of object ``path``; a 416 (it ends before ``a``) ``refute``s its size."""
    try:
        return bytes(await fs._cat_file(path, start=a, end=b))
    except Exception as exc:
        if not any(http_status(e) == 416 for e in causes(exc)):
            raise
        refute(int((await fs._info(path))["size"]))
        raise


def streams(fs: Any) -> bool:
    """Whether ``fs`` streams a GET's body to us (s3fs; not gcsfs)."""
    return hasattr(fs, "_call_s3")


PART = 4 << 20  #: bytes per ranged GET of an object store's download in place
IN_FLIGHT = 4  #: its ranged GETs at once


def fill_parts(
    fs: Any,
    path: str,
    size: int,
    fd: int,
    arrival: Arrival,
    refute: Callable[[int], None],
    deadline: Callable[[int], float | None],
) -> int:
    """Object ``path`` (``size`` bytes, an async fsspec filesystem that streams no GET: gcsfs)
    into ``fd`` by ranged GETs, ``IN_FLIGHT`` at once: its tail first, then parts of ``PART``
    bytes in order, each reported to ``arrival`` once its prefix is whole. The backend retries
    each GET; a part past ``deadline(bytes)`` seconds stalls. Returns how many bytes lead up to
    the first gap (``size``: all of them); a larger object is ``refute``d by its last byte."""
    tail = min(arrival.tail, size)
    body = size - tail
    spans = [(body, size)] if tail else []
    spans += [(a, min(a + PART, body)) for a in range(0, body, PART)]
    done: set[int] = set()

    async def part(a: int, b: int, gate: asyncio.Semaphore) -> int:
        async with gate:
            wanted = ranged(fs, path, a, b + (b == size), refute)  # + 1: a larger object shows
            data = await asyncio.wait_for(wanted, deadline(b - a))
        if a + len(data) > size:
            refute(a + len(data))
        os.pwrite(fd, data[: b - a], a)
        if len(data) < b - a:
            return a + len(data)  # the object ends here
        done.add(a)
        if tail and a == body:
            arrival.tail_arrived(size)
        have = 0
        while have < body and have in done:
            have = min(have + PART, body)
        arrival.arrived(size if have == body and (not tail or body in done) else have)
        return size

    async def run() -> int:
        gate = asyncio.Semaphore(IN_FLIGHT)
        tasks = [asyncio.ensure_future(part(a, b, gate)) for a, b in spans]
        try:
            return min([size, *[await task for task in tasks]])
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    arrival.arrived(0)
    return int(asyncio.run_coroutine_threadsafe(run(), fs.loop).result())
