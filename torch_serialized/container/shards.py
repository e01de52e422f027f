"""A packed dataset: one container file, or a shard folder opened from its manifest.

A shard folder opens from its manifest and its catalog alone; each shard is opened on first
use, checked then against its manifest entry and its own binding, and kept in a bounded
least-recently-used set, so a pack of any number of shards needs a bounded number of file
descriptors (each map holds its own, and before 3.13's ``trackfd=False`` Python's ``mmap``
keeps a duplicate: two). This module never imports torch.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from ..errors import CorruptFileError, FileChangedError, FormatError
from . import spec as fmt
from .fileio import read_regular_file
from .locate import find, intact
from .manifest import Expected, Manifest, ShardEntry, parse_manifest
from .reader import ContainerReader, gone

__all__ = ["PackReader", "open_pack", "default_max_open_shards"]

#: Shards whose checked metadata a ``PackReader`` keeps after closing their maps, so opening
#: one again costs a map, not a validation (a few KB each).
_MAX_CLOSED_SHARDS = 4096


class _Shards:
    """What one process holds of a pack's shards; never pickled, never shared."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        #: shards mapped in this process, least recently used first
        self.open: OrderedDict[int, ContainerReader] = OrderedDict()
        #: shards checked before whose maps were closed: opened again without a validation
        self.closed: OrderedDict[int, ContainerReader] = OrderedDict()


