"""The LMDB baseline: a plain LMDB store of the same samples, the second reference beside
``VOCDetection`` (benchmarks/README.md, "The LMDB baseline").

One key per sample of the image set, in list order (``b"%08d" % index``, so the store's key
order is the list order and a cursor walks it front to back), whose value is the image file's
bytes followed by torchvision's parsed target as JSON::

    u32 little-endian image length | image bytes | target JSON (orjson)

The environment is opened read-only with ``readahead=True`` (LMDB's default: the kernel's
read-ahead stays on for its map), ``lock=False``. Reads use ``buffers=True`` views, so an image
costs one copy (to ``bytes``) and the target one ``orjson.loads``, as ours. ``lmdb`` is a
benchmark-only dependency (the ``bench`` extra): without it the rows say so.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

MISSING = "n/a (pip install lmdb)"


def available() -> str | None:
    """None when ``lmdb`` can be imported, else the text the table shows instead."""
    try:
        import lmdb  # noqa: F401
    except ImportError:
        return MISSING
    return None


def _key(index: int) -> bytes:
    return b"%08d" % index


def build(tv: Any, path: Path) -> float:
    """Write ``tv``'s samples (a ``VOCDetection``) to a new LMDB store at ``path``: read the
    files, parse the XML as torchvision does, write, sync. Returns the seconds it took."""
    import lmdb
    import orjson
    from torchvision.datasets.voc import ET_parse

    start = time.perf_counter()
    sizes = sum(os.path.getsize(p) for p in tv.images)
    env = lmdb.open(
        str(path), map_size=2 * sizes + (64 << 20), subdir=True, lock=False, writemap=False
    )
    try:
        with env.begin(write=True) as txn:
            for i, (image, annotation) in enumerate(zip(tv.images, tv.annotations)):
                with open(image, "rb") as f:
                    data = f.read()
                target = tv.parse_voc_xml(ET_parse(annotation).getroot())
                value = len(data).to_bytes(4, "little") + data + orjson.dumps(target)
                txn.put(_key(i), value, append=True)
        env.sync(True)
    finally:
        env.close()
    return time.perf_counter() - start


def store_files(path: Path) -> list[str]:
    return [str(path / name) for name in ("data.mdb", "lock.mdb") if (path / name).exists()]


class Store:
    """A read-only view of a store written by ``build``: random gets and a cursor walk."""

    def __init__(self, path: Path) -> None:
        import lmdb

        self.path = path
        self.env = lmdb.open(
            str(path), readonly=True, lock=False, readahead=True, meminit=False, subdir=True
        )
        self.txn = self.env.begin(buffers=True)

    def close(self) -> None:
        self.txn.abort()
        self.env.close()

    def __len__(self) -> int:
        return int(self.env.stat()["entries"])

    @staticmethod
    def split(value: Any, image: Callable[[Any], Any] = bytes) -> tuple[Any, Any]:
        """(image, target dict) of a stored value (a view): ``image`` makes the one copy of
        the image bytes (``bytes`` by default)."""
        import orjson

        n = int.from_bytes(value[:4], "little")
        return image(value[4 : 4 + n]), orjson.loads(value[4 + n :])

    def get(self, index: int) -> tuple[bytes, Any]:
        return self.split(self.txn.get(_key(index)))

    @staticmethod
    def split_tensor(value: Any) -> tuple[Any, Any]:
        """``split`` with the image as ours returns it for ``decode="none"``: a 1-D uint8
        tensor owning a copy (``torch.frombuffer(bytearray(view))``, as ours makes it)."""
        import torch

        return Store.split(value, lambda view: torch.frombuffer(bytearray(view), dtype=torch.uint8))

    def get_tensor(self, index: int) -> tuple[Any, Any]:
        """``get`` with the image as a tensor (``split_tensor``): the same work as ours."""
        return self.split_tensor(self.txn.get(_key(index)))

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[bytes, Any]]:
        """What a DataLoader's fetcher makes of a batch: a list of gets."""
        get = self.get
        return [get(i) for i in indices]

    def walk(self, split: Callable[[Any], Any] | None = None) -> Iterator[Any]:
        """Every sample in key (= list, = storage) order, through one cursor (each value
        split by ``split``, by default ``Store.split``)."""
        split = split or self.split
        for value in self.txn.cursor().iternext(keys=False, values=True):
            yield split(value)


def count_in_order(path: Path, order: Sequence[int]) -> int:
    """Open the store and read ``order`` (the cold-cache runs: opening included)."""
    store = Store(path)
    try:
        get = store.get
        for i in order:
            get(i)
        return len(order)
    finally:
        store.close()


def count_walk(path: Path) -> int:
    """Open the store and walk it with a cursor (cold storage order, opening included)."""
    store = Store(path)
    try:
        return sum(1 for _ in store.walk())
    finally:
        store.close()


class LMDBDataset:
    """The store as a map-style dataset of ``(PIL image, target dict)`` (with ``decode=False``
    ``(bytes, target dict)``) for a DataLoader: the environment is opened in the process that
    reads (LMDB handles must not cross a fork)."""

    def __init__(
        self, path: Path, transform: Callable[[Any], Any] | None = None, *, decode: bool = True
    ) -> None:
        self.path = path
        self.transform = transform
        self.decode = decode  # False: the stored bytes, undecoded (I/O-only workers)
        self._store: Store | None = None
        self._pid: int | None = None
        probe = Store(path)
        self._len = len(probe)
        probe.close()

    def __len__(self) -> int:
        return self._len

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None, "_pid": None}

    def close(self) -> None:
        """Close this process's environment (a live one keeps the store's pages mapped)."""
        if self._store is not None and self._pid == os.getpid():
            self._store.close()
        self._store = None

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        import io

        from PIL import Image

        if self._store is None or self._pid != os.getpid():
            self._store, self._pid = Store(self.path), os.getpid()
        data, target = self._store.get(index)
        if not self.decode:
            return data, target
        image = Image.open(io.BytesIO(data)).convert("RGB")
        if self.transform is not None:
            image = self.transform(image)
        return image, target
