"""Pack locations at URLs: whole objects moved to and from them through fsspec, and retries.

A URL is a ``str`` with a scheme of 2+ letters; backends load lazily. :meth:`RemoteStore.call`
is our one retry loop, around whole transfers: over S3 and GCS only for what their own retries
cannot see (short or damaged body, a stall past 60 s plus the size at ``min_rate``, HTTP 429),
over HTTP every transient fault. Messages hide passwords and query strings."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing.util
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from contextlib import suppress
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit, urlunsplit

from fsspec.callbacks import Callback

from ..container.spec import MAX_MANIFEST_BYTES
from ..errors import (
    ChecksumError,
    CorruptFileError,
    RemoteAccessError,
    RemoteError,
    RemoteNotFoundError,
)
from .arrival import Arrival, Damaged
from .retry import (
    BUGS,
    MIN_RATE_ENV,
    RETRY_ATTEMPTS_ENV,
    Fault,
    RetryPolicy,
    ShortReadError,
    causes,
    classify_error,
    http_status,
)
from .transfer import Writer, fill_parts, get_body, get_tail, stream_in

log = logging.getLogger(__name__)
_TAIL_WAIT = 2.0  #: seconds a shard's body waits for its tail's GET (tens of KB)
T = TypeVar("T")

_DEADLINE_GRACE = 60.0  # seconds, as aiohttp's sock_read below
_CHUNK = 1 << 20
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+://")
#: The backend each scheme needs, and the extra that installs it from a clone.
_BACKENDS = {
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "http": ("aiohttp", "http"),
    "https": ("aiohttp", "http"),
}
LOCAL_PROTOCOLS = frozenset({"file", "local"})  #: fsspec's local files: uploads rename a temp
_RETRYING = {"s3", "s3a", "gs", "gcs"}  # backends that retry requests themselves
#: URL schemes of fsspec's HTTP filesystem: reads only, servers that may ignore ``Range``.
HTTP_PROTOCOLS = frozenset({"http", "https"})


def is_url(location: str | os.PathLike[str]) -> bool:
    """True if ``location`` is an fsspec URL; a path object or a plain path is local."""
    return isinstance(location, str) and _URL.match(location) is not None


def protocol_of(url: str) -> str:
    """The scheme of ``url``, lower case (``""`` for a local path)."""
    return url.split("://", 1)[0].lower() if "://" in url else ""


def redact_url(url: str) -> str:
    """``url`` fit for a message: password and query string (signed tokens) hidden."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    user, at, host = parts.netloc.rpartition("@")
    if at and ":" in user:
        user = user.split(":", 1)[0] + ":***"
    netloc = f"{user}@{host}" if at else host
    return urlunsplit((parts.scheme, netloc, parts.path, "…" if parts.query else "", ""))


class PerProcess:
    """Holds things of the process using it (locks, threads, descriptors): ``_reset`` makes the
    ``_PER_PROCESS`` attributes; pickling drops them, unpickling and a fork (at once, in the
    child's one thread, via ``multiprocessing``) call ``_reset`` again."""

    _PER_PROCESS: ClassVar[tuple[str, ...]] = ("_pid",)
    _pid: int

    def _reset(self) -> None:
        raise NotImplementedError

    def _start(self) -> None:
        self._reset()
        multiprocessing.util.register_after_fork(self, type(self)._check_fork)

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            self._reset()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._PER_PROCESS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start()


def _orphan_loop(fs: Any) -> None:
    """Mark a fork-inherited filesystem's event loop stopped: its thread stayed in the parent,
    and fsspec's finalizers wait 1 s on a loop that claims to run (measured: 1 s per worker)."""
    loop = vars(fs).get("_loop")
    if loop is not None and getattr(loop, "_thread_id", None) is not None:
        loop._thread_id = None  # asyncio's own test of is_running()


def _share_models(fs: Any, inherited: list[Any]) -> None:
    """A forked worker's S3 client takes botocore's service models from the parent's loader,
    parsed already, not from disk: its first request 40 ms sooner (S3's first batch)."""
    sessions = [getattr(f, "session", None) for f in inherited]  # s3fs's, once it was used
    parent = next((s for s in sessions if hasattr(s, "get_component")), None)
    if parent is None or fs.session is not None:
        return  # not forked from a user of s3fs, or the user's own session
    from aiobotocore.session import AioSession

    fs.session, fs._session_is_owned = AioSession(**fs.kwargs), True  # as s3fs makes it
    fs.session.register_component("data_loader", parent.get_component("data_loader"))


