"""The local cache: keys, one download per object across processes, LRU, list and clear."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pickle
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import torch_serialized.remote.cache as cache_module
from torch_serialized.errors import CacheLimitWarning
from torch_serialized.remote.cache import (
    CACHE_ENV,
    Cache,
    PackCache,
    clear_cache,
    default_cache_dir,
    list_cache,
    pack_key,
)

if TYPE_CHECKING:
    from remote_fixtures import Remote

pytest_plugins = ["remote_fixtures"]

WORKER = Path(__file__).with_name("_remote_worker.py")
URL = "s3://bucket/voc"
PART = 64 << 10


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


class Source:
    """A download callable over in-memory objects that counts its calls."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects
        self.calls: list[str] = []

    def __call__(self, name: str) -> Callable[[Path], None]:
        def download(dest: Path) -> None:
            self.calls.append(name)
            tmp = dest.with_name(f".{dest.name}.x.partial")
            tmp.write_bytes(self.objects[name])
            os.replace(tmp, dest)

        return download


def fetch(pc: PackCache, source: Source, name: str) -> Path:
    return pc.fetch(name, len(source.objects[name]), source(name))


def age(path: Path, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(path, (t, t))


@contextmanager
def held_elsewhere(
    cache_dir: Path, url: str, identity: str, name: str, size: int
) -> Iterator[None]:
    """Another process holds object ``name`` (a shared lock) while the block runs."""
    spec = {
        "cache_dir": str(cache_dir),
        "url": url,
        "identity": identity,
        "name": name,
        "size": size,
    }
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), "hold", json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "HELD"
        yield
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)
        assert proc.stdout is not None
        proc.stdout.close()


# --------------------------------------------------------------------------- where and keys


def test_default_cache_dir_reads_the_environment_when_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env-cache"))
    assert default_cache_dir() == tmp_path / "env-cache"
    assert Cache().directory == tmp_path / "env-cache"
    assert Cache(tmp_path / "given").directory == tmp_path / "given"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "torch_serialized"


