"""Remote locations: URL rules, fault classification, retried downloads and uploads.

Downloads and uploads go to real servers on 127.0.0.1 (``remote_fixtures``) through a proxy that
injects the faults; nothing of ours is mocked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import random
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _remote_cases import NOT_GCS
from support.loopback import start_fault_proxy, start_http_server

from torch_serialized.errors import (
    ChecksumError,
    RemoteAccessError,
    RemoteError,
    RemoteNotFoundError,
)
from torch_serialized.remote.arrival import Damaged
from torch_serialized.remote.retry import Fault, RetryPolicy, classify_error
from torch_serialized.remote.store import RemoteStore, is_url, redact_url
from torch_serialized.remote.upload import upload_file, upload_folder

if TYPE_CHECKING:
    from remote_fixtures import Remote, Served

pytest_plugins = ["remote_fixtures"]

PART = 64 << 10
FAST = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.02)
# with the deadline's grace made small too: a read of n bytes must end in about n / 1 MiB/s
QUICK = dataclasses.replace(FAST, min_rate=1 << 20)


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def store(remote: Remote, retry: RetryPolicy = FAST, **options: Any) -> RemoteStore:
    return RemoteStore(remote.url, {**remote.storage_options, **options}, retry=retry)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --------------------------------------------------------------------------- locations


@pytest.mark.parametrize(
    ("location", "expected"),
    [
        ("s3://bucket/prefix/voc", True),
        ("gs://bucket/voc", True),
        ("https://example.invalid/voc", True),
        ("http://127.0.0.1:8000/voc", True),
        ("file:///tmp/voc", True),
        ("memory://voc", True),
        ("/data/voc", False),
        ("relative/voc.tser", False),
        ("C:\\data\\voc", False),
        ("c://data/voc", False),  # a drive letter, not a scheme
        (Path("s3://bucket/voc"), False),  # a path object is always local
    ],
)
def test_is_url(location: Any, expected: bool) -> None:
    assert is_url(location) is expected


def test_redact_url_hides_passwords_and_signed_queries() -> None:
    assert redact_url("https://me:secret@host/p?X-Amz-Signature=abc") == "https://me:***@host/p?…"
    assert redact_url("s3://bucket/key") == "s3://bucket/key"


def test_a_local_path_is_not_a_store() -> None:
    with pytest.raises(ValueError, match="not a URL"):
        RemoteStore("/data/voc")


def test_import_and_local_use_load_no_backend(tmp_path: Path) -> None:
    code = f"""
