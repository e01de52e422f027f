"""Real servers on 127.0.0.1 for the remote tests and benchmarks; never imported by the library.

* :func:`start_http_server`: an aiohttp web server serving a folder, with ``Range`` support (or,
  with ``ranges=False``, ignoring ``Range`` like ``python -m http.server``).
* :func:`start_s3_server`: moto's standalone S3 server, reached through s3fs with
  :func:`s3_storage_options` (dummy credentials, a region and ``endpoint_url``) exactly as a user
  reaches AWS, and never the instance metadata service or AWS itself.
* :func:`start_gcs_server`: gcp-storage-emulator's Google Cloud Storage JSON API, reached through
  gcsfs with :func:`gcs_storage_options` (anonymous, ``endpoint_url``); a process that imports
  gcsfs needs :data:`GCS_ENVIRONMENT` set first (see there).
* :func:`start_fault_proxy`: an HTTP proxy in front of any of them, controlled while it runs:
  it drops connections, answers a status (503, 429, 403...), cuts bodies short, delays requests,
  adds a latency to every request and caps the bandwidth of all responses together. It counts
  requests by method and path, and the body bytes it sent.

Each server runs in its own process (``multiprocessing``, spawned), so the caller stays
single-threaded (``fork`` stays safe), and exits when its parent stops it or dies. Every socket is
bound to 127.0.0.1 on a free port. ``python -m support.loopback KIND ...`` runs
one by hand (it prints ``READY <port>``). As with any spawned process, a script that starts one
must do it under ``if __name__ == "__main__":`` (the child imports the script's main module).
"""

# More than 400 lines: four servers (HTTP, S3, GCS, fault proxy) and their process plumbing.

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import threading
import time
import traceback
import urllib.request
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "FaultProxy",
    "GCS_ENVIRONMENT",
    "LoopbackServer",
    "S3_ENVIRONMENT",
    "gcs_storage_options",
    "s3_storage_options",
    "start_fault_proxy",
    "start_gcs_server",
    "start_http_server",
    "start_s3_server",
]

HOST = "127.0.0.1"
CONTROL = "/__loopback__/"
_LOG_MAX = 100_000
# For a process that reaches the loopback S3 server without explicit storage_options: dummy
# credentials, a region, and no instance metadata service lookups.
S3_ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "eu-west-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
# For a process that reaches the loopback GCS server, set before gcsfs is imported (gcsfs reads
# it then): recent gcsfs (2026.10 here) first asks each bucket's layout over gRPC, which an
# emulator does not serve, and waits 60 s for it on every call. This keeps plain JSON-API gcsfs.
GCS_ENVIRONMENT = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
GCS_PROJECT = "torch-serialized-tests"
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
}
_S3_ERROR_CODES = {
    403: "AccessDenied",
    404: "NoSuchKey",
    429: "TooManyRequests",
    500: "InternalError",
    503: "SlowDown",
}


def s3_storage_options(endpoint_url: str) -> dict[str, Any]:
    """``storage_options`` for s3fs to reach a loopback S3 server with dummy credentials."""
    return {
        "key": S3_ENVIRONMENT["AWS_ACCESS_KEY_ID"],
        "secret": S3_ENVIRONMENT["AWS_SECRET_ACCESS_KEY"],
        "endpoint_url": endpoint_url,
        "client_kwargs": {"region_name": S3_ENVIRONMENT["AWS_DEFAULT_REGION"]},
    }


def gcs_storage_options(endpoint_url: str) -> dict[str, Any]:
    """``storage_options`` for gcsfs to reach a loopback GCS server, anonymously."""
    return {"endpoint_url": endpoint_url, "token": "anon", "project": GCS_PROJECT}


# --------------------------------------------------------------------------- client side

_S = TypeVar("_S", bound="LoopbackServer")


