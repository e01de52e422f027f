"""A separate process for the cache tests: ``python _remote_worker.py MODE JSON``.

``fetch``: resolve a remote pack and fetch one shard, then print the sha256 of the cached file.
``hold``: hold one object already in a cache, print ``HELD`` and wait until stdin closes.
``pool``: a function for multiprocessing pools (``fetch_in_worker``).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from torch_serialized.remote.cache import Cache
from torch_serialized.remote.packs import RemotePack, resolve
from torch_serialized.remote.retry import RetryPolicy


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch_in_worker(args: tuple[RemotePack, str, int]) -> str:
    """Fetch shard ``name`` through a (pickled or forked) RemotePack; its file's sha256."""
    pack, name, size = args
    return _sha256(pack.fetch_shard(name, size))


def main(mode: str, spec: dict[str, Any]) -> None:
    if mode == "fetch":
        pack = resolve(
            spec["url"],
            spec["storage_options"],
            spec["cache_dir"],
            retry=RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.02),
        )
        path = pack.fetch_shard(spec["name"], spec["size"])
        print(_sha256(path), flush=True)
        pack.close()
    elif mode == "hold":
        pack_cache = Cache(spec["cache_dir"]).pack(spec["url"], spec["identity"])

        def refuse(dest: Path) -> None:
            raise AssertionError(f"{dest} should be cached already")

        pack_cache.fetch(spec["name"], spec["size"], refuse)
        print("HELD", flush=True)
        sys.stdin.read()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