import sys
import torch_serialized
from torch_serialized import pack_voc, VOCSerializedDataset
from torch_serialized.remote.cache import Cache
from torch_serialized.remote.store import RemoteStore, is_url
from torch_serialized.remote.packs import resolve
from torch_serialized.tools import make_synthetic_voc
root = make_synthetic_voc({str(tmp_path)!r}, 4, year="2007")
pack = pack_voc(root, {str(tmp_path / "p.tser")!r}, year="2007").path
ds = VOCSerializedDataset(pack)
ds[0]
RemoteStore("s3://bucket/voc")  # made, not used: opens nothing
Cache({str(tmp_path / "cache")!r}).pack("s3://bucket/voc", "x")
heavy = ["s3fs", "gcsfs", "aiohttp", "botocore", "aiobotocore", "fsspec.implementations.http"]
print(sorted(m for m in heavy if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_missing_backend_names_the_package_to_install() -> None:
    """The package is installed from a clone, not an index: the hint names the backend itself
    (``pip install s3fs``), the extra only as the clone's alternative, and no verb (packing
    *to* s3:// needs it as much as reading)."""
    code = """
import sys
sys.modules["s3fs"] = None  # as if not installed
from torch_serialized.remote.store import RemoteStore
try:
    RemoteStore("s3://bucket/voc").info("manifest.json")["size"]
except ImportError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "s3://URLs" not in out.stdout and "reading" not in out.stdout
    assert "need s3fs" in out.stdout and "pip install s3fs (" in out.stdout
    assert "pip install -e '.[s3]'" in out.stdout and "s3://bucket/voc" in out.stdout


# --------------------------------------------------------------------------- classification


def _client_error(code: str, status: int) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "GetObject",
    )


def _s3fs_translated(code: str, status: int) -> Exception:
    from s3fs.errors import translate_boto_error

    return translate_boto_error(_client_error(code, status))


def _aiohttp_status(status: int) -> Exception:
    import aiohttp

    return aiohttp.ClientResponseError(None, (), status=status)  # type: ignore[arg-type]


def _aiohttp_payload() -> Exception:
    import aiohttp
    from aiohttp.http_exceptions import ContentLengthError

    try:
        raise aiohttp.ClientPayloadError("Response payload is not completed") from (
            ContentLengthError("Not enough data to satisfy content length header")
        )
    except aiohttp.ClientPayloadError as exc:
        return exc


def _aiohttp_garbled() -> Exception:
    """What aiohttp raises for a response it cannot parse (here a bad status line): a
    ``ClientResponseError`` with a status 400 of the parser's own."""
    import aiohttp
    from aiohttp.http_exceptions import BadStatusLine

    try:
        cause = BadStatusLine("HTTP/1.1 2\\x00junk")
        raise aiohttp.ClientResponseError(
            None,  # type: ignore[arg-type]
            (),
            status=cause.code,
            message=cause.message,
        ) from cause
    except aiohttp.ClientResponseError as exc:
        return exc


def _fsspec_info_outage() -> Exception:
    """What fsspec's HTTP ``_info`` raises when the server is unreachable: a wrapped outage."""
    import aiohttp

    try:
        raise FileNotFoundError("http://h/x.tser") from aiohttp.ServerDisconnectedError()
    except FileNotFoundError as exc:
        return exc


def _gcs_http(code: int) -> Exception:
    from gcsfs.retry import HttpError

    return HttpError({"code": code, "message": "m"})


def _botocore(name: str) -> Exception:
    import botocore.exceptions as be

    cls = getattr(be, name)
    return cls(endpoint_url="http://127.0.0.1:1/x", error="e")


def _requests(name: str) -> Exception:
    import requests.exceptions as re

    return getattr(re, name)("e")


CLASSIFIED = {
    # fsspec HTTP (aiohttp)
    "http 404": (lambda: FileNotFoundError("http://h/x"), Fault.NOT_FOUND),
    "http 410": (lambda: _aiohttp_status(410), Fault.NOT_FOUND),
    "http 403": (lambda: _aiohttp_status(403), Fault.DENIED),
    "http 401": (lambda: _aiohttp_status(401), Fault.DENIED),
    "http 429": (lambda: _aiohttp_status(429), Fault.TRANSIENT),
    "http 500": (lambda: _aiohttp_status(500), Fault.TRANSIENT),
    "http 503": (lambda: _aiohttp_status(503), Fault.TRANSIENT),
    "http 400": (lambda: _aiohttp_status(400), Fault.FATAL),
    "http 416": (lambda: _aiohttp_status(416), Fault.FATAL),
    "http truncated body": (_aiohttp_payload, Fault.TRANSIENT),
    "http garbled response": (_aiohttp_garbled, Fault.TRANSIENT),
    "http disconnected": (lambda: __import__("aiohttp").ServerDisconnectedError(), Fault.TRANSIENT),
    "http size probe cut": (_fsspec_info_outage, Fault.TRANSIENT),
    # s3fs, as it translates botocore's errors, and botocore's own
    "s3 NoSuchKey": (lambda: _s3fs_translated("NoSuchKey", 404), Fault.NOT_FOUND),
    "s3 NoSuchBucket": (lambda: _s3fs_translated("NoSuchBucket", 404), Fault.NOT_FOUND),
    "s3 AccessDenied": (lambda: _s3fs_translated("AccessDenied", 403), Fault.DENIED),
    "s3 InvalidAccessKeyId": (lambda: _s3fs_translated("InvalidAccessKeyId", 403), Fault.DENIED),
    "s3 SlowDown": (lambda: _s3fs_translated("SlowDown", 503), Fault.TRANSIENT),
    "s3 InternalError": (lambda: _s3fs_translated("InternalError", 500), Fault.TRANSIENT),
    "s3 429": (lambda: _s3fs_translated("TooManyRequests", 429), Fault.TRANSIENT),
    "s3 bare 503": (lambda: _client_error("503", 503), Fault.TRANSIENT),
    "s3 InvalidRange": (lambda: _s3fs_translated("InvalidRange", 416), Fault.FATAL),
    "botocore closed": (lambda: _botocore("ConnectionClosedError"), Fault.TRANSIENT),
    "botocore endpoint": (lambda: _botocore("EndpointConnectionError"), Fault.TRANSIENT),
    "botocore read timeout": (lambda: _botocore("ReadTimeoutError"), Fault.TRANSIENT),
    "botocore connect timeout": (lambda: _botocore("ConnectTimeoutError"), Fault.TRANSIENT),
    "s3fs EBUSY": (lambda: OSError(errno.EBUSY, "SlowDown"), Fault.TRANSIENT),
    # gcsfs
    "gcs 404": (lambda: FileNotFoundError("b/x"), Fault.NOT_FOUND),
    "gcs 403": (lambda: OSError("Forbidden: b/x\nno access"), Fault.DENIED),
    "gcs 503": (lambda: _gcs_http(503), Fault.TRANSIENT),
    "gcs 429": (lambda: _gcs_http(429), Fault.TRANSIENT),
    "gcs 400": (lambda: _gcs_http(400), Fault.FATAL),
    "gcs 502 (ProxyError)": (lambda: _requests("ProxyError"), Fault.TRANSIENT),
    "requests chunked": (lambda: _requests("ChunkedEncodingError"), Fault.TRANSIENT),
    # the OS and asyncio
    "reset": (lambda: ConnectionResetError(errno.ECONNRESET, "reset"), Fault.TRANSIENT),
    "refused": (lambda: ConnectionRefusedError(errno.ECONNREFUSED, "refused"), Fault.TRANSIENT),
    "timeout": (lambda: TimeoutError("timed out"), Fault.TRANSIENT),
    "asyncio timeout": (lambda: asyncio.TimeoutError(), Fault.TRANSIENT),  # noqa: UP041
    "permission": (lambda: PermissionError("no"), Fault.DENIED),
    "disk full is not ours to retry": (lambda: OSError(errno.ENOSPC, "full"), Fault.FATAL),
    "a bug": (lambda: TypeError("bad argument"), Fault.FATAL),
}


@pytest.mark.parametrize("case", sorted(CLASSIFIED))
def test_classify_error(case: str) -> None:
    make, expected = CLASSIFIED[case]
    assert classify_error(make()) is expected


def test_classify_error_follows_the_cause_chain() -> None:
    try:
        try:
            raise _aiohttp_status(503)
        except Exception as inner:
            raise OSError(errno.EIO, "wrapped") from inner
    except OSError as exc:
        assert classify_error(exc) is Fault.TRANSIENT


def test_a_damaged_body_is_transient_whatever_was_being_handled() -> None:
    """A download run inside another error's handler (a vanished partial file) raised its own
    faults with that error as their context: "not found" was read from it, and not retried."""
    try:
        try:
            raise FileNotFoundError(errno.ENOENT, "gone", "x.partial")
        except FileNotFoundError:
            raise Damaged("the download does not match its checksum")  # noqa: B904 - the case
    except Damaged as exc:
        assert classify_error(exc) is Fault.TRANSIENT


def test_classify_error_follows_a_long_cause_chain() -> None:
    """A status several causes deep (a backend wrapping a wrapped error) still decides."""
    exc: BaseException = _aiohttp_status(503)
    for depth in range(4):
        outer = OSError(errno.EIO, f"wrapped {depth}")
        outer.__cause__ = exc
        exc = outer
    assert classify_error(exc) is Fault.TRANSIENT


def test_retry_policy_backs_off_exponentially_within_bounds() -> None:
    rng = random.Random(1)
    policy = RetryPolicy(attempts=8, base_delay=0.5, max_delay=3.0)
    for retry in range(1, 8):
        full = min(3.0, 0.5 * 2 ** (retry - 1))
        for _ in range(20):
            assert full / 2 <= policy.delay(retry, rng) <= full
    exact = RetryPolicy(base_delay=0.5, max_delay=3.0, jitter=False)
    assert [exact.delay(k, rng) for k in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"attempts": 0},
        {"base_delay": -1.0},
        {"base_delay": 2.0, "max_delay": 1.0},
        {"min_rate": -1.0},
        {"min_rate": float("nan")},
        {"min_rate": float("inf")},
        {"min_rate": "16384"},
    ],
)
def test_retry_policy_rejects_nonsense(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="RetryPolicy"):
        RetryPolicy(**kwargs)