class LoopbackServer:
    """A server process on 127.0.0.1; ``url`` is its base URL. Stop it with :meth:`stop`.

    ``startup_timeout`` bounds the wait for a fresh interpreter to import the server (moto,
    aiohttp, torch): a few seconds on a quiet machine, once over 60 s on a loaded 2-core one."""

    def __init__(self, kind: str, *args: Any, startup_timeout: float = 180.0) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited threads
        ready_r, ready_w = ctx.Pipe(duplex=False)
        alive_r, self._alive = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_serve, args=(kind, args, ready_w, alive_r), name=f"loopback-{kind}"
        )
        self._proc.daemon = True  # ended at interpreter exit if stop() was never called
        self._proc.start()
        ready_w.close()
        alive_r.close()
        message: tuple[str, Any]
        try:
            message = ready_r.recv() if ready_r.poll(startup_timeout) else ("ERROR", "timed out")
        except EOFError:
            message = (
                "ERROR",
                "the process ended before it was ready (a script that starts servers must do it "
                "under `if __name__ == '__main__':`)",
            )
        finally:
            ready_r.close()
        if message[0] != "READY":
            self.stop()
            raise RuntimeError(f"loopback {kind} server {args} did not start: {message[1]}")
        self.port = int(message[1])
        self.url = f"http://{HOST}:{self.port}"

    def stop(self) -> None:
        """Stop the server (closing its pipe asks it to exit) and wait for it."""
        self._alive.close()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def start_http_server(root: str | os.PathLike[str], *, ranges: bool = True) -> LoopbackServer:
    """Serve the folder ``root`` over HTTP (GET and HEAD; ``Range`` unless ``ranges=False``)."""
    return LoopbackServer("http", os.fspath(root), ranges)


def start_s3_server() -> LoopbackServer:
    """moto's S3 server (empty, in memory); its ``url`` is the ``endpoint_url``."""
    return LoopbackServer("s3")


def start_gcs_server() -> LoopbackServer:
    """gcp-storage-emulator's GCS server (empty, in memory); its ``url`` is the
    ``endpoint_url``. It answers one request at a time."""
    return LoopbackServer("gcs")


@dataclass(frozen=True)
class Fault:
    """One fault rule of a :class:`FaultProxy`; see :meth:`FaultProxy.add_fault`."""

    kind: str
    count: int | None = 1
    path: str | None = None
    method: str | None = None
    status: int = 503
    after_bytes: int | None = None
    delay: float = 0.0