def test_keys_differ_by_identity_and_url(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    a = cache.pack(URL, "manifest-sha-1")
    assert cache.pack(URL + "/", "manifest-sha-1").directory == a.directory
    assert cache.pack(URL, "manifest-sha-2").directory != a.directory
    assert cache.pack("s3://bucket/other", "manifest-sha-1").directory != a.directory
    assert a.directory.name == pack_key(URL, "manifest-sha-1")


def test_a_repacked_pack_never_sees_stale_shards(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    old, new = Source({"s.tser": b"old!"}), Source({"s.tser": b"new!"})
    assert fetch(cache.pack(URL, "v1"), old, "s.tser").read_bytes() == b"old!"
    assert fetch(cache.pack(URL, "v2"), new, "s.tser").read_bytes() == b"new!"
    assert new.calls == ["s.tser"]


@pytest.mark.parametrize("name", ["", "../x", "a/b", ".hidden", "pack.json"])
def test_object_names_are_plain_file_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="cached object"):
        Cache(tmp_path).pack(URL, "i").object_path(name)


# --------------------------------------------------------------------------- fetch


def test_fetch_downloads_once_then_serves_from_disk(tmp_path: Path) -> None:
    source = Source({"a.tser": blob(1000)})
    pc = Cache(tmp_path).pack(URL, "i")
    path = fetch(pc, source, "a.tser")
    assert path.read_bytes() == source.objects["a.tser"]
    assert fetch(pc, source, "a.tser") == path
    pc.close()
    assert fetch(Cache(tmp_path).pack(URL, "i"), source, "a.tser") == path  # a new process too
    assert source.calls == ["a.tser"]
    assert pc.held() == []


def test_an_object_whose_last_use_cannot_be_set_is_still_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a cache shared by users, another user's object may refuse its new mtime (the LRU
    order): the read goes on; before, it failed with that ``PermissionError``."""
    source = Source({"a.tser": blob(1000)})
    pc = Cache(tmp_path).pack(URL, "i")
    fetch(pc, source, "a.tser")
    pc.close()

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "utime", refuse)
    other = Cache(tmp_path).pack(URL, "i")
    assert fetch(other, source, "a.tser").read_bytes() == source.objects["a.tser"]
    assert fetch(other, source, "a.tser").read_bytes() == source.objects["a.tser"]  # held
    assert source.calls == ["a.tser"]
    other.close()


@pytest.mark.parametrize("damage", ["cut short", "appended to"])
def test_a_cached_file_of_the_wrong_size_is_downloaded_again(tmp_path: Path, damage: str) -> None:
    source = Source({"a.tser": blob(1000)})
    pc = Cache(tmp_path).pack(URL, "i")
    path = fetch(pc, source, "a.tser")
    pc.close()
    # damaged by hand: not our writer
    path.write_bytes(b"cut short" if damage == "cut short" else path.read_bytes() + b"x")
    assert fetch(pc, source, "a.tser").read_bytes() == source.objects["a.tser"]
    assert source.calls == ["a.tser", "a.tser"]


def test_a_dead_writers_partial_file_is_removed(tmp_path: Path) -> None:
    source = Source({"a.tser": blob(100)})
    pc = Cache(tmp_path).pack(URL, "i")
    pc.directory.mkdir(parents=True)
    stale = pc.directory / ".a.tser.0123456789ab.partial"
    stale.write_bytes(b"half")
    fetch(pc, source, "a.tser")
    assert not stale.exists()


def test_put_stores_and_replaces_small_objects(tmp_path: Path) -> None:
    pc = Cache(tmp_path).pack(URL, "i")
    assert pc.put("manifest.json", b"{}").read_bytes() == b"{}"
    assert pc.put("manifest.json", b"{}").read_bytes() == b"{}"
    pc.close()
    assert pc.put("manifest.json", b'{"a": 1}').read_bytes() == b'{"a": 1}'
    assert pc.held() == ["manifest.json"]


def test_a_pack_cache_pickles_without_what_it_holds(tmp_path: Path) -> None:
    source = Source({"a.tser": blob(10)})
    pc = Cache(tmp_path).pack(URL, "i")
    fetch(pc, source, "a.tser")
    clone = pickle.loads(pickle.dumps(pc))
    assert clone.held() == [] and pc.held() == ["a.tser"]
    assert fetch(clone, source, "a.tser").read_bytes() == source.objects["a.tser"]
    assert source.calls == ["a.tser"]


# --------------------------------------------------------------------------- limits


def test_lru_eviction_never_takes_a_held_object(tmp_path: Path) -> None:
    objects = {f"s{i}.tser": blob(1000, i) for i in range(6)}
    source = Source(objects)
    cache = Cache(tmp_path, limit_bytes=3000)
    pc = cache.pack(URL, "i")
    for i, name in enumerate(["s0.tser", "s1.tser", "s2.tser"]):
        age(fetch(pc, source, name), 100 - i)  # s0 is the least recently used
    pc.release("s1.tser")
    pc.release("s2.tser")  # s0 stays held by this process
    fetch(pc, source, "s3.tser")
    assert sorted(p.name for p in pc.directory.glob("s*.tser")) == ["s0.tser", "s2.tser", "s3.tser"]
    pc.release("s3.tser")
    age(pc.object_path("s3.tser"), 200)  # now the oldest, but another process holds it
    with held_elsewhere(tmp_path, URL, "i", "s3.tser", 1000):
        fetch(pc, source, "s4.tser")
        names = sorted(p.name for p in pc.directory.glob("s*.tser"))
        assert names == ["s0.tser", "s3.tser", "s4.tser"]
    assert pc.object_path("s0.tser").read_bytes() == objects["s0.tser"]


def test_eviction_spares_an_object_whose_fetch_holds_its_lock(tmp_path: Path) -> None:
    """A fetch holds ``.locks/<name>.lock`` from before its download until it holds the
    object: an object just renamed into place, not yet held, is not evicted under it."""
    source = Source({"s0.tser": blob(1000)})
    cache = Cache(tmp_path, limit_bytes=1500)
    pc = cache.pack(URL, "i")
    path = fetch(pc, source, "s0.tser")
    pc.release("s0.tser")
    fd = os.open(pc.directory / ".locks" / "s0.tser.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a fetch between its rename and its first use
        with pytest.warns(CacheLimitWarning, match="in use or being downloaded"):
            cache.make_room(1000)
        assert path.exists()
    finally:
        os.close(fd)
    cache.make_room(1000)
    assert not path.exists()


def test_room_is_made_once_a_download_is_in_for_its_bytes(tmp_path: Path) -> None:
    """Room is made after a download, for the bytes that came (never for a size the manifest
    only claims); a download in flight is not counted, and its partial file is never evicted."""
    objects = {f"s{i}.tser": blob(1000, i) for i in range(4)}
    source = Source(objects)
    pc = Cache(tmp_path, limit_bytes=3000).pack(URL, "i")
    for i, name in enumerate(["s0.tser", "s1.tser"]):
        age(fetch(pc, source, name), 100 - i)
        pc.release(name)
    started, go_on = threading.Event(), threading.Event()

    def slow(dest: Path) -> None:
        started.set()
        assert go_on.wait(10)
        source("s2.tser")(dest)

    first = threading.Thread(target=pc.fetch, args=("s2.tser", 1000, slow))
    first.start()
    assert started.wait(10)
    try:
        fetch(pc, source, "s3.tser")  # s0, s1, s3 fit: nothing is evicted yet
        names = sorted(p.name for p in pc.directory.glob("*.tser"))
        assert names == ["s0.tser", "s1.tser", "s3.tser"]
    finally:
        go_on.set()
        first.join()
    names = sorted(p.name for p in pc.directory.glob("*.tser"))
    assert names == ["s1.tser", "s2.tser", "s3.tser"]  # s2 in: the oldest goes
    assert sum(p.bytes for p in list_cache(tmp_path)) <= 3000


def test_a_download_joins_the_cache_only_once_there_is_room_for_it(tmp_path: Path) -> None:
    """Its bytes wait outside the counted objects until room is made, so the cached objects
    never exceed the limit, even for a moment (a stream checking it between samples saw
    one shard too many while a prefetch was renamed in before its eviction ran)."""
    source = Source({f"s{i}.tser": blob(1000, i) for i in range(3)})
    pc = Cache(tmp_path, limit_bytes=2500).pack(URL, "i")
    for i in range(2):
        age(fetch(pc, source, f"s{i}.tser"), 100 - i)
        pc.release(f"s{i}.tser")
    seen: list[int] = []

    def watched(dest: Path) -> None:
        source("s2.tser")(dest)
        seen.append(sum(p.bytes for p in list_cache(tmp_path)))  # s2 whole, not yet counted

    pc.fetch("s2.tser", 1000, watched)
    assert seen == [2000]
    assert sorted(p.name for p in pc.directory.glob("*.tser")) == ["s1.tser", "s2.tser"]


def test_a_killed_downloads_staged_files_are_listed_and_evicted(tmp_path: Path) -> None:
    """A download killed in ``.staging/`` (its bytes in a temporary, or whole and waiting for
    room) is a partial file as any other: listed, and removed once its writer is gone."""
    cache = Cache(tmp_path, limit_bytes=5000)
    pc = cache.pack(URL, "i")
    staging = pc.directory / ".staging"
    staging.mkdir(parents=True)
    (pc.directory / ".locks").mkdir()
    (staging / ".a.tser.0123456789ab.partial").write_bytes(blob(300))
    (staging / "b.tser").write_bytes(blob(200))
    assert list_cache(tmp_path)[0].partial_bytes == 500
    with open(pc.directory / ".locks" / "b.tser.lock", "w") as writer:
        fcntl.flock(writer, fcntl.LOCK_EX)  # b's download still runs
        assert list_cache(tmp_path)[0].in_use == 1
        cache.make_room()
        assert sorted(p.name for p in staging.iterdir()) == ["b.tser"]
    cache.make_room()
    assert list(staging.iterdir()) == []


def test_the_limit_spans_every_pack_in_the_folder(tmp_path: Path) -> None:
    cache = Cache(tmp_path, limit_bytes=2500)
    a, b = cache.pack(URL, "a"), cache.pack("s3://bucket/other", "b")
    source = Source({"x.tser": blob(1000), "y.tser": blob(1000, 1)})
    age(fetch(a, source, "x.tser"), 100)
    a.close()
    fetch(b, source, "x.tser")
    fetch(b, source, "y.tser")
    assert not a.object_path("x.tser").exists()
    assert sum(p.bytes for p in list_cache(tmp_path)) <= 2500


def test_a_working_set_over_the_limit_warns_and_still_works(tmp_path: Path) -> None:
    source = Source({f"s{i}.tser": blob(1000, i) for i in range(3)})
    pc = Cache(tmp_path, limit_bytes=1500).pack(URL, "i")
    fetch(pc, source, "s0.tser")
    with pytest.warns(CacheLimitWarning, match="cache_limit_bytes=1500"):
        assert fetch(pc, source, "s1.tser").exists()
    fetch(pc, source, "s2.tser")  # one warning per cache, not one per object
    assert pc.held() == ["s0.tser", "s1.tser", "s2.tser"]


def orphan(pc: PackCache, name: str, size: int) -> Path:
    """The partial file of a download of ``name`` killed midway, in ``pc``'s folder."""
    (pc.directory / ".locks").mkdir(parents=True, exist_ok=True)
    (pc.directory / ".locks" / f"{name}.lock").touch()
    partial = pc.directory / f".{name}.0123456789ab.partial"
    partial.write_bytes(blob(size, 5))
    return partial


