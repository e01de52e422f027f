"""Pack locations at URLs, and whole objects moved to and from them through fsspec.

Design
------
* **A location** is a local path or an fsspec URL (``s3://``, ``gs://``, ``https://``,
  ``file://``, ``memory://``...). :func:`is_url` decides: only a ``str`` with a scheme of two
  or more letters is a URL, so an ``os.PathLike`` never reaches fsspec or the cache.
* **Backends load lazily**, in the process that uses them (again after a fork, never
  pickled): ``import torch_serialized`` and local use import no s3fs, gcsfs or aiohttp. A
  missing backend names the extra to install.
* **fsspec's backends make the requests and retry them their way**: botocore's standard
  retries for S3 (``RetryPolicy.attempts`` of them; s3fs resumes a cut body), gcsfs's own.
  Ours is one loop, :meth:`RemoteStore.call`, around each whole transfer: over S3 and GCS it
  retries what their retries cannot see (a body that ended short or failed its check, a
  stall past our deadline); over HTTP, whose filesystem retries nothing, every transient
  fault (a lost connection, HTTP 408/429/5xx) as well, under a :class:`RetryPolicy`.
  :func:`~torch_serialized.remote.retry.classify_error` reads what fsspec raises.
* **A download** is one streamed ``get_file`` into a temporary file beside its destination,
  then checked (size; the caller's ``verify``), fsynced and renamed. It must end within 60 s
  plus its size at ``min_rate`` (16 KiB/s, ``TORCH_SERIALIZED_MIN_RATE``; 0: no deadline), so
  a server that drips bytes just fast enough for the socket timeouts still times out.
* **Uploads put the manifest last**, so a reader never sees a manifest naming missing shards.
  On ``file://`` an object is written to a temporary name and renamed.

Messages name the URL with any password and query string hidden.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit, urlunsplit

from ..errors import (
    ChecksumError,
    CorruptFileError,
    RemoteAccessError,
    RemoteError,
    RemoteNotFoundError,
)
from .retry import (
    MIN_RATE_ENV,
    OURS_TO_FIX,
    RETRY_ATTEMPTS_ENV,
    Fault,
    RetryPolicy,
    ShortReadError,
    causes,
    classify_error,
    http_status,
)

__all__ = ["HTTP_PROTOCOLS", "PerProcess", "RemoteStore", "is_url", "protocol_of", "redact_url"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_CHUNK = 1 << 20
_DEADLINE_GRACE = 60.0  # seconds, as aiohttp's sock_read below
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+://")
# Which extra brings the backend of a protocol, for the message when it is missing.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}
_LOCAL = {"file", "local"}
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
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.split(':', 1)[0]}:***@{host}" if ":" in user else f"{user}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, "…" if parts.query else "", ""))


# --------------------------------------------------------------------------- the store


class PerProcess:
    """Instances that hold things of the process using them (locks, threads, descriptors)
    and ``_pid``, the process they were made in.

    ``_reset`` makes exactly the attributes ``_PER_PROCESS`` names: pickling drops them and
    unpickling calls ``_reset``; ``_check_fork`` calls it in a forked child. Subclasses call
    ``_start`` when made, so a child that ``multiprocessing`` forks resets at once, in its
    one thread, before two of its threads can both find the parent's state.
    """

    _PER_PROCESS: ClassVar[tuple[str, ...]] = ("_pid",)
    _pid: int

    def _reset(self) -> None:
        raise NotImplementedError

    def _start(self) -> None:
        """``_reset``, and the same in each child ``multiprocessing`` forks, as it starts."""
        self._reset()
        multiprocessing.util.register_after_fork(self, _after_fork)

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            self._reset()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in self._PER_PROCESS:
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start()


def _after_fork(instance: PerProcess) -> None:
    instance._check_fork()  # the subclass's: a PackCache also closes inherited descriptors


class RemoteStore(PerProcess):
    """A pack location at a URL: reads, downloads and uploads objects below it, with retries.

    ``key`` arguments are paths relative to ``url`` (``"manifest.json"``); ``""`` is ``url``
    itself (a single-file pack). ``storage_options`` go to fsspec as they are. Safe to share
    between threads; pickles without its filesystem, which each process opens for itself.
    """

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

    _PER_PROCESS = ("_pid", "_lock", "_fs", "_root", "_rng")

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._fs: Any = None
        self._root = ""
        self._rng = random.Random()  # never the global RNG: the user's seeds stay untouched

    def __repr__(self) -> str:
        return f"RemoteStore({redact_url(self.url)!r})"

    def url_of(self, key: str = "") -> str:
        """The URL of ``key`` below this location, for messages (password hidden)."""
        return redact_url(f"{self.url}/{key}" if key else self.url)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem, opened on first use in this process."""
        self._check_fork()  # a forked child: the parent's sessions are unusable
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
        except ImportError as exc:
            extra = _EXTRAS.get(self.protocol)
            hint = f"pip install 'torch_serialized[{extra}]'" if extra else "install its backend"
            raise ImportError(
                f"{self.url_of()}: reading {self.protocol}:// URLs needs a package that is not "
                f"installed ({exc}); {hint}"
            ) from exc
        except ValueError as exc:
            raise RemoteError(f"{self.url_of()}: fsspec cannot open this URL: {exc}") from exc
        return fs, str(root).rstrip("/")

    def fs_path(self, key: str = "") -> str:
        """The path of ``key`` as ``fs`` names it (no scheme)."""
        self.fs  # noqa: B018 - opens the filesystem and sets the root
        return f"{self._root}/{key}" if key else self._root

    # -- the one retry loop

    def call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """``fn()`` (one whole transfer) under the retry policy; errors become ours, naming
        the URL of ``key``."""
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
                if fault is Fault.FATAL and isinstance(exc, OURS_TO_FIX):
                    raise  # a programming error stays what it is
                raise self._error(what, key, fault, exc, attempt) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _ours(self, exc: Exception) -> bool:
        """Whether our loop retries a transient fault: every one over a protocol whose backend
        does not retry (HTTP); over S3 and GCS only what their retries cannot see: a body
        that ended short or failed its check, a stall past our deadline, HTTP 429 (which
        botocore takes for a client error)."""
        if self.protocol not in _RETRYING:
            return True
        ours = (ShortReadError, TimeoutError)
        return any(isinstance(e, ours) or http_status(e) == 429 for e in causes(exc))

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
        """fsspec's ``timeout`` for a transfer of ``nbytes`` (async backends only): 60 s plus
        the bytes at ``min_rate``; none when ``min_rate`` is 0 or ``storage_options`` bound
        whole HTTP requests themselves (a ``ClientTimeout`` with a ``total``, or seconds)."""
        rate = self.retry.min_rate
        session = (self.storage_options.get("client_kwargs") or {}).get("timeout")
        own = [getattr(t, "total", t) for t in (session, self.storage_options.get("timeout"))]
        if not rate or any(isinstance(t, (int, float)) and t > 0 for t in own):
            return {}
        return {"timeout": _DEADLINE_GRACE + nbytes / rate} if self.fs.async_impl else {}

    # -- reading

    def reported_size(self, key: str = "") -> int | None:
        """Size in bytes of object ``key`` as the server reports it; None when it reports
        none (an HTTP server that sends no Content-Length)."""
        path = self.fs_path(key)
        size = self.call("size", key, lambda: self.fs.size(path))
        return None if size is None else int(size)

    def size(self, key: str = "") -> int:
        """Size in bytes of object ``key`` (``reported_size``, required)."""
        size = self.reported_size(key)
        if size is None:
            raise RemoteError(
                f"{self.url_of(key)}: the server does not report the object's size (no "
                "Content-Length), which reading it needs. Serve the pack with a server that "
                "sends Content-Length (check any proxy or compression in between)"
            )
        return size

    def read_bytes(self, key: str = "", start: int | None = None, end: int | None = None) -> bytes:
        """The bytes of ``key`` (``[start, end)`` if given), for small objects (a manifest,
        a footer). Over HTTP a range is read as a stream: a server that ignores ``Range``
        sends the object from its start, of which only the range is kept."""
        path = self.fs_path(key)
        if start is None or end is None:
            return bytes(self.call("read", key, lambda: self.fs.cat_file(path)))
        n = end - start

        def read() -> bytes:
            if self.protocol in HTTP_PROTOCOLS:
                data = self._read_range(key, start, end)
            else:
                data = bytes(self.fs.cat_file(path, start=start, end=end, **self._deadline(n)))
            if len(data) < n:
                raise ShortReadError(f"got {len(data)} of {n} bytes")
            return data

        return self.call("read", key, read)

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` over HTTP, streamed: a body longer than the range is the
        object (Range ignored), whose bytes before ``start`` are dropped as they come."""
        headers = dict(getattr(self.fs, "kwargs", {}).get("headers") or {})
        headers["Range"] = f"bytes={start}-{end - 1}"
        options: dict[str, Any] = {"block_size": 0, "size": end, "headers": headers}
        limit = self._deadline(end).get("timeout")
        if limit is not None:
            import aiohttp

            options["timeout"] = aiohttp.ClientTimeout(total=limit, sock_connect=30, sock_read=60)
        body = bytearray()
        received = 0
        with self.fs.open(self.fs_path(key), "rb", **options) as f:
            while received < end:
                chunk = f.read(_CHUNK)
                if not chunk:
                    break
                body += chunk
                received += len(chunk)
                if received > end - start:  # the whole object: keep what reaches the range
                    del body[: max(0, len(body) - (received - start))]
        if received <= end - start:
            return bytes(body)
        log.warning("%s: the server ignores Range requests", self.url_of(key))
        return bytes(body[: end - start]) if received >= end else b""

    def download(
        self,
        key: str,
        dest: str | os.PathLike[str],
        *,
        expected_size: int | None = None,
        verify: Callable[[Path], bool] | None = None,
    ) -> Path:
        """Download ``key`` to the local file ``dest``, atomically; return ``dest``.

        The bytes go to a temporary file beside ``dest``, are checked (size; ``verify(path)``
        must return True) and fsynced, then renamed: ``dest`` is never a partial or unchecked
        file. A body ending short is retried as a cut, but the same end twice is the object's
        size and raises; a mismatch under ``verify`` downloads once more, then raises
        ``ChecksumError``.
        """
        dest = Path(dest)
        size = self.size(key) if expected_size is None else expected_size
        if size < 0:
            raise ValueError(f"expected_size must be >= 0, got {size}")
        path, deadline = self.fs_path(key), self._deadline(size)
        ends: set[int] = set()
        damaged = []

        def attempt() -> Path:
            tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:12]}.partial"
            try:
                self.fs.get_file(path, str(tmp), **deadline)
                got = tmp.stat().st_size
                if got != size:
                    if got in ends or got > size:
                        raise RemoteError(
                            f"{self.url_of(key)}: the object has {got} bytes, the manifest says "
                            f"{size}. The manifest and the object disagree: re-upload the pack "
                            "(or pack it again)"
                        )
                    ends.update([got] if got else [])  # an empty body shows no size
                    raise ShortReadError(f"the body ended after {got} of {size} bytes")
                if verify is not None and not verify(tmp):
                    damaged.append(tmp)
                    if len(damaged) == 2:
                        raise ChecksumError(
                            f"{self.url_of(key)}: object {key or dest.name!r} does not match "
                            "its checksum in the manifest, twice. The object on the server is "
                            "damaged or was replaced without its manifest: re-upload the pack "
                            "(or pack it again)"
                        )
                    raise ShortReadError("the download does not match its checksum")
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, dest)
                _fsync_dir(dest.parent)
                return dest
            finally:
                tmp.unlink(missing_ok=True)

        return self.call("download", key, attempt)

    # -- writing

    def upload_file(self, local: str | os.PathLike[str], key: str = "") -> None:
        """Upload the local file ``local`` as ``key``, so that no reader sees it half written."""
        local, path = os.fspath(local), self.fs_path(key)
        if self.protocol not in _LOCAL:  # object stores write an object atomically
            self.call("upload", key, lambda: self.fs.put_file(local, path))
            return
        tmp = f"{path}.{uuid.uuid4().hex[:12]}.partial"  # a rename is atomic, a copy is not

        def put() -> None:
            try:
                self.fs.put_file(local, tmp)
                self.fs.mv(tmp, path)
            finally:
                if self.fs.exists(tmp):
                    self.fs.rm_file(tmp)

        self.call("upload", key, put)

    def upload_folder(
        self,
        folder: str | os.PathLike[str],
        *,
        last: Iterable[str] = ("manifest.json",),
        threads: int = 4,
    ) -> list[str]:
        """Upload every file of ``folder`` (recursively) below this URL; return the keys.

        The files named in ``last`` go up after all others, in that order, so a reader that
        finds the manifest finds every shard it names. Nothing is deleted at the destination.
        """
        root = Path(folder)
        if not root.is_dir():
            raise NotADirectoryError(f"{root}: not a folder")
        later = list(last)
        for name in later:
            if not (root / name).is_file():
                raise FileNotFoundError(f"{root / name}: missing; it must be uploaded last")
        keys = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        first = [k for k in keys if k not in later]
        if self.protocol in _LOCAL:
            for key in {k.rpartition("/")[0] for k in keys}:
                self.fs.makedirs(self.fs_path(key), exist_ok=True)
        with ThreadPoolExecutor(max(1, threads)) as pool:
            for future in [pool.submit(self.upload_file, root / k, k) for k in first]:
                future.result()
        for key in later:
            self.upload_file(root / key, key)
        self.fs.invalidate_cache()
        return first + later


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0].rstrip('.')}" if text else type(exc).__name__


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
