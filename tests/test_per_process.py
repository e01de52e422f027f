"""Per-process state of the remote classes: what ``_reset`` makes, pickling drops.

``RemoteStore``, ``PackCache`` and ``RemotePack`` each hold things that belong to one process
(locks, thread pools, open descriptors, the pid they were made in). A spawned DataLoader worker
gets the object through pickle: each of those must be dropped there and made anew, or pickling
fails (a lock) or the worker uses the parent's (a pool, descriptors). Each test uses the object
first, so that everything made on demand exists, then checks that the attributes ``_reset``
makes are exactly the ones pickling drops, and that the copy works in a fresh process.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch_serialized.remote.cache import Cache
from torch_serialized.remote.packs import RemotePack, resolve
from torch_serialized.remote.retry import RetryPolicy
from torch_serialized.remote.store import PerProcess, RemoteStore

if TYPE_CHECKING:
    from remote_fixtures import Remote

pytest_plugins = ["remote_fixtures"]

PART = 64 << 10
FAST = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.02)
MANIFEST = b'{"format": "torch_serialized.shards", "shards": ["a.tser", "b.tser"]}'

# Unpickles (obj, name, size) from stdin, uses obj as a worker would, prints the bytes' sha256.
_CHILD = """
import hashlib, pickle, sys
from torch_serialized.remote.packs import RemotePack
from torch_serialized.remote.store import RemoteStore

obj, name, size = pickle.load(sys.stdin.buffer)
if isinstance(obj, RemoteStore):
    data = obj.read_bytes(name)
elif not isinstance(obj, RemotePack):  # a PackCache
    def refuse(dest):
        raise AssertionError(f"{dest} should be cached already")
    data = obj.fetch(name, size, refuse).read_bytes()
    assert obj.held() == [name], obj.held()
else:
    obj.prefetch([name])
    data = obj.fetch_shard(name, size).read_bytes()
    obj.close()
print(hashlib.sha256(data).hexdigest())
"""


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_per_process(used: PerProcess, fresh: PerProcess) -> Any:
    """The checks common to the three classes; the unpickled copy of ``used``.

    ``used`` has been used (whatever it makes on demand exists); ``fresh`` is a new instance.
    """
    cls = type(used)
    names = set(cls._PER_PROCESS)
    blank = cls.__new__(cls)
    blank._reset()
    assert set(vars(blank)) == names, "_reset makes other attributes than _PER_PROCESS names"
    kept = set(used.__getstate__())
    assert kept == set(vars(fresh)) - names, "pickling keeps per-process attributes"
    assert set(vars(used)) == kept | names
    clone = pickle.loads(pickle.dumps(used))
    assert set(vars(clone)) == kept | names and clone._pid == used._pid
    return clone


def in_fresh_process(obj: Any, name: str, size: int | None = None) -> str:
    """The sha256 a fresh Python process prints after using the pickled ``obj``."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=pickle.dumps((obj, name, size)),
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode().strip()


def test_a_used_remote_store_pickles_without_its_per_process_state(
    remote: Remote, tmp_path: Path
) -> None:
    data = blob(2 * PART + 5)
    remote.put("obj.bin", data)

    def store() -> RemoteStore:
        return RemoteStore(remote.url, remote.storage_options, retry=FAST)

    used = store()
    assert used.download("obj.bin", tmp_path / "obj.bin").read_bytes() == data
    assert used._fs is not None
    clone = check_per_process(used, store())
    assert clone._fs is None
    assert clone.read_bytes("obj.bin") == data
    assert in_fresh_process(used, "obj.bin") == sha(data)


def test_a_used_pack_cache_pickles_without_its_per_process_state(tmp_path: Path) -> None:
    data = blob(100)
    used = Cache(tmp_path).pack("s3://bucket/voc", "i")
    used.fetch("a.tser", len(data), lambda dest: dest.write_bytes(data))
    assert used.held() == ["a.tser"]
    clone = check_per_process(used, Cache(tmp_path).pack("s3://bucket/voc", "i"))
    assert clone.held() == [] and used.held() == ["a.tser"]
    assert in_fresh_process(used, "a.tser", len(data)) == sha(data)
    assert used.held() == ["a.tser"]
    used.close()


def test_a_used_remote_pack_pickles_without_its_per_process_state(
    remote: Remote, tmp_path: Path
) -> None:
    shards = {"a.tser": blob(3 * PART, 1), "b.tser": blob(2 * PART + 9, 2)}
    remote.put("manifest.json", MANIFEST)
    for name, content in shards.items():
        remote.put(name, content)

    def open_pack() -> RemotePack:
        return resolve(remote.url, remote.storage_options, tmp_path, retry=FAST)

    with open_pack() as used, open_pack() as fresh:
        used.fetch_shard("a.tser", len(shards["a.tser"]))
        used.prefetch(["b.tser"])  # the pool and a pending download
        assert used._pool is not None and used._pending
        clone = check_per_process(used, fresh)
        assert clone._pool is None and clone._pending == {} and clone.held() == []
        assert in_fresh_process(used, "b.tser", len(shards["b.tser"])) == sha(shards["b.tser"])
        assert clone.fetch_shard("b.tser", len(shards["b.tser"])).read_bytes() == shards["b.tser"]
        clone.close()


def _own_state(objects: list[PerProcess], parent: int, done: Any) -> None:
    """In a forked child, before it uses anything: whether each object's state is its own."""
    done.put([obj._pid == os.getpid() != parent for obj in objects])


def test_a_child_multiprocessing_forks_resets_them_before_its_first_use(
    remote: Remote, tmp_path: Path
) -> None:
    """A DataLoader worker forked while the parent used these objects found the parent's
    state at its first call, and two of its threads (the worker's and a prefetch thread)
    could both reset it, each closing what the other had just opened (a held cache file
    closed under its reader: EBADF). Each object is now reset as the child starts, in its
    one thread."""
    import multiprocessing

    remote.put("manifest.json", MANIFEST)
    store = RemoteStore(remote.url, remote.storage_options, retry=FAST)
    cache = Cache(tmp_path).pack("s3://bucket/voc", "i")
    with resolve(remote.url, remote.storage_options, tmp_path, retry=FAST) as pack:
        context = multiprocessing.get_context("fork")
        done = context.Queue()
        child = context.Process(target=_own_state, args=([store, cache, pack], os.getpid(), done))
        child.start()
        assert done.get(timeout=60) == [True, True, True]
        child.join(60)
        assert child.exitcode == 0