class _Stated(Callback):
    """Calls ``on_size(n)`` once the GET stated ``n`` bytes and its body flows (fsspec sets an
    error page's size too): a false size is refuted before the body is read."""

    def __init__(self, on_size: Callable[[int], None]) -> None:
        super().__init__()
        self._on_size: Callable[[int], None] | None = on_size

    def relative_update(self, inc: int = 1) -> None:
        if self.size is not None and self._on_size is not None:
            on_size, self._on_size = self._on_size, None
            on_size(self.size)


class RemoteStore(PerProcess):
    """A pack location at a URL: reads, downloads and uploads objects below it, with retries.
    ``key``s are relative to ``url`` (``""``: ``url`` itself); ``storage_options`` go to fsspec.
    Thread-safe; pickles without its filesystem, which each process opens for itself."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
    ) -> None:
        if not is_url(url):
            raise ValueError(f"{url!r} is not a URL (a local path is read without RemoteStore)")
        self.url = url.rstrip("/") if not url.endswith("://") else url
        self.protocol = protocol_of(url)
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        self.retry = retry or RetryPolicy.from_env()
        self._start()

    _PER_PROCESS = ("_pid", "_lock", "_fs", "_root", "_rng", "_no_ranges", "_inherited")

    def _reset(self) -> None:
        inherited, self._inherited = getattr(self, "_fs", None), getattr(self, "_inherited", [])
        if inherited is not None:  # forked: kept, never collected here, as collecting s3fs's
            _orphan_loop(inherited)  # client printed "Unclosed client session" in each worker
            self._inherited = [*self._inherited, inherited]
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._fs: Any = None
        self._root = ""
        self._rng = random.Random()  # never the global RNG: the user's seeds stay untouched
        self._no_ranges = False  # the server answered a ranged GET with the whole object

    def __repr__(self) -> str:
        return f"RemoteStore({redact_url(self.url)!r})"

    def url_of(self, key: str = "") -> str:
        """The URL of ``key`` below this location, for messages (password hidden)."""
        return redact_url(f"{self.url}/{key}" if key else self.url)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem, opened on first use in this process."""
        self._check_fork()
        with self._lock:
            if self._fs is None:
                self._fs, self._root = self._open()
            return self._fs

    def _open(self) -> tuple[Any, str]:
        from fsspec.core import url_to_fs

        options = dict(self.storage_options)
        if self.protocol in ("s3", "s3a"):  # botocore's standard retries, not its legacy ones
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("retries", {"mode": "standard", "max_attempts": self.retry.attempts})
            options["config_kwargs"] = config
        try:
            if self.protocol in HTTP_PROTOCOLS:
                import aiohttp  # aiohttp's default allows 5 minutes between two bytes

                client = dict(options.get("client_kwargs") or {})
                client.setdefault("timeout", aiohttp.ClientTimeout(sock_connect=30, sock_read=60))
                options["client_kwargs"] = client
            fs, root = url_to_fs(self.url, skip_instance_cache=True, **options)
            if self.protocol in ("s3", "s3a"):
                _share_models(fs, self._inherited)
        except ImportError as exc:
            package, extra = _BACKENDS.get(self.protocol, (getattr(exc, "name", None), None))
            hint = f"pip install {package}" if package else "install fsspec's backend for it"
            if extra:
                hint += f" (or, in a clone of torch_serialized: pip install -e '.[{extra}]')"
            raise ImportError(
                f"{self.url_of()}: {self.protocol}:// URLs need {package or 'a package'}, which "
                f"is not installed ({exc}): {hint}"
            ) from exc
        except ValueError as exc:
            raise RemoteError(f"{self.url_of()}: fsspec cannot open this URL: {exc}") from exc
        return fs, str(root).rstrip("/")

    def fs_path(self, key: str = "") -> str:
        """The path of ``key`` as ``fs`` names it (no scheme)."""
        self.fs  # noqa: B018 - opens the filesystem and sets the root
        return f"{self._root}/{key}" if key else self._root

    def call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """``fn()``, one whole transfer, under the retry policy; errors become ours (URL named)."""
        policy = self.retry
        for attempt in range(1, policy.attempts + 1):
            try:
                return fn()
            except (RemoteError, CorruptFileError):
                raise  # ours already: it names the URL and says what to do
            except Exception as exc:
                fault = classify_error(exc)
                if fault is Fault.TRANSIENT and attempt < policy.attempts and self._ours(exc):
                    pause = policy.delay(attempt, self._rng)
                    log.info(
                        "%s %s: %s (attempt %d of %d), retrying in %.2fs",
                        *(what, self.url_of(key), _describe(exc), attempt, policy.attempts, pause),
                    )
                    time.sleep(pause)
                    continue
                if fault is Fault.FATAL and isinstance(exc, BUGS):
                    raise
                raise self._error(what, key, fault, exc, attempt) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _ours(self, exc: Exception) -> bool:
        """Whether we retry a transient fault: all over HTTP; over S3/GCS what theirs cannot see."""
        if self.protocol not in _RETRYING:
            return True
        mine = (ShortReadError, TimeoutError)
        return any(isinstance(e, mine) or http_status(e) == 429 for e in causes(exc))

    def _error(
        self, what: str, key: str, fault: Fault, exc: Exception, attempt: int
    ) -> RemoteError:
        url = self.url_of(key)
        if fault is Fault.NOT_FOUND:
            return RemoteNotFoundError(
                f"{url}: not found ({_describe(exc)}). Check the path in the URL and, for an "
                "object store, the bucket name"
            )
        if fault is Fault.DENIED:
            return RemoteAccessError(
                f"{url}: access denied ({_describe(exc)}). Check the credentials (the "
                "storage_options argument, or the backend's usual configuration such as "
                "AWS_PROFILE / ~/.aws or GOOGLE_APPLICATION_CREDENTIALS), the bucket's access "
                "policy and the path"
            )
        if fault is Fault.FATAL:
            return RemoteError(f"{url}: {what} failed: {_describe(exc)}")
        slow = ""
        if any(isinstance(e, TimeoutError) for e in causes(exc)) and self.retry.min_rate:
            slow = (
                f"; on a link slower than {self.retry.min_rate:g} bytes/s, lower {MIN_RATE_ENV} "
                "(0: reads have no deadline)"
            )
        cause = next((e for e in causes(exc) if not isinstance(e, FileNotFoundError)), exc)
        tries = f"{attempt} times" if attempt > 1 else f"after {self.protocol}'s own retries"
        return RemoteError(  # naming the outage, not fsspec's FileNotFoundError around it
            f"{url}: {what} failed {tries}, the last with {_describe(cause)}. Check the "
            "network and the endpoint, or allow more attempts (environment variable "
            f"{RETRY_ATTEMPTS_ENV}, now {self.retry.attempts}){slow}"
        )

    def _deadline(self, nbytes: int) -> dict[str, Any]:
        """fsspec's ``timeout`` for ``nbytes``; none if ``min_rate`` is 0 or options bound it."""
        rate = self.retry.min_rate
        session = (self.storage_options.get("client_kwargs") or {}).get("timeout")
        own = [getattr(t, "total", t) for t in (session, self.storage_options.get("timeout"))]
        if not rate or any(isinstance(t, (int, float)) and t > 0 for t in own):
            return {}
        return {"timeout": _DEADLINE_GRACE + nbytes / rate} if self.fs.async_impl else {}

    def _ranges_ignored(self) -> None:
        self._no_ranges = True  # later shards are read whole at once

    def info(self, key: str = "") -> dict[str, Any]:
        """What the server says of object ``key`` (fsspec's ``info``); it must state the size."""
        path = self.fs_path(key)
        info = dict(self.call("size", key, lambda: self.fs.info(path)))
        if info.get("size") is None:
            raise RemoteError(
                f"{self.url_of(key)}: the server does not report the object's size (no "
                "Content-Length), which reading it needs. Serve the pack with a server that "
                "sends Content-Length (check any proxy or compression in between)"
            )
        return info

    def read_bytes(self, key: str = "", max_bytes: int | None = None) -> bytes:
        """Small object ``key`` whole; over ``max_bytes`` (default: a manifest's cap) raises.
        Streamed over HTTP: an endless body is cut at the cap, a server may ignore ``Range``."""
        path = self.fs_path(key)
        cap = MAX_MANIFEST_BYTES if max_bytes is None else max_bytes

        def read() -> bytes:
            if self.protocol not in HTTP_PROTOCOLS:
                try:
                    return bytes(self.fs.cat_file(path, start=0, end=cap + 1))
                except OSError as exc:  # no range of an empty object can be served
                    if classify_error(exc) is Fault.FATAL and self.fs.size(path) == 0:
                        return b""
                    raise
            body = bytearray()
            with self.fs.open(path, "rb", block_size=0, size=cap + 1) as f:
                while len(body) <= cap and (chunk := f.read(_CHUNK)):
                    body += chunk
            return bytes(body)

        data = self.call("read", key, read)
        if len(data) > cap:
            raise RemoteError(
                f"{self.url_of(key)}: larger than the {cap:,}-byte limit of this read (a "
                "pack's manifest, say), or endless; check that the URL names a pack"
            )
        return data

    def download(
        self,
        key: str,
        dest: str | os.PathLike[str],
        *,
        expected_size: int | None = None,
        verify: Callable[[Path], bool] | None = None,
        arrival: Arrival | None = None,
    ) -> Path:
        """Download ``key`` atomically to ``dest``: the GET must state ``expected_size`` (a false
        one is refuted at the first chunk) and ``verify(path)`` pass. Short bodies are retried
        (one end twice is the size); a second ``verify`` failure raises ``ChecksumError``.
        ``arrival`` is told of the bytes as they are written in place into the partial file, its
        tail fetched first by a ranged GET: then over HTTP and from S3 the body's one GET, from
        GCS ranged parts (``fill_parts``)."""
        dest = Path(dest)
        size = self.info(key)["size"] if expected_size is None else expected_size
        path, deadline = self.fs_path(key), self._deadline(size)
        tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:12]}.partial"
        in_place = arrival is not None and (self.protocol in HTTP_PROTOCOLS or self.fs.async_impl)
        ends: set[int] = set()
        damaged = 0

        def refute(got: int) -> None:
            if got != size:
                raise RemoteError(
                    f"{self.url_of(key)}: the object has {got} bytes, the manifest says {size}. "
                    "The manifest and the object disagree: re-upload the pack (or pack it again)"
                )

        def get() -> int:
            if not in_place:
                self.fs.get_file(path, str(tmp), callback=_Stated(refute), **deadline)
                return tmp.stat().st_size
            assert arrival is not None
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o644)  # never shrunk: readers map it
            try:
                os.ftruncate(fd, size)
                fs = self.fs  # a reader's range, read ahead of the body

                def read_range(a: int, b: int) -> Future[bytes]:
                    wanted = fs._cat_file(path, start=a, end=b)
                    return asyncio.run_coroutine_threadsafe(wanted, fs.loop)

                arrival.update(path=str(tmp), get=read_range)
                if self.protocol not in HTTP_PROTOCOLS:
                    writer = Writer(fd, size, arrival, refute)
                    if hasattr(fs, "_call_s3"):  # s3fs streams a GET's body
                        return stream_in(fs, path, writer, deadline.get("timeout"))
                    return fill_parts(fs, path, writer, self._deadline)  # gcsfs: ranged GETs
                tail = get_tail(fs, path, size, arrival, self._no_ranges, self._ranges_ignored)
                if tail is not None:  # alone, first: beside the body's GET it slowed a fast
                    with suppress(Exception):  # link (20 ms, no cap: 232 -> 208 MB/s); a
                        tail.result(timeout=_TAIL_WAIT)  # stalled one holds the body 2 s
                try:
                    return get_body(fs, path, Writer(fd, size, arrival, refute), deadline)
                finally:
                    if tail is not None:
                        tail.cancel()  # done by now, unless a stall holds it
            finally:
                os.close(fd)

        def attempt() -> Path:
            nonlocal damaged
            try:
                got = get()
                if got in ends or got > size:
                    refute(got)
                if got < size:
                    ends.update([got] if got else [])  # an empty body shows no size
                    raise ShortReadError(f"the body ended after {got} of {size} bytes")
                sound = arrival is not None and arrival.checked(size)  # as it came in
                if verify is not None and not sound and not verify(tmp):
                    raise Damaged("the download does not match its checksum")
            except Damaged:
                damaged += 1
                if damaged == 2:
                    raise ChecksumError(
                        f"{self.url_of(key)}: object {key or dest.name!r} does not match "
                        "its checksum in the manifest, twice. The object on the server is "
                        "damaged or was replaced without its manifest: re-upload the pack "
                        "(or pack it again)"
                    ) from None
                if arrival is not None:  # the tail too comes again: the body stops before it
                    arrival.update(tail_in=None)
                raise
            os.replace(tmp, dest)  # not fsynced: a crash's damage is caught at open
            return dest

        ok = False
        try:
            ok = self.call("download", key, attempt) == dest
            return dest
        finally:
            tmp.unlink(missing_ok=True)
            if arrival is not None:
                arrival.update(ended=True, ok=ok)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0].rstrip('.')}" if text else type(exc).__name__