class FaultProxy(LoopbackServer):
    """A fault-injecting HTTP proxy in front of ``upstream``; ``url`` is where clients go."""

    def __init__(self, upstream: str) -> None:
        _check_upstream(upstream)
        super().__init__("proxy", upstream)
        self.upstream = upstream
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _control(self, method: str, what: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{CONTROL}{what}", data, method=method)
        with self._opener.open(request, timeout=30) as response:
            return json.loads(response.read())

    def configure(self, *, latency: float = 0.0, bandwidth: float | None = None) -> None:
        """Delay every request by ``latency`` seconds; cap all bodies at ``bandwidth`` bytes/s."""
        self._control("POST", "config", {"latency": latency, "bandwidth": bandwidth})

    def add_fault(
        self,
        kind: str,
        *,
        count: int | None = 1,
        path: str | None = None,
        method: str | None = None,
        status: int = 503,
        after_bytes: int | None = None,
        delay: float = 0.0,
    ) -> None:
        """Apply a fault to the next ``count`` matching requests (``None``: all of them).

        ``kind``: ``"drop"`` closes the connection without an answer; ``"status"`` answers
        ``status`` with an S3-style error body; ``"truncate"`` sends the headers and
        ``after_bytes`` bytes of the body (default half) then closes; ``"delay"`` waits
        ``delay`` seconds first. A request matches if ``path`` is in its path and ``method``
        (GET, HEAD, PUT...) is its method, when given. Rules apply in the order added.
        """
        if kind not in ("drop", "status", "truncate", "delay"):
            raise ValueError(f"unknown fault kind {kind!r}")
        self._control(
            "POST", "faults", asdict(Fault(kind, count, path, method, status, after_bytes, delay))
        )

    def clear_faults(self) -> None:
        self._control("DELETE", "faults")

    def reset(self) -> None:
        """No faults, no latency, no cap, counters at zero."""
        self._control("POST", "reset")

    def stats(self) -> dict[str, Any]:
        """Counters since the last reset.

        ``requests`` ({"GET /path": n}), ``log`` (["GET /path", ...] in arrival order),
        ``faults`` ({kind: n} applied), ``bytes_sent`` (response body bytes), ``total``.
        """
        return dict(self._control("GET", "stats"))

    def count(self, method: str, path_part: str) -> int:
        """Requests so far with method ``method`` and ``path_part`` in their path."""
        return sum(
            n
            for key, n in self.stats()["requests"].items()
            if key.split(" ", 1)[0] == method and path_part in key.split(" ", 1)[1]
        )


def start_fault_proxy(upstream: str) -> FaultProxy:
    """A :class:`FaultProxy` in front of ``upstream`` (``http://127.0.0.1:PORT``)."""
    return FaultProxy(upstream)


# --------------------------------------------------------------------------- server side


Ready = Callable[[int], None]


def _check_upstream(upstream: str) -> None:
    if not upstream.startswith(f"http://{HOST}:"):
        raise ValueError(
            f"the upstream must be on http://{HOST}: a loopback server, not {upstream}"
        )


def _serve(kind: str, args: tuple[Any, ...], ready_w: Any, alive_r: Any) -> None:
    """The server process: run ``kind`` until the parent closes its end of ``alive_r`` or dies."""

    def watch() -> None:
        with suppress(EOFError, OSError):
            alive_r.recv()
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
    try:
        _run(kind, args, lambda port: ready_w.send(("READY", port)))
    except BaseException:
        ready_w.send(("ERROR", traceback.format_exc()))
        raise


def _run(kind: str, args: tuple[Any, ...], ready: Ready) -> None:
    if kind == "http":
        asyncio.run(_run_http(Path(args[0]), bool(args[1]), ready))
    elif kind == "s3":
        _run_s3(ready)
    elif kind == "gcs":
        _run_gcs(ready)
    elif kind == "proxy":
        _check_upstream(args[0])
        asyncio.run(_run_proxy(args[0].rstrip("/"), ready))
    else:
        raise ValueError(f"unknown loopback server kind {kind!r}")


def _print_ready(port: int) -> None:
    sys.stdout.write(f"READY {port}\n")
    sys.stdout.flush()


class _Throttle:
    """All bodies together at most ``rate`` bytes/s: a virtual clock of when the link is free.

    The clock may lag real time by ``SLACK`` seconds before the lag is forgotten: a sleep
    wakes up to a timer tick (1 ms with epoll) late, and restarting the clock from "now" after
    each late wake-up would lose that time on every chunk (64 KiB at 100 MB/s is 0.66 ms: the
    link then carried a third of its rate). Over any interval the bytes stay within
    ``rate * (interval + SLACK)``.
    """

    SLACK = 0.02

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._free_at = 0.0

    async def take(self, n: int) -> None:
        now = time.monotonic()
        self._free_at = max(now - self.SLACK, self._free_at) + n / self.rate
        if self._free_at > now:
            await asyncio.sleep(self._free_at - now)


class _ProxyState:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.latency = 0.0
        self.throttle: _Throttle | None = None
        self.rules: list[dict[str, Any]] = []
        self.requests: Counter[str] = Counter()
        self.log: list[str] = []  # "METHOD /path" in arrival order, the first _LOG_MAX
        self.faults: Counter[str] = Counter()
        self.bytes_sent = 0

    def take_rule(self, method: str, path: str) -> dict[str, Any] | None:
        for rule in self.rules:
            if rule["path"] is not None and rule["path"] not in path:
                continue
            if rule["method"] is not None and rule["method"] != method:
                continue
            if rule["count"] is not None:
                rule["count"] -= 1
                if rule["count"] <= 0:
                    self.rules.remove(rule)
            self.faults[rule["kind"]] += 1
            return rule
        return None


async def _run_proxy(upstream: str, ready: Ready) -> None:
    import aiohttp
    from aiohttp import web

    state = _ProxyState()
    session = aiohttp.ClientSession(
        auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None, sock_read=120)
    )

    async def control(request: web.Request) -> web.Response:
        what = request.path[len(CONTROL) :]
        if what == "stats":
            return web.json_response(
                {
                    "requests": dict(state.requests),
                    "log": state.log,
                    "faults": dict(state.faults),
                    "bytes_sent": state.bytes_sent,
                    "total": sum(state.requests.values()),
                }
            )
        if what == "config":
            body = await request.json()
            state.latency = float(body.get("latency") or 0.0)
            rate = body.get("bandwidth")
            state.throttle = _Throttle(float(rate)) if rate else None
        elif what == "faults" and request.method == "POST":
            state.rules.append(await request.json())
        elif what == "faults" and request.method == "DELETE":
            state.rules.clear()
        elif what == "reset":
            state.reset()
        else:
            raise web.HTTPNotFound()
        return web.json_response({"ok": True})

    def abort(request: web.Request) -> None:
        if request.transport is not None:
            request.transport.abort()  # a reset connection, as a crashed server or a cut link

    async def forward(request: web.Request) -> web.StreamResponse:
        if request.path.startswith(CONTROL):
            return await control(request)
        state.requests[f"{request.method} {request.path}"] += 1
        if len(state.log) < _LOG_MAX:
            state.log.append(f"{request.method} {request.path}")
        rule = state.take_rule(request.method, request.path)
        kind = rule["kind"] if rule else None
        pause = state.latency + (float(rule["delay"]) if rule and kind == "delay" else 0.0)
        if pause:
            await asyncio.sleep(pause)
        body = await request.read()
        if rule and kind == "drop":
            abort(request)
            return web.Response()
        if rule and kind == "status":
            status = int(rule["status"])
            code = _S3_ERROR_CODES.get(status, str(status))
            xml = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>injected by the loopback proxy</Message></Error>"
            )
            return web.Response(status=status, text=xml, content_type="application/xml")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with session.request(
            request.method,
            upstream + request.path_qs,
            headers=headers,
            data=body or None,
            allow_redirects=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
        ) as up:
            response = web.StreamResponse(status=up.status, reason=up.reason)
            for k, v in up.headers.items():
                if k.lower() not in _HOP_BY_HOP:
                    response.headers.add(k, v)
            if up.content_length is not None:
                response.content_length = up.content_length
            await response.prepare(request)
            if request.method == "HEAD":
                await response.write_eof()
                return response
            limit = None
            if rule and kind == "truncate":
                after = rule["after_bytes"]
                limit = int(after) if after is not None else (up.content_length or 0) // 2
            sent = 0
            async for chunk in up.content.iter_chunked(64 << 10):
                if limit is not None and sent + len(chunk) >= limit:
                    chunk = chunk[: limit - sent]
                if state.throttle is not None:
                    await state.throttle.take(len(chunk))
                await response.write(chunk)
                sent += len(chunk)
                state.bytes_sent += len(chunk)
                if limit is not None and sent >= limit:
                    abort(request)
                    return response
            await response.write_eof()
            return response

    app = web.Application(client_max_size=1 << 34)
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    ready(runner.addresses[0][1])
    await asyncio.Event().wait()