def test_a_killed_downloads_partial_file_is_evicted_not_counted_forever(tmp_path: Path) -> None:
    cache = Cache(tmp_path, limit_bytes=2500)
    dead = orphan(cache.pack(URL, "old"), "gone.tser", 2000)  # a name nobody fetches again
    live = orphan(cache.pack(URL, "old"), "busy.tser", 100)
    pc = cache.pack(URL, "new")
    source = Source({"x.tser": blob(1000), "y.tser": blob(1000, 1)})
    with open(live.parent / ".locks" / "busy.tser.lock") as writer:
        fcntl.flock(writer, fcntl.LOCK_EX)  # a download in progress
        fetch(pc, source, "x.tser")  # no CacheLimitWarning (an error in this suite)
        fetch(pc, source, "y.tser")
        assert not dead.exists() and live.exists()


def test_list_and_clear_see_partial_files(tmp_path: Path) -> None:
    pc = Cache(tmp_path).pack(URL, "i")
    dead, live = orphan(pc, "gone.tser", 300), orphan(pc, "busy.tser", 100)
    assert list_cache(tmp_path)[0].partial_bytes == 400
    with open(live.parent / ".locks" / "busy.tser.lock") as writer:
        fcntl.flock(writer, fcntl.LOCK_EX)
        assert list_cache(tmp_path)[0].in_use == 1
        result = clear_cache(tmp_path)
        assert (result.bytes_freed, result.objects_in_use, result.packs_removed) == (300, 1, 0)
        assert not dead.exists() and live.exists()
    assert clear_cache(tmp_path).packs_removed == 1