def test_download_is_identical_and_one_request(remote: Remote, tmp_path: Path) -> None:
    data = payload(5 * PART + 123)
    remote.put("obj.bin", data)
    dest = store(remote).download("obj.bin", tmp_path / "obj.bin", expected_size=len(data))
    assert dest.read_bytes() == data
    assert leftovers(tmp_path) == ["obj.bin"]
    assert remote.proxy.count("GET", remote.path("obj.bin")) == 1


def test_download_of_an_empty_and_a_small_object(remote: Remote, tmp_path: Path) -> None:
    remote.put("empty", b"")
    remote.put("small", b"abc")
    s = store(remote)
    assert s.download("empty", tmp_path / "empty").read_bytes() == b""
    assert s.download("small", tmp_path / "small").read_bytes() == b"abc"
    assert s.read_bytes("small") == b"abc"


FAULTS: dict[str, dict[str, Any]] = {
    "drop": {"kind": "drop"},
    "503": {"kind": "status", "status": 503},
    "429": {"kind": "status", "status": 429},
    "500": {"kind": "status", "status": 500},
    "truncate": {"kind": "truncate"},
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_transient_faults_are_retried(remote: Remote, tmp_path: Path, fault: str) -> None:
    data = payload(3 * PART, seed=2)
    remote.put("obj.bin", data)
    remote.proxy.add_fault(count=2, method="GET", **FAULTS[fault])
    dest = store(remote).download("obj.bin", tmp_path / "obj.bin", expected_size=len(data))
    assert dest.read_bytes() == data
    assert sum(remote.proxy.stats()["faults"].values()) == 2
    assert leftovers(tmp_path) == ["obj.bin"]


def test_latency_is_only_slower(remote: Remote, tmp_path: Path) -> None:
    data = payload(2 * PART)
    remote.put("obj.bin", data)
    remote.proxy.configure(latency=0.1)
    start = time.monotonic()
    store(remote).download("obj.bin", tmp_path / "obj.bin", expected_size=len(data))
    assert time.monotonic() - start >= 0.1
    assert (tmp_path / "obj.bin").read_bytes() == data


@NOT_GCS
def test_a_stalled_response_times_out_and_is_retried(remote: Remote, tmp_path: Path) -> None:
    data = payload(PART // 2)
    remote.put("obj.bin", data)
    if remote.kind == "s3":
        options: dict[str, Any] = {"config_kwargs": {"read_timeout": 0.5, "connect_timeout": 2}}
    else:
        import aiohttp

        options = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(sock_read=0.5)}}
    s = store(remote, **options)
    # the backend's client first (botocore builds it on the first call: up to ~1 s, not a wait)
    assert s.info("obj.bin")["size"] == len(data)
    remote.proxy.add_fault("delay", delay=3.0, count=1, method="GET")
    start = time.monotonic()
    assert s.download("obj.bin", tmp_path / "o", expected_size=len(data)).read_bytes() == data
    assert time.monotonic() - start < 2.0  # did not wait for the stalled answer
    assert remote.proxy.count("GET", remote.path("obj.bin")) >= 2


def test_a_slow_drip_body_meets_a_deadline(
    http_server: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every byte in time for sock_read, the whole far too slow: bounded by a minimum rate
    http_server.proxy.reset()
    assert http_server.root is not None
    data = payload(PART)
    (http_server.root / "drip.bin").write_bytes(data)
    http_server.proxy.configure(bandwidth=32 << 10)  # 2 s for the object
    monkeypatch.setattr("torch_serialized.remote.store._DEADLINE_GRACE", 0.2)
    import aiohttp

    s = RemoteStore(http_server.proxy.url, retry=QUICK)
    sock_only = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, sock_read=30)}}
    t = RemoteStore(http_server.proxy.url, sock_only, retry=QUICK)
    start = time.monotonic()
    for read in (
        lambda: s.download("drip.bin", tmp_path / "o", expected_size=len(data)),
        lambda: t.download("drip.bin", tmp_path / "p", expected_size=len(data)),  # user's timeout
    ):
        with pytest.raises(RemoteError, match=r"drip\.bin.*3 times.*Timeout") as failed:
            read()
        assert "lower TORCH_SERIALIZED_MIN_RATE (0: reads have no deadline)" in str(failed.value)
    assert time.monotonic() - start < 8
    http_server.proxy.reset()


