"""Pack locations at URLs and the transfer of single objects to and from them.

Design
------
* **A location** is either a local path or an fsspec URL (``s3://``, ``gs://``, ``https://``,
  ``http://``, ``file://``, ``memory://``...). :func:`is_url` decides, and only a ``str`` with a
  scheme of two or more letters is a URL: an ``os.PathLike`` never is, so a local path never
  reaches fsspec or the cache.
* **Backends load lazily.** :class:`RemoteStore` opens its fsspec filesystem on first use, in the
  process that uses it (again after a fork, never pickled), so ``import torch_serialized`` and
  local use never import s3fs, gcsfs or aiohttp. A missing backend names the extra to install.
* **One retry layer, ours.** Each remote call goes through :func:`classify_error`, which maps what
  s3fs/botocore, gcsfs, fsspec's HTTP filesystem (aiohttp) and the OS raise to a
  :class:`Fault`: transient faults (connection reset/refused, timeouts, truncated bodies, HTTP 408,
  429 and 5xx) are retried with exponential backoff and jitter under a :class:`RetryPolicy`;
  404 and 401/403 raise at once. A body that ends cleanly short of the expected size is read
  once more; the same end twice is the object's size (a wrong manifest) and raises at once,
  see :class:`_CleanEnds`. For S3 the backends' own retries (botocore's and s3fs's) are
  turned off unless ``storage_options`` sets them, otherwise their counts multiply ours and a dead
  endpoint hangs for minutes whatever the policy says. gcsfs keeps its own retries. A read of
  known length must end within 60 s plus its size at the policy's ``min_rate`` (16 KiB/s,
  ``TORCH_SERIALIZED_MIN_RATE``; 0: no deadline) times the parts of its download in flight
  (fsspec's ``timeout``), so a server that drips bytes just fast enough for the socket
  timeouts still times out (unless ``storage_options`` gives aiohttp a ``ClientTimeout``
  with a ``total``).
* **Downloads are ranged parts.** An object is fetched as parts of ``part_size`` bytes
  (``cat_file(path, start, end)``, a few in parallel) written with ``pwrite`` into a temporary file
  of the final size in the destination folder, then checked (every part's length; the caller's
  ``verify``), fsynced and renamed. A dropped connection costs one part, not the object; parallel
  requests hide per-request latency; every fsspec backend supports it. A server that ignores
  ``Range`` (``python -m http.server``) is detected once and read as one stream instead,
  under the deadline of one read of the object's size; over HTTP the probe (a request for the
  first part) is itself read as a stream into the file, so the whole object it brings from
  such a server is kept without being held in memory; a ranged read (a footer) is streamed
  too, keeping only its range.
  A checksum mismatch re-downloads once, then raises
  :class:`~torch_serialized.errors.ChecksumError`.
* **Uploads put the manifest last**, so a reader never sees a manifest naming missing shards.
  Object stores write an object atomically; on ``file://`` an object is written to a temporary
  name and renamed.

Messages name the URL with any password and query string hidden.
"""

# More than 400 lines: one transfer layer (fault classes, the retry policy, ranged downloads
# and manifest-last uploads) that every backend goes through.

from __future__ import annotations

import asyncio
import enum
import errno
import http.client
import itertools
import logging
import math
import multiprocessing.util
import os
import random
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit, urlunsplit

from ..errors import ChecksumError, RemoteAccessError, RemoteError, RemoteNotFoundError