def test_an_object_larger_than_the_limit_evicts_nothing(tmp_path: Path) -> None:
    source = Source({"x.tser": blob(1000), "y.tser": blob(1000, 1), "huge.tser": blob(3000, 2)})
    pc = Cache(tmp_path, limit_bytes=2500).pack(URL, "i")
    fetch(pc, source, "x.tser")
    fetch(pc, source, "y.tser")
    pc.close()
    with pytest.warns(CacheLimitWarning, match="larger than cache_limit_bytes=2500"):
        fetch(pc, source, "huge.tser")  # a size no eviction can make fit (or a manifest's lie)
    assert pc.object_path("x.tser").exists() and pc.object_path("y.tser").exists()


def test_no_limit_evicts_nothing(tmp_path: Path) -> None:
    source = Source({f"s{i}.tser": blob(1000, i) for i in range(4)})
    pc = Cache(tmp_path).pack(URL, "i")
    for name in source.objects:
        fetch(pc, source, name)
        pc.release(name)
    assert len(list(pc.directory.glob("s*.tser"))) == 4


# --------------------------------------------------------------------------- list and clear


def test_list_and_clear(tmp_path: Path) -> None:
    source = Source({"a.tser": blob(100), "b.tser": blob(200, 1)})
    one, two = Cache(tmp_path).pack(URL, "one"), Cache(tmp_path).pack("s3://b/two", "two")
    fetch(one, source, "a.tser")
    fetch(one, source, "b.tser")
    fetch(two, source, "a.tser")
    one.release("b.tser")
    two.close()
    listed = {p.url: p for p in list_cache(tmp_path)}
    assert set(listed) == {URL, "s3://b/two"}
    assert (listed[URL].objects, listed[URL].bytes, listed[URL].in_use) == (2, 300, 1)
    assert listed[URL].identity == "one" and listed[URL].last_used > 0

    result = clear_cache(tmp_path, url="s3://b/two")
    assert (result.packs_removed, result.objects_removed, result.bytes_freed) == (1, 1, 100)
    result = clear_cache(tmp_path)  # a.tser of "one" is held: it stays
    assert (result.packs_removed, result.objects_removed, result.objects_in_use) == (0, 1, 1)
    assert one.object_path("a.tser").exists() and not one.object_path("b.tser").exists()
    one.close()
    assert clear_cache(tmp_path).packs_removed == 1
    assert list_cache(tmp_path) == []
    assert clear_cache(tmp_path / "never-made").packs_removed == 0