def test_a_slow_drip_stream_meets_a_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A download from a server that ignores Range has the deadline of its size too."""
    served = tmp_path / "served"
    served.mkdir()
    data = payload(3 * PART, seed=6)
    (served / "obj.bin").write_bytes(data)
    with start_http_server(served, ranges=False) as server, start_fault_proxy(server.url) as proxy:
        s = RemoteStore(proxy.url, retry=QUICK)
        assert s.download("obj.bin", tmp_path / "a", expected_size=len(data)).read_bytes() == data
        proxy.configure(bandwidth=16 << 10)  # the first 64 KiB after 4 s, the whole after 12 s
        monkeypatch.setattr("torch_serialized.remote.store._DEADLINE_GRACE", 0.5)  # 0.69 s in all
        start = time.monotonic()
        with pytest.raises(RemoteError, match=r"obj\.bin.*3 times.*Timeout"):
            s.download("obj.bin", tmp_path / "b", expected_size=len(data))
        assert time.monotonic() - start < 3.5
        assert leftovers(tmp_path) == ["a", "served"]
        proxy.configure()  # a stream within its deadline passes
        assert s.download("obj.bin", tmp_path / "c", expected_size=len(data)).read_bytes() == data


def test_the_minimum_rate_sets_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy's min_rate (or TORCH_SERIALIZED_MIN_RATE) sets the deadline of a read on
    every async backend; 0 turns it off; an aiohttp ClientTimeout with a total still does."""
    import aiohttp

    from torch_serialized.remote.retry import _MIN_RATE, MIN_RATE_ENV
    from torch_serialized.remote.store import _DEADLINE_GRACE

    n = 1 << 20
    for url in ("http://127.0.0.1:9/p", "s3://bucket/p"):  # opened, never connected
        assert RemoteStore(url)._deadline(n) == {"timeout": _DEADLINE_GRACE + n / _MIN_RATE}
        slow = RemoteStore(url, retry=RetryPolicy(min_rate=1024))
        assert slow._deadline(n) == {"timeout": _DEADLINE_GRACE + n / 1024}
        assert RemoteStore(url, retry=RetryPolicy(min_rate=0))._deadline(n) == {}
        monkeypatch.setenv(MIN_RATE_ENV, "512")  # read when a store is made without a policy
        assert RemoteStore(url)._deadline(n) == {"timeout": _DEADLINE_GRACE + n / 512}
        monkeypatch.setenv(MIN_RATE_ENV, "0")
        assert RemoteStore(url)._deadline(n) == {}
        monkeypatch.delenv(MIN_RATE_ENV)
    total = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=600)}}
    assert RemoteStore("http://127.0.0.1:9/p", total)._deadline(n) == {}


