"""The loopback servers of ``support.loopback`` do what the remote tests rely on."""

from __future__ import annotations

import http.client
import socket
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support import loopback
from support.loopback import start_fault_proxy, start_http_server

if TYPE_CHECKING:
    from remote_fixtures import Remote, Served

pytest_plugins = ["remote_fixtures"]

DATA = bytes(range(256)) * 4096  # 1 MiB


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
        return r.status, r.read()


def _status(url: str) -> int:
    """The status of a failed GET (closing the error's response)."""
    with pytest.raises(urllib.error.HTTPError) as info:
        _get(url)
    info.value.close()
    return info.value.code


def test_http_server_serves_ranges(tmp_path: Path) -> None:
    (tmp_path / "f.bin").write_bytes(DATA)
    with start_http_server(tmp_path) as server:
        assert server.url.startswith("http://127.0.0.1:")
        assert _get(f"{server.url}/f.bin") == (200, DATA)
        assert _get(f"{server.url}/f.bin", {"Range": "bytes=10-19"}) == (206, DATA[10:20])
        assert _status(f"{server.url}/missing") == 404
        assert _status(f"{server.url}/../etc/passwd") == 404
    with start_http_server(tmp_path, ranges=False) as server:
        assert _get(f"{server.url}/f.bin", {"Range": "bytes=10-19"}) == (200, DATA)


def test_a_stopped_server_is_gone(tmp_path: Path) -> None:
    server = start_http_server(tmp_path)
    port = server.port
    server.stop()
    assert not server._proc.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_s3_server_through_s3fs(s3_remote: Remote) -> None:
    s3_remote.put("k/obj.bin", DATA)
    from remote_fixtures import direct_s3

    fs = direct_s3(s3_remote.proxy.url)  # through the proxy, as a user through a network
    assert (
        fs.cat_file(f"torch-serialized-tests/{s3_remote.prefix}/k/obj.bin", start=5, end=9)
        == DATA[5:9]
    )
    assert s3_remote.proxy.count("GET", "/k/obj.bin") == 1


def test_gcs_server_through_gcsfs(gcs_remote: Remote) -> None:
    gcs_remote.put("k/obj.bin", DATA)
    from remote_fixtures import direct

    fs = direct("gcs", gcs_remote.proxy.url)  # through the proxy, as a user through a network
    path = f"torch-serialized-tests/{gcs_remote.prefix}/k/obj.bin"
    assert fs.cat_file(path, start=5, end=9) == DATA[5:9]
    assert gcs_remote.proxy.count("GET", gcs_remote.path("k/obj.bin")) == 1
    assert fs.ls(f"torch-serialized-tests/{gcs_remote.prefix}/k") == [path]


def test_proxy_latency_and_bandwidth(http_server: Served) -> None:
    assert http_server.root is not None
    (http_server.root / "bw.bin").write_bytes(DATA * 2)
    proxy = http_server.proxy
    proxy.reset()
    proxy.configure(latency=0.2)
    start = time.monotonic()
    assert _get(f"{proxy.url}/bw.bin", {"Range": "bytes=0-0"})[1] == DATA[:1]
    assert time.monotonic() - start >= 0.2
    proxy.configure(bandwidth=4 << 20)  # 2 MiB at 4 MiB/s: about half a second
    start = time.monotonic()
    assert _get(f"{proxy.url}/bw.bin")[1] == DATA * 2
    elapsed = time.monotonic() - start
    assert 0.45 <= elapsed < 5
    stats = proxy.stats()
    assert stats["requests"] == {"GET /bw.bin": 2}
    assert stats["log"] == ["GET /bw.bin", "GET /bw.bin"]
    assert stats["bytes_sent"] == 1 + 2 * len(DATA)


def test_proxy_faults(http_server: Served) -> None:
    assert http_server.root is not None
    (http_server.root / "f.bin").write_bytes(DATA)
    proxy = http_server.proxy
    proxy.reset()
    url = f"{proxy.url}/f.bin"
    proxy.add_fault("status", status=429, count=1)
    proxy.add_fault("drop", count=1, path="/f.bin")
    proxy.add_fault("truncate", count=1, after_bytes=1000)
    assert _status(url) == 429
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError, urllib.error.URLError)):
        _get(url)
    with pytest.raises(http.client.IncompleteRead) as cut:
        _get(url)
    assert len(cut.value.partial) == 1000
    assert _get(url) == (200, DATA)  # rules are used up
    proxy.add_fault("status", status=503, count=None, method="HEAD")
    assert _get(url) == (200, DATA)  # a rule for HEAD leaves GET alone
    stats = proxy.stats()
    assert stats["faults"] == {"status": 1, "drop": 1, "truncate": 1}
    assert stats["total"] == 5
    proxy.reset()
    assert proxy.stats()["total"] == 0
    with pytest.raises(ValueError, match="unknown fault"):
        proxy.add_fault("explode")


def test_proxy_refuses_an_upstream_off_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="127.0.0.1"):
        start_fault_proxy("http://10.1.2.3:80")
    with pytest.raises(SystemExit):
        loopback.main(["proxy", "http://10.1.2.3:80"])
    assert "127.0.0.1" in capsys.readouterr().err


def test_the_guard_refuses_addresses_off_this_machine() -> None:
    from remote_fixtures import _loopback_only

    with socket.socket() as sock:
        with pytest.raises(ConnectionRefusedError, match="127.0.0.0/8"):
            _loopback_only("socket.connect", (sock, ("192.0.2.1", 80)))
        _loopback_only("socket.connect", (sock, ("127.0.0.1", 80)))  # allowed
    with pytest.raises(ConnectionRefusedError, match="lookups"):
        _loopback_only("socket.getaddrinfo", ("s3.amazonaws.com", 443, 0, 0, 0))
    with pytest.raises(ConnectionRefusedError):
        _loopback_only("socket.getaddrinfo", ("169.254.169.254", 80, 0, 0, 0))
    _loopback_only("socket.getaddrinfo", ("localhost", 80, 0, 0, 0))


def test_the_bandwidth_cap_is_reached_though_every_sleep_wakes_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fake clock whose sleeps overshoot by 1 ms (epoll's tick): 1,000 chunks of 64 KiB at
    100 MB/s take 0.66 s of link time, not 1,000 x (0.66 + 1) ms."""
    import asyncio

    from support import loopback

    clock = [1000.0]

    async def late_sleep(delay: float) -> None:
        clock[0] += delay + 0.001

    monkeypatch.setattr(loopback.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(loopback.asyncio, "sleep", late_sleep)
    throttle = loopback._Throttle(100e6)

    async def send() -> None:
        for _ in range(1000):
            await throttle.take(64 << 10)

    start = clock[0]
    asyncio.run(send())
    ideal = 1000 * (64 << 10) / 100e6
    assert ideal - throttle.SLACK <= clock[0] - start <= ideal * 1.05