def test_a_cache_dir_that_is_a_file_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cache list --cache-dir FILE`` failed with "FILE/v1: Not a directory" and ``cache
    clear`` reported "removed 0 pack(s)" from it; a reader said "Not a directory:
    'FILE/v1/<key>/.locks'"."""
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    monkeypatch.setenv(CACHE_ENV, str(file))
    for call in (
        lambda: list_cache(file),
        lambda: clear_cache(file),
        lambda: clear_cache(file, url=URL),
        lambda: Cache(file),
        lambda: list_cache(),  # $TORCH_SERIALIZED_CACHE
    ):
        with pytest.raises(NotADirectoryError, match="is not a folder") as info:
            call()
        assert str(file) in str(info.value) and info.value.filename == str(file)
    assert file.read_text() == "mine" and sorted(tmp_path.iterdir()) == [file]


def test_a_new_version_removes_the_other_versions_of_its_url_not_in_use(tmp_path: Path) -> None:
    source = Source({"a.tser": blob(100), "b.tser": blob(200, 1)})
    cache = Cache(tmp_path)
    old = cache.pack(URL, "v1")
    fetch(old, source, "a.tser")
    fetch(old, source, "b.tser")
    old.close()
    held = cache.pack(URL, "v0")  # an old reader still runs: it holds a.tser
    fetch(held, source, "a.tser")
    fetch(held, source, "b.tser")
    held.release("b.tser")
    loading = cache.pack(URL, "v3")
    loading.put("manifest.json", b"{}")
    loading.close()
    downloading = orphan(loading, "x.tser", 50)  # a download in flight
    for other in (cache.pack(URL + "?versionId=1", "v1"), cache.pack("s3://bucket/other", "v1")):
        fetch(other, source, "a.tser")  # other URLs, whatever their identity
        other.close()
    new = cache.pack(URL, "v2")
    fetch(new, source, "a.tser")
    with open(downloading.parent / ".locks" / "x.tser.lock") as writer:
        fcntl.flock(writer, fcntl.LOCK_EX)
        done = new.remove_other_versions()
        assert (done.packs_removed, done.objects_removed, done.bytes_freed) == (1, 2, 300)
        assert not old.directory.exists() and downloading.exists()
    assert held.object_path("b.tser").exists()  # a folder in use is left whole
    assert new.object_path("a.tser").exists()
    listed = sorted((p.url, p.identity) for p in list_cache(tmp_path))
    assert listed == sorted(
        [(URL, "v0"), (URL, "v2"), (URL, "v3"), (URL + "?…", "v1"), ("s3://bucket/other", "v1")]
    )
    held.close()
    assert new.remove_other_versions().packs_removed == 2  # v0, and v3's dead download
    assert sorted(p.identity for p in list_cache(tmp_path) if p.url == URL) == ["v2"]


def test_clear_between_a_download_and_its_first_use_removes_nothing(tmp_path: Path) -> None:
    source = Source({"a.tser": blob(100)})
    pc = Cache(tmp_path).pack(URL, "i")

    def download_then_clear(dest: Path) -> None:
        source("a.tser")(dest)
        clear_cache(tmp_path)  # `cache clear` run by hand at the worst moment

    assert pc.fetch("a.tser", 100, download_then_clear).read_bytes() == source.objects["a.tser"]
    assert source.calls == ["a.tser"]
    assert (pc.directory / "pack.json").exists()


def test_clear_while_put_writes_never_breaks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_atomic = cache_module._write_atomic

    def write_then_clear(path: Path, data: bytes) -> None:  # pack.json, then the manifest
        write_atomic(path, data)
        clear_cache(tmp_path)

    monkeypatch.setattr(cache_module, "_write_atomic", write_then_clear)
    pc = Cache(tmp_path).pack(URL, "i")
    assert pc.put("manifest.json", b"{}").read_bytes() == b"{}"
    assert list_cache(tmp_path)[0].url == URL