async def _run_http(root: Path, ranges: bool, ready: Ready) -> None:
    from aiohttp import web

    base = root.resolve()

    async def serve(request: web.Request) -> web.StreamResponse:
        path = (base / request.match_info["tail"]).resolve()
        if base not in path.parents or not path.is_file():
            raise web.HTTPNotFound()
        if ranges:
            return web.FileResponse(path)
        # Like python -m http.server: the whole file whatever the Range header says.
        return web.Response(body=path.read_bytes(), content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/{tail:.*}", serve)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    ready(runner.addresses[0][1])
    await asyncio.Event().wait()


def _run_s3(ready: Ready) -> None:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request on stderr

    server = ThreadedMotoServer(ip_address=HOST, port=0, verbose=False)
    server.start()
    ready(server.get_host_and_port()[1])
    threading.Event().wait()


def _run_gcs(ready: Ready) -> None:
    import logging

    from gcp_storage_emulator.server import create_server

    logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)
    server = create_server(HOST, 0, in_memory=True)
    server.start()
    ready(server._api._httpd.server_address[1])  # bound to port 0: the port it was given
    threading.Event().wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m support.loopback")
    sub = parser.add_subparsers(dest="kind", required=True)
    http = sub.add_parser("http", help="serve a folder over HTTP")
    http.add_argument("root", type=Path)
    http.add_argument("--no-ranges", action="store_true", help="ignore Range headers")
    sub.add_parser("s3", help="moto's S3 server")
    sub.add_parser("gcs", help="gcp-storage-emulator's GCS server")
    proxy = sub.add_parser("proxy", help="a fault-injecting proxy")
    proxy.add_argument("upstream", help="http://127.0.0.1:PORT")
    args = parser.parse_args(argv)
    if args.kind == "http":
        _run("http", (args.root, not args.no_ranges), _print_ready)
    elif args.kind in ("s3", "gcs"):
        _run(args.kind, (), _print_ready)
    else:
        try:
            _check_upstream(args.upstream)
        except ValueError as exc:
            parser.error(str(exc))
        _run("proxy", (args.upstream,), _print_ready)


if __name__ == "__main__":
    main()
