"""A shard being downloaded is read before its download ends: its tail (index, metadata) comes
by a ranged GET just before the body, and each record once its own bytes are in and match their
CRC32s. A server that holds back the rest of the body shows it; faults still end whole."""

from __future__ import annotations

import itertools
import logging
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from _container_helpers import FIELDS, check_pack, payload, size_of, write_pack

from torch_serialized.container import shards as shards_module
from torch_serialized.container.reader import ContainerReader
from torch_serialized.container.shards import PackReader, open_pack
from torch_serialized.container.shardwriter import PackWriter
from torch_serialized.data.pipeline import PIECE, read_blocks
from torch_serialized.errors import ChecksumError
from torch_serialized.remote import arrival as arrival_module
from torch_serialized.remote.arrival import Arrival, ArrivingShard

if TYPE_CHECKING:
    from remote_fixtures import Remote

pytest_plugins = ["remote_fixtures"]

N, PER_SHARD = 40, 20
FIRST = "shard-00000"
ONE_SERVER = pytest.mark.parametrize("remote", ["http"], indirect=True)


class HoldingServer(ThreadingHTTPServer):
    """Serves ``root`` on 127.0.0.1 with ranges; the first shard's body (a GET from byte 0, its
    "whole" GET) sends its first ``hold`` bytes, then the rest only once ``release`` is set.
    ``ranges=False``: Range ignored."""

    daemon_threads = True

    def __init__(self, root: Path, hold: int, ranges: bool = True) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root, self.hold, self.ranges = root, hold, ranges
        self.release = threading.Event()
        self.requests: list[str] = []
        self.range_delay = 0.0  # seconds before a ranged answer (a slow or stalled tail)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HoldingServer

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path = self.server.root / self.path.lstrip("/")
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        wanted = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        body = not wanted or wanted[1] == "0"  # the body's GET: ranged up to an early tail
        self.server.requests.append(f"{'whole' if body else 'range'} {path.name}")
        if wanted and self.server.ranges:
            time.sleep(self.server.range_delay)
            start, end = int(wanted[1]), min(int(wanted[2]), len(data) - 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            data = data[start : end + 1]
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        hold = self.server.hold if body and path.name.startswith(FIRST) else len(data)
        if not body:  # logged before the client can hold the bytes: its next step sees it
            self.server.requests.append(f"range sent {path.name}")
        self.wfile.write(data[:hold])
        self.wfile.flush()
        if hold < len(data):
            self.server.release.wait(30)
            self.wfile.write(data[hold:])


@pytest.fixture
def pack(tmp_path: Path) -> Path:
    return write_pack(tmp_path / "pack", N, max_records_per_shard=PER_SHARD)


def first_record_end(pack: Path) -> int:
    """Where record 0's last field ends in the first shard."""
    row = ContainerReader(next(pack.glob(f"{FIRST}*"))).index_rows([0])[0]
    return int((row["offset"] + row["length"]).max())


@pytest.fixture
def holding(pack: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HoldingServer]:
    # tails of the index alone: these shards are small, a default tail would be all of them
    monkeypatch.setattr("torch_serialized.container.shards._TAIL", 0)
    server = HoldingServer(pack.parent, hold=first_record_end(pack))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


def in_cache(reader: PackReader, s: int) -> bool:
    """Whether shard ``s`` of a remote pack is whole in its cache."""
    assert reader.remote is not None
    return reader.remote.object_path(reader.entries[s].file).exists()


def record_0(reader: object) -> list[bytes]:
    return [bytes(reader.field(0, k)) for k in range(len(FIELDS))]  # type: ignore[attr-defined]


def test_a_record_is_read_before_the_rest_of_its_shard_arrives(
    holding: HoldingServer, tmp_path: Path
) -> None:
    reader = open_pack(f"{holding.url}/pack", cache_dir=tmp_path / "cache")
    reader.prefetch_shards([0])
    start = time.monotonic()
    assert record_0(reader) == [payload(0, k, size_of(0, k)) for k in range(len(FIELDS))]
    assert time.monotonic() - start < 10 and not holding.release.is_set()
    assert isinstance(reader.shard(0), ArrivingShard)
    assert f"range {FIRST}" in " ".join(holding.requests)  # its tail came with the body

    later = threading.Thread(target=lambda: (time.sleep(0.3), holding.release.set()))
    later.start()
    check_pack(reader, N)  # record 19 waits for its bytes, then all of them are right
    later.join()
    reader.close()
    cached = next((tmp_path / "cache").rglob(f"{FIRST}*.tser"))
    assert cached.read_bytes() == next((holding.root / "pack").glob(f"{FIRST}*")).read_bytes()
    assert not list((tmp_path / "cache").rglob("*.partial"))
    whole = [r for r in holding.requests if r.startswith("whole shard")]
    assert len(whole) == 2  # one GET per shard


def test_a_shard_another_process_downloads_is_read_early_from_that_download(
    holding: HoldingServer, tmp_path: Path
) -> None:
    """A rank's DataLoader workers share one cache: a worker asking for a shard a sibling is
    downloading waited for the whole of it (its fetch lock), to read one record. Now it reads
    the sibling's partial file as its progress file tells: one download, read early by both.
    (Two readers in one process: their fetch locks are as two processes'.)"""
    cache = tmp_path / "cache"
    first = open_pack(f"{holding.url}/pack", cache_dir=cache)
    first.prefetch_shards([0])
    expected = [payload(0, k, size_of(0, k)) for k in range(len(FIELDS))]
    assert record_0(first) == expected  # the first reader's download is under way
    second = open_pack(f"{holding.url}/pack", cache_dir=cache)
    second.prefetch_shards([0], now=True)
    start = time.monotonic()
    assert record_0(second) == expected
    assert time.monotonic() - start < 10 and not holding.release.is_set()
    shard = second.shard(0)
    assert isinstance(shard, ArrivingShard) and shard._arrival.following
    assert list(cache.rglob("*.progress.partial"))  # the first's progress, while it runs

    later = threading.Thread(target=lambda: (time.sleep(0.3), holding.release.set()))
    later.start()
    check_pack(second, N)  # the rest waits for the first's download, then the whole copy
    later.join()
    check_pack(first, N)
    first.close()
    second.close()
    assert sum(r.startswith(f"whole {FIRST}") for r in holding.requests) == 1
    assert not list(cache.rglob("*.partial"))  # the progress file went with the download


DOWNLOADER = """
import sys, time
from torch_serialized.container import shards
shards._TAIL = 0  # as the holding fixture sets it here
reader = shards.open_pack(sys.argv[1], cache_dir=sys.argv[2])
reader.prefetch_shards([0])
reader.field(0, 0)  # its first record is in: the download is under way
print("reading", flush=True)
time.sleep(60)
"""


def test_a_shard_whose_downloader_dies_is_downloaded_again_by_its_follower(
    holding: HoldingServer, tmp_path: Path
) -> None:
    """A worker killed while downloading a shard others read early: they read what came,
    then one downloads the shard again (its lock is free, the dead one's files are removed)."""
    cache = tmp_path / "cache"
    url = f"{holding.url}/pack"
    argv = [sys.executable, "-c", DOWNLOADER, url, str(cache)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as downloader:
        try:
            assert downloader.stdout is not None and downloader.stdout.readline() == "reading\n"
            reader = open_pack(url, cache_dir=cache)
            reader.prefetch_shards([0], now=True)
            expected = [payload(0, k, size_of(0, k)) for k in range(len(FIELDS))]
            assert record_0(reader) == expected and not holding.release.is_set()  # read early
            shard = reader.shard(0)
            assert isinstance(shard, ArrivingShard) and shard._arrival.following
        finally:
            downloader.kill()
    holding.release.set()
    check_pack(reader, N)
    reader.close()
    assert sum(r.startswith(f"whole {FIRST}") for r in holding.requests) == 2
    assert not list(cache.rglob("*.partial"))


def test_a_prefetch_ahead_leaves_a_shard_to_the_process_downloading_it(
    holding: HoldingServer, tmp_path: Path
) -> None:
    """A worker's prefetch thread that found a sibling downloading its shard waited for that
    download, so the worker had nothing of its own in flight. It moves on to its next shard;
    a reader asking for the first one then follows the sibling's download."""
    cache = tmp_path / "cache"
    first = open_pack(f"{holding.url}/pack", cache_dir=cache)
    first.prefetch_shards([0])
    expected = [payload(0, k, size_of(0, k)) for k in range(len(FIELDS))]
    assert record_0(first) == expected  # its download is under way, held back by the server
    second = one_thread(holding, tmp_path)
    second.prefetch_shards([0, 1])
    deadline = time.monotonic() + 10
    while not in_cache(second, 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert in_cache(second, 1) and not holding.release.is_set()
    assert record_0(second) == expected and not holding.release.is_set()  # read early
    holding.release.set()
    check_pack(second, N)
    first.close()
    second.close()
    assert sum(r.startswith(f"whole {FIRST}") for r in holding.requests) == 1


def test_an_arrival_follows_another_process_download_by_its_progress_file(
    tmp_path: Path,
) -> None:
    """The progress file is all a follower sees: records caught half written, and a later
    download of the object than the one whose file it reads, are passed over."""
    progress, partial = tmp_path / ".shard.progress.partial", tmp_path / "partial"
    partial.write_bytes(bytes(1000))
    download, follower = Arrival(tail=100), Arrival()
    download.share(progress)
    download.update(path=str(partial))
    follower.follow(progress)
    assert follower.following and not download.following
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(follower.wait(600)))
    waiter.start()
    download.tail_arrived(1000)  # its last 100 bytes
    download.arrived(500)
    time.sleep(0.05)
    assert not got and follower.path == str(partial) and follower.have == 500
    download.arrived(600)
    waiter.join(5)
    assert got == [True] and follower._has(900, 1000)

    download.arrived(700)
    record = bytearray(progress.read_bytes())
    record[-1] ^= 0xFF  # caught half written: its checksum fails
    progress.write_bytes(bytes(record))
    with follower._cond:
        follower._look()
    assert follower.have == 600  # not taken
    progress.write_bytes(b"\x40\x00")  # caught as it began: too short to frame anything
    with follower._cond:
        follower._look()
    assert follower.have == 600
    other = Arrival()  # a later download, of another partial file
    other.share(progress)
    other.update(path=str(tmp_path / "another"), tail_in=True, have=1000)
    later = threading.Thread(target=lambda: (time.sleep(0.1), follower.end()))
    later.start()
    assert not follower.wait(800)  # ended (its own fetch) without those bytes
    later.join()
    assert follower.path == str(partial) and follower.have == 600
    other.share(None)
    download.share(None)
    assert not progress.exists()
    with follower._cond:
        follower._look()  # gone with its download: nothing to take
    assert follower.have == 600

    unwritable = Arrival()  # publishing is best effort: a download never fails for it
    unwritable.share(tmp_path / "gone" / ".shard.progress.partial")
    unwritable.arrived(10)
    unwritable.share(None)
    assert unwritable.have == 10


def one_thread(holding: HoldingServer, tmp_path: Path) -> PackReader:
    """A reader of ``holding``'s pack whose prefetches run one at a time."""
    reader = open_pack(f"{holding.url}/pack", cache_dir=tmp_path / "cache")
    assert reader.remote is not None
    reader.remote.prefetch_threads = 1
    return reader


@pytest.mark.parametrize("read_early", [True, False])
def test_a_shard_released_while_it_downloads_is_not_held_after(
    holding: HoldingServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_early: bool
) -> None:
    """A shard a stream left while its download still ran (read early to its last record, or
    not read: out of the window) was held once the download ended, until the stream closed: a
    bounded cache could not evict it and grew past its limit (a shard over, under load)."""
    from torch_serialized.remote.cache import Cache, PackCache

    in_room, gate, registered = threading.Event(), threading.Event(), threading.Event()
    real_room, real_fetch = Cache.room, PackCache.fetch

    def held_back(self: Cache, need: int, *args: Any) -> Any:
        in_room.set()
        gate.wait(30)  # the bytes are in, the download has not joined the cache yet
        return real_room(self, need, *args)

    def fetch(self: PackCache, name: str, *args: Any) -> Path:
        path = real_fetch(self, name, *args)
        if name.startswith(FIRST):
            registered.set()
        return path

    reader = open_pack(f"{holding.url}/pack", cache_dir=tmp_path / "cache")
    monkeypatch.setattr(Cache, "room", held_back)
    monkeypatch.setattr(PackCache, "fetch", fetch)
    reader.prefetch_shards([0])
    if read_early:
        assert isinstance(reader.shard(0), ArrivingShard)
    holding.release.set()
    if read_early:
        for i in range(PER_SHARD):  # every record of the shard, from the partial file
            assert bytes(reader.field(i, 0)) == payload(i, 0, size_of(i, 0))
    assert in_room.wait(30)
    reader.release_shard(0)
    gate.set()
    assert registered.wait(30)
    name = reader.entries[0].file
    deadline = time.monotonic() + 5
    while name in reader.remote.held() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert name not in reader.remote.held()
    check_pack(reader, N)  # asked for again: downloaded once, held while read
    assert name in reader.remote.held()
    reader.close()
    assert sum(r.startswith(f"whole {FIRST}") for r in holding.requests) == 1


def test_a_download_left_while_it_runs_is_dropped_if_the_cache_is_full(
    holding: HoldingServer, pack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard a stream left while its download ran joined a bounded cache full of held shards
    when it ended, past the limit until some later download evicted it (a shard over, in CI).
    Nobody waits for it: it is dropped, and downloaded again if asked for."""
    from torch_serialized.remote.cache import Cache

    size = {f.name[: len(FIRST)]: f.stat().st_size for f in pack.iterdir()}
    fixed = sum(n for name, n in size.items() if not name.startswith("shard-"))
    in_room, gate, real_room = threading.Event(), threading.Event(), Cache.room

    def held_back(self: Cache, need: int, *args: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():  # shard 0's prefetch
            in_room.set()
            gate.wait(30)
        return real_room(self, need, *args)

    reader = open_pack(
        f"{holding.url}/pack",
        cache_dir=tmp_path / "cache",
        cache_limit_bytes=fixed + size["shard-00001"] + size[FIRST] // 2,
    )
    monkeypatch.setattr(Cache, "room", held_back)
    reader.prefetch_shards([0])
    assert bytes(reader.field(PER_SHARD, 0)) == payload(PER_SHARD, 0, size_of(PER_SHARD, 0))
    holding.release.set()
    assert in_room.wait(30)
    reader.release_shard(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gate.set()
        assert reader.remote is not None
        deadline = time.monotonic() + 10
        while reader.remote._pending and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not seen and not reader.remote._pending
    assert not list((tmp_path / "cache").rglob(f"{FIRST}*.tser"))
    reader.release_shard(1)
    for i in range(PER_SHARD):  # shard 0 asked for again: downloaded again
        assert bytes(reader.field(i, 0)) == payload(i, 0, size_of(i, 0))
    reader.close()
    assert sum(r.startswith(f"whole {FIRST}") for r in holding.requests) == 2


def test_a_queued_prefetch_released_is_not_downloaded(
    holding: HoldingServer, tmp_path: Path
) -> None:
    reader = one_thread(holding, tmp_path)
    reader.prefetch_shards([0, 1])  # the one thread waits on shard 0's held body
    reader.release_shard(1)
    holding.release.set()
    for i in range(PER_SHARD):  # shard 0's records
        assert bytes(reader.field(i, 0)) == payload(i, 0, size_of(i, 0))
    reader.close()
    assert not [r for r in holding.requests if "shard-00001" in r]


@pytest.mark.parametrize("remote", ["http", "s3"], indirect=True)
def test_a_shard_is_checked_as_it_arrives_not_read_again(
    remote: Remote, pack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefetched shard's fields are checked against their CRC32s as its bytes arrive: no
    pass over the whole file after its download, nor when it is read; a field that fails its
    CRC32 fails the download, retried (see the damaged test). The reads wait for the
    downloads, so how far they got (early reads are tested below) changes nothing here."""
    for f in sorted(pack.iterdir(), key=lambda f: f.name == "manifest.json"):
        remote.put(f.name, f.read_bytes())
    passes: list[str] = []
    real = shards_module.intact

    def counted(expect: object = None) -> object:
        check = real(expect)  # type: ignore[arg-type]
        return lambda path: passes.append(Path(path).name) or check(path)

    monkeypatch.setattr(shards_module, "intact", counted)
    monkeypatch.setattr("torch_serialized.container.shards._TAIL", 0)  # a body before its tail
    reader = open_pack(
        remote.url, storage_options=remote.storage_options, cache_dir=tmp_path / "cache"
    )
    reader.prefetch_shards([0, 1])
    deadline = time.monotonic() + 30
    while not (in_cache(reader, 0) and in_cache(reader, 1)) and time.monotonic() < deadline:
        time.sleep(0.01)
    check_pack(reader, N)
    assert not reader.shard(0).checked  # read as checked by its download
    reader.close()
    assert not [p for p in passes if "shard-" in p]  # neither shard was read whole again
    for f in pack.glob("shard-*"):
        assert next((tmp_path / "cache").rglob(f.name)).read_bytes() == f.read_bytes()


def test_a_record_far_ahead_of_the_body_is_read_by_a_range_of_its_own(
    holding: HoldingServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record far ahead of a shard's body in flight does not wait for the body to reach it:
    its bytes come by a ranged GET of their own (a first batch needing a shard's far end)."""
    monkeypatch.setattr("torch_serialized.remote.arrival.FAR", 0)  # the shards here are small
    monkeypatch.setattr("torch_serialized.container.shards._TAIL", 0)  # so not in the tail
    reader = open_pack(f"{holding.url}/pack", cache_dir=tmp_path / "cache")
    reader.prefetch_shards([0])
    last = PER_SHARD // 2
    start = time.monotonic()
    got = [bytes(reader.field(last, k)) for k in range(len(FIELDS))]
    assert got == [payload(last, k, size_of(last, k)) for k in range(len(FIELDS))]
    assert time.monotonic() - start < 10 and not holding.release.is_set()
    assert sum(r.startswith(f"range sent {FIRST}") for r in holding.requests) == 2  # tail, it
    holding.release.set()
    check_pack(reader, N)
    reader.close()


def large_payloads(i: int) -> list[bytes]:
    return [payload(i, k, 20_000 + 100 * (i % 3)) for k in range(len(FIELDS))]


def large_records(out: Path, n: int, per_shard: int) -> Path:
    """A pack of ``n`` records of about the same size, as images are, larger than tails."""
    out.parent.mkdir()
    with PackWriter(out, FIELDS, max_records_per_shard=per_shard) as w:
        for i in range(n):
            w.add(large_payloads(i))
        w.close()
    return out


def test_a_block_that_ends_a_shard_comes_with_its_tail(tmp_path: Path) -> None:
    """The records a stream needs first of a shard, where they end it, come in its tail's GET
    (sized by their mean size, with a margin): no GET of their own, no wait for the body."""
    root = tmp_path / "served"
    server = HoldingServer(root, hold=first_record_end(large_records(root / "pack", N, PER_SHARD)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reader = open_pack(f"{server.url}/pack", cache_dir=tmp_path / "cache")
        last = np.arange(PER_SHARD - 4, PER_SHARD)
        reader.prefetch_shards([0], now=True, rows={0: last})
        start = time.monotonic()
        for i in last:
            assert [bytes(reader.field(i, k)) for k in range(2)] == large_payloads(i)
        assert time.monotonic() - start < 10 and not server.release.is_set()
        assert sum(r.startswith("range sent") for r in server.requests) == 1  # the tail alone
        server.release.set()
        reader.close()
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()


def test_a_remote_stream_yields_a_batch_before_its_block_is_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream's block of 64 from a shard in flight yields its first ``PIECE`` records (a
    worker's first batch) once their bytes are in, not once the whole block's are."""
    pack = large_records(tmp_path / "served" / "pack", 80, 40)
    row = ContainerReader(next(pack.glob(f"{FIRST}*"))).index_rows([PIECE - 1])[0]
    server = HoldingServer(pack.parent, hold=int((row["offset"] + row["length"]).max()))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reader = open_pack(f"{server.url}/pack", cache_dir=tmp_path / "cache")
        items = read_blocks([np.arange(64)], np.arange(80), reader, [0, 1])
        start = time.monotonic()
        first = list(itertools.islice(items, PIECE))
        assert time.monotonic() - start < 10 and not server.release.is_set()
        assert [i for i, _ in first] == list(range(PIECE))
        server.release.set()
        rest = list(items)
        assert [i for i, _ in rest] == list(range(PIECE, 64))
        for i, fields in first + rest:
            assert fields is not None
            assert [bytes(f) for f in fields] == large_payloads(i)
        del first, rest, fields
        reader.close()
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()


def test_a_range_asked_for_leaves_out_what_the_tail_brings(tmp_path: Path) -> None:
    """Bytes a reader wants that run into the tail are fetched up to the tail only, and are
    then in: the ranged GET's bytes and the tail's together."""
    path = tmp_path / "partial"
    path.write_bytes(bytes(1000))
    asked: list[tuple[int, int]] = []

    def get(a: int, b: int) -> Future[bytes]:
        asked.append((a, b))
        done: Future[bytes] = Future()
        done.set_result(b"x" * (b - a))
        return done

    arrival = Arrival(tail=100)
    arrival.update(path=str(path), get=get)
    arrival.tail_arrived(1000)
    arrival.want(8 << 20, 8 << 20)  # nothing: not far ahead of the body
    with pytest.MonkeyPatch.context() as m:
        m.setattr("torch_serialized.remote.arrival.FAR", 0)
        arrival.want(500, 950)
    assert asked == [(500, 900)]
    assert arrival.wait(950, 500) and not arrival.ended
    assert path.read_bytes()[500:900] == b"x" * 400


def test_two_ranges_that_arrive_together_are_both_kept(tmp_path: Path) -> None:
    """A ranged GET ending while another one's bytes are written keeps both spans: before, the
    second to end overwrote the first's, and its reader waited for the whole body."""
    path = tmp_path / "partial"
    path.write_bytes(bytes(1000))
    pending: dict[tuple[int, int], Future[bytes]] = {}

    def get(a: int, b: int) -> Future[bytes]:
        return pending.setdefault((a, b), Future())

    arrival = Arrival(tail=100)
    arrival.update(path=str(path), get=get)
    arrival.tail_arrived(1000)
    with pytest.MonkeyPatch.context() as m:
        m.setattr("torch_serialized.remote.arrival.FAR", 0)
        arrival.want(100, 200)
        arrival.want(300, 400)
        real = arrival_module.write_at

        def write_at(target: str, data: bytes, at: int) -> None:
            real(target, data, at)
            if at == 100:  # the other range ends while this one's bytes are written
                pending[(300, 400)].set_result(b"y" * 100)

        m.setattr(arrival_module, "write_at", write_at)
        pending[(100, 200)].set_result(b"x" * 100)
    arrival.end()  # the body failed: waiters stop waiting, and see what is in
    assert arrival.wait(200, 100) and arrival.wait(400, 300)


def test_a_shard_awaited_behind_other_downloads_starts_at_once(
    holding: HoldingServer, tmp_path: Path
) -> None:
    """Prefetches run ``prefetch_threads`` at a time; a shard a reader waits for (or that a
    stream asks for ``now``) does not queue behind them."""
    reader = one_thread(holding, tmp_path)
    reader.prefetch_shards([0, 1])  # shard 0's body is held: shard 1 waits for the thread
    time.sleep(0.3)
    assert not any("shard-00001" in r for r in holding.requests)
    reader.prefetch_shards([1], now=True)
    deadline = time.monotonic() + 10
    while not any(r.startswith("whole shard-00001") for r in holding.requests):
        assert time.monotonic() < deadline, holding.requests
        time.sleep(0.05)
    assert record_0(reader) == [payload(0, k, size_of(0, k)) for k in range(len(FIELDS))]
    later = PER_SHARD  # shard 1's first record: read while shard 0 is still held
    got = [bytes(reader.field(later, k)) for k in range(len(FIELDS))]
    assert got == [payload(later, k, size_of(later, k)) for k in range(len(FIELDS))]
    assert not holding.release.is_set()
    holding.release.set()
    reader.close()


def test_a_queued_shard_a_reader_opens_is_started_for_it(
    holding: HoldingServer, tmp_path: Path
) -> None:
    reader = one_thread(holding, tmp_path)
    reader.prefetch_shards([0, 1])
    start = time.monotonic()
    later = PER_SHARD
    got = [bytes(reader.field(later, k)) for k in range(len(FIELDS))]
    assert got == [payload(later, k, size_of(later, k)) for k in range(len(FIELDS))]
    assert time.monotonic() - start < 10 and not holding.release.is_set()
    holding.release.set()
    check_pack(reader, N)
    reader.close()


@pytest.mark.parametrize("delay, wait", [(0.2, 5.0), (30.0, 0.3)], ids=["slow", "stalled"])
def test_a_shards_body_is_asked_for_once_its_tail_is_in_or_late(
    holding: HoldingServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    delay: float,
    wait: float,
) -> None:
    """The tail's GET goes alone, then the body's: side by side they slowed a fast link (a
    second connection ramping up beside the body's: 20 ms, no cap, 232 -> 208 MB/s). A stalled
    tail holds the body no longer than ``_TAIL_WAIT``; its shard is then read whole."""
    monkeypatch.setattr("torch_serialized.remote.store._TAIL_WAIT", wait)
    monkeypatch.setattr("torch_serialized.container.shards._TAIL", 0)  # record 0 not in it
    holding.range_delay, holding.hold = delay, 1 << 40  # the body is not held back here
    reader = open_pack(f"{holding.url}/pack", cache_dir=tmp_path / "cache")
    reader.prefetch_shards([0])
    start = time.monotonic()
    assert record_0(reader) == [payload(0, k, size_of(0, k)) for k in range(len(FIELDS))]
    assert time.monotonic() - start < min(delay, wait) + 3
    log = holding.requests
    name = next(r.split(" ", 1)[1] for r in log if r.startswith(f"range {FIRST}"))
    asked = log.index(f"whole {name}")
    if delay < wait:  # the tail came first, then the body was asked for
        assert log.index(f"range sent {name}") < asked
    else:  # the tail stalled: the body went ahead after the wait, the shard read whole
        assert f"range sent {name}" not in log
        assert not isinstance(reader.shard(0), ArrivingShard)
    reader.close()


def test_a_server_ignoring_range_is_read_whole(pack: Path, tmp_path: Path) -> None:
    server = HoldingServer(pack.parent, hold=first_record_end(pack), ranges=False)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reader = open_pack(f"{server.url}/pack", cache_dir=tmp_path / "cache")
        reader.prefetch_shards([0])
        threading.Timer(0.5, server.release.set).start()
        start = time.monotonic()
        assert record_0(reader) == [payload(0, k, size_of(0, k)) for k in range(len(FIELDS))]
        assert time.monotonic() - start >= 0.4  # no tail: it waited for the whole shard
        assert not isinstance(reader.shard(0), ArrivingShard)
        check_pack(reader, N)
        reader.close()
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("remote", ["http", "s3"], indirect=True)
def test_a_shards_body_stops_where_its_tail_begins(
    remote: Remote, pack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over HTTP and from S3 a shard is its tail's ranged GET and its body's up to the tail:
    the server sends each byte of the pack once."""
    monkeypatch.setattr("torch_serialized.container.shards._TAIL", 0)  # a body before its tail
    for f in sorted(pack.iterdir(), key=lambda f: f.name == "manifest.json"):
        remote.put(f.name, f.read_bytes())
    reader = open_pack(
        remote.url, storage_options=remote.storage_options, cache_dir=tmp_path / "cache"
    )
    assert not in_cache(reader, 0)
    reader.prefetch_shards([0, 1])
    check_pack(reader, N)
    reader.close()
    assert in_cache(reader, 0) and in_cache(reader, 1)  # whole in the cache
    assert remote.proxy.stats()["bytes_sent"] == sum(f.stat().st_size for f in pack.iterdir())


@pytest.mark.parametrize("remote", ["http", "s3"], indirect=True)
def test_a_tail_damaged_on_the_way_comes_again(
    remote: Remote,
    pack: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A record among a shard's tail that fails its CRC32 fails the download, and the retry
    fetches the tail again (the body stops before it, so only the tail can mend it)."""
    for f in sorted(pack.iterdir(), key=lambda f: f.name == "manifest.json"):
        remote.put(f.name, f.read_bytes())
    shard = next(pack.glob(f"{FIRST}*"))
    row = ContainerReader(shard).index_rows([1])[0]
    at = int(row["offset"][row["length"] > 0][0])  # a byte of record 1, in the tail here
    writes = {"tail": 0}
    real = os.pwrite

    def flip_once(fd: int, data: bytes, offset: int) -> int:  # the first tail of FIRST
        tail = len(data) + offset == shard.stat().st_size and offset <= at < len(data) + offset
        if tail and not writes["tail"]:
            writes["tail"] += 1
            data = data[: at - offset] + bytes([data[at - offset] ^ 1]) + data[at - offset + 1 :]
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", flip_once)
    reader = open_pack(
        remote.url, storage_options=remote.storage_options, cache_dir=tmp_path / "cache"
    )
    reader.prefetch_shards([0])
    with caplog.at_level(logging.INFO, logger="torch_serialized"):
        path = reader.remote.fetch_shard(shard.name)  # type: ignore[union-attr]
    assert writes["tail"] == 1 and path.read_bytes() == shard.read_bytes()
    assert "prefetch failed" not in caplog.text  # its own retry mended it
    check_pack(reader, N)
    reader.close()


@pytest.mark.parametrize("fault", ["truncate", "status", "drop"])
def test_an_early_read_survives_a_fault_of_its_download(
    remote: Remote, pack: Path, tmp_path: Path, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_SERIALIZED_RETRY_MAX_DELAY", "0.05")  # retries, not their waits
    for f in sorted(pack.iterdir(), key=lambda f: f.name == "manifest.json"):
        remote.put(f.name, f.read_bytes())
    remote.proxy.add_fault(fault, path=FIRST, method="GET", count=2, after_bytes=5000)
    reader = open_pack(
        remote.url, storage_options=remote.storage_options, cache_dir=tmp_path / "cache"
    )
    reader.prefetch_shards([0, 1])
    check_pack(reader, N)
    reader.close()
    sent = remote.proxy.stats()["bytes_sent"]
    assert sent < 2.2 * sum(f.stat().st_size for f in pack.iterdir())


@pytest.mark.parametrize("remote", ["gcs"], indirect=True)  # S3 streams, as HTTP
def test_an_object_stores_shard_is_read_part_by_part(
    remote: Remote, pack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From GCS (gcsfs streams no GET) a shard comes by ranged GETs, its tail first: a record is
    read once its part is in, while a later part is held back; no HEAD, no whole-object GET."""
    for f in sorted(pack.iterdir(), key=lambda f: f.name == "manifest.json"):
        remote.put(f.name, f.read_bytes())
    part = 256
    monkeypatch.setattr("torch_serialized.container.shards._TAIL", 0)  # index, metadata: less
    monkeypatch.setattr("torch_serialized.remote.transfer.PART", part)
    monkeypatch.setattr("torch_serialized.remote.transfer.IN_FLIGHT", 1)  # in order: tail, 0, 1
    held = 2.5
    remote.proxy.add_fault("delay", count=2, path=FIRST, method="GET")
    remote.proxy.add_fault("delay", count=1, path=FIRST, method="GET", delay=held)
    assert first_record_end(pack) <= part
    reader = open_pack(
        remote.url, storage_options=remote.storage_options, cache_dir=tmp_path / "cache"
    )
    reader.prefetch_shards([0])
    start = time.monotonic()
    assert record_0(reader) == [payload(0, k, size_of(0, k)) for k in range(len(FIELDS))]
    assert time.monotonic() - start < held - 0.5
    assert isinstance(reader.shard(0), ArrivingShard)
    check_pack(reader, N)
    reader.close()
    size = next(pack.glob(f"{FIRST}*")).stat().st_size
    gets = remote.proxy.count("GET", FIRST)
    assert remote.proxy.count("HEAD", FIRST) == 0
    assert 3 <= gets <= 1 + -(-size // part)  # its tail, then its parts, each once
    cached = next((tmp_path / "cache").rglob(f"{FIRST}*.tser"))
    assert cached.read_bytes() == next(pack.glob(f"{FIRST}*")).read_bytes()


@pytest.mark.parametrize("gone", [False, True])
def test_a_damaged_record_read_early_raises_checksum_error(
    pack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gone: bool
) -> None:
    """``gone``: the partial file vanished as the reader opened it (a failed attempt removed
    it, as under CI's load): the shard is then downloaded whole, retried, and still raises
    ``ChecksumError``, not a "not found" that the vanished file's error lent it."""
    if gone:

        def vanished(*args: object) -> None:
            raise FileNotFoundError(2, "No such file or directory", "x.partial")

        monkeypatch.setattr("torch_serialized.remote.packs.ArrivingShard", vanished)
    shard = next(pack.glob(f"{FIRST}*"))
    data = bytearray(shard.read_bytes())
    data[first_record_end(pack) - 1] ^= 0xFF  # record 0's last byte; its index is intact
    shard.write_bytes(bytes(data))
    server = HoldingServer(pack.parent, hold=len(data))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reader = open_pack(f"{server.url}/pack", cache_dir=tmp_path / "cache")
        reader.prefetch_shards([0])
        with pytest.raises(ChecksumError, match="does not match its checksum"):
            reader.field(0, len(FIELDS) - 1)
        assert not list((tmp_path / "cache").rglob(f"{FIRST}*.tser"))  # never cached
        reader.close()
    finally:
        server.shutdown()
        server.server_close()


def test_a_reader_waiting_on_an_arrival_wakes_once_its_bytes_are_in() -> None:
    arrival = Arrival()
    arrival.update(tail_in=True)
    woke: list[float] = []
    waiter = threading.Thread(target=lambda: woke.append(arrival.wait(100) and time.monotonic()))
    waiter.start()
    for have in range(0, 100, 10):  # below what it waits for: no wake-up, no return
        arrival.arrived(have)
        time.sleep(0.01)
    assert not woke
    done = time.monotonic()
    arrival.arrived(100)
    waiter.join(5)
    assert woke and woke[0] >= done
    assert arrival.wait(100) and not Arrival().ok


def test_an_arriving_shard_falls_back_to_the_whole_copy(tmp_path: Path) -> None:
    """Reads of a shard in flight: from the partial file while it holds their bytes and they
    match; from the copy downloaded again once a record fails its CRC32 or the download ends
    without the bytes; ``verify`` and ``prefetch`` follow the same source."""
    original = write_pack(tmp_path / "one.tser", 6)
    data = bytearray(original.read_bytes())
    end_1 = int(max(ContainerReader(original).index_rows([1])[0]["offset"]))
    data[end_1] ^= 0xFF  # record 1's last field damaged in the partial copy only
    partial = tmp_path / "partial.tser"
    partial.write_bytes(bytes(data))
    opened: list[ContainerReader] = []

    def whole() -> ContainerReader:
        opened.append(ContainerReader(original))
        return opened[-1]

    arrival = Arrival()
    arrival.update(path=str(partial), tail_in=True, have=len(data))
    shard = ArrivingShard(arrival, None, False, whole)  # type: ignore[arg-type]
    shard.prefetch([0])  # in flight: no read hint
    assert record_0(shard) == [payload(0, k, size_of(0, k)) for k in range(len(FIELDS))]
    assert not opened and shard.verify() == [1]  # verify reads the partial file: record 1
    got = shard.record(1, range(len(FIELDS)))  # fails its CRC32 here: read from the copy
    assert [bytes(v) for v in got] == [payload(1, k, size_of(1, k)) for k in range(len(FIELDS))]
    assert len(opened) == 1 and shard.verify() == []  # now the copy's
    shard.prefetch([0, 1])
    assert [bytes(v) for v in shard.views([1], [0])[0]] == [payload(1, 0, size_of(1, 0))]
    fresh = ArrivingShard(arrival, None, False, whole)  # type: ignore[arg-type]
    assert bytes(fresh.views([0, 1], [1])[1][0]) == payload(1, 1, size_of(1, 1))  # the copy's
    assert len(opened) == 2
    arrival.update(ended=True, ok=True)  # whole and checked, yet damaged: the error stands
    checked = ArrivingShard(arrival, None, True, whole)  # type: ignore[arg-type]
    for read in (lambda: checked.record(1, [1]), lambda: checked.views([1], [1])):
        with pytest.raises(ChecksumError):
            read()

    waiting = Arrival()
    waiting.update(path=str(original), tail_in=True, have=100)  # the header and tail only
    late = ArrivingShard(waiting, None, False, whole)  # type: ignore[arg-type]
    waiting.end()  # the download failed: its bytes never come
    assert bytes(late.field(5, 1)) == payload(5, 1, size_of(5, 1)) and len(opened) == 3
    done = Arrival()
    done.update(path=str(original), tail_in=True, have=len(data), ended=True, ok=True)
    ArrivingShard(done, None, False, whole).prefetch([0])  # whole and checked: hinted


def test_a_download_writer_refuses_more_than_the_manifests_size(tmp_path: Path) -> None:
    from torch_serialized.remote.transfer import Writer

    def refute(got: int) -> None:
        raise ValueError(f"{got} bytes")

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        writer = Writer(fd, 4, Arrival(), refute)
        assert writer.write(b"abc") == 3 and writer.at == 3
        with pytest.raises(ValueError, match="5 bytes"):
            writer.write(b"de")
    finally:
        os.close(fd)