def test_clear_never_removes_a_folder_a_writer_is_about_to_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that made its pack folder but has not yet made its pack lock: clear_cache
    makes the lock and holds it while it moves the folder away, so the writer waits, finds
    its folder gone and makes it again, instead of downloading into a folder clear deletes."""
    import threading

    pc = Cache(tmp_path).pack(URL, "i")
    at_open, go_open = threading.Event(), threading.Event()
    writer: list[threading.Thread] = []
    real_open, real_unless = os.open, cache_module.unless_locked

    def paused_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if threading.current_thread() in writer and str(path).endswith(".pack.lock"):
            at_open.set()
            go_open.wait(5)
        return real_open(path, flags, *args, **kwargs)  # shutil.rmtree passes dir_fd=

    @contextmanager
    def unless_then_writer_goes(lock: Path, create: bool = False) -> Iterator[bool]:
        with real_unless(lock, create) as free:
            if lock.name == ".pack.lock" and free:
                go_open.set()  # the writer opens (and, before the fix, takes) the lock now
                time.sleep(0.3)
            yield free

    monkeypatch.setattr(cache_module.os, "open", paused_open)
    monkeypatch.setattr(cache_module, "unless_locked", unless_then_writer_goes)
    got: dict[str, Any] = {}

    def fetch() -> None:
        try:
            got["path"] = pc.fetch("a.tser", 3, lambda dest: dest.write_bytes(b"abc"))
        except Exception as exc:
            got["error"] = exc

    writer.append(threading.Thread(target=fetch))
    writer[0].start()
    assert at_open.wait(5)
    clear_cache(tmp_path)
    writer[0].join(10)
    assert "error" not in got, got
    assert got["path"].read_bytes() == b"abc" and pc.directory.is_dir()


# --------------------------------------------------------------------------- processes


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_processes_sharing_a_cache_download_each_object_once(
    remote: Remote, tmp_path: Path
) -> None:
    data = blob(6 * PART + 5, 7)
    remote.put("manifest.json", b'{"shards": ["s.tser"]}')
    remote.put("s.tser", data)
    remote.proxy.configure(latency=0.05, bandwidth=256 << 10)  # ~2 s: the four overlap
    spec = {
        "url": remote.url,
        "storage_options": remote.storage_options,
        "cache_dir": str(tmp_path / "cache"),
        "name": "s.tser",
        "size": len(data),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "fetch", json.dumps(spec)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0] * 4
    assert outputs == [_sha(data)] * 4
    assert remote.proxy.count("GET", remote.path("s.tser")) == 1  # one download
    assert remote.proxy.count("GET", remote.path("manifest.json")) == 4
    cached = list((tmp_path / "cache").rglob("s.tser"))
    assert len(cached) == 1 and cached[0].read_bytes() == data
    assert not list((tmp_path / "cache").rglob("*.partial"))


def test_a_killed_download_leaves_no_file_that_passes_as_complete(
    remote: Remote, tmp_path: Path
) -> None:
    data = blob(8 * PART, 9)
    remote.put("manifest.json", b"{}")
    remote.put("s.tser", data)
    remote.proxy.configure(bandwidth=256 << 10)  # two seconds for the whole object
    spec = {
        "url": remote.url,
        "storage_options": remote.storage_options,
        "cache_dir": str(tmp_path / "cache"),
        "name": "s.tser",
        "size": len(data),
    }
    proc = subprocess.Popen([sys.executable, str(WORKER), "fetch", json.dumps(spec)])
    deadline = time.monotonic() + 60
    while not list((tmp_path / "cache").rglob("*.partial")):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    time.sleep(0.3)
    proc.kill()
    proc.wait()
    assert not list((tmp_path / "cache").rglob("s.tser"))  # only the partial file
    remote.proxy.configure()
    out = subprocess.run(
        [sys.executable, str(WORKER), "fetch", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == _sha(data)
    assert not list((tmp_path / "cache").rglob("*.partial"))  # the dead one's was removed


def test_credentials_never_reach_pack_json_or_the_listing(tmp_path: Path) -> None:
    secret = "http://alice:S3cretPW@127.0.0.1:1/voc?X-Amz-Signature=T0ken"
    source = Source({"a.tser": blob(10)})
    pc = Cache(tmp_path).pack(secret, "i")
    fetch(pc, source, "a.tser")
    pc.close()
    info = (pc.directory / "pack.json").read_text()
    listed = list_cache(tmp_path)
    for shown in (info, *(p.url for p in listed)):
        assert "S3cretPW" not in shown and "T0ken" not in shown
    assert [p.url for p in listed] == ["http://alice:***@127.0.0.1:1/voc?…"]
    # The key is still the whole URL: other credentials get their own folder.
    assert Cache(tmp_path).pack(secret.replace("S3cret", "0ther"), "i").directory != pc.directory
    assert clear_cache(tmp_path, url="http://alice:wrong@127.0.0.1:1/voc?x=1").packs_removed == 1


def test_a_pack_json_of_an_older_version_loses_its_password(tmp_path: Path) -> None:
    secret = "http://alice:S3cretPW@127.0.0.1:1/voc"
    pc = Cache(tmp_path).pack(secret, "i")
    pc.directory.mkdir(parents=True)
    (pc.directory / "pack.json").write_text(json.dumps({"url": secret, "identity": "i"}))
    assert "S3cretPW" not in list_cache(tmp_path)[0].url
    fetch(pc, Source({"a.tser": blob(10)}), "a.tser")
    pc.close()
    assert "S3cretPW" not in (pc.directory / "pack.json").read_text()


@pytest.mark.parametrize("limit", [None, 1 << 20])
def test_a_child_forked_during_a_download_does_not_wait_on_its_parents_lock(
    tmp_path: Path, limit: int | None
) -> None:
    """A DataLoader forks its workers while a prefetch thread of the parent may be downloading
    (holding the object's lock file, and with a limit the eviction lock): the child inherited
    those descriptors, and a flock belongs to the open file, so once the parent's thread closed
    its copy the child's copy still held the lock, and the child waited on it for good. A
    forked child now closes the lock files it inherited, then waits for the parent's download
    like any other process."""
    import threading

    pack = Cache(tmp_path, limit).pack("https://example.invalid/voc", "id")
    started, release = threading.Event(), threading.Event()

    def slow_download(dest: Path) -> None:
        started.set()
        release.wait(10)
        dest.write_bytes(b"x" * 100)

    thread = threading.Thread(target=pack.fetch, args=("a.tser", 100, slow_download))
    thread.start()
    assert started.wait(10)  # the parent's thread holds the locks, mid-download
    pid = os.fork()
    if pid == 0:  # the child: fetch the same object, which the parent is downloading
        status = 1
        try:
            got = pack.fetch("a.tser", 100, lambda dest: dest.write_bytes(b"y" * 100))
            status = 0 if got.read_bytes() == b"x" * 100 else 2
        finally:
            os._exit(status)
    time.sleep(0.3)  # the child is waiting on the lock now
    release.set()
    thread.join(10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child waited on the lock its parent's thread had released")
    assert os.waitstatus_to_exitcode(status) == 0  # it read the parent's download


def test_an_object_as_large_as_the_limit_evicts_every_other_one(tmp_path: Path) -> None:
    """The limit is inclusive: an object of exactly ``cache_limit_bytes`` fits once every
    other object is evicted (no warning; an object one byte larger evicts nothing)."""
    source = Source({"x.tser": blob(1000), "y.tser": blob(1000, 1), "big.tser": blob(2500, 2)})
    pc = Cache(tmp_path, limit_bytes=2500).pack(URL, "i")
    fetch(pc, source, "x.tser")
    fetch(pc, source, "y.tser")
    pc.close()
    fetch(pc, source, "big.tser")  # no CacheLimitWarning (an error in this suite)
    assert not pc.object_path("x.tser").exists() and not pc.object_path("y.tser").exists()
    assert [(p.objects, p.bytes) for p in list_cache(tmp_path)] == [(1, 2500)]


def test_list_shows_each_packs_last_use_and_versions_of_a_url_newest_first(tmp_path: Path) -> None:
    """``last_used`` is the newest object's time (an object's mtime is its last fetch), and
    the versions of one URL are listed most recently used first."""
    source = Source({"a.tser": blob(100), "b.tser": blob(200, 1)})
    old, new = Cache(tmp_path).pack(URL, "old"), Cache(tmp_path).pack(URL, "new")
    now = time.time()
    for pc, ages in ((old, (300, 200)), (new, (100, 50))):
        for name, seconds in zip(["a.tser", "b.tser"], ages):
            age(fetch(pc, source, name), seconds)
        pc.close()
    listed = list_cache(tmp_path)
    assert [p.identity for p in listed] == ["new", "old"]
    assert [round(now - p.last_used) for p in listed] == [50, 200]