class PackReader:
    """A packed dataset: one container file, or a shard folder with ``manifest.json``.

    Records are numbered globally across shards. The dataset-level arrays, the per-record
    columns (``arrays``) and the metadata (``user``) come from one file: the catalog of a
    version-2 shard folder, the single file, or (manifest version 1) the last shard plus the
    columns every shard holds, read once at open. Shards are opened on first use (``shard``),
    checked against their manifest entry and binding, and at most ``max_open_shards`` stay
    open (least recently used closed first); the catalog stays open.

    ``path`` may be an fsspec URL (``s3://``, ``gs://``, ``https://``, ``file://``...): the
    pack is then read through the local cache (``storage_options``, ``cache_dir`` and
    ``cache_limit_bytes``: see ``remote.packs.resolve``; they are ignored for a local path).
    Its manifest and catalog are downloaded at open, each shard on first use (or ahead of use,
    ``prefetch_shards``), checked in full before it is renamed into the cache; ``path`` is then
    the cache folder, ``url`` the URL.

    ``check_records(shard, first_record)`` is a schema's check of a shard's records (its
    columns against its fields' lengths, say; ``first_record``: the pack's number of the
    shard's first record), called once per shard when it is first opened; it raises to refuse
    the shard. A single file (``single``) is there at open: its check is the caller's.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        checked: bool = False,
        max_open_shards: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit_bytes: int | None = None,
        check_records: Callable[[ContainerReader, int], None] | None = None,
    ) -> None:
        if max_open_shards is None:
            max_open_shards = default_max_open_shards()
        if max_open_shards < 1:
            raise ValueError(f"max_open_shards must be >= 1, got {max_open_shards}")
        location, manifest_path, data, self.remote = find(
            path, storage_options, cache_dir, cache_limit_bytes
        )
        #: the pack's URL, None for a local pack
        self.url: str | None = None if self.remote is None else self.remote.store.url_of()
        self.path = str(location)
        self.checked = checked
        self.max_open_shards = max_open_shards
        self.manifest: Manifest | None = None
        self.manifest_path = manifest_path
        #: sha256 of the manifest's bytes: the pack's identity, and how a reader tells a
        #: replaced pack (``FileChangedError``) from a damaged one
        self.manifest_sha256: str | None = None
        self._per_record: dict[str, np.ndarray] = {}  # manifest v1: columns merged at open
        self._check_records = check_records
        self._expected: list[Expected | None] = []
        self._local: _Shards | None = None
        if manifest_path is None:
            self._catalog = ContainerReader(location, checked=checked)
            self.entries: tuple[ShardEntry, ...] = (
                ShardEntry(
                    location.name,
                    0,
                    self._catalog.num_records,
                    self._catalog.size,
                    self._catalog.meta_crc32,
                ),
            )
            self._expected = [None]
            self.user: dict[str, Any] = self._catalog.user
        else:
            assert data is not None
            self.manifest_sha256 = hashlib.sha256(data).hexdigest()
            manifest = self.manifest = parse_manifest(data, str(manifest_path))
            self.entries = manifest.shards
            name = self._manifest_name()
            self._expected = [manifest.expect_shard(k, name) for k in range(len(manifest.shards))]
            if manifest.version >= 2:
                self._open_catalog(manifest)
            else:
                self._open_v1(manifest)
        self.fields = list(self._catalog.fields)
        counts = [entry.num_records for entry in self.entries]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.num_records = int(self.starts[-1])
        self._starts: list[int] = self.starts.tolist()  # for ``locate``
        #: the one container holding every record, when it is the catalog (a single file)
        self._single = self._catalog if self._expected == [None] else None
        #: the shard that is the catalog itself: a single file's, or a v1 pack's last one
        v2 = self.manifest is not None and self.manifest.version >= 2
        self._catalog_shard = -1 if v2 else len(self.entries) - 1
        self._field_index = {name: k for k, name in enumerate(self.fields)}

    # -- opening ---------------------------------------------------------------------------
    def _open_catalog(self, manifest: Manifest) -> None:
        """Manifest version 2: the catalog holds the metadata, the dataset-level arrays and a
        copy of every record's columns; no shard is opened yet."""
        assert manifest.catalog is not None and manifest.pack_id is not None
        expect = manifest.expect_catalog(self._manifest_name())
        catalog = self._open_listed(manifest.catalog.file, expect)
        for name, array in catalog.arrays().items():
            if catalog.is_per_record(name):
                raise expect.mismatch(catalog.path, f"the catalog holds per-record array {name!r}")
            if name == "records" and array.shape[:1] != (manifest.num_records,):
                raise expect.mismatch(catalog.path, "its record columns do not cover every record")
        self._catalog = catalog
        self.user = catalog.user

    def _manifest_name(self) -> str:
        """The manifest as messages about the pack's files name it: the URL's for a remote
        pack (the cached copy is not what the user opened), else its path."""
        if self.remote is not None:
            return self.remote.store.url_of(fmt.MANIFEST_NAME)
        return str(self.manifest_path)

    def _open_v1(self, manifest: Manifest) -> None:
        """Manifest version 1 (0.1.0): every shard is checked now, since the per-record columns
        are spread across them (merged into private arrays here) and the manifest has no
        checksum of its own: its ``user`` must equal the copy in the last shard."""
        parts: dict[str, list[np.ndarray]] = {}
        last = len(manifest.shards) - 1
        for k in range(last + 1):
            shard = self._open_shard(k)
            for name, array in shard.arrays().items():
                if shard.is_per_record(name):
                    parts.setdefault(name, []).append(array)
            if k == last:
                self._catalog = shard
            else:
                self._remember(k, shard)
        assert self.manifest_path is not None and manifest.user is not None
        if self._catalog.user != manifest.user:
            raise CorruptFileError(
                f"{self.manifest_path}: its metadata differs from the copy in "
                f"{self._catalog.path}: the manifest was damaged or edited; re-pack the dataset"
            )
        self.user = manifest.user
        for name, arrays in parts.items():
            if len(arrays) != len(manifest.shards) or not self._catalog.is_per_record(name):
                raise CorruptFileError(
                    f"{self.path}: per-record array {name!r} is missing from some shards; "
                    "the pack is damaged, re-pack it"
                )
            try:
                self._per_record[name] = np.concatenate(arrays)
            except (ValueError, TypeError) as exc:  # shapes or dtypes differ by shard
                raise CorruptFileError(
                    f"{self.path}: shards disagree on array {name!r} ({exc}); "
                    "the pack is damaged, re-pack it"
                ) from None

    # -- shards: opened on first use, a bounded number kept ------------------------------------
    def _here(self) -> _Shards:
        """This process's shards (as ``reader._Mapped`` is a file's map): made on first use in
        a process that has none. A forked child closes the maps it inherited (they are not
        its own) and keeps what was checked, except a remote pack's shards, which it fetches
        (holds in the cache) again."""
        here = self._local
        if here is not None and here.pid == os.getpid():
            return here
        fresh = self._local = _Shards()
        for s, shard in [*here.closed.items(), *here.open.items()] if here else ():
            shard.close()
            if self.remote is None:
                fresh.closed[s] = shard
        return fresh

    @property
    def num_shards(self) -> int:
        return len(self.entries)

    def shard_path(self, s: int) -> str:
        """Where shard ``s`` is (the file itself for a single-file pack)."""
        if self.manifest_path is None:
            return self.path
        return os.path.join(self.path, self.entries[s].file)

    def shard(self, s: int) -> ContainerReader:
        """Shard ``s``, opened and checked on first use. At most ``max_open_shards`` stay
        mapped: the least recently used one is closed (its checked metadata kept, so mapping it
        again is cheap) when another is needed."""
        if not 0 <= s < len(self.entries):
            raise IndexError(f"shard {s} out of range for {len(self.entries)} shards")
        if s == self._catalog_shard:
            return self._catalog
        here = self._here()
        with here.lock:
            shard = here.open.get(s)
            if shard is not None:
                here.open.move_to_end(s)
                return shard
            shard = here.closed.pop(s, None)
            if shard is not None:
                shard.reopen()  # FileChangedError if the file is no longer the one checked
            else:
                shard = self._open_shard(s)
            self._remember(s, shard)
            return shard

    def _remember(self, s: int, shard: ContainerReader) -> None:
        here = self._here()
        here.open[s] = shard
        while len(here.open) > self.max_open_shards:
            old, closing = here.open.popitem(last=False)
            closing.close()  # the map goes once no view of it is left
            if self.remote is not None:  # evictable now; fetched (and checked) again if needed
                self.remote.release(self.entries[old].file)
                continue
            here.closed[old] = closing
            while len(here.closed) > _MAX_CLOSED_SHARDS:
                here.closed.popitem(last=False)

    # -- remote packs: where the files come from -------------------------------------------
    def prefetch_shards(self, shards: Iterable[int]) -> None:
        """Start downloading ``shards`` of a remote pack in the background (a no-op for a
        local pack or shards already open here), so that reading them later does not wait."""
        if self.remote is None or self.manifest_path is None:
            return
        from ..remote.packs import ShardRequest

        here = self._here()
        requests = []
        for s in shards:
            expect = self._expected[s]
            if expect is not None and s not in here.open:
                requests.append(ShardRequest(self.entries[s].file, expect.bytes, intact(expect)))
        self.remote.prefetch(requests)

    def release_shard(self, s: int) -> None:
        """Done with shard ``s`` for now: close its map and, for a remote pack, let the cache
        evict it (it is fetched again if read again). Views handed out stay valid."""
        if self.remote is None or s == self._catalog_shard:
            return
        here = self._here()
        with here.lock:
            shard = here.open.pop(s, None)
        if shard is not None:
            shard.close()
        self.remote.release(self.entries[s].file)

    def close(self) -> None:
        """Close every shard's map and, for a remote pack, stop prefetching and release the
        shards this process holds in the cache (not the manifest and catalog, which stay in
        use). The reader maps (and fetches) shards again on next use."""
        here = self._here()
        with here.lock:
            opened = list(here.open.items())
            here.open.clear()
        for s, shard in opened:
            shard.close()
            if self.remote is None:
                here.closed[s] = shard
        if self.remote is not None:
            keep = [fmt.MANIFEST_NAME, os.path.basename(self._catalog.path)]
            self.remote.close(keep=keep)

    def _open_shard(self, s: int) -> ContainerReader:
        expect = self._expected[s]
        assert expect is not None
        shard = self._open_listed(self.entries[s].file, expect)
        if self.manifest is not None and self.manifest.version >= 2:
            self._check_columns(s, shard)
        if self._check_records is not None:
            self._check_records(shard, self.entries[s].first_record)
        return shard

    def _open_listed(self, name: str, expect: Expected) -> ContainerReader:
        """The manifest's file ``name`` (``expect.what``: "shard 3", "the catalog"), opened
        and checked against ``expect``. Missing or not the file listed: ``FileChangedError`` if
        the manifest changed since it was read (the pack was replaced: its files are the new
        pack's), else the pack is incomplete or damaged."""
        path = os.path.join(self.path, name)
        try:
            if self.remote is not None:  # the cached copy, downloaded and checked if need be
                path = str(self.remote.fetch_shard(name, expect.bytes, intact(expect)))
            return ContainerReader(path, checked=self.checked, expect=expect)
        except (FileNotFoundError, FormatError) as exc:
            if self._manifest_changed():
                assert self.manifest_path is not None
                if self.remote is None and not os.path.lexists(self.manifest_path):
                    raise FileChangedError(gone(self.path, f" ({name} is gone)")) from None
                raise FileChangedError(
                    f"{self.name} was replaced after it was opened ({name} is not the "
                    "file its manifest named then); create the dataset again to read the new pack"
                ) from None
            if isinstance(exc, FileNotFoundError) and self.remote is None:
                raise FileNotFoundError(
                    f"{path}: {expect.member} is missing; the pack is "
                    "incomplete: copy it again or re-pack the dataset"
                ) from None
            raise

    def _check_columns(self, s: int, shard: ContainerReader) -> None:
        """A shard holds its rows of the catalog's ``records`` (and no other per-record
        array), equal to the catalog's copy."""
        catalog = self._catalog.arrays()
        first, count = self.entries[s].first_record, self.entries[s].num_records
        expect = self._expected[s]
        assert expect is not None
        names = {name for name in shard.arrays() if shard.is_per_record(name)}
        wanted = {"records"} & set(catalog)
        if names != wanted:
            raise expect.mismatch(
                shard.path,
                f"it holds per-record arrays {sorted(names)}, the catalog {sorted(wanted)}",
            )
        for name in names:
            rows, copy = shard.arrays()[name], catalog[name]
            if copy.dtype != rows.dtype or copy[first : first + count].tobytes() != rows.tobytes():
                raise expect.mismatch(
                    shard.path, f"its array {name!r} differs from the catalog's copy"
                )

    def _manifest_changed(self) -> bool:
        """Whether the manifest on disk (at the URL, for a remote pack) is no longer the one
        this reader opened."""
        assert self.manifest_path is not None
        try:
            if self.remote is not None:  # the cached copy never changes: ask the URL
                data = self.remote.store.read_bytes(fmt.MANIFEST_NAME)
            else:
                data = read_regular_file(self.manifest_path, fmt.MAX_MANIFEST_BYTES, "manifest")
        except OSError:  # gone here: changed; a URL that fails: the caller's own error stands
            return self.remote is None
        return hashlib.sha256(data).hexdigest() != self.manifest_sha256

    def __len__(self) -> int:
        return self.num_records

    def __getstate__(self) -> dict[str, Any]:
        """What is this process's (maps, locks) is not pickled."""
        return {**self.__dict__, "_local": None}

    def field_index(self, name: str) -> int:
        try:
            return self._field_index[name]
        except KeyError:
            raise KeyError(f"{self.path} has no field {name!r} (fields: {self.fields})") from None

    def locate(self, i: int) -> tuple[ContainerReader, int]:
        """The shard holding global record ``i`` and the record's index inside it."""
        if not 0 <= i < self.num_records:
            raise IndexError(f"record {i} out of range for {self.num_records} records")
        if self._single is not None:
            return self._single, i
        starts = self._starts
        s = bisect.bisect_right(starts, i) - 1  # a tenth of np.searchsorted's cost per call
        return self.shard(s), i - starts[s]

    def field(self, i: int, k: int) -> memoryview:
        """Bytes of field number ``k`` of global record ``i``."""
        shard, j = self.locate(i)
        return shard.field(j, k)

    def arrays(self) -> dict[str, np.ndarray]:
        """The dataset-level arrays and the per-record columns of all records.

        Views of this process's map of the catalog (rebuilt when it is mapped again, after a
        fork), plus for a version-1 shard folder the columns merged at open.
        """
        source = self._catalog.arrays()
        if not self._per_record:
            return dict(source)
        kept = {n: a for n, a in source.items() if not self._catalog.is_per_record(n)}
        return {**kept, **self._per_record}

    def reopen(self) -> None:
        """Map the catalog in this process now rather than on first read (idempotent);
        shards are mapped on first use."""
        self._here()
        self._catalog.reopen()

    def verify(self) -> list[int]:
        """Global indices of damaged records (empty when all is well); opens every shard in
        turn."""
        bad: list[int] = []
        for s, start in enumerate(self.starts[:-1]):
            bad.extend(int(start) + i for i in self.shard(s).verify())
        return bad

    @property
    def version(self) -> tuple[int, int]:
        """The container format version of the catalog (or single file)."""
        return self._catalog.version

    @property
    def name(self) -> str:
        """What the user opened, for messages: the URL of a remote pack, else ``path`` (the
        local file or folder read: a URL's cached copy)."""
        return self.url or self.path

    @property
    def single(self) -> ContainerReader | None:
        """The one file holding every record of a single-file pack; None for a shard folder."""
        return self._single

    @property
    def binding(self) -> dict[str, Any] | None:
        """The catalog's (or single file's) binding to its pack (``spec.binding``: the
        ``pack_id`` a full pack draws and an append keeps); None in packs written by 0.1.0."""
        value = self._catalog.meta.get("pack")
        return value if isinstance(value, dict) else None

    @property
    def nbytes(self) -> int:
        """Bytes on disk, all files included (as the manifest lists them)."""
        if self.manifest is None:
            return sum(entry.bytes for entry in self.entries)
        assert self.manifest_path is not None
        return self.manifest.files_bytes() + self.manifest_path.stat().st_size


def default_max_open_shards() -> int:
    """How many shards a reader keeps mapped unless told: an eighth of this process's
    descriptor limit (each open shard holds up to two), between 4 and 512 (64 where the limit
    cannot be read)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 64
    if soft == resource.RLIM_INFINITY:
        return 512
    return max(4, min(512, soft // 8))


def open_pack(
    path: str | os.PathLike[str],
    *,
    checked: bool = False,
    max_open_shards: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit_bytes: int | None = None,
) -> PackReader:
    """Open a packed dataset (a ``.tser`` file or a shard folder, local or at a URL). A shard
    folder keeps at most ``max_open_shards`` shards mapped (default:
    ``default_max_open_shards()``). A URL is read through the local cache: see ``PackReader``.
    """
    return PackReader(
        path,
        checked=checked,
        max_open_shards=max_open_shards,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_limit_bytes=cache_limit_bytes,
    )
