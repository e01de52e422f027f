"""The cache never follows, deletes or blocks on what is planted in it, reads of whole objects
are capped, and a cached copy damaged on the local disk is named as such (issue #34)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

import torch_serialized.remote.store as store_module
from torch_serialized.container.shards import open_pack
from torch_serialized.errors import CorruptFileError, RemoteError
from torch_serialized.remote.cache import Cache, clear_cache, list_cache
from torch_serialized.remote.locks import LAYOUT, LOCKS, PACK_INFO
from torch_serialized.remote.packs import resolve
from torch_serialized.remote.retry import RetryPolicy
from torch_serialized.remote.store import RemoteStore

if TYPE_CHECKING:
    from remote_fixtures import Remote

pytest_plugins = ["remote_fixtures"]

URL = "s3://bucket/voc"
FAST = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02)
T = TypeVar("T")


def download_of(data: bytes) -> Callable[[Path], None]:
    def download(dest: Path) -> None:
        tmp = dest.with_name(f".{dest.name}.x.partial")
        tmp.write_bytes(data)
        os.replace(tmp, dest)

    return download


def within(seconds: float, fn: Callable[[], T], fifos: list[Path]) -> T:
    """``fn()`` in a thread, which must end within ``seconds``; if it blocks on one of
    ``fifos`` it is set free (a writer opens them) and the test fails."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:  # handed to the test's thread
            out.append(("error", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:
            with suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
        pytest.fail(f"blocked for more than {seconds} s on a FIFO in the cache")
    kind, value = out[0]
    if kind == "error":
        raise value
    return value  # type: ignore[no-any-return]


def elsewhere(tmp_path: Path) -> dict[Path, bytes]:
    """A folder outside the cache and its files, which nothing of the cache may touch."""
    folder = tmp_path / "elsewhere"
    (folder / "sub").mkdir(parents=True)
    files = {folder / name: os.urandom(500) for name in ("a.tser", "b.tser", "sub/c.tser")}
    for path, data in files.items():
        path.write_bytes(data)
    return files


def intact(files: dict[Path, bytes]) -> bool:
    return all(path.is_file() and path.read_bytes() == data for path, data in files.items())


# --------------------------------------------------------------------------- links (item 8)


def test_links_planted_in_the_cache_are_never_followed(tmp_path: Path) -> None:
    files = elsewhere(tmp_path)
    target = tmp_path / "elsewhere"
    cache = Cache(tmp_path / "cache", limit_bytes=10_000)
    pack = cache.pack(URL, "one")
    for name in ("x.tser", "y.tser"):
        pack.fetch(name, 300, download_of(os.urandom(300)))
    pack.close()
    # a pack folder that is a link to a folder elsewhere, with a pack.json to look like one
    (target / PACK_INFO).write_text('{"url": "s3://bucket/voc", "identity": "two"}')
    files[target / PACK_INFO] = (target / PACK_INFO).read_bytes()
    (tmp_path / "cache" / LAYOUT / ("f" * 32)).symlink_to(target, target_is_directory=True)
    # links inside a real pack folder: an object, a partial download, a lock
    (pack.directory / "a.tser").symlink_to(target / "a.tser")
    (pack.directory / ".b.tser.1234.partial").symlink_to(target / "b.tser")
    (pack.directory / LOCKS / "x.tser.lock").unlink()
    (pack.directory / LOCKS / "x.tser.lock").symlink_to(target / "sub" / "c.tser")

    listed = list_cache(tmp_path / "cache")
    cache.make_room(9_900)  # evicts both objects
    assert intact(files) and not pack.object_path("x.tser").exists()
    assert [p.directory for p in listed] == [pack.directory]
    assert (listed[0].objects, listed[0].bytes) == (2, 600)  # links are not objects
    other = cache.pack(URL, "three")  # removes the other versions of its URL
    other.fetch("z.tser", 300, download_of(os.urandom(300)))
    other.remove_other_versions()
    assert intact(files)
    other.close()
    assert clear_cache(tmp_path / "cache").objects_in_use == 0
    assert intact(files)
    assert list_cache(tmp_path / "cache") == []


def test_a_pack_folder_or_locks_folder_that_is_a_link_is_replaced_not_written_through(
    tmp_path: Path,
) -> None:
    files = elsewhere(tmp_path)
    target = tmp_path / "elsewhere"
    pack = Cache(tmp_path / "cache").pack(URL, "one")
    pack.directory.parent.mkdir(parents=True)
    pack.directory.symlink_to(target, target_is_directory=True)
    data = os.urandom(500)  # as large as a.tser: a cached copy "of the right size"
    path = pack.fetch("a.tser", 500, download_of(data))
    assert path.read_bytes() == data and not pack.directory.is_symlink() and intact(files)
    pack.close()
    (pack.directory / LOCKS).rename(tmp_path / "old-locks")
    (pack.directory / LOCKS).symlink_to(target / "sub", target_is_directory=True)
    assert clear_cache(tmp_path / "cache").packs_removed == 1
    assert intact(files) and sorted(p.name for p in (target / "sub").iterdir()) == ["c.tser"]


def test_a_cache_dir_that_is_a_link_works(tmp_path: Path) -> None:
    real = tmp_path / "disk" / "cache"
    real.mkdir(parents=True)
    (tmp_path / "cache").symlink_to(real, target_is_directory=True)
    pack = Cache(tmp_path / "cache", limit_bytes=1000).pack(URL, "one")
    for age, name in enumerate(("a.tser", "b.tser", "c.tser")):  # the third evicts the first
        pack.fetch(name, 400, download_of(os.urandom(400)))
        pack.release(name)
        os.utime(pack.object_path(name), (1e9 + age, 1e9 + age))
    assert sorted(p.name for p in (real / LAYOUT / pack.directory.name).iterdir()) == [
        ".locks",
        ".staging",
        "b.tser",
        "c.tser",
        "pack.json",
    ]
    assert [p.objects for p in list_cache(tmp_path / "cache")] == [2]
    assert clear_cache(tmp_path / "cache").packs_removed == 1
    assert (tmp_path / "cache").is_symlink() and list_cache(tmp_path / "cache") == []


# --------------------------------------------------------------------------- FIFOs (item 9)


@pytest.mark.parametrize("planted", ["fifo", "link to a fifo"])
def test_a_fifo_where_an_object_is_cached_is_downloaded_again(tmp_path: Path, planted: str) -> None:
    pack = Cache(tmp_path / "cache").pack(URL, "one")
    (pack.directory / LOCKS).mkdir(parents=True)
    fifo = pack.directory / "a.tser" if planted == "fifo" else tmp_path / "fifo"
    os.mkfifo(fifo)
    if planted != "fifo":
        pack.object_path("a.tser").symlink_to(fifo)
    data = os.urandom(1000)
    path = within(10, lambda: pack.fetch("a.tser", len(data), download_of(data)), [fifo])
    assert path.read_bytes() == data
    assert planted == "fifo" or fifo.exists()  # the link went, not what it named
    pack.close()


def test_fifos_as_locks_and_pack_json_never_block_list_clear_or_eviction(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache", limit_bytes=1000)
    pack = cache.pack(URL, "one")
    for age, name in enumerate(("a.tser", "b.tser")):
        pack.fetch(name, 400, download_of(os.urandom(400)))
        os.utime(pack.object_path(name), (1e9 + age, 1e9 + age))
    pack.close()
    (pack.directory / PACK_INFO).unlink()
    fifos = [pack.directory / PACK_INFO, pack.directory / LOCKS / "a.tser.lock"]
    (pack.directory / LOCKS / "a.tser.lock").unlink()
    for fifo in fifos:
        os.mkfifo(fifo)
    os.mkfifo(pack.directory / ".c.tser.1234.partial")  # not a file: never an object
    listed = within(10, lambda: list_cache(tmp_path / "cache"), fifos)
    assert [(p.objects, p.bytes) for p in listed] == [(2, 800)]
    within(10, lambda: cache.make_room(600), fifos)  # evicts a.tser, the older one
    assert not pack.object_path("a.tser").exists()
    assert within(10, lambda: clear_cache(tmp_path / "cache"), fifos).packs_removed == 1


# --------------------------------------------------------------------------- capped reads (10)


def test_a_whole_read_is_capped_naming_the_url(remote: Remote) -> None:
    big = os.urandom(256 << 10)
    remote.put("manifest.json", big)
    store = RemoteStore(remote.url, remote.storage_options, retry=FAST)
    with pytest.raises(RemoteError, match="1,024-byte limit") as info:
        store.read_bytes("manifest.json", max_bytes=1024)
    assert f"{remote.prefix}/manifest.json" in str(info.value)
    assert store.read_bytes("manifest.json", max_bytes=len(big)) == big
    remote.put("empty.json", b"")
    assert store.read_bytes("empty.json", max_bytes=10) == b""


def test_a_manifest_over_the_cap_is_refused_by_resolve(
    remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote.put("manifest.json", b"{" + b" " * 4096 + b"}")
    monkeypatch.setattr(store_module, "MAX_MANIFEST_BYTES", 1024)
    with pytest.raises(RemoteError, match="1,024-byte limit") as info:
        resolve(remote.url, remote.storage_options, tmp_path, retry=FAST)
    assert "manifest.json" in str(info.value)
    assert list_cache(tmp_path) == []


@contextmanager
def endless_server() -> Iterator[tuple[str, list[int]]]:
    """An HTTP server answering every GET with a huge Content-Length and a body that never
    ends; yields its URL and the bytes each answer sent before the client went away."""
    listener = socket.create_server(("127.0.0.1", 0))
    sent: list[int] = []

    def serve(conn: socket.socket) -> None:
        with closing(conn):
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(4096) or b"\r\n\r\n"
            head = b"HTTP/1.1 200 OK\r\nContent-Length: 1099511627776\r\n\r\n"
            n = 0
            try:
                conn.sendall(head)
                if request.startswith(b"GET"):
                    while n < 1 << 30:
                        conn.sendall(b"\0" * 65536)
                        n += 65536
            except OSError:
                pass
            sent.append(n)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/voc", sent
    finally:
        listener.close()


def test_an_endless_manifest_is_cut_at_the_cap() -> None:
    with endless_server() as (url, sent):
        store = RemoteStore(url, retry=FAST)
        with pytest.raises(RemoteError, match="65,536-byte limit") as info:
            within(30, lambda: store.read_bytes("manifest.json", max_bytes=1 << 16), [])
        assert "/voc/manifest.json" in str(info.value)
        for _ in range(100):  # the server sees the client go away
            if sent:
                break
            time.sleep(0.05)
    assert sent and max(sent) < 1 << 30  # the body was left unread


# --------------------------------------------------------------------------- damaged copies (12)


@pytest.mark.parametrize("form", ["shards", "single"])
def test_a_cached_copy_damaged_on_disk_says_to_clear_the_cache(
    remote: Remote, tiny_packs: dict[str, Path], tmp_path: Path, form: str
) -> None:
    local = tiny_packs[form]
    if form == "shards":
        for file in local.iterdir():
            remote.put(file.name, file.read_bytes())
        url = remote.url
    else:
        remote.put(local.name, local.read_bytes())
        url = f"{remote.url}/{local.name}"
    cache = tmp_path / "cache"
    reader = open_pack(url, storage_options=remote.storage_options, cache_dir=cache)
    for i in range(len(reader)):
        bytes(reader.field(i, 0))
    s = 1 if form == "shards" else 0
    first, cached = int(reader.starts[s]), Path(reader.shard_path(s))
    reader.close()
    data = bytearray(cached.read_bytes())
    data[-66] ^= 0x40  # its metadata: same size, refused at open
    cached.write_bytes(bytes(data))

    with pytest.raises(CorruptFileError) as info:
        again = open_pack(url, storage_options=remote.storage_options, cache_dir=cache)
        again.field(first, 0)
    message = str(info.value)
    assert str(cached) in message and "cached copy" in message and "re-copy" not in message
    assert f"{remote.prefix}/{cached.name}" in message and "cache clear" in message
    cached.unlink()  # as it says: downloaded again
    again = open_pack(url, storage_options=remote.storage_options, cache_dir=cache)
    assert bytes(again.field(first, 0)) == bytes(open_pack(local).field(first, 0))
    again.close()


def test_a_local_pack_is_not_called_a_cached_copy(
    tmp_path: Path, tiny_packs: dict[str, Path]
) -> None:
    path = tmp_path / "tiny.tser"
    data = bytearray(tiny_packs["single"].read_bytes())
    data[-66] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError) as info:
        open_pack(path)
    assert "cached" not in str(info.value)
