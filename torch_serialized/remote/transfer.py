"""How a download's bytes come into its partial file, told to its :class:`Arrival`:
:class:`Writer`, the file-like a GET's body goes into; :func:`get_tail` and :func:`get_body`,
over HTTP; :func:`stream_in`, from S3; :func:`fill_parts`, GCS's ranged GETs."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from .arrival import Arrival, write_at
from .retry import ShortReadError, causes, http_status

log = logging.getLogger(__name__)


class Writer:
    """Where a GET's body goes: in place from offset 0, reported to ``arrival``; the body ends at
    ``end``, before the tail once that is in (``within``)."""

    def __init__(self, fd: int, size: int, arrival: Arrival, refute: Callable[[int], None]):
        self.fd, self.size, self.arrival, self.refute, self.at = fd, size, arrival, refute, 0
        self.end = size
        arrival.arrived(0)

    def within(self) -> dict[str, str]:
        """The body's ``Range`` header: up to the tail if that is in, so none of its bytes come
        twice (a server ignoring Range sends them all)."""
        tail_in, tail = self.arrival.tail_in, min(self.arrival.tail, self.size)
        self.end = self.size - tail if tail_in else self.size
        return {"Range": f"bytes=0-{self.end - 1}"} if 0 < self.end < self.size else {}

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
        if self.at == self.end < self.size:
            self.arrival.arrived(self.size)
            return self.size
        return self.at


def get_body(fs: Any, path: str, writer: Writer, options: Mapping[str, Any]) -> int:
    """Object ``path``'s body into ``writer`` by one streamed GET (HTTP), up to its tail if that
    is in (``Writer.within``). Returns the bytes in, its size once whole; fsspec's ``options``
    (a timeout) go to the GET."""
    within = writer.within()

    async def get() -> int:
        session = await fs.set_session()
        kw = {**fs.kwargs, **options}
        headers = {**kw.pop("headers", {}), **within}
        async with session.get(fs.encode_url(path), headers=headers, **kw) as r:
            if r.status == 404:
                raise FileNotFoundError(errno.ENOENT, "not found", path)
            r.raise_for_status()
            writer.stated(r.headers.get("Content-Range", ""), r.content_length)
            while data := await r.content.read(1 << 20):
                writer.write(data)
        return writer.whole()

    if writer.end == 0:  # all of it is the tail
        return writer.whole()
    return int(asyncio.run_coroutine_threadsafe(get(), fs.loop).result())


def get_tail(
    fs: Any, path: str, size: int, arrival: Arrival, skip: bool, ignored: Callable[[], None]
) -> Future[None] | None:
    """Start a ranged GET of object ``path``'s last ``arrival.tail`` bytes into ``arrival.path``
    (HTTP, before the body's GET); None, and ``tail_in`` False, if ``skip`` or there is nothing
    to get. A 200 answer calls ``ignored()``: the server ignores ``Range``."""
    n = min(arrival.tail, size)
    if arrival.tail_in or not n or skip:
        if not arrival.tail_in:
            arrival.tail_arrived(None)
        return None

    async def get() -> None:
        got = False
        try:
            session = await fs.set_session()
            kw = dict(fs.kwargs)
            headers = {**kw.pop("headers", {}), "Range": f"bytes={size - n}-{size - 1}"}
            async with session.get(fs.encode_url(path), headers=headers, **kw) as r:
                if r.status != 206:  # 200: the whole object; left unread, closed
                    if r.status == 200:
                        ignored()
                    return
                body = await r.read()
            if len(body) == n:
                got = write_at(arrival.path, body, size - n) == n
        except Exception as exc:  # the body's GET still brings every byte
            log.debug("%s: its tail could not be read first (%s)", arrival.path, exc)
        finally:
            arrival.tail_arrived(size if got else None)

    return asyncio.run_coroutine_threadsafe(get(), fs.loop)


def stream_in(fs: Any, path: str, writer: Writer, deadline: float | None) -> int:
    """Object ``path`` into ``writer`` from S3 (s3fs, whose GETs stream their body): its tail by
    a ranged GET, then the body up to the tail as one streamed GET, as over HTTP (first batch
    from S3 over 20 ms + 100 MB/s: 1.14-1.44 s by ``fill_parts``, 0.76-0.81 s streamed). A body
    cut short raises ``ShortReadError`` (retried: the backend retries only the request).
    Returns the bytes in, its size once whole."""
    size, arrival = writer.size, writer.arrival
    tail = min(arrival.tail, size)

    async def run() -> int:
        if tail and not arrival.tail_in:
            data = await ranged(fs, path, size - tail, size, writer.refute)
            os.pwrite(writer.fd, data, size - tail)
            arrival.tail_arrived(size if len(data) == tail else None)
        elif not tail:
            arrival.tail_arrived(None)
        within = writer.within()
        if writer.end == 0:  # all of it is the tail
            return writer.whole()
        bucket, key, _ = fs.split_path(path)
        answer = await fs._call_s3("get_object", Bucket=bucket, Key=key, **within)
        writer.stated(answer.get("ContentRange", ""), answer.get("ContentLength"))
        body = answer["Body"]
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
        return writer.whole()

    wanted = asyncio.wait_for(run(), deadline)
    return int(asyncio.run_coroutine_threadsafe(wanted, fs.loop).result())


async def ranged(fs: Any, path: str, a: int, b: int, refute: Callable[[int], None]) -> bytes:
    """Bytes ``a..b`` of object ``path``; a 416 (it ends before ``a``) ``refute``s its size."""
    try:
        return bytes(await fs._cat_file(path, start=a, end=b))
    except Exception as exc:
        if not any(http_status(e) == 416 for e in causes(exc)):
            raise
        refute(int((await fs._info(path))["size"]))
        raise


PART = 4 << 20  #: bytes per ranged GET of an object store's download in place
IN_FLIGHT = 4  #: its ranged GETs at once


def fill_parts(
    fs: Any, path: str, writer: Writer, deadline: Callable[[int], Mapping[str, Any]]
) -> int:
    """Object ``path`` (an async fsspec filesystem that streams no GET: gcsfs) into ``writer``'s
    file by ranged GETs, ``IN_FLIGHT`` at once: its tail first, then parts of ``PART`` bytes in
    order, each reported to its arrival once its prefix is whole. The backend retries each GET;
    a part of ``n`` bytes stalls past ``deadline(n)``. Returns how many bytes lead up to the
    first gap (its size: all of them); a larger object is refuted by its last byte."""
    fd, size, arrival, refute = writer.fd, writer.size, writer.arrival, writer.refute
    tail = min(arrival.tail, size)
    body = size - tail
    spans = [(body, size)] if tail else []
    spans += [(a, min(a + PART, body)) for a in range(0, body, PART)]
    done: set[int] = set()

    async def part(a: int, b: int, gate: asyncio.Semaphore) -> int:
        async with gate:
            wanted = ranged(fs, path, a, b + (b == size), refute)  # + 1: a larger object shows
            data = await asyncio.wait_for(wanted, deadline(b - a).get("timeout"))
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

    return int(asyncio.run_coroutine_threadsafe(run(), fs.loop).result())
