"""resolve() and RemotePack: a remote pack through the cache, shards on demand or prefetched."""

from __future__ import annotations

import gc
import hashlib
import multiprocessing
import os
import random
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _remote_cases import NOT_GCS
from _remote_worker import fetch_in_worker
from support.loopback import start_fault_proxy, start_http_server

from torch_serialized.errors import (
    ChecksumError,
    RemoteError,
    RemoteNotFoundError,
)
from torch_serialized.remote.cache import list_cache
from torch_serialized.remote.packs import RemotePack, ShardRequest, file_identity, resolve
from torch_serialized.remote.retry import RetryPolicy
from torch_serialized.remote.store import RemoteStore

if TYPE_CHECKING:
    from remote_fixtures import Remote

pytest_plugins = ["remote_fixtures"]

PART = 64 << 10
FAST = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.02)
MANIFEST = b'{"format": "torch_serialized.shards", "shards": ["a.tser", "b.tser"]}'


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def holds(data: bytes) -> Callable[[Path], bool]:
    """A ``verify`` callback: the downloaded file holds ``data``."""
    return lambda path: path.read_bytes() == data


@pytest.fixture
def shards(remote: Remote) -> dict[str, bytes]:
    data = {"a.tser": blob(3 * PART, 1), "b.tser": blob(2 * PART + 9, 2)}
    remote.put("manifest.json", MANIFEST)
    for name, content in data.items():
        remote.put(name, content)
    return data


def open_pack(remote: Remote, cache_dir: Path) -> RemotePack:
    return resolve(remote.url, remote.storage_options, cache_dir, retry=FAST)


def test_resolve_reads_the_manifest_into_the_cache(
    remote: Remote, shards: dict[str, bytes], tmp_path: Path
) -> None:
    with open_pack(remote, tmp_path) as pack:
        assert pack.manifest_path is not None
        assert pack.manifest_path.read_bytes() == MANIFEST
        assert pack.manifest_path.parent == pack.path
        assert pack.identity == sha(MANIFEST)
        assert pack.path.is_relative_to(tmp_path)
        assert remote.proxy.count("GET", remote.path("manifest.json")) == 1


def test_shards_are_fetched_once_and_verified(
    remote: Remote, shards: dict[str, bytes], tmp_path: Path
) -> None:
    with open_pack(remote, tmp_path) as pack:
        for name, data in shards.items():
            path = pack.fetch_shard(name, len(data), holds(data))
            assert path.read_bytes() == data and path.parent == pack.path
        pack.fetch_shard("a.tser", len(shards["a.tser"]))
    with open_pack(remote, tmp_path) as again:  # a new run: the shards are cached
        assert again.fetch_shard("b.tser", len(shards["b.tser"])).read_bytes() == shards["b.tser"]
    assert remote.proxy.count("GET", remote.path("a.tser")) == 1
    assert remote.proxy.count("GET", remote.path("b.tser")) == 1


