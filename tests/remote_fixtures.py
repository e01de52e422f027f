"""Fixtures with real servers on 127.0.0.1, for the tests of remote packs.

Use it as a plugin from a test module: ``pytest_plugins = ["remote_fixtures"]``.

* ``s3_server`` / ``gcs_server`` / ``http_server``: moto's S3 server, gcp-storage-emulator's GCS
  server and an aiohttp server over a folder, each with a fault-injecting proxy in front
  (session-scoped: started once, a second or so).
* ``remote``: parametrized over ``"http"``, ``"s3"`` and ``"gcs"``, a :class:`Remote` whose
  proxy has been reset and whose objects live under a fresh prefix, so tests never see each
  other's objects (``_remote_cases.NOT_GCS`` leaves GCS out). ``store_remote``: the same over
  the object stores (S3, GCS); ``s3_remote`` / ``gcs_remote``: one server.

Importing this module also installs an audit hook that refuses any connection, and any name
lookup, to an address outside 127.0.0.0/8 and ::1, so that a wrong endpoint or an instance
metadata lookup fails the test instead of sending traffic off this machine.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.loopback import (
    S3_ENVIRONMENT,
    FaultProxy,
    LoopbackServer,
    gcs_storage_options,
    s3_storage_options,
    start_fault_proxy,
    start_gcs_server,
    start_http_server,
    start_s3_server,
)

BUCKET = "torch-serialized-tests"
_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", socket.gethostname()}


def _is_loopback(host: object) -> bool:
    if not isinstance(host, str):
        return True  # bytes paths of AF_UNIX sockets and the like
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return host.lower() in _LOCAL_NAMES


def _loopback_only(event: str, args: tuple[Any, ...]) -> None:
    if event == "socket.connect":
        sock, address = args
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            raise ConnectionRefusedError(f"test guard: no traffic outside 127.0.0.0/8 ({address})")
    elif event == "socket.getaddrinfo" and args[0] is not None and not _is_loopback(args[0]):
        host = args[0].decode() if isinstance(args[0], bytes) else args[0]
        if not _is_loopback(host):
            raise ConnectionRefusedError(f"test guard: no name lookups of {host!r}")


sys.addaudithook(_loopback_only)


@dataclass
class Served:
    """A server and the proxy in front of it."""

    server: LoopbackServer
    proxy: FaultProxy
    root: Path | None = None  # the folder an HTTP server serves


@dataclass
class Remote:
    """One test's remote location: put objects directly, read them through the proxy."""

    kind: str
    served: Served
    prefix: str

    @property
    def proxy(self) -> FaultProxy:
        return self.served.proxy

    @property
    def url(self) -> str:
        """The URL of this test's folder, through the proxy."""
        if self.kind in ("s3", "gcs"):
            return f"{'gs' if self.kind == 'gcs' else 's3'}://{BUCKET}/{self.prefix}"
        return f"{self.proxy.url}/{self.prefix}"

    @property
    def storage_options(self) -> dict[str, Any]:
        if self.kind == "s3":
            return s3_storage_options(self.proxy.url)
        return gcs_storage_options(self.proxy.url) if self.kind == "gcs" else {}

    def path(self, key: str) -> str:
        """The path of ``key``'s bytes as the proxy counts it (GETs of the object's data)."""
        if self.kind == "s3":
            return f"/{BUCKET}/{self.prefix}/{key}"
        if self.kind == "gcs":  # the JSON API's media download; metadata is /storage/v1/b/...
            return f"/download/storage/v1/b/{BUCKET}/o/{self.prefix}/{key}"
        return f"/{self.prefix}/{key}"

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` as ``key`` in this folder, bypassing the proxy."""
        if self.kind in ("s3", "gcs"):
            direct(self.kind, self.served.server.url).pipe(f"{BUCKET}/{self.prefix}/{key}", data)
        else:
            assert self.served.root is not None
            target = self.served.root / self.prefix / key
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

    def get(self, key: str) -> bytes:
        """The stored bytes of ``key``, bypassing the proxy."""
        if self.kind in ("s3", "gcs"):
            fs = direct(self.kind, self.served.server.url)
            return bytes(fs.cat_file(f"{BUCKET}/{self.prefix}/{key}"))
        assert self.served.root is not None
        return (self.served.root / self.prefix / key).read_bytes()


def direct(kind: str, endpoint_url: str) -> Any:
    """An s3fs or gcsfs filesystem straight to a loopback server (for setting tests up)."""
    if kind == "gcs":
        import gcsfs

        return gcsfs.GCSFileSystem(skip_instance_cache=True, **gcs_storage_options(endpoint_url))
    return direct_s3(endpoint_url)


def direct_s3(endpoint_url: str) -> Any:
    """An s3fs filesystem straight to the loopback S3 server (for setting tests up)."""
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **s3_storage_options(endpoint_url))


@pytest.fixture(scope="session")
def _aws_environment() -> Iterator[None]:
    """Dummy AWS settings for this process: no real credentials, profiles or metadata lookups."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            mp.delenv(name, raising=False)
        for name, value in S3_ENVIRONMENT.items():
            mp.setenv(name, value)
        mp.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
        yield


@pytest.fixture(scope="session")
def s3_server(_aws_environment: None) -> Iterator[Served]:
    from botocore.retries.standard import ExponentialBackoff

    with (
        start_s3_server() as server,
        start_fault_proxy(server.url) as proxy,
        pytest.MonkeyPatch.context() as mp,
    ):
        # botocore's own retries wait a random 0-2**k s before retry k (~70 s of the default
        # suite's 240 went to them): these tests count retries and their outcome, not seconds
        mp.setattr(ExponentialBackoff, "delay_amount", lambda self, context: 0.01)
        direct_s3(server.url).mkdir(BUCKET)
        yield Served(server, proxy)


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[Served]:
    with start_gcs_server() as server, start_fault_proxy(server.url) as proxy:
        direct("gcs", server.url).mkdir(BUCKET)
        yield Served(server, proxy)


@pytest.fixture(scope="session")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("http-root")
    with start_http_server(root) as server, start_fault_proxy(server.url) as proxy:
        yield Served(server, proxy, root)


@pytest.fixture(params=["http", "s3", "gcs"])
def remote(request: pytest.FixtureRequest) -> Remote:
    """A fresh folder on a loopback HTTP, S3 or GCS server, behind a proxy with no faults."""
    served: Served = request.getfixturevalue(f"{request.param}_server")
    served.proxy.reset()
    return Remote(request.param, served, f"t-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def gcs_remote(gcs_server: Served) -> Remote:
    """A fresh folder on the loopback GCS server (for test_remote_gcs.py)."""
    gcs_server.proxy.reset()
    return Remote("gcs", gcs_server, f"t-{uuid.uuid4().hex[:10]}")


@pytest.fixture(params=["s3", "gcs"])
def store_remote(request: pytest.FixtureRequest) -> Remote:
    """A fresh folder on the loopback S3 or GCS server: what HTTP cannot do (uploads), for
    tests that count no uploads by name (GCS names an upload in its query string, which the
    proxy's log of paths leaves out)."""
    return request.getfixturevalue(f"{request.param}_remote")


@pytest.fixture
def s3_remote(s3_server: Served) -> Remote:
    """A fresh folder on the loopback S3 server (for the upload and append tests)."""
    s3_server.proxy.reset()
    return Remote("s3", s3_server, f"t-{uuid.uuid4().hex[:10]}")