__all__ = [
    "Fault",
    "RetryPolicy",
    "RemoteStore",
    "classify_error",
    "is_url",
    "protocol_of",
    "redact_url",
    "revive_fsspec_loop",
    "HTTP_PROTOCOLS",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PART_SIZE = 8 << 20
DEFAULT_CONCURRENCY = 4
_STREAM_CHUNK = 1 << 20
# A read of n bytes, with k reads in flight together, must end within
# _DEADLINE_GRACE + n * k / RetryPolicy.min_rate seconds: a server
# that drips a byte a minute beats aiohttp's sock_read timeout forever, this it does not.
_MIN_RATE = 16 << 10  # bytes per second, shared by the reads in flight: min_rate's default
_DEADLINE_GRACE = 60.0  # seconds, as sock_read
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+://")
# Which extra brings the backend of a protocol, for the message when it is missing.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}
# Protocols whose object writes are atomic (a reader sees the old object or the whole new one).
_ATOMIC_PUT = {"s3", "s3a", "gs", "gcs", "memory", "az", "abfs", "abfss", "adl"}
_LOCAL = {"file", "local"}


def is_url(location: str | os.PathLike[str]) -> bool:
    """True if ``location`` is an fsspec URL; a path object or a plain path is local."""
    return isinstance(location, str) and _URL.match(location) is not None


#: URL schemes of fsspec's HTTP filesystem: reads only, streamed GETs, servers that may
#: ignore ``Range``.
HTTP_PROTOCOLS = frozenset({"http", "https"})


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


# --------------------------------------------------------------------------- faults and retries


class Fault(enum.Enum):
    """What a failed remote call means for the caller."""

    TRANSIENT = "transient"  # retry with backoff
    NOT_FOUND = "not found"  # the object or bucket does not exist: never retried
    DENIED = "denied"  # credentials or permissions: never retried
    FATAL = "fatal"  # anything else (bad request, bug): never retried


class ShortReadError(ConnectionError):
    """A response body ended before the bytes asked for: a cut connection, retried."""


class _CleanEnds:
    """Where the bodies of one download ended cleanly (no connection error) before the
    bytes asked for, as the object's size each one shows.

    A client cannot always tell such an end from a cut: a body delimited by the connection's
    close (or re-framed by a proxy) ends the same way. Once is therefore retried as a cut; a
    second body ending at the same byte (a cut lands there twice only by chance) shows the
    object's size, and fails at once instead of using up the retries as an outage would. An
    empty body shows nothing: a busy server or proxy that sends headers and closes does that
    again and again, so it stays a cut, retried to the end of the policy.
    """

    def __init__(self, url: str, claimed: int) -> None:
        self.url = url
        self.claimed = claimed
        self._seen: set[int] = set()

    def short(self, size: int, detail: str, received: int) -> ShortReadError:
        """The error of a body of ``received`` bytes that ended cleanly with the object's
        first ``size`` bytes: ``ShortReadError`` (retried) the first time; raises
        ``RemoteError`` (not retried) the second."""
        self.note(size, received)
        return ShortReadError(f"{detail}; the body ended cleanly, reading once more to confirm")

    def note(self, size: int, received: int) -> None:
        """Count a clean end at ``size`` bytes of a body of ``received`` bytes (an empty one
        counts for nothing); the second at that byte raises."""
        if not received:
            return
        if size in self._seen:
            raise RemoteError(
                f"{self.url}: the object has {size} bytes, the manifest says {self.claimed}: "
                "two reads ended cleanly at that byte, with no connection error. The manifest "
                "and the object disagree: re-upload the pack (or pack it again). (If a proxy "
                "between you and the server cuts bodies at a fixed size, that is the cause "
                "instead.)"
            )
        self._seen.add(size)


class _RangeIgnoredError(Exception):
    """The server answered a ranged read with more bytes than asked: it ignores ``Range``."""

    def __init__(self, data: bytes) -> None:
        super().__init__(f"asked for a range, got {len(data)} bytes")
        self.data = data


# Raised as they are, not as a RemoteError: bugs, and the signal that Range is ignored.
_OURS_TO_FIX = (
    TypeError,
    AttributeError,
    NameError,
    AssertionError,
    NotImplementedError,
    _RangeIgnoredError,
)
_TRANSIENT_STATUS = {408, 425, 429}
_S3_CODES = {
    "NoSuchKey": 404,
    "NoSuchBucket": 404,
    "NotFound": 404,
    "AccessDenied": 403,
    "AllAccessDisabled": 403,
    "InvalidAccessKeyId": 403,
    "SignatureDoesNotMatch": 403,
    "ExpiredToken": 403,
    "InvalidToken": 403,
    "SlowDown": 503,
    "ServiceUnavailable": 503,
    "InternalError": 500,
    "RequestTimeout": 408,
    "RequestTimeTooSkewed": 403,
    "TooManyRequests": 429,
    "Throttling": 429,
    "ThrottlingException": 429,
}
_TRANSIENT_ERRNO = {
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EAGAIN,
    errno.EBUSY,  # s3fs: SlowDown / 503
    errno.ENETUNREACH,
    errno.EHOSTUNREACH,
    getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs: InternalError / 500
}
# Transient exception classes of the backends, looked up only in modules already imported: an
# exception of a module that is not loaded cannot have been raised, and nothing gets imported.
_BACKEND_TRANSIENT = {
    "aiohttp": ("ClientConnectionError", "ClientPayloadError", "ServerTimeoutError"),
    "botocore.exceptions": (
        "HTTPClientError",
        "ConnectionError",
        "ConnectionClosedError",
        "EndpointConnectionError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ResponseStreamingError",
        "IncompleteReadError",
    ),
    "urllib3.exceptions": ("ProtocolError", "IncompleteRead", "TimeoutError"),
    "requests.exceptions": ("ConnectionError", "ChunkedEncodingError", "Timeout"),
    "google.auth.exceptions": ("TransportError",),
    "fsspec.exceptions": ("FSTimeoutError",),
}


#: A response the HTTP client could not parse (a bad status line, Content-Length or chunk size:
#: a middlebox or a server crashing mid-response). aiohttp reports it as a response with
#: status 400 raised from one of these, so its status is the client's, not the server's.
_GARBLED = {"aiohttp.http_exceptions": ("HttpProcessingError",)}


def _transient_types() -> tuple[type[BaseException], ...]:
    builtin = (ConnectionError, TimeoutError, asyncio.TimeoutError, http.client.IncompleteRead)
    return builtin + _backend_types(_BACKEND_TRANSIENT)


def _backend_types(names: Mapping[str, tuple[str, ...]]) -> tuple[type[BaseException], ...]:
    """The exception classes ``names`` lists per module, of the backends imported so far."""
    found: list[type[BaseException]] = []
    for module_name, classes in names.items():
        module = sys.modules.get(module_name)
        for name in classes:
            cls = getattr(module, name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                found.append(cls)
    return tuple(found)


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during (each once)."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo and len(seen) < 16:
        e = todo.pop(0)
        if any(e is s for s in seen):
            continue
        seen.append(e)
        todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)
    return seen


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status an exception carries, whichever backend raised it."""
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):  # botocore ClientError
        code = response.get("Error", {}).get("Code")
        if code in _S3_CODES:
            return _S3_CODES[code]
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
        if isinstance(code, str) and code.isdigit():
            return int(code)
    # aiohttp ClientResponseError.status (also urllib's HTTPError), requests' HTTPError, gcsfs's
    # HttpError.code. Not any ``code``: aiohttp's parser errors carry a code 400 for a cut body.
    candidates = [getattr(exc, "status", None), getattr(response, "status_code", None)]
    if type(exc).__name__ == "HttpError":
        candidates.append(getattr(exc, "code", None))
    for value in candidates:
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def _fault_of_status(status: int) -> Fault:
    if status in (404, 410):
        return Fault.NOT_FOUND
    if status in (401, 403):
        return Fault.DENIED
    if status in _TRANSIENT_STATUS or status >= 500:
        return Fault.TRANSIENT
    return Fault.FATAL


def classify_error(exc: BaseException) -> Fault:
    """What a remote call's exception means: retry it, or report not found / denied / fatal.

    Knows the exceptions of s3fs (and botocore/aiobotocore under it), gcsfs, fsspec's HTTP
    filesystem (aiohttp) and the OS; an HTTP status anywhere in the exception chain decides first.
    """
    chain = _causes(exc)
    garbled = _backend_types(_GARBLED)
    for e in chain:
        status = _http_status(e)
        if status is not None:
            if isinstance(e.__cause__, garbled):  # the client's parser made up this status
                return Fault.TRANSIENT
            return _fault_of_status(status)
    transient = _transient_types()
    for k, e in enumerate(chain):
        if isinstance(e, FileNotFoundError):
            # fsspec's HTTP ``_info`` raises FileNotFoundError(url) from *any* failed GET: a
            # connection-level cause below it is an outage, not a missing object.
            if any(_is_transient(c, transient) for c in chain[k + 1 :]):
                return Fault.TRANSIENT
            return Fault.NOT_FOUND
        if isinstance(e, PermissionError):
            return Fault.DENIED
        if _is_transient(e, transient):
            return Fault.TRANSIENT
        if isinstance(e, OSError) and str(e).startswith("Forbidden"):  # gcsfs's 403
            return Fault.DENIED
    return Fault.FATAL


def _is_transient(exc: BaseException, transient: tuple[type[BaseException], ...]) -> bool:
    """True if ``exc`` is a connection-level failure (a transient class or errno)."""
    if isinstance(exc, transient):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNO


#: Environment variables that change the default ``RetryPolicy`` (``RetryPolicy.from_env``).
RETRY_ATTEMPTS_ENV = "TORCH_SERIALIZED_RETRY_ATTEMPTS"
RETRY_MAX_DELAY_ENV = "TORCH_SERIALIZED_RETRY_MAX_DELAY"
MIN_RATE_ENV = "TORCH_SERIALIZED_MIN_RATE"


@dataclass(frozen=True)
class RetryPolicy:
    """How transient faults are retried: ``attempts`` tries in all, exponential backoff.

    The wait before retry ``k`` (1, 2, ...) is ``min(max_delay, base_delay * 2 ** (k - 1))``;
    with ``jitter`` a uniformly random half of it is dropped, so that many workers retrying
    together do not hit the server in step.

    ``min_rate`` (bytes per second) decides when a read counts as stalled, a fault retried
    like the others: a read of known length must end within 60 s plus its size at
    ``min_rate`` shared by the parts of its download in flight, so that a server dripping
    bytes cannot hold it forever. The deadline applies on fsspec's async backends (HTTP, S3,
    GCS) only: reads on the others (``file://``, ``memory://``...) have none. Lower it for a
    slower link; ``0`` turns the deadline off (the backends' socket timeouts still apply).
    """

    attempts: int = 5
    base_delay: float = 0.5
    max_delay: float = 20.0
    jitter: bool = True
    min_rate: float = _MIN_RATE

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be an int >= 1, got {self.attempts!r}")
        if not 0 <= self.base_delay <= self.max_delay:
            raise ValueError(
                "RetryPolicy needs 0 <= base_delay <= max_delay, got "
                f"base_delay={self.base_delay!r}, max_delay={self.max_delay!r}"
            )
        rate = self.min_rate
        if (
            isinstance(rate, bool)
            or not isinstance(rate, (int, float))
            or not math.isfinite(rate)
            or (rate != 0 and rate < 1)
        ):
            raise ValueError(
                "RetryPolicy.min_rate must be 0 (reads have no deadline) or a finite number "
                f"of bytes per second >= 1, got {rate!r}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RetryPolicy:
        """The default policy, with ``TORCH_SERIALIZED_RETRY_ATTEMPTS`` (tries in all),
        ``TORCH_SERIALIZED_RETRY_MAX_DELAY`` (seconds) and ``TORCH_SERIALIZED_MIN_RATE``
        (bytes per second, ``min_rate``) applied when set: how a training job changes retries
        and read deadlines without code, in every DataLoader worker and rank alike."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        given: list[str] = []
        for variable, key, kind, unit in (
            (RETRY_ATTEMPTS_ENV, "attempts", int, "tries in all"),
            (RETRY_MAX_DELAY_ENV, "max_delay", float, "seconds"),
            (MIN_RATE_ENV, "min_rate", float, "bytes per second"),
        ):
            text = environ.get(variable)
            if text is None or not text.strip():
                continue
            given.append(f"{variable}={text!r}")
            try:
                values[key] = kind(text)
            except ValueError:
                raise ValueError(
                    f"{variable}={text!r} is not a number ({unit}); unset it or give e.g. "
                    f"{variable}={getattr(cls, key)}"
                ) from None
        if "max_delay" in values:
            values["base_delay"] = min(cls.base_delay, values["max_delay"])
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"{exc} (from the environment: {', '.join(given)})") from None

    def delay(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first retry)."""
        full = min(self.max_delay, self.base_delay * 2.0 ** (retry - 1))
        return full / 2 + rng.uniform(0.0, full / 2) if self.jitter else full


# --------------------------------------------------------------------------- the store


class PerProcess:
    """Instances that hold things of the process using them: locks, thread pools, open
    descriptors, and ``_pid``, the process they were made in.

    ``_reset`` makes exactly the attributes ``_PER_PROCESS`` names (tests/test_per_process.py
    checks each subclass): pickling drops those names and unpickling calls ``_reset``, so a
    spawned DataLoader worker makes its own; ``_check_fork`` calls it in a forked child.
    Subclasses call ``_start`` (not ``_reset``) when made: a child that ``multiprocessing``
    forks (a DataLoader worker) then resets at once, in its one thread, before two of its
    threads can both find the parent's state and reset it twice (each closing what the
    other had just opened).
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
    itself (a single-file pack). ``storage_options`` go to fsspec as they are (credentials,
    ``endpoint_url``, timeouts...). Safe to share between threads; pickles without its
    filesystem, which each process opens for itself on first use.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        max_concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        if not is_url(url):
            raise ValueError(f"{url!r} is not a URL (a local path is read without RemoteStore)")
        if part_size < 1 or max_concurrency < 1:
            raise ValueError("part_size and max_concurrency must be >= 1")
        self.url = url.rstrip("/") if not url.endswith("://") else url
        self.protocol = protocol_of(url)
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        self.retry = retry or RetryPolicy.from_env()
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self._start()

    _PER_PROCESS = ("_pid", "_lock", "_fs", "_root", "_ranges_ok", "_rng")

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._fs: Any = None
        self._root = ""
        self._ranges_ok: bool | None = None
        self._rng = random.Random()  # never the global RNG: the user's seeds stay untouched

    def __repr__(self) -> str:
        return f"RemoteStore({redact_url(self.url)!r})"

    # -- naming

    def url_of(self, key: str = "") -> str:
        """The URL of ``key`` below this location, for messages (password hidden)."""
        return redact_url(f"{self.url}/{key}" if key else self.url)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem, opened on first use in this process."""
        self._check_fork()  # a forked child: the parent's event loop and sessions are unusable
        with self._lock:
            if self._fs is None:
                self._fs, self._root = self._open()
            return self._fs

    def _open(self) -> tuple[Any, str]:
        from fsspec.core import url_to_fs  # fsspec is light; it imports backends on demand

        revive_fsspec_loop()
        try:
            options = _with_default_timeouts(self.protocol, self.storage_options)
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
        if self.protocol in ("s3", "s3a") and "retries" not in self.storage_options:
            fs.retries = 1  # s3fs's own retry loop; ours is the one that counts
        return fs, str(root).rstrip("/")

    def _path(self, key: str) -> str:
        self.fs  # noqa: B018 - opens the filesystem and sets the root
        return f"{self._root}/{key}" if key else self._root

    def fs_path(self, key: str = "") -> str:
        """The path of ``key`` as ``fs`` names it (no scheme)."""
        return self._path(key)

    # -- retries

    def call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """``fn()`` under the retry policy; errors become ours, naming the URL of ``key``."""
        policy = self.retry
        for attempt in range(1, policy.attempts + 1):
            try:
                return fn()
            except RemoteError:
                raise  # ours already: it names the URL and says what to do
            except Exception as exc:
                fault = classify_error(exc)
                if fault is Fault.TRANSIENT and attempt < policy.attempts:
                    pause = policy.delay(attempt, self._rng)
                    log.info(
                        "%s %s: %s (attempt %d of %d), retrying in %.2fs",
                        what,
                        self.url_of(key),
                        _describe(exc),
                        attempt,
                        policy.attempts,
                        pause,
                    )
                    time.sleep(pause)
                    continue
                if fault is Fault.FATAL and isinstance(exc, _OURS_TO_FIX):
                    raise  # a programming error stays what it is
                raise self._error(what, key, fault, exc, attempt) from exc
        raise AssertionError("unreachable")  # pragma: no cover

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
        if fault is Fault.TRANSIENT:
            transient = _transient_types()  # name the outage, not a wrapper around it
            cause = next((e for e in _causes(exc) if _is_transient(e, transient)), exc)
            slow = ""
            if any(isinstance(e, TimeoutError) for e in _causes(exc)) and self.retry.min_rate:
                slow = (
                    f"; on a link slower than {self.retry.min_rate:g} bytes/s per download, "
                    f"lower {MIN_RATE_ENV} (0: reads have no deadline)"
                )
            return RemoteError(
                f"{url}: {what} failed {attempt} times, the last with {_describe(cause)}. Check "
                "the network and the endpoint, or allow more attempts (environment variable "
                f"{RETRY_ATTEMPTS_ENV}, now {self.retry.attempts}){slow}"
            )
        if any(_http_status(e) == 416 for e in _causes(exc)):
            return RemoteError(
                f"{url}: {what} failed: the object is shorter than expected (HTTP 416). The "
                "manifest and the object disagree: re-upload the pack"
            )
        return RemoteError(f"{url}: {what} failed: {_describe(exc)}")

    # -- reading

    def reported_size(self, key: str = "") -> int | None:
        """Size in bytes of the object ``key`` as the server reports it; None when it reports
        none (an HTTP server that sends no Content-Length)."""
        path = self._path(key)
        size = self.call("size", key, lambda: self.fs.size(path))
        return None if size is None else int(size)

    def size(self, key: str = "") -> int:
        """Size in bytes of the object ``key`` (``reported_size``, required)."""
        size = self.reported_size(key)
        if size is None:
            raise RemoteError(
                f"{self.url_of(key)}: the server does not report the object's size (no "
                "Content-Length), which reading it needs. Serve the pack with a server that "
                "sends Content-Length (check any proxy or compression in between); callers of "
                "RemoteStore.download may pass expected_size instead"
            )
        return size

    def read_bytes(self, key: str = "", start: int | None = None, end: int | None = None) -> bytes:
        """The bytes of ``key`` (``[start, end)`` if given), for small objects (a manifest).

        On a server that ignores ``Range`` a ranged read gets the whole object and returns the
        range asked for out of it (and later downloads stream); over HTTP it is read as a
        stream (``_read_range``), so that only the range is held, never the object.
        """
        http = self.protocol in HTTP_PROTOCOLS
        if http and start is not None and end is not None and 0 <= start < end:
            return self.call("read", key, lambda: self._read_range(key, start, end))
        try:
            return self._read_bytes(key, start, end)
        except _RangeIgnoredError as exc:
            self._ranges_ok = False
            if start is not None and end is not None and len(exc.data) >= end:
                log.warning("%s: the server ignores Range requests", self.url_of(key))
                return exc.data[start:end]
            raise RemoteError(
                f"{self.url_of(key)}: asked for bytes {start} to {end}, the server ignored the "
                f"range and sent the whole object, {len(exc.data)} bytes: the object is shorter "
                "than expected. It changed while being read (open it again), or the manifest and "
                "the object disagree (re-upload the pack)"
            ) from None

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``key`` over HTTP, read as a stream: a server that ignores
        ``Range`` sends the object from its first byte, of which the bytes before ``start`` are
        dropped as they come and the rest is left unread past ``end``, so memory holds the range
        and a chunk whatever the object's size. The body's length tells which it sent: the
        range alone (``end - start`` bytes, then the end), or more (the object). Until Range is
        known to be honoured, the read has the deadline of ``end`` bytes (the object up to it)."""
        n = end - start
        limit = self._deadline(n if self._ranges_ok else end).get("timeout")
        options = self._http_stream(end, limit, (start, end))
        body = bytearray()  # the body's bytes from ``dropped`` on
        received = dropped = 0
        whole = False  # more than the range came: the object, from its first byte
        with self.fs.open(self._path(key), "rb", **options) as f:
            while not whole or received < end:
                chunk = f.read(_STREAM_CHUNK)
                if not chunk:
                    break
                body += chunk
                received += len(chunk)
                whole = whole or received > n
                if whole and dropped < start:  # the object's bytes before the range
                    cut = min(start - dropped, len(body))
                    del body[:cut]
                    dropped += cut
        if not whole:
            if received < n:  # no error: a cut not noticed, or the object ends there
                raise ShortReadError(f"got {received} of {n} bytes")
            return bytes(body)
        self._ranges_ok = False
        if received < end:
            raise RemoteError(
                f"{self.url_of(key)}: asked for bytes {start} to {end}, the server ignored the "
                f"range and sent the whole object, {received} bytes: the object is shorter than "
                "expected. It changed while being read (open it again), or the manifest and the "
                "object disagree (re-upload the pack)"
            )
        log.warning("%s: the server ignores Range requests", self.url_of(key))
        return bytes(body[:n])

    def _read_bytes(
        self,
        key: str,
        start: int | None,
        end: int | None,
        in_flight: int = 1,
        ends: _CleanEnds | None = None,
    ) -> bytes:
        """``read_bytes``, but a server that ignores ``Range`` raises ``_RangeIgnoredError``;
        ``in_flight``: reads running together, sharing the link (``_deadline``); ``ends``: a
        download's clean short bodies, which a second one at the same byte confirms."""
        path = self._path(key)
        nbytes = None if start is None or end is None else end - start
        deadline = self._deadline(nbytes, in_flight)

        def read() -> bytes:
            data = bytes(self.fs.cat_file(path, start=start, end=end, **deadline))
            if start is not None and end is not None and len(data) != end - start:
                if len(data) < end - start:
                    detail = f"got {len(data)} of {end - start} bytes"
                    if ends is not None:  # Range was honoured: the object ends there
                        raise ends.short(start + len(data), detail, len(data))
                    raise ShortReadError(detail)
                raise _RangeIgnoredError(data)
            return data

        return self.call("read", key, read)

    def _deadline(self, nbytes: int | None, in_flight: int = 1) -> dict[str, Any]:
        """``cat_file`` options that bound a whole read of ``nbytes`` bytes in time: fsspec's
        ``timeout`` (async backends: HTTP, S3, GCS), ``_DEADLINE_GRACE`` seconds plus the
        bytes at the policy's ``min_rate`` shared by the ``in_flight`` reads of one download.
        Left out when ``min_rate`` is 0, and when ``storage_options`` bounds whole HTTP
        requests itself (an aiohttp ``ClientTimeout`` with a ``total``)."""
        rate = self.retry.min_rate
        if nbytes is None or not rate or self._bounded_by_user():
            return {}
        if not getattr(self.fs, "async_impl", 0):
            return {}
        return {"timeout": _DEADLINE_GRACE + nbytes * in_flight / rate}

    def _bounded_by_user(self) -> bool:
        """Whether ``storage_options`` bound whole HTTP requests in time: an aiohttp
        ``ClientTimeout`` with a ``total`` (or a number of seconds), for the session
        (``client_kwargs``) or for every request (fsspec's top-level ``timeout``)."""
        session = (self.storage_options.get("client_kwargs") or {}).get("timeout")
        for own in (session, self.storage_options.get("timeout")):
            if isinstance(own, (int, float)) and not isinstance(own, bool) and own > 0:
                return True
            if getattr(own, "total", None):
                return True
        return False

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
        file. A mismatch under ``verify`` downloads once more, then raises ``ChecksumError``.
        Raises ``RemoteNotFoundError``/``RemoteAccessError`` at once, ``RemoteError`` once
        transient faults have used up the retry policy.
        """
        dest = Path(dest)
        size = self.size(key) if expected_size is None else expected_size
        if size < 0:
            raise ValueError(f"expected_size must be >= 0, got {size}")
        for round_ in (1, 2):
            tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:12]}.partial"
            try:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                try:
                    self._fill(key, fd, size)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                if verify is None or verify(tmp):
                    os.replace(tmp, dest)
                    _fsync_dir(dest.parent)
                    return dest
            finally:
                tmp.unlink(missing_ok=True)
            log.warning("%s: checksum mismatch after download %d of 2", self.url_of(key), round_)
        raise ChecksumError(
            f"{self.url_of(key)}: object {key or dest.name!r} does not match its checksum in the "
            "manifest, twice. The object on the server is damaged or was replaced without its "
            "manifest: re-upload the pack (or pack it again)"
        )

    def _fill(self, key: str, fd: int, size: int) -> None:
        """Write the ``size`` bytes of ``key`` into ``fd`` (ranged parts, or one stream)."""
        os.ftruncate(fd, size)
        if size == 0:
            return
        ends = _CleanEnds(self.url_of(key), size)
        parts = [(s, min(s + self.part_size, size)) for s in range(0, size, self.part_size)]
        if len(parts) == 1:
            path = self._path(key)
            deadline = self._deadline(size)
            # HTTP: no Range header, which works with any server. Object stores honour Range,
            # and given no range s3fs asks the size (a HEAD) before its GET: the size is known
            # (confirmed by a HEAD of ours), so they get it as the range, as the parts do.
            span = {} if self.protocol in HTTP_PROTOCOLS else {"start": 0, "end": size}

            def whole() -> bytes:
                data = bytes(self.fs.cat_file(path, **span, **deadline))
                if len(data) < size:  # no error: the object's size, or a cut not noticed
                    raise ends.short(len(data), f"got {len(data)} of {size} bytes", len(data))
                return data

            data = self.call("read", key, whole)
            if len(data) != size:
                raise RemoteError(
                    f"{self.url_of(key)}: the object has {len(data)} bytes, expected {size}. "
                    "The manifest and the object disagree: re-upload the pack"
                )
            _pwrite_all(fd, data, 0)
            return
        try:
            if self._ranges_ok is None:  # learn once per process whether Range is honoured
                # a server that ignores Range answers with the whole object: the probe gets
                # the deadline of the whole object's read (that many parts in flight)
                start, end = parts[0]
                if self.protocol in HTTP_PROTOCOLS:  # the answer goes to fd as it comes
                    honoured = self.call(
                        "read", key, lambda: self._stream(key, fd, size, ends, end, len(parts))
                    )
                    self._ranges_ok = honoured
                    if not honoured:  # the probe brought the whole object: kept
                        log.warning(
                            "%s: the server ignores Range requests; streaming", self.url_of(key)
                        )
                        return
                else:  # object stores honour Range: a part's bytes
                    self._fetch_part(key, fd, start, end, len(parts), ends)
                    self._ranges_ok = True
                parts = parts[1:]
            if self._ranges_ok:
                self._fetch_parts(key, fd, parts, ends)
                return
        except _RangeIgnoredError as exc:
            self._ranges_ok = False
            log.warning("%s: the server ignores Range requests; streaming", self.url_of(key))
            if len(exc.data) == size:  # the probe brought the whole object: keep it
                _pwrite_all(fd, exc.data, 0)
                return
            if len(exc.data) < size:  # a whole body, ended cleanly: the stream confirms it
                ends.note(len(exc.data), len(exc.data))
        self.call("download", key, lambda: self._stream(key, fd, size, ends))

    def _http_stream(
        self, size: int, limit: float | None, byte_range: tuple[int, int] | None = None
    ) -> dict[str, Any]:
        """fsspec ``open`` options for one HTTP GET read as a stream: ``size`` given (no HEAD
        asking it), for ``byte_range`` (``[start, end)``) a ``Range`` header beside the
        filesystem's own headers (from ``storage_options``), and the whole request, body
        included, ended by aiohttp within ``limit`` seconds."""
        options: dict[str, Any] = {"block_size": 0, "size": size}
        if byte_range is not None:
            headers = dict(getattr(self.fs, "kwargs", {}).get("headers") or {})
            options["headers"] = {**headers, "Range": f"bytes={byte_range[0]}-{byte_range[1] - 1}"}
        if limit is not None:
            options.update(_http_deadline(self.storage_options, limit))
        return options

    def _fetch_part(
        self,
        key: str,
        fd: int,
        start: int,
        end: int,
        in_flight: int = 1,
        ends: _CleanEnds | None = None,
    ) -> None:
        _pwrite_all(fd, self._read_bytes(key, start, end, in_flight, ends), start)

    def _fetch_parts(
        self, key: str, fd: int, parts: list[tuple[int, int]], ends: _CleanEnds | None = None
    ) -> None:
        """Fetch ``parts`` with ``max_concurrency`` threads, submitting a part only when one
        ends: the first failure raises (once the parts running end) and nothing more starts;
        bookkeeping stays bounded whatever the part count (a size claimed wrongly: 2^17
        futures queued at once for 1 TiB of 8 MiB parts cost ~0.3 GB)."""
        if not parts:
            return
        threads = min(self.max_concurrency, len(parts))
        waiting = iter(parts)
        with ThreadPoolExecutor(threads) as pool:
            running = {
                pool.submit(self._fetch_part, key, fd, s, e, threads, ends)
                for s, e in itertools.islice(waiting, threads)
            }
            while running:
                done, running = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    future.result()
                for s, e in itertools.islice(waiting, len(done)):
                    running.add(pool.submit(self._fetch_part, key, fd, s, e, threads, ends))

    def _stream(
        self,
        key: str,
        fd: int,
        size: int,
        ends: _CleanEnds,
        probe: int | None = None,
        in_flight: int = 1,
    ) -> bool:
        """One sequential read of the whole object (servers without Range support, which are
        HTTP servers: object stores honour it), written to ``fd`` chunk by chunk: the object
        is never held in memory. Under the deadline of a ranged read of ``size`` bytes
        (``_deadline``), so a server that drips the body times out and the download is
        retried as a ranged read would be. A body that ends short goes to ``ends``.

        With ``probe`` (HTTP), the Range probe: asks for the first ``probe`` bytes, under the
        deadline of ``in_flight`` such parts, and returns True if the server sent them alone
        (it honours Range); False once the whole object came instead (it ignores Range,
        which ``_ranges_ok`` learns as soon as more bytes come, even from a body that is then
        cut or ends short).
        """
        from fsspec.exceptions import FSTimeoutError  # fsspec is loaded: ``fs`` is open

        os.ftruncate(fd, 0)
        os.ftruncate(fd, size)
        limit = self._deadline(size if probe is None else probe, in_flight).get("timeout")
        options: dict[str, Any] = {}
        if self.protocol in HTTP_PROTOCOLS:
            options = self._http_stream(size, limit, None if probe is None else (0, probe))
        written = 0
        began = time.monotonic()
        try:
            with self.fs.open(self._path(key), "rb", **options) as f:
                # the answer's status, where fsspec's stream shows it: 200 to a ranged request
                # is the whole object (Range ignored), whatever the body's length
                whole = probe is not None and getattr(getattr(f, "r", None), "status", 0) == 200
                if whole:
                    self._ranges_ok = False
                while written < size:
                    chunk = f.read(min(_STREAM_CHUNK, size - written))
                    if not chunk:
                        break
                    _pwrite_all(fd, chunk, written)
                    written += len(chunk)
                    if probe is not None and written > probe:
                        self._ranges_ok = False  # Range is ignored, whatever comes next
        except FSTimeoutError as exc:
            if limit is None or time.monotonic() - began < limit:  # another limit fired
                raise
            raise FSTimeoutError(  # which deadline, and how far the stream got (_error advises)
                f"the stream did not end within its deadline of {limit:.1f} s, with {written} "
                f"of {size} bytes"
            ) from exc
        if probe is not None and written == probe and not whole:
            return True  # the part asked for, then the end: Range is honoured
        if written < size:  # no error: the object's size, or a cut not noticed
            raise ends.short(written, f"the body ended after {written} of {size} bytes", written)
        return False

    # -- writing

    def upload_file(self, local: str | os.PathLike[str], key: str = "") -> None:
        """Upload the local file ``local`` as ``key``, so that no reader sees it half written."""
        local = os.fspath(local)
        path = self._path(key)
        if self.protocol in _LOCAL:  # a rename is atomic, a copy is not
            tmp = f"{path}.{uuid.uuid4().hex[:12]}.partial"

            def put() -> None:
                try:
                    self.fs.put_file(local, tmp)
                    self.fs.mv(tmp, path)
                finally:
                    if self.fs.exists(tmp):
                        self.fs.rm_file(tmp)

            self.call("upload", key, put)
        else:
            if self.protocol not in _ATOMIC_PUT:
                log.debug("%s: uploads to %s:// may not be atomic", self.url_of(key), self.protocol)
            self.call("upload", key, lambda: self.fs.put_file(local, path))

    def upload_folder(
        self,
        folder: str | os.PathLike[str],
        *,
        last: Iterable[str] = ("manifest.json",),
        threads: int = 4,
    ) -> list[str]:
        """Upload every file of ``folder`` (recursively) below this URL; return the keys.

        The files named in ``last`` (paths relative to ``folder``) go up after all others, in the
        order given, so a reader that finds the manifest finds every shard it names. Nothing is
        deleted at the destination: readers of an earlier pack keep its shards.
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
                self.fs.makedirs(self._path(key), exist_ok=True)
        with ThreadPoolExecutor(max(1, threads)) as pool:
            for future in [pool.submit(self.upload_file, root / k, k) for k in first]:
                future.result()
        for key in later:
            self.upload_file(root / key, key)
        self.fs.invalidate_cache()
        return first + later