@NOT_GCS
def test_a_shard_download_is_one_get(remote: Remote, tmp_path: Path) -> None:
    """A shard's size is compared with its manifest's in the GET's answer: no idle HEAD."""
    data = {"a.tser": blob(PART // 2, 1), "b.tser": blob(3 * PART, 2), "one.tser": blob(99, 3)}
    remote.put("manifest.json", MANIFEST)
    for name, content in data.items():
        remote.put(name, content)
    with open_pack(remote, tmp_path) as pack:
        for name in ("a.tser", "b.tser"):
            assert pack.fetch_shard(name, len(data[name])).read_bytes() == data[name]
    url = f"{remote.url}/one.tser"  # a single file: its size and identity (one HEAD), the file
    with resolve(url, remote.storage_options, tmp_path, retry=FAST) as one:
        assert one.path.read_bytes() == data["one.tser"]
    heads = {name: remote.proxy.count("HEAD", remote.path(name)) for name in data}
    gets = {name: remote.proxy.count("GET", remote.path(name)) for name in data}
    assert heads == {"a.tser": 0, "b.tser": 0, "one.tser": 1}
    assert gets == {"a.tser": 1, "b.tser": 1, "one.tser": 1}


def test_prefetch_downloads_in_the_background(
    remote: Remote, shards: dict[str, bytes], tmp_path: Path
) -> None:
    with open_pack(remote, tmp_path) as pack:
        pack.prefetch([ShardRequest(n, len(d), holds(d)) for n, d in shards.items()])
        deadline = time.monotonic() + 30
        while not all((pack.path / n).exists() for n in shards):  # no fetch_shard call yet
            assert time.monotonic() < deadline
            time.sleep(0.01)
        before = remote.proxy.stats()["total"]
        for name, data in shards.items():
            assert pack.fetch_shard(name, len(data)).read_bytes() == data
        assert remote.proxy.stats()["total"] == before
        assert pack.held() == ["a.tser", "b.tser", "manifest.json"]
        pack.release("a.tser")
        assert pack.held() == ["b.tser", "manifest.json"]
    assert pack.held() == []


def test_a_shard_asked_for_goes_before_queued_prefetches(
    remote: Remote, shards: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader waiting for a shard whose prefetch has not started does not wait behind the
    prefetches queued before it: the shard is fetched at once, in the reader's thread."""
    with open_pack(remote, tmp_path) as pack:
        pack.prefetch_threads = 1
        release = threading.Event()
        slow = pack.store.download

        def download(key: str, *args: Any, **kwargs: Any) -> Any:
            if key == "a.tser":
                assert release.wait(30)
            return slow(key, *args, **kwargs)

        monkeypatch.setattr(pack.store, "download", download)
        pack.prefetch([ShardRequest(n, len(d)) for n, d in shards.items()])  # a blocks the pool
        assert pack.fetch_shard("b.tser", len(shards["b.tser"])).read_bytes() == shards["b.tser"]
        release.set()
        assert pack.fetch_shard("a.tser", len(shards["a.tser"])).read_bytes() == shards["a.tser"]


def test_a_download_is_not_fsynced(
    remote: Remote, shards: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache can download a shard again: an fsync per shard cost 15-80 ms of a download
    thread (issue #36). A crash's damage is found when the shard is opened."""
    synced: list[int] = []
    with open_pack(remote, tmp_path) as pack:
        monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
        pack.fetch_shard("a.tser", len(shards["a.tser"]))
    assert synced == []


def test_a_shard_cached_before_the_last_boot_is_verified_once(
    remote: Remote, shards: dict[str, bytes], tmp_path: Path
) -> None:
    """Downloads are not fsynced: an OS crash may leave holes in a cached shard, so one
    downloaded before the machine booted is verified before use, and downloaded again if
    damaged; once verified (or downloaded) in this boot it is trusted."""
    data = shards["a.tser"]
    checks: list[Path] = []

    def verify(path: Path) -> bool:
        checks.append(path)
        return path.read_bytes() == data

    with open_pack(remote, tmp_path) as pack:
        cached = pack.fetch_shard("a.tser", len(data), verify)
    assert len(checks) == 1  # the download's own check
    mark = cached.parent / ".locks" / "a.tser.lock"
    gets = remote.proxy.count("GET", remote.path("a.tser"))

    os.utime(mark, (0, 0))  # downloaded before this boot
    with open_pack(remote, tmp_path) as pack:
        assert pack.fetch_shard("a.tser", len(data), verify).read_bytes() == data
        assert len(checks) == 2 and remote.proxy.count("GET", remote.path("a.tser")) == gets
    with open_pack(remote, tmp_path) as pack:  # verified in this boot: trusted
        pack.fetch_shard("a.tser", len(data), verify)
    assert len(checks) == 2

    os.utime(mark, (0, 0))
    with open(cached, "r+b") as f:  # a hole a crash left: zeros where bytes were
        f.seek(PART)
        f.write(bytes(4096))
    with open_pack(remote, tmp_path) as pack:
        assert pack.fetch_shard("a.tser", len(data), verify).read_bytes() == data
    assert remote.proxy.count("GET", remote.path("a.tser")) == gets + 1


def test_a_failed_prefetch_raises_when_the_shard_is_asked_for(
    remote: Remote, shards: dict[str, bytes], tmp_path: Path
) -> None:
    with open_pack(remote, tmp_path) as pack:
        pack.prefetch(["missing.tser"])
        with pytest.raises(RemoteNotFoundError, match=r"missing\.tser"):
            pack.fetch_shard("missing.tser")


@NOT_GCS
def test_a_failed_prefetch_is_tried_again_when_the_shard_is_asked_for(
    remote: Remote, shards: dict[str, bytes], tmp_path: Path
) -> None:
    remote.proxy.add_fault("status", status=503, count=None, path="a.tser")
    with open_pack(remote, tmp_path) as pack:
        pack.prefetch([ShardRequest("a.tser", len(shards["a.tser"]))])
        prefetch = pack._pending["a.tser"]
        assert isinstance(prefetch.exception(timeout=30), RemoteError)  # retries used up
        remote.proxy.clear_faults()  # the outage is over before the shard is needed
        assert pack.fetch_shard("a.tser", len(shards["a.tser"])).read_bytes() == shards["a.tser"]


def test_a_corrupt_shard_raises_checksum_error_and_is_not_cached(
    remote: Remote, shards: dict[str, bytes], tmp_path: Path
) -> None:
    with open_pack(remote, tmp_path) as pack:
        with pytest.raises(ChecksumError, match=r"a\.tser"):
            pack.fetch_shard("a.tser", len(shards["a.tser"]), holds(b"other"))
        assert not (pack.path / "a.tser").exists()


def test_a_repacked_url_gets_a_new_cache_folder(
    remote: Remote, shards: dict[str, bytes], tmp_path: Path
) -> None:
    old = open_pack(remote, tmp_path)
    old.fetch_shard("a.tser", len(shards["a.tser"]))
    remote.put("manifest.json", MANIFEST + b" ")
    remote.put("a.tser", b"new contents")
    with open_pack(remote, tmp_path) as new:
        assert new.path != old.path and new.identity != old.identity
        assert new.fetch_shard("a.tser", 12).read_bytes() == b"new contents"
    assert (old.path / "a.tser").read_bytes() == shards["a.tser"]  # the old reader is intact
    old.close()


def test_a_false_size_in_a_manifest_evicts_nothing(
    remote: Remote, shards: dict[str, bytes], tmp_path: Path
) -> None:
    limit = 1 << 20
    with resolve(remote.url, remote.storage_options, tmp_path, limit) as pack:
        for name, data in shards.items():
            pack.fetch_shard(name, len(data))
    remote.put("v2/manifest.json", b'{"shards": ["c.tser"]}')
    remote.put("v2/c.tser", blob(100, 3))
    other = resolve(f"{remote.url}/v2", remote.storage_options, tmp_path, limit, retry=FAST)
    with other, pytest.raises(RemoteError, match=r"c\.tser.*100 bytes.*disagree.*re-upload"):
        other.fetch_shard("c.tser", limit - 1000)  # stale or hostile: fits, but is not true
    assert all((pack.path / name).read_bytes() == data for name, data in shards.items())
    assert remote.proxy.count("GET", remote.path("v2/c.tser")) == 1  # refuted by its answer


@NOT_GCS
def test_a_huge_false_size_fails_at_once_without_retries(
    remote: Remote, shards: dict[str, bytes], tmp_path: Path
) -> None:
    with open_pack(remote, tmp_path) as pack:
        pack.fetch_shard("a.tser", len(shards["a.tser"]))
        with pytest.raises(RemoteError, match=r"b\.tser.*disagree.*re-upload") as caught:
            pack.fetch_shard("b.tser", 1 << 40)
        assert "times" not in str(caught.value)  # not an outage: nothing to retry
        assert remote.proxy.count("GET", remote.path("b.tser")) == 1  # refuted by its answer
        assert remote.proxy.count("HEAD", remote.path("b.tser")) == 0
        assert not list(pack.path.glob(".b.tser.*"))


def test_a_false_size_a_server_cannot_refute_fails_after_one_confirming_read(
    remote: Remote, shards: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GET answer without a size cannot refute a manifest's size before the body; a body
    that then ends cleanly short of it twice is reported as the object's size, not retried
    as an outage."""
    patient = RetryPolicy(attempts=5, base_delay=0.01, max_delay=0.02)
    url = remote.url
    with resolve(url, remote.storage_options, tmp_path, retry=patient) as pack:
        get_file = pack.store.fs.get_file

        def unsized(rpath: str, lpath: str, callback: Any = None, **kwargs: Any) -> Any:
            return get_file(rpath, lpath, **kwargs)  # no size stated (no Content-Length)

        monkeypatch.setattr(pack.store.fs, "get_file", unsized)
        claimed = len(shards["b.tser"]) + 100
        with pytest.raises(RemoteError) as caught:
            pack.fetch_shard("b.tser", claimed)
        first = str(caught.value).splitlines()[0]
        assert first.startswith(
            f"{pack.store.url_of('b.tser')}: the object has {len(shards['b.tser'])} bytes, "
            f"the manifest says {claimed}"
        )
        assert "re-upload" in first and "times" not in first
        assert remote.proxy.count("GET", remote.path("b.tser")) == 2  # 1 confirming the end
        assert not list(pack.path.glob("*b.tser*"))


def test_a_folder_without_a_manifest(remote: Remote, tmp_path: Path) -> None:
    with pytest.raises(RemoteNotFoundError, match=r"manifest\.json.*\.tser"):
        open_pack(remote, tmp_path)


def test_a_single_file_pack_is_downloaded_whole(remote: Remote, tmp_path: Path) -> None:
    data = blob(3 * PART + 100, 5)
    remote.put("one.tser", data)
    url = f"{remote.url}/one.tser"
    with resolve(url, remote.storage_options, tmp_path, retry=FAST) as pack:
        assert pack.manifest_path is None
        assert pack.path.name == "one.tser" and pack.path.read_bytes() == data
        first = pack.identity
    remote.put("one.tser", data[:-64] + bytes(64))  # re-packed: a different footer
    with resolve(url, remote.storage_options, tmp_path, retry=FAST) as pack:
        assert pack.identity != first
        assert pack.path.read_bytes() == data[:-64] + bytes(64)


def test_two_versions_of_a_url_leave_one_cache_folder(remote: Remote, tmp_path: Path) -> None:
    old, new = blob(3 * PART + 100, 5), blob(2 * PART + 7, 6)
    remote.put("one.tser", old)
    remote.put("two.tser", old)  # another URL: its folder is no version of one.tser
    options, url = remote.storage_options, f"{remote.url}/one.tser"
    with resolve(f"{remote.url}/two.tser", options, tmp_path, retry=FAST) as two:
        pass
    with resolve(url, options, tmp_path, retry=FAST) as first:
        assert first.path.read_bytes() == old
    remote.put("one.tser", new)  # replaced on the server: a new identity
    with resolve(url, options, tmp_path, retry=FAST) as second:
        assert second.path.read_bytes() == new
        listed = {(p.url.rsplit("/", 1)[-1], p.identity) for p in list_cache(tmp_path)}
        assert listed == {("one.tser", second.identity), ("two.tser", two.identity)}
        assert not first.directory.exists()
        remote.put("one.tser", old)  # and back (a new upload), while a reader holds the new one
        with resolve(url, options, tmp_path, retry=FAST) as third:
            assert third.identity not in (first.identity, second.identity)
            assert second.path.read_bytes() == new  # held: left whole
        assert len(list_cache(tmp_path)) == 3


def test_a_single_file_pack_replaced_while_it_downloads_opens_the_new_one(
    remote: Remote, tmp_path: Path
) -> None:
    old, new = blob(3 * PART + 100, 7), blob(2 * PART + 3, 8)
    remote.put("one.tser", old)
    replaced: list[int] = []

    def replace_once(path: Path) -> bool:  # a re-pack uploads a new file mid-download
        if not replaced:
            replaced.append(1)
            remote.put("one.tser", new)
            return False
        return True

    url = remote.url + "/one.tser"
    options = remote.storage_options
    with resolve(url, options, tmp_path, retry=FAST, verify_file=replace_once) as p:
        assert p.path.read_bytes() == new
        assert p.identity == file_identity(RemoteStore(url, options))[1]
    with pytest.raises(ChecksumError, match=r"one\.tser: the downloaded file failed.*damaged"):
        resolve(url, options, tmp_path / "b", retry=FAST, verify_file=lambda path: False)


def test_a_single_file_pack_on_a_server_without_range_support(tmp_path: Path) -> None:
    served = tmp_path / "served"
    served.mkdir()
    data = blob(3 * PART + 100, 6)
    (served / "one.tser").write_bytes(data)
    with start_http_server(served, ranges=False) as server:
        url = f"{server.url}/one.tser"
        with resolve(url, None, tmp_path / "cache", retry=FAST) as pack:
            assert pack.path.read_bytes() == data


def test_a_single_file_is_opened_with_one_get_and_never_held_in_memory(tmp_path: Path) -> None:
    """Its identity comes from what the server says of it (no ranged read, which a server
    without Range support answers with the whole file); the download streams to disk."""
    import tracemalloc

    served = tmp_path / "served"
    served.mkdir()
    data = blob(32 << 20, 9)
    (served / "one.tser").write_bytes(data)
    with start_http_server(served, ranges=False) as server, start_fault_proxy(server.url) as proxy:
        url = f"{proxy.url}/one.tser"
        RemoteStore(url, retry=FAST).fs  # noqa: B018 - imports are not the read's memory
        tracemalloc.start()
        try:
            pack = resolve(url, None, tmp_path, retry=FAST)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        with pack:
            assert pack.path.read_bytes() == data
        assert peak < len(data) // 4, f"peak {peak} bytes for a {len(data)}-byte file"
        assert proxy.count("GET", "/one.tser") == 1


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_worker_processes_share_one_download(
    remote: Remote, shards: dict[str, bytes], tmp_path: Path, method: str
) -> None:
    pack = open_pack(remote, tmp_path)
    remote.proxy.configure(latency=0.05)
    jobs = [(pack, name, len(shards[name])) for name in ["a.tser", "b.tser", "a.tser", "b.tser"]]
    with warnings.catch_warnings():
        # Python 3.12+ warns that forking a process with threads (fsspec's event loop) may
        # deadlock; DataLoader forks all the same, and the fork handlers make it safe here.
        warnings.simplefilter("ignore", DeprecationWarning)
        with multiprocessing.get_context(method).Pool(2) as pool:
            digests = pool.map(fetch_in_worker, jobs, chunksize=1)
    assert digests == [sha(shards[name]) for _, name, _ in jobs]
    assert remote.proxy.count("GET", remote.path("a.tser")) == 1
    assert remote.proxy.count("GET", remote.path("b.tser")) == 1
    pack.close()


def test_close_keeping_some_objects_releases_only_the_others(
    remote: Remote, shards: dict[str, bytes], tmp_path: Path
) -> None:
    """``close(keep)`` (what ``PackReader.close_shards`` calls) lets the cache evict every
    object but those kept; the pack then still holds the kept ones until it closes."""
    with open_pack(remote, tmp_path) as pack:
        for name, data in shards.items():
            pack.fetch_shard(name, len(data))
        assert pack.held() == ["a.tser", "b.tser", "manifest.json"]
        pack.close(keep=["manifest.json", "b.tser"])
        assert pack.held() == ["b.tser", "manifest.json"]
    assert pack.held() == []


def test_a_pack_dropped_unclosed_releases_its_objects_without_a_gc(
    remote: Remote, shards: dict[str, bytes], tmp_path: Path
) -> None:
    """A pack nobody closes (``info(url)`` returns without closing) lets its objects go as
    soon as it is dropped: no reference cycle keeps it, and its locks, until a collection."""
    pack = open_pack(remote, tmp_path)
    for name, data in shards.items():
        pack.fetch_shard(name, len(data), holds(data))
    folder = pack.path
    gc.disable()
    try:
        del pack
        [entry] = list_cache(tmp_path)
        assert entry.directory == folder and entry.in_use == 0
    finally:
        gc.enable()