def test_a_lower_minimum_rate_lets_a_slow_link_through(
    remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link slower than the minimum rate times out on HTTP and S3 alike; lowering the rate
    (by the environment or the policy) or turning the deadline off lets it through."""
    from torch_serialized.remote.retry import MIN_RATE_ENV

    data = payload(4 << 10, seed=7)
    for name in ("slow.bin", "slow-b.bin", "slow-c.bin"):
        remote.put(name, data)
    remote.proxy.configure(bandwidth=4 << 10)  # 1 s for the object
    monkeypatch.setattr("torch_serialized.remote.store._DEADLINE_GRACE", 0.1)  # 0.35 s at 16 KiB/s
    two = dataclasses.replace(FAST, attempts=2)
    with pytest.raises(RemoteError, match=r"slow\.bin.*2 times.*Timeout"):
        store(remote, two).download("slow.bin", tmp_path / "a", expected_size=len(data))
    remote.proxy.configure(bandwidth=4 << 10)  # the link to itself again, not shared with those
    monkeypatch.setenv(MIN_RATE_ENV, "256")  # 16.1 s: room for a loaded machine (CI)
    s = RemoteStore(remote.url, remote.storage_options)
    assert s.download("slow-b.bin", tmp_path / "b", expected_size=len(data)).read_bytes() == data
    off = dataclasses.replace(two, min_rate=0)
    got = store(remote, off).download("slow-c.bin", tmp_path / "c", expected_size=len(data))
    assert got.read_bytes() == data
    # one try each; counted per object, as the timed-out tries' requests may reach the server
    # late (older aiobotocore sends them after the deadline gave up on them)
    for name in ("slow-b.bin", "slow-c.bin"):
        assert remote.proxy.count("GET", remote.path(name)) == 1


@NOT_GCS
@pytest.mark.parametrize("fault", ["drop", "503", "truncate"])
def test_exhausted_retries_raise_our_error(remote: Remote, tmp_path: Path, fault: str) -> None:
    data = payload(2 * PART, seed=3)
    remote.put("obj.bin", data)
    remote.proxy.add_fault(count=None, method="GET", **FAULTS[fault])
    with pytest.raises(RemoteError) as info:
        store(remote).download("obj.bin", tmp_path / "obj.bin", expected_size=len(data))
    assert type(info.value) is RemoteError  # neither not-found nor access denied
    assert "obj.bin" in str(info.value)
    tries = "after s3's own retries" if remote.kind == "s3" else "3 times"
    assert tries in str(info.value)
    assert leftovers(tmp_path) == []  # a cut download leaves nothing that passes as complete


@pytest.mark.parametrize(
    ("status", "error", "builtin", "hint"),
    [
        (404, RemoteNotFoundError, FileNotFoundError, "bucket name"),
        (403, RemoteAccessError, PermissionError, "credentials"),
    ],
)
def test_not_found_and_denied_are_not_retried(
    remote: Remote, tmp_path: Path, status: int, error: type, builtin: type, hint: str
) -> None:
    data = payload(2 * PART)
    remote.put("obj.bin", data)
    remote.proxy.add_fault("status", status=status, count=None, method="GET")
    with pytest.raises(error) as info:
        store(remote).download("obj.bin", tmp_path / "obj.bin", expected_size=len(data))
    assert isinstance(info.value, builtin)
    message = str(info.value)
    assert hint in message
    assert remote.url in message
    first = next(e for e in remote.proxy.stats()["log"] if e.startswith("GET "))
    assert remote.proxy.count("GET", first[4:]) == 1  # not retried (gcsfs's is its metadata)
    assert leftovers(tmp_path) == []


def test_an_outage_while_asking_the_size_is_retried(http_server: Served, tmp_path: Path) -> None:
    # fsspec turns the failed HEAD and GET of its size probe into FileNotFoundError(url)
    http_server.proxy.reset()
    assert http_server.root is not None
    (http_server.root / "size.bin").write_bytes(b"x" * 100)
    http_server.proxy.add_fault("drop", count=4)
    s = RemoteStore(http_server.proxy.url, retry=FAST)
    assert s.info("size.bin")["size"] == 100
    with pytest.raises(RemoteNotFoundError):  # while a real 404 is still not found
        s.info("no-such.bin")["size"]
    http_server.proxy.add_fault("drop", count=None)
    with pytest.raises(RemoteError, match="3 times") as info:  # naming the outage itself
        s.info("size.bin")["size"]
    assert type(info.value) is RemoteError and "FileNotFoundError" not in str(info.value)


def test_a_missing_object_is_not_found(remote: Remote, tmp_path: Path) -> None:
    with pytest.raises(RemoteNotFoundError, match="nothing-here"):
        store(remote).download("nothing-here", tmp_path / "x")
    with pytest.raises(RemoteNotFoundError):
        store(remote).read_bytes("nothing-here")


def test_checksum_mismatch_downloads_once_more_then_raises(remote: Remote, tmp_path: Path) -> None:
    data = payload(2 * PART)
    remote.put("obj.bin", data)
    with pytest.raises(ChecksumError) as info:
        store(remote).download(
            "obj.bin", tmp_path / "obj.bin", expected_size=len(data), verify=lambda path: False
        )
    assert "obj.bin" in str(info.value) and "twice" in str(info.value)
    assert remote.proxy.count("GET", remote.path("obj.bin")) == 2
    assert leftovers(tmp_path) == []


def test_a_checksum_mismatch_that_heals_on_the_second_download(
    remote: Remote, tmp_path: Path
) -> None:
    data = payload(2 * PART)
    remote.put("obj.bin", data)
    calls: list[bytes] = []

    def flaky(path: Path) -> bool:  # a bit flipped on the way the first time
        calls.append(path.read_bytes())
        return len(calls) > 1

    s = store(remote)
    assert s.download("obj.bin", tmp_path / "o", expected_size=len(data), verify=flaky).exists()
    assert len(calls) == 2 and calls[1] == data
    assert (tmp_path / "o").read_bytes() == data


def test_an_object_smaller_than_expected_is_an_error(remote: Remote, tmp_path: Path) -> None:
    data = payload(2 * PART)
    remote.put("obj.bin", data)
    with pytest.raises(RemoteError, match="obj.bin"):
        store(remote).download("obj.bin", tmp_path / "o", expected_size=len(data) + 10)
    assert leftovers(tmp_path) == []


# A size claim and a body that ends cleanly short of it (whether or not the server states it):
# a fact about the object, not an outage retried to the end.
PATIENT = dataclasses.replace(FAST, attempts=5)


def _says_the_object_is_shorter(error: BaseException, url: str, has: int, claimed: int) -> None:
    first = str(error).splitlines()[0]
    assert first.startswith(f"{url}: the object has {has} bytes, the manifest says {claimed}")
    assert "re-upload the pack" in first and "times" not in first


def test_a_whole_body_shorter_than_claimed_fails_at_its_stated_size(
    remote: Remote, tmp_path: Path
) -> None:
    """The GET's answer states a size other than the claimed one: it is the object's."""
    size, claimed = 2 * PART + 100, 2 * PART + 200
    remote.put("obj.bin", payload(size))
    s = store(remote, PATIENT)
    with pytest.raises(RemoteError) as failed:
        s.download("obj.bin", tmp_path / "o", expected_size=claimed)
    _says_the_object_is_shorter(failed.value, s.url_of("obj.bin"), size, claimed)
    assert remote.proxy.count("GET", remote.path("obj.bin")) == 1  # no retry, no HEAD
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("remote", ["s3", "gcs"], indirect=True)
@pytest.mark.parametrize("claimed", [-100, 100, 3 * PART], ids=["larger", "shorter", "far"])
def test_an_object_read_in_place_by_parts_refutes_a_false_size(
    remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, claimed: int
) -> None:
    """A shard downloaded in place (read while it arrives: S3 streams it, GCS by ranged GETs)
    shows its true size: larger by its answer or one byte past the claim, shorter by a short
    body or part, far shorter by its tail's 416."""
    from torch_serialized.remote.arrival import Arrival

    monkeypatch.setattr("torch_serialized.remote.transfer.PART", PART // 4)
    size = 2 * PART + 50
    remote.put("obj.bin", payload(size))
    s = store(remote, PATIENT)
    with pytest.raises(RemoteError) as failed:
        s.download("obj.bin", tmp_path / "o", expected_size=size + claimed, arrival=Arrival(500))
    first = str(failed.value).splitlines()[0]
    if claimed < 0:  # S3's streamed GET states the size; GCS's parts see one byte past it
        has = size if remote.kind == "s3" else size + claimed + 1
        assert f"has {has} bytes, the manifest says {size + claimed}" in first
    else:
        _says_the_object_is_shorter(failed.value, s.url_of("obj.bin"), size, size + claimed)
    assert leftovers(tmp_path) == []


def cut_bodies(s: RemoteStore, monkeypatch: pytest.MonkeyPatch, lengths: list[int]) -> list[int]:
    """Make the downloads of ``s`` end cleanly after ``lengths[k]`` bytes (whole once the
    lengths run out), as a proxy that re-framed the bodies would; the lengths written."""
    real = s.fs.cat_file
    calls: list[int] = []

    def get_file(rpath: str, lpath: str, **kwargs: Any) -> None:
        data = bytes(real(rpath))
        calls.append(lengths[len(calls)] if len(calls) < len(lengths) else len(data))
        Path(lpath).write_bytes(data[: calls[-1]])

    monkeypatch.setattr(s.fs, "get_file", get_file)
    return calls


def test_bodies_cut_at_different_places_are_still_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bodies that end cleanly but each at another byte (cut by a proxy that re-framed them)
    say nothing about the object: retried as an outage, to the end of the policy."""
    data = payload(PART // 2)
    s = RemoteStore(f"memory://cuts-{os.getpid()}", retry=FAST)
    s.fs.pipe_file(s.fs_path("obj.bin"), data)
    cut_bodies(s, monkeypatch, [100, 200, 300])
    with pytest.raises(RemoteError, match=r"obj\.bin: download failed 3 times.*300 of 32768"):
        s.download("obj.bin", tmp_path / "o", expected_size=len(data))


def test_empty_bodies_are_retried_as_cuts_not_taken_for_the_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy proxy that sends headers and closes gives empty bodies that end cleanly, at
    the same byte each time: two of them said "the object has 0 bytes ... re-upload the
    pack" and stopped the retries (review of the clean-ends check)."""
    data = payload(3 * PART)
    s = RemoteStore(f"memory://empty-{os.getpid()}", retry=PATIENT)
    s.fs.pipe_file(s.fs_path("obj.bin"), data)
    calls = cut_bodies(s, monkeypatch, [0, 0])
    assert s.download("obj.bin", tmp_path / "o", expected_size=len(data)).read_bytes() == data
    assert calls == [0, 0, len(data)]


def test_a_server_without_range_support_is_read_whole(tmp_path: Path) -> None:
    served = tmp_path / "served"
    served.mkdir()
    data = payload(4 * PART + 7)
    (served / "obj.bin").write_bytes(data)
    with start_http_server(served, ranges=False) as server, start_fault_proxy(server.url) as proxy:
        s = RemoteStore(proxy.url, retry=FAST)
        for name in ("a", "b"):
            dest = s.download("obj.bin", tmp_path / name, expected_size=len(data))
            assert dest.read_bytes() == data
        proxy.add_fault("truncate", count=1, method="GET")  # and a cut stream is retried
        assert s.download("obj.bin", tmp_path / "c", expected_size=len(data)).read_bytes() == data
        assert proxy.count("GET", "/obj.bin") == 4  # one whole body each, plus the cut one


def test_reads_from_a_server_without_range_support(tmp_path: Path) -> None:
    served = tmp_path / "served"
    served.mkdir()
    data = payload(3 * PART + 5)
    (served / "obj.bin").write_bytes(data)
    with start_http_server(served, ranges=False) as server:
        s = RemoteStore(server.url, retry=FAST)
        assert s.read_bytes("obj.bin") == data
        assert s.download("obj.bin", tmp_path / "o").read_bytes() == data  # its size from info
        with pytest.raises(RemoteError, match=r"obj\.bin: larger than the 100-byte limit"):
            s.read_bytes("obj.bin", max_bytes=100)


def test_a_short_body_of_a_whole_object_read_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a body cut short without the client noticing (a proxy that re-framed it)
    data = payload(PART // 2)
    s = RemoteStore(f"memory://short-{os.getpid()}", retry=FAST)
    s.fs.pipe_file(s.fs_path("obj.bin"), data)
    calls = cut_bodies(s, monkeypatch, [len(data) // 2])
    assert s.download("obj.bin", tmp_path / "o", expected_size=len(data)).read_bytes() == data
    assert calls == [len(data) // 2, len(data)]
    calls = cut_bodies(s, monkeypatch, [10] * 5)  # the same length: the object's size
    with pytest.raises(RemoteError, match=r"obj\.bin: the object has 10 bytes.*re-upload"):
        s.download("obj.bin", tmp_path / "p", expected_size=len(data))
    assert len(calls) == 2
    assert leftovers(tmp_path) == ["o"]


def test_memory_and_file_urls(tmp_path: Path) -> None:
    import fsspec

    data = payload(3 * PART)
    fsspec.filesystem("memory").pipe(f"/ts-{os.getpid()}/obj.bin", data)
    got = RemoteStore(f"memory://ts-{os.getpid()}").download("obj.bin", tmp_path / "m")
    assert got.read_bytes() == data
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "obj.bin").write_bytes(data)
    s = RemoteStore((tmp_path / "src").as_uri())
    assert s.download("obj.bin", tmp_path / "f").read_bytes() == data


def test_a_store_pickles_without_its_filesystem(remote: Remote, tmp_path: Path) -> None:
    import pickle

    remote.put("obj.bin", b"hello")
    s = store(remote)
    assert s.read_bytes("obj.bin") == b"hello"
    clone = pickle.loads(pickle.dumps(s))
    assert clone._fs is None
    assert clone.read_bytes("obj.bin") == b"hello"


def test_a_forked_child_drops_the_parents_filesystem_at_once(remote: Remote) -> None:
    """fsspec's session finalizers waited 1 s on the parent's event loop in every DataLoader
    worker: the loop's thread does not exist in the child."""
    import gc
    import multiprocessing

    remote.put("obj.bin", b"hello")
    s = store(remote)
    assert s.read_bytes("obj.bin") == b"hello"  # the parent's session and event loop

    loop = vars(s._fs)["_loop"]  # its session's finalizer syncs on it

    def child(queue: Any) -> None:
        assert s._fs is None  # dropped at the fork
        gc.collect()
        queue.put((loop.is_running(), s.read_bytes("obj.bin")))

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    process = ctx.Process(target=child, args=(queue,))
    process.start()
    running, data = queue.get(timeout=30)
    process.join(30)
    assert not running and data == b"hello"
    assert loop.is_running()  # in the parent, where its thread is


def test_a_forked_child_reuses_the_parents_s3_service_models(s3_remote: Remote) -> None:
    """A DataLoader worker's S3 client takes botocore's parsed service models from the parent
    (its first request 40 ms sooner), in a session of its own: nothing else is shared."""
    import multiprocessing

    s3_remote.put("obj.bin", b"hello")
    s = store(s3_remote)
    assert s.read_bytes("obj.bin") == b"hello"
    loader = s.fs.session.get_component("data_loader")

    def child(queue: Any) -> None:
        data = s.read_bytes("obj.bin")
        mine = s.fs.session
        queue.put(
            (data, mine.get_component("data_loader") is loader, mine is not s._inherited[0].session)
        )

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    process = ctx.Process(target=child, args=(queue,))
    process.start()
    assert queue.get(timeout=30) == (b"hello", True, True)
    process.join(30)


class _KeepAlive(BaseHTTPRequestHandler):
    """Any GET: ``hello`` on a connection kept alive (what S3 does; the fault proxy does not)."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")

    def log_message(self, *args: object) -> None:
        pass


def test_a_forked_child_prints_nothing_about_the_parents_sessions() -> None:
    """A DataLoader worker forked from a process that read from S3 printed "Unclosed client
    session" and "Unclosed connector": s3fs's client, collected in the child, cannot close the
    parent's sessions. The child keeps them."""
    with ThreadingHTTPServer(("127.0.0.1", 0), _KeepAlive) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        options = {
            "key": "k",
            "secret": "s",
            "endpoint_url": f"http://127.0.0.1:{server.server_port}",
        }
        code = f"""
import gc, multiprocessing, sys
from torch_serialized.remote.store import RemoteStore
store = RemoteStore("s3://bucket/pack", {options!r})
store.read_bytes("obj.bin")
def work():  # a worker's: its garbage is collected at some point
    gc.collect()
    store.read_bytes("obj.bin")
child = multiprocessing.get_context("fork").Process(target=work)
child.start()
child.join()
sys.exit(child.exitcode)
"""
        args = [sys.executable, "-c", code]
        out = subprocess.run(args, capture_output=True, text=True, timeout=60)
        server.shutdown()
    assert out.returncode == 0 and "Unclosed" not in out.stderr, out.stderr


# --------------------------------------------------------------------------- uploads


def _pack_folder(root: Path) -> dict[str, bytes]:
    files = {
        "shard-00000.tser": payload(3 * PART, 1),
        "shard-00001.tser": payload(PART + 1, 2),
        "sub/extra.bin": b"x",
        "manifest.json": b'{"shards": 2}',
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def test_upload_folder_to_s3_puts_the_manifest_last(s3_remote: Remote, tmp_path: Path) -> None:
    files = _pack_folder(tmp_path)
    keys = upload_folder(store(s3_remote), tmp_path)
    assert keys[-1] == "manifest.json" and sorted(keys) == sorted(files)
    for name, data in files.items():
        assert s3_remote.get(name) == data
    puts = [e for e in s3_remote.proxy.stats()["log"] if e.startswith("PUT ")]
    assert puts[-1] == f"PUT {s3_remote.path('manifest.json')}"
    assert len(puts) == len(files)


def test_upload_is_retried(s3_remote: Remote, tmp_path: Path) -> None:
    (tmp_path / "one.tser").write_bytes(payload(PART))
    s3_remote.proxy.add_fault("status", status=503, count=1, method="PUT")
    upload_file(store(s3_remote), tmp_path / "one.tser", "one.tser")
    assert s3_remote.get("one.tser") == payload(PART)


def test_upload_to_a_file_url_never_shows_a_partial_file(tmp_path: Path) -> None:
    files = _pack_folder(tmp_path / "src")
    dest = tmp_path / "dest"
    keys = upload_folder(RemoteStore(dest.as_uri()), tmp_path / "src")
    assert keys[-1] == "manifest.json"
    for name, data in files.items():
        assert (dest / name).read_bytes() == data
    assert not list(dest.rglob("*.partial"))


def test_upload_folder_needs_its_manifest(tmp_path: Path) -> None:
    (tmp_path / "shard.tser").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        upload_folder(RemoteStore((tmp_path / "out").as_uri()), tmp_path)


def test_an_unknown_size_says_what_a_user_can_do(monkeypatch: pytest.MonkeyPatch) -> None:
    s = RemoteStore(f"memory://nosize-{os.getpid()}", retry=FAST)
    monkeypatch.setattr(
        s.fs, "info", lambda path: {"name": path, "size": None}
    )  # no Content-Length
    with pytest.raises(RemoteError, match=r"nosize.*x\.tser.*sends Content-Length") as info:
        s.info("x.tser")["size"]
    assert "expected_size (from the manifest)" not in str(info.value)


def test_prune_over_http_says_where_to_prune() -> None:
    from torch_serialized.remote.upload import prune_remote

    # no request is made: HTTP cannot delete, so nothing is read first
    with pytest.raises(RemoteError, match=r"127\.0\.0\.1:9/pack: http:// cannot delete.*dry run"):
        prune_remote("http://127.0.0.1:9/pack")


def test_retry_policy_from_the_environment() -> None:
    """Retries are configurable without code (every worker and rank reads the same
    variables): attempts and the longest wait; bad values name the variable."""
    from torch_serialized.remote.retry import RETRY_ATTEMPTS_ENV, RETRY_MAX_DELAY_ENV

    assert RetryPolicy.from_env({}) == RetryPolicy()
    policy = RetryPolicy.from_env({RETRY_ATTEMPTS_ENV: "9", RETRY_MAX_DELAY_ENV: "0.2"})
    assert (policy.attempts, policy.max_delay, policy.base_delay) == (9, 0.2, 0.2)
    assert RetryPolicy.from_env({RETRY_ATTEMPTS_ENV: " "}) == RetryPolicy()
    with pytest.raises(ValueError, match=RETRY_ATTEMPTS_ENV):
        RetryPolicy.from_env({RETRY_ATTEMPTS_ENV: "many"})
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy.from_env({RETRY_ATTEMPTS_ENV: "0"})


def test_the_minimum_rate_from_the_environment() -> None:
    from torch_serialized.remote.retry import MIN_RATE_ENV

    assert RetryPolicy.from_env({MIN_RATE_ENV: "1024"}) == RetryPolicy(min_rate=1024)
    assert RetryPolicy.from_env({MIN_RATE_ENV: "0"}).min_rate == 0
    assert RetryPolicy.from_env({MIN_RATE_ENV: ""}) == RetryPolicy()
    for bad in ("fast", "16KiB", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match=f"{MIN_RATE_ENV}={bad!r}") as info:
            RetryPolicy.from_env({MIN_RATE_ENV: bad})
        assert "bytes per second" in str(info.value)


def test_a_store_without_a_policy_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, http_server: Any, tmp_path: Path
) -> None:
    """A dataset's store (no policy passed) makes as many attempts as the environment says,
    and the error names the variable that allows more."""
    from remote_fixtures import Remote

    from torch_serialized.remote.retry import RETRY_ATTEMPTS_ENV, RETRY_MAX_DELAY_ENV

    remote = Remote("http", http_server, "retry-env")
    http_server.proxy.reset()
    remote.put("obj.bin", payload(100))
    remote.proxy.add_fault(count=None, method="GET", **FAULTS["503"])
    monkeypatch.setenv(RETRY_ATTEMPTS_ENV, "2")
    monkeypatch.setenv(RETRY_MAX_DELAY_ENV, "0.01")
    with pytest.raises(RemoteError, match=f"failed 2 times.*{RETRY_ATTEMPTS_ENV}, now 2"):
        RemoteStore(remote.url).download("obj.bin", tmp_path / "obj.bin", expected_size=100)
    assert remote.proxy.count("GET", remote.path("obj.bin")) == 2


def test_a_download_is_written_as_it_arrives_never_held(tmp_path: Path) -> None:
    """A download goes to its file as it arrives, never held in memory whole: what stays is
    the client's socket buffers and one chunk, whatever the object's size."""
    import tracemalloc

    served = tmp_path / "served"
    served.mkdir()
    data = payload(32 << 20, seed=10)
    (served / "obj.bin").write_bytes(data)
    with start_http_server(served, ranges=False) as server, start_fault_proxy(server.url) as proxy:
        s = RemoteStore(proxy.url, retry=FAST)
        s.fs  # noqa: B018 - imports and the HTTP session are not the download's memory
        tracemalloc.start()
        try:
            s.download("obj.bin", tmp_path / "o", expected_size=len(data))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert (tmp_path / "o").read_bytes() == data
        assert peak < len(data) // 4, f"peak {peak} bytes for a {len(data)}-byte object"
        assert proxy.count("GET", "/obj.bin") == 1


def test_a_streams_other_timeouts_are_not_blamed_on_the_minimum_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream cut by another limit (the user's sock_read here) long before its deadline
    keeps that limit's error: lowering the minimum rate would not help."""
    import aiohttp

    served = tmp_path / "served"
    served.mkdir()
    (served / "obj.bin").write_bytes(payload(3 * PART, seed=9))
    options = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, sock_read=0.5)}}
    with start_http_server(served, ranges=False) as server, start_fault_proxy(server.url) as proxy:
        proxy.add_fault("delay", delay=3.0, count=None)
        s = RemoteStore(proxy.url, options, retry=RetryPolicy(attempts=1))
        with pytest.raises(RemoteError, match="Timeout") as failed:
            s.download("obj.bin", tmp_path / "o", expected_size=3 * PART)
        assert "did not end within its deadline" not in str(failed.value)


def test_a_per_request_timeout_of_the_user_replaces_the_deadline() -> None:
    """fsspec's top-level ``timeout`` (a ClientTimeout with a total, or seconds) bounds every
    HTTP request itself: no deadline of ours then, as with one in ``client_kwargs``."""
    import aiohttp

    n = 1 << 20
    for timeout in (aiohttp.ClientTimeout(total=600), 600):
        assert RemoteStore("http://127.0.0.1:9/p", {"timeout": timeout})._deadline(n) == {}
    no_total = {"timeout": aiohttp.ClientTimeout(total=None, sock_read=5)}
    assert RemoteStore("http://127.0.0.1:9/p", no_total)._deadline(n) != {}


@pytest.mark.parametrize("rate", [True, 1e-320, 0.5, float("inf"), -1])
def test_a_minimum_rate_is_zero_or_at_least_one_byte_a_second(rate: Any) -> None:
    with pytest.raises(ValueError, match="min_rate must be 0 .* >= 1"):
        RetryPolicy(min_rate=rate)
    RetryPolicy(min_rate=0)
    RetryPolicy(min_rate=1)


def test_a_dry_run_prune_lists_what_prune_then_deletes(tmp_path: Path) -> None:
    """``dry_run`` only lists: the files earlier packs left (shards and catalogs no manifest
    names) are deleted by the real prune, and nothing else is, ever."""
    from torch_serialized.container.shardwriter import PackWriter
    from torch_serialized.remote.upload import prune_remote

    folder = tmp_path / "pack"
    with PackWriter(folder, ["a"], max_records_per_shard=1) as writer:
        for i in range(2):
            writer.add([bytes([i])])
    stale = ["catalog-0badc0de.tser", "shard-00007-0badc0de.tser"]
    for name in [*stale, "notes.txt", "shard-x.tser"]:
        (folder / name).write_bytes(b"left by an earlier pack")
    ours = sorted(os.listdir(folder))
    url = folder.as_uri()
    assert prune_remote(url, dry_run=True) == stale
    assert sorted(os.listdir(folder)) == ours
    assert prune_remote(url) == stale
    assert sorted(os.listdir(folder)) == sorted(set(ours) - set(stale))
    assert prune_remote(url) == []