def revive_fsspec_loop() -> None:
    """Let fsspec start a new event loop in a forked child whose loop is the parent's.

    fsspec runs every async backend (HTTP, S3, GCS) on one event loop in a thread of its
    own. Before 2025.5 it kept that loop across a fork, though the thread running it does
    not exist in the child: every call there waited for good (a DataLoader worker forked
    after the main process had read a pack at a URL hung on its first shard). Where the
    loop's thread is dead, ``fsspec.asyn.reset_lock`` (fsspec's own reset, documented for
    "the init of a forked process") makes the next call start a new one. Where the thread
    lives, or fsspec resets itself at a fork, nothing is done.
    """
    import fsspec.asyn

    thread = fsspec.asyn.iothread[0]
    if fsspec.asyn.loop[0] is not None and thread is not None and not thread.is_alive():
        fsspec.asyn.reset_lock()


def _with_default_timeouts(protocol: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` plus our defaults: no backend retries for S3, read timeouts for HTTP."""
    out = dict(options)
    if protocol in ("s3", "s3a"):
        config = dict(out.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        out["config_kwargs"] = config
    elif protocol in HTTP_PROTOCOLS:
        import aiohttp  # the backend of this URL: needed now anyway

        client = dict(out.get("client_kwargs") or {})
        # aiohttp's default is 5 minutes for a whole request and no limit between bytes (the
        # reads of known length are bounded as a whole by RemoteStore._deadline).
        client.setdefault(
            "timeout", aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=60)
        )
        out["client_kwargs"] = client
    return out


def _http_deadline(options: Mapping[str, Any], seconds: float) -> dict[str, Any]:
    """Request options (fsspec's HTTP ``open``) that end one request, body included, within
    ``seconds``: the session's aiohttp ``ClientTimeout`` (of ``options``, or ours) with that
    ``total``, its other limits kept."""
    import aiohttp

    timeout = _with_default_timeouts("http", options)["client_kwargs"]["timeout"]
    if not isinstance(timeout, aiohttp.ClientTimeout):
        timeout = aiohttp.ClientTimeout()
    # built anew, field by field: the class is attrs-made in aiohttp 3, which may change
    limits = ("connect", "sock_read", "sock_connect", "ceil_threshold")
    kept = {name: getattr(timeout, name) for name in limits if hasattr(timeout, name)}
    return {"timeout": aiohttp.ClientTimeout(total=seconds, **kept)}


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0].rstrip('.')}" if text else type(exc).__name__


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
