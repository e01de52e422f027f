"""What a failed remote call means, and how often ``RemoteStore.call`` retries a transfer: all
but not found, denied and fatal (other 4xx, full disk, bug) is transient (408/429/5xx, stall)."""

from __future__ import annotations

import enum
import errno
import math
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RETRY_ATTEMPTS_ENV = "TORCH_SERIALIZED_RETRY_ATTEMPTS"
RETRY_MAX_DELAY_ENV = "TORCH_SERIALIZED_RETRY_MAX_DELAY"
MIN_RATE_ENV = "TORCH_SERIALIZED_MIN_RATE"
_MIN_RATE = 16 << 10  # bytes per second: min_rate's default
# Raised as they are: bugs, not faults of the remote.
BUGS = (TypeError, AttributeError, NameError, AssertionError, NotImplementedError)
_LOCAL_ERRNO = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}  # retrying cannot help


class Fault(enum.Enum):
    """What a failed remote call means for the caller."""

    TRANSIENT = "transient"  # retry with backoff
    NOT_FOUND = "not found"
    DENIED = "denied"  # credentials or permissions
    FATAL = "fatal"  # a bad request, a full disk, a bug


class ShortReadError(ConnectionError):
    """A body ended before the bytes asked for, or failed its check: retried."""


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during (each once)."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo and len(seen) < 16:
        e = todo.pop(0)
        if all(e is not s for s in seen):
            seen.append(e)
            todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)
    return seen


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (aiohttp, gcsfs's ``HttpError``, botocore)."""
    response = getattr(exc, "response", None)
    candidates = [getattr(exc, "status", None)]
    if isinstance(response, Mapping):
        candidates.append(response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
    if type(exc).__name__ == "HttpError":  # gcsfs; others' ``code`` may be a parser's
        candidates.append(getattr(exc, "code", None))
    for value in candidates:
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def classify_error(exc: BaseException) -> Fault:
    """What a remote call's exception means (fsspec's standard exceptions, any HTTP status)."""
    if isinstance(exc, ShortReadError):  # ours: a body cut or damaged, whatever it happened in
        return Fault.TRANSIENT
    for e in causes(exc):
        if isinstance(e, PermissionError) or (
            isinstance(e, OSError) and str(e).startswith("Forbidden")  # gcsfs's 403
        ):
            return Fault.DENIED
        status = http_status(e)
        if status is not None and e.__cause__ is None:  # with a cause: a client parser's
            if status in (404, 410):
                return Fault.NOT_FOUND
            if status in (401, 403):
                return Fault.DENIED
            transient = status in (408, 425, 429) or status >= 500
            return Fault.TRANSIENT if transient else Fault.FATAL
        if isinstance(e, FileNotFoundError) and e.__cause__ is None:
            return Fault.NOT_FOUND  # with a cause (fsspec's HTTP size probe, s3fs): it decides
        if isinstance(e, BUGS) or (isinstance(e, OSError) and e.errno in _LOCAL_ERRNO):
            return Fault.FATAL
    return Fault.TRANSIENT


@dataclass(frozen=True)
class RetryPolicy:
    """How transient faults are retried: ``attempts`` tries in all, exponential backoff.
    Retry ``k`` waits ``min(max_delay, base_delay * 2 ** (k - 1))``, less a random half with
    ``jitter`` (workers do not retry in step). ``min_rate`` (bytes/s) stalls a transfer of known
    length after 60 s plus its size at that rate (HTTP, S3, GCS); ``0``: no deadline."""

    attempts: int = 5
    base_delay: float = 0.5
    max_delay: float = 20.0
    jitter: bool = True
    min_rate: float = _MIN_RATE

    def __post_init__(self) -> None:
        rate = self.min_rate
        rate_ok = type(rate) in (int, float) and math.isfinite(rate) and (rate == 0 or rate >= 1)
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be an int >= 1, got {self.attempts!r}")
        if not 0 <= self.base_delay <= self.max_delay:
            raise ValueError(f"RetryPolicy needs 0 <= base_delay <= max_delay, got {self!r}")
        if not rate_ok:
            raise ValueError(f"RetryPolicy.min_rate must be 0 or a number >= 1, got {rate!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RetryPolicy:
        """Defaults with ``TORCH_SERIALIZED_RETRY_ATTEMPTS``, ``TORCH_SERIALIZED_RETRY_MAX_DELAY``
        (s) and ``TORCH_SERIALIZED_MIN_RATE`` (bytes/s) applied if set, alike in every worker."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for variable, key, kind, unit in (
            (RETRY_ATTEMPTS_ENV, "attempts", int, "tries in all"),
            (RETRY_MAX_DELAY_ENV, "max_delay", float, "seconds"),
            (MIN_RATE_ENV, "min_rate", float, "bytes per second"),
        ):
            text = environ.get(variable, "").strip()
            try:
                if text:
                    values[key] = kind(text)
                    values["base_delay"] = min(cls.base_delay, values.get("max_delay", 1e9))
                    cls(**values)
            except ValueError as exc:
                raise ValueError(
                    f"{variable}={text!r} is not valid ({unit}; {exc}); unset it or give e.g. "
                    f"{variable}={getattr(cls, key)}"
                ) from None
        return cls(**values)

    def delay(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first retry)."""
        full = min(self.max_delay, self.base_delay * 2.0 ** (retry - 1))
        return full / 2 + rng.uniform(0.0, full / 2) if self.jitter else full
