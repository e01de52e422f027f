"""A packed dataset: one container file, or a shard folder opened from its manifest and catalog.
Shards are opened and checked on first use and kept in a bounded LRU set, so any number of
shards needs a bounded number of file descriptors. Never imports torch."""

from __future__ import annotations

import bisect
import hashlib
import os
import resource
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from ..errors import CorruptFileError, FileChangedError, FormatError, IncompletePackError
from . import spec as fmt
from .fileio import read_regular_file
from .locate import find, intact
from .manifest import Expected, Manifest, ShardEntry, parse_manifest
from .reader import ContainerReader, gone

__all__ = ["PackReader", "open_pack"]


#: Bytes of a shard's tail fetched beside its download beyond its index rows and columns (its
#: metadata, the arrays' alignment): reads start once the tail and their own bytes are in.
_TAIL = 16 << 10
#: Checked shards kept unmapped: remapping costs a map, not a check (0.03 vs 0.2 ms; KBs each).
_MAX_CLOSED_SHARDS = 4096


class _Shards:
    """What one process holds of a pack's shards; never pickled, never shared."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.open: OrderedDict[int, ContainerReader] = OrderedDict()  # mapped, LRU first
        self.closed: OrderedDict[int, ContainerReader] = OrderedDict()  # checked, unmapped


class PackReader:
    """A packed dataset: one container file, or a shard folder with ``manifest.json``.

    Records are numbered across shards; arrays and ``user`` come from the catalog (manifest v1:
    the last shard, plus all shards' columns read at open). Shards open on use, checked against
    the manifest; at most ``max_open_shards`` stay mapped. For an fsspec URL, ``path`` is the
    cache folder and ``url`` the URL. ``check_records(shard, first_record)`` runs on each shard
    opened (a single file's is the caller's). ``check_files``: a ``stat`` of every listed file
    at open (``IncompletePackError``); an append's partial staged copy and ``verify`` skip it.
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
        check_files: bool = False,
    ) -> None:
        if max_open_shards is None:  # an eighth of the descriptor limit (2 each at most), 4 to 512
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            max_open_shards = 512 if soft == resource.RLIM_INFINITY else max(4, min(512, soft // 8))
        if max_open_shards < 1:
            raise ValueError(f"max_open_shards must be >= 1, got {max_open_shards}")
        location, manifest_path, data, self.remote = find(
            path, storage_options, cache_dir, cache_limit_bytes
        )
        self.url: str | None = None if self.remote is None else self.remote.store.url_of()
        self.path = str(location)
        self.checked = checked
        self.max_open_shards = max_open_shards
        self.manifest: Manifest | None = None
        self.manifest_path = manifest_path
        #: the pack's identity: tells a replaced pack (``FileChangedError``) from a damaged one
        self.manifest_sha256: str | None = None
        self._per_record: dict[str, np.ndarray] = {}  # manifest v1: columns merged at open
        self._check_records = check_records
        self._expected: list[Expected] = []  # by shard; none for a single file
        self._local: _Shards | None = None
        if manifest_path is None:
            try:
                self._catalog = ContainerReader(location, checked=checked)
            except FormatError as exc:
                if self.remote is None:
                    raise
                raise self._damaged_copy(str(location), self.name) from exc
            c = self._catalog
            self.entries: tuple[ShardEntry, ...] = (
                ShardEntry(location.name, 0, c.num_records, c.size, c.meta_crc32),
            )
        else:
            assert data is not None
            self.manifest_sha256 = hashlib.sha256(data).hexdigest()
            manifest = self.manifest = parse_manifest(data, str(manifest_path))
            self.entries = manifest.shards
            remote = self.remote
            name = str(manifest_path) if remote is None else remote.store.url_of(fmt.MANIFEST_NAME)
            self._expected = [manifest.expect_shard(k, name) for k in range(len(manifest.shards))]
            if check_files and self.remote is None:
                self._check_files(manifest)
            if manifest.catalog is not None:  # version 2: the catalog holds metadata and arrays
                expect = manifest.expect_catalog(name)
                self._catalog = self._open_listed(manifest.catalog.file, expect)
                records = self._catalog.arrays().get("records")
                if records is not None and records.shape[:1] != (manifest.num_records,):
                    raise expect.mismatch(self._catalog.path, "its records do not cover the pack")
            else:
                self._open_v1(manifest)
        self.fields = list(self._catalog.fields)
        self.user: dict[str, Any] = self._catalog.user
        counts = [entry.num_records for entry in self.entries]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.num_records = int(self.starts[-1])
        self._starts: list[int] = self.starts.tolist()  # for ``locate``
        self._single = self._catalog if manifest_path is None else None
        #: the shard that is the catalog itself: a single file's, or a v1 pack's last one
        v2 = self.manifest is not None and self.manifest.version >= 2
        self._catalog_shard = -1 if v2 else len(self.entries) - 1

    def _check_files(self, manifest: Manifest) -> None:
        """Every file the manifest lists is here at its size (non-regular ones fail at open)."""
        wrong = {}
        for entry in manifest.listed():
            path = os.path.join(self.path, entry.file)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                wrong[entry.file] = f"{path} is missing"
                continue
            if stat.S_ISREG(st.st_mode) and st.st_size != entry.bytes:
                wrong[entry.file] = f"{path} has {st.st_size:,} bytes, it lists {entry.bytes:,}"
        if not wrong:
            return
        if (changed := self._changed(next(iter(wrong)))) is not None:
            raise changed
        more = f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""
        raise IncompletePackError(
            f"{self.path}: files its {fmt.MANIFEST_NAME} lists are missing or of another "
            f"size: {'; '.join(list(wrong.values())[:5])}{more}. An incomplete or mixed copy: "
            "copy the pack again from where it came from, or re-pack it"
        )

    def _open_v1(self, manifest: Manifest) -> None:
        """Manifest version 1 (0.1.0): every shard is opened now to merge the per-record
        columns; the manifest's ``user`` must equal the last shard's (it has no checksum)."""
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
            where = f"{self.manifest_path}: its metadata differs from {self._catalog.path}"
            raise CorruptFileError(f"{where}: damaged or edited; re-pack the dataset")
        for name, arrays in parts.items():
            damaged = f"{self.path}: shards disagree on array {name!r}; the pack is damaged"
            if len(arrays) != len(manifest.shards) or not self._catalog.is_per_record(name):
                raise CorruptFileError(f"{damaged}, re-pack it")
            try:
                self._per_record[name] = np.concatenate(arrays)
            except (ValueError, TypeError) as exc:  # shapes or dtypes differ by shard
                raise CorruptFileError(f"{damaged} ({exc}), re-pack it") from None

    def _here(self) -> _Shards:
        """This process's shards (after a fork: maps closed, checked ones kept unless remote)."""
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
        """How many shards the pack has (1 for a single file)."""
        return len(self.entries)

    def shard_path(self, s: int) -> str:
        """Where shard ``s`` is (the file itself for a single-file pack)."""
        if self.manifest_path is None:
            return self.path
        return os.path.join(self.path, self.entries[s].file)

    def shard(self, s: int) -> ContainerReader:
        """Shard ``s``, opened and checked on first use (LRU closed beyond ``max_open_shards``)."""
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

    def prefetch_shards(
        self,
        shards: Iterable[int],
        *,
        now: bool = False,
        rows: Mapping[int, np.ndarray] | None = None,
    ) -> None:
        """Start downloading ``shards`` of a remote pack in the background (else a no-op);
        ``now``: awaited, so they go first. ``rows``: local records a reader needs first; where
        they end their shard, its tail's GET brings them too (a stream starting at a shard's
        end waits for no GET of its own)."""
        if self.remote is None or self.manifest_path is None:
            return
        from ..remote.packs import ShardRequest

        here = self._here()
        requests = []
        per_record = fmt.INDEX_DTYPE.itemsize * len(self.fields) + 64  # 64: columns
        for s in (s for s in shards if s not in here.open):
            expect, entry = self._expected[s], self.entries[s]
            tail = _TAIL + entry.num_records * per_record  # index rows, columns, metadata
            first = rows.get(s) if rows else None
            if first is not None and len(first) and first[-1] == entry.num_records - 1:
                mean = (entry.bytes - tail) // entry.num_records
                ahead = (entry.num_records - int(first[0])) * mean * 3 // 2 + 2 * mean
                tail = tail + ahead if 2 * (tail + ahead) <= entry.bytes else tail
            requests.append(ShardRequest(entry.file, expect.bytes, intact(expect), tail, expect))
        self.remote.prefetch(requests, now=now)

    def shard_budget(self, streams: int = 1) -> int | None:
        """The bytes a bounded cache has for each of ``streams`` readers of this pack's shards:
        its limit less the manifest and the catalog, which stay held, shared evenly (None:
        unbounded, or not a remote pack)."""
        if self.remote is None or self.remote.cache.limit_bytes is None:
            return None
        held = self._catalog.size + (self.manifest_path.stat().st_size if self.manifest_path else 0)
        return (self.remote.cache.limit_bytes - held) // streams

    def release_shard(self, s: int) -> None:
        """Done with shard ``s`` of a remote pack for now: close it and let the cache evict it."""
        if self.remote is None or s == self._catalog_shard:
            return
        here = self._here()
        with here.lock:
            shard = here.open.pop(s, None)
        if shard is not None:
            shard.close()
        self.remote.release(self.entries[s].file)

    def close(self) -> None:
        """Close every shard's map (remote: stop prefetching, release shards); remapped on use."""
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
        shard = self._open_listed(self.entries[s].file, self._expected[s])
        if self.manifest is not None and self.manifest.version >= 2:
            self._check_columns(s, shard)
        if self._check_records is not None:
            self._check_records(shard, self.entries[s].first_record)
        return shard

    def _open_listed(self, name: str, expect: Expected) -> ContainerReader:
        """The manifest's file ``name``, opened and checked against ``expect``; missing or not
        that file: ``FileChangedError`` if the manifest changed since (a replaced pack)."""
        path, url = os.path.join(self.path, name), None  # url: of the cached copy at path
        try:
            if self.remote is not None:  # the cached copy, downloaded and checked if need be
                early = self.remote.early(name, expect, self.checked)  # or its download's
                if early is not None:
                    return early
                path = str(self.remote.fetch_shard(name, expect.bytes, intact(expect)))
                url = self.remote.store.url_of(name)
            return ContainerReader(path, checked=self.checked, expect=expect)
        except (FileNotFoundError, FormatError) as exc:
            if (changed := self._changed(name)) is not None:
                raise changed from None
            if url is not None and isinstance(exc, FormatError):
                raise self._damaged_copy(path, url) from exc
            if isinstance(exc, FileNotFoundError) and self.remote is None:
                msg = f"{path}: {expect.member} is missing (incomplete pack): copy it again"
                raise FileNotFoundError(msg) from None
            raise

    def _changed(self, name: str) -> FileChangedError | None:
        """``FileChangedError`` if ``name`` is off because the pack was replaced (the manifest here,
        or at the URL: its cached copy never changes, is not the one opened), else None."""
        assert self.manifest_path is not None
        try:
            if self.remote is not None:
                data = self.remote.store.read_bytes(fmt.MANIFEST_NAME)
            else:
                data = read_regular_file(self.manifest_path, fmt.MAX_MANIFEST_BYTES, "manifest")
            if hashlib.sha256(data).hexdigest() == self.manifest_sha256:
                return None
        except OSError:  # gone here: changed; a URL that fails: the caller's own error stands
            if self.remote is not None:
                return None
        if self.remote is None and not os.path.lexists(self.manifest_path):
            return FileChangedError(gone(self.path, f" ({name} is gone)"))
        msg = f"{self.name} was replaced after it was opened ({name} changed)"
        return FileChangedError(f"{msg}; create the dataset again to read it")

    def _damaged_copy(self, path: str, url: str) -> CorruptFileError:
        """The error for a cached copy of ``url`` damaged locally after its download was checked."""
        assert self.remote is not None
        return CorruptFileError(
            f"{path}: this cached copy of {url} was damaged on the local disk: delete it (or run "
            f"`torch-serialized cache clear --url {self.name} --cache-dir "
            f"{self.remote.cache.directory}`) and open the pack again to download it again"
        )

    def _check_columns(self, s: int, shard: ContainerReader) -> None:
        """A shard's per-record arrays are its rows of the catalog's ``records``: the copy read
        is then the one ``check_records`` checked."""
        entry, expect, catalog = self.entries[s], self._expected[s], self._catalog.arrays()
        names = sorted(n for n in shard.arrays() if shard.is_per_record(n))
        wanted = ["records"] if "records" in catalog else []
        if names != wanted:
            raise expect.mismatch(shard.path, f"it holds per-record arrays {names}, not {wanted}")
        for name in names:
            rows, copy = shard.arrays()[name], catalog[name][entry.first_record :]
            if copy.dtype != rows.dtype or copy[: entry.num_records].tobytes() != rows.tobytes():
                raise expect.mismatch(shard.path, f"its {name!r} differ from the catalog's copy")

    def __len__(self) -> int:
        return self.num_records

    def __getstate__(self) -> dict[str, Any]:
        """What is this process's (maps, locks) is not pickled."""
        return {**self.__dict__, "_local": None}

    def field_index(self, name: str) -> int:
        """The column of field ``name``."""
        try:
            return self.fields.index(name)
        except ValueError:
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
        """The dataset-level arrays and every record's columns (views of the catalog's map)."""
        source = self._catalog.arrays()
        if not self._per_record:
            return dict(source)
        kept = {n: a for n, a in source.items() if not self._catalog.is_per_record(n)}
        return {**kept, **self._per_record}

    def reopen(self) -> None:
        """Map the catalog in this process now rather than on first read (idempotent)."""
        self._here()
        self._catalog.reopen()

    def verify(self) -> list[int]:
        """Global indices of damaged records (empty when all is well)."""
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
        """What the user opened, for messages: the URL of a remote pack, else ``path``."""
        return self.url or self.path

    @property
    def single(self) -> ContainerReader | None:
        """The one file holding every record of a single-file pack; None for a shard folder."""
        return self._single

    @property
    def binding(self) -> dict[str, Any] | None:
        """The catalog's binding to its pack (``spec.binding``); None in 0.1.0 packs."""
        return self._catalog.meta.get("pack")

    @property
    def nbytes(self) -> int:
        """Bytes on disk, all files included (as the manifest lists them)."""
        if self.manifest is None:
            return sum(entry.bytes for entry in self.entries)
        assert self.manifest_path is not None
        return self.manifest.files_bytes() + self.manifest_path.stat().st_size


def open_pack(
    path: str | os.PathLike[str],
    *,
    checked: bool = False,
    max_open_shards: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit_bytes: int | None = None,
    check_files: bool = True,
) -> PackReader:
    """Open a packed dataset: a ``.tser`` file or a shard folder, local or at a URL
    (``PackReader``; a local shard folder's files are all checked there at open)."""
    return PackReader(
        path,
        checked=checked,
        max_open_shards=max_open_shards,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_limit_bytes=cache_limit_bytes,
        check_files=check_files,
    )
