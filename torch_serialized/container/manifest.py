"""The shard-folder manifest (strict JSON naming catalog and shards, protected by ``checksum``;
0.1.0's version 1 still read), and ``member_of``: whether a file belongs to a shard folder, which
writers (never replace one alone) and readers (never open one alone) both ask."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from ..errors import CorruptFileError, UnsupportedVersionError
from .fileio import open_regular, read_regular_file
from .spec import (
    FOOTER_SIZE,
    HEADER_SIZE,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    MAX_MANIFEST_BYTES,
    PACK_ID,
    ROLE_CATALOG,
    ROLE_SHARD,
    binding,
    clip,
    damaged,
    dumps,
    is_count,
    is_names,
    loads_json,
    read_head,
    read_metadata,
)


@dataclass(frozen=True)
class ShardEntry:
    file: str
    first_record: int
    num_records: int
    bytes: int
    meta_crc32: int  # the shard footer's meta_crc32


@dataclass(frozen=True)
class CatalogEntry:
    file: str
    bytes: int
    meta_crc32: int


@dataclass(frozen=True)
class Manifest:
    """Parsed; version 2 has ``pack_id``, ``catalog``, ``checksum``, version 1 (0.1.0) ``user``."""

    version: int
    created_by: str
    num_records: int
    fields: tuple[str, ...]
    shards: tuple[ShardEntry, ...]
    pack_id: str | None = None
    catalog: CatalogEntry | None = None
    checksum: str | None = None
    user: dict[str, Any] | None = None

    def listed(self) -> list[CatalogEntry | ShardEntry]:
        """Every file the manifest names (catalog first), the manifest itself excluded."""
        return [*([self.catalog] if self.catalog else []), *self.shards]

    def files(self) -> list[str]:
        return [entry.file for entry in self.listed()]

    def files_bytes(self) -> int:
        return sum(entry.bytes for entry in self.listed())

    def expect_shard(self, k: int, name: str) -> Expected:
        """What shard ``k`` must be (``name``: the manifest, for messages)."""
        e, pack = self.shards[k], None
        if self.pack_id is not None:  # version 1: no binding
            place = dict(index=k, first_record=e.first_record, num_records=e.num_records)
            pack = binding(ROLE_SHARD, self.pack_id, **place)
        what = f"shard {k}"
        return Expected(
            name, e.bytes, e.meta_crc32, e.num_records, self.fields, pack, what, e.first_record
        )

    def expect_catalog(self, name: str) -> Expected:
        """What the catalog of a version-2 manifest must be (``name``: the manifest)."""
        assert self.catalog is not None and self.pack_id is not None
        place = dict(num_records=self.num_records, num_shards=len(self.shards))
        pack = binding(ROLE_CATALOG, self.pack_id, **place)
        c = self.catalog
        return Expected(name, c.bytes, c.meta_crc32, 0, self.fields, pack, "the catalog")


def canonical_json(value: Any) -> str:
    """The JSON a manifest's checksum covers (docs/FORMAT.md, "The manifest checksum")."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def manifest_checksum(manifest: Mapping[str, Any]) -> str:
    """``"sha256:<hex>"`` of the UTF-8 ``canonical_json`` of every key but ``checksum``."""
    body = {key: value for key, value in manifest.items() if key != "checksum"}
    return "sha256:" + hashlib.sha256(canonical_json(body).encode("utf-8")).hexdigest()


def build_manifest(
    *,
    created_by: str,
    pack_id: str,
    num_records: int,
    fields: Sequence[str],
    catalog: CatalogEntry,
    shards: Sequence[ShardEntry],
) -> bytes:
    """The version-2 manifest of a shard folder, encoded, its ``checksum`` last."""
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "created_by": created_by,
        "pack_id": pack_id,
        "num_records": num_records,
        "fields": list(fields),
        "catalog": dataclasses.asdict(catalog),
        "shards": [dataclasses.asdict(shard) for shard in shards],
    }
    manifest["checksum"] = manifest_checksum(manifest)
    return (dumps(manifest, "the manifest", indent=1, ensure_ascii=False) + "\n").encode("utf-8")


def parse_manifest(data: bytes, path: str) -> Manifest:
    """The valid manifest: ``UnsupportedVersionError`` if newer, else ``CorruptFileError``.
    ``data`` was read under the ``MAX_MANIFEST_BYTES`` cap (``read_manifest``, the remote store)."""
    raw = loads_json(data, path, "manifest")
    if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
        found = clip(repr(raw.get("format") if isinstance(raw, dict) else raw))
        raise damaged(path, f"not a torch_serialized shard manifest (format {found})")
    version: Any = raw.get("version")
    if not is_count(version) or version < 1:
        raise damaged(path, f"the manifest's version is {clip(repr(version))}, not 1 or more")
    if version > MANIFEST_VERSION:
        msg = f"manifest version {version} is newer than this torch_serialized reads"
        raise UnsupportedVersionError(f"{path}: {msg}; upgrade torch_serialized")
    if version >= 2 and raw.get("checksum") != manifest_checksum(raw):
        raise damaged(path, "the manifest's checksum does not match its content (edited?)")
    fields = raw.get("fields")
    if not is_names(fields):
        raise damaged(path, f"the manifest's fields are {clip(repr(fields))}, not distinct names")
    entries = raw.get("shards")
    if not isinstance(entries, list) or not entries:
        raise damaged(path, f"the manifest lists no shards (shards: {clip(repr(entries))})")
    shards: list[ShardEntry] = []
    for k, entry in enumerate(entries):
        first = shards[-1].first_record + shards[-1].num_records if shards else 0
        name, size, crc = _file_entry(entry, f"shard entry {k}", path)
        count = entry.get("num_records")
        if not is_count(count) or (version >= 2 and entry.get("first_record") != first):
            raise damaged(path, f"the manifest's shard entry {k} is invalid ({clip(repr(entry))})")
        shards.append(ShardEntry(name, first, count, size, crc))
    num_records = raw.get("num_records")
    if num_records != shards[-1].first_record + shards[-1].num_records:
        raise damaged(path, f"the manifest's num_records is {clip(repr(num_records))}, not the sum")
    pack_id = catalog = user = None
    if version == 1:
        user = raw.get("user")
        if not isinstance(user, dict):
            raise damaged(path, "the version-1 manifest's user is not an object")
    else:
        pack_id = raw.get("pack_id")
        if not isinstance(pack_id, str) or not PACK_ID.fullmatch(pack_id):
            msg = f"the manifest's pack_id is {clip(repr(pack_id))}, not 32 hex digits"
            raise damaged(path, msg)
        catalog = CatalogEntry(*_file_entry(raw.get("catalog"), "catalog entry", path))
    created_by = raw.get("created_by")
    created_by = created_by if isinstance(created_by, str) else ""
    extra = (pack_id, catalog, raw.get("checksum") if version >= 2 else None, user)
    manifest = Manifest(version, created_by, num_records, tuple(fields), tuple(shards), *extra)
    names = manifest.files()
    if len(set(names)) != len(names):
        twice = next(name for k, name in enumerate(names) if name in names[:k])
        raise damaged(path, f"the manifest names {twice!r} twice")
    return manifest


def _plain_name(name: Any) -> TypeGuard[str]:
    """A file name inside the pack's folder: not a path, not hidden, no control characters."""
    return (
        isinstance(name, str)
        and 0 < len(name.encode("utf-8", "surrogatepass")) <= 255
        and not name.startswith(".")
        and name != MANIFEST_NAME
        and not any(c in name for c in "/\\")
        and not any(unicodedata.category(c) in ("Cc", "Cs") for c in name)
    )


def _file_entry(entry: Any, what: str, path: str) -> tuple[str, int, int]:
    if isinstance(entry, dict):
        name, size, crc = entry.get("file"), entry.get("bytes"), entry.get("meta_crc32")
        smallest = HEADER_SIZE + FOOTER_SIZE
        if _plain_name(name) and is_count(size) and size >= smallest and is_count(crc, 1 << 32):
            return name, size, crc
    raise damaged(path, f"the manifest's {what} is invalid ({clip(repr(entry))})")


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    data = read_regular_file(path, MAX_MANIFEST_BYTES, "the manifest")
    return parse_manifest(data, os.fspath(path))


def read_binding(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``pack`` metadata of the container at ``path``; None if none or unreadable."""
    try:
        fd = open_regular(path, "the file")
        try:
            version, _, footer = read_head(fd, os.fstat(fd).st_size, os.fspath(path))
            meta = read_metadata(fd, version, footer, os.fspath(path))
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return None
    return meta.get("pack")


@dataclass(frozen=True)
class Member:
    """A shard or catalog file of a shard folder: part of a pack, never a pack by itself."""

    role: str  # ``spec.ROLE_SHARD`` or ``spec.ROLE_CATALOG``
    folder: str | None  # the shard folder to pass instead; None when not in it (copied out)
    index: int | None = None  # a shard's number from 0 (None for a catalog)
    num_shards: int | None = None  # of the manifest naming this file; None when none does

    def __str__(self) -> str:
        """E.g. ``shard 2 of 3 of the pack at data/voc``."""
        shard = self.role == ROLE_SHARD
        number = f"shard {self.index + 1}" if shard and self.index is not None else "a shard"
        if self.folder is None:
            what = number if shard else "a catalog"
            return f"{what} of a shard folder (its metadata says so)"
        if self.num_shards is None:  # the folder's earlier generation: an append kept it
            kind = "a shard" if shard else "a catalog"
            return f"{kind} of an earlier version of the pack at {self.folder}"
        what = f"{number} of {self.num_shards}" if shard else "the catalog"
        return f"{what} of the pack at {self.folder}"

    @property
    def advice(self) -> str:
        """What to pass instead of the file."""
        if self.folder is None:
            return "pass the shard folder it belongs to (the folder with its manifest.json)"
        return f"pass the folder {self.folder}"


def member_of(path: str | os.PathLike[str], binding: Mapping[str, Any] | None) -> Member | None:
    """What ``path`` is if it is a shard folder's file, not a pack: named by the manifest
    beside it, else a shard or catalog by its ``binding`` (the only way for a URL)."""
    binding = binding or {}
    role = binding["role"] if binding.get("role") in (ROLE_SHARD, ROLE_CATALOG) else None
    index = binding.get("index") if role == ROLE_SHARD else None
    file = Path(path)
    manifest = None
    if file.name != MANIFEST_NAME:
        with contextlib.suppress(OSError, ValueError):  # none (a URL's folder is no local path)
            manifest = read_manifest(file.parent / MANIFEST_NAME)
    if manifest is not None:
        folder = str(file.parent)
        names = [entry.file for entry in manifest.shards]
        if file.name in names:
            return Member(ROLE_SHARD, folder, names.index(file.name), len(names))
        if manifest.catalog is not None and file.name == manifest.catalog.file:
            return Member(ROLE_CATALOG, folder, None, len(names))
        if role is not None and binding.get("pack_id") == manifest.pack_id:
            return Member(role, folder, index)
    return Member(role, None, index) if role is not None else None


@dataclass(frozen=True)
class Expected:
    """What a manifest says about one of its containers, checked when it is opened."""

    manifest: str  # the manifest's path, named in errors
    bytes: int
    meta_crc32: int
    num_records: int
    fields: tuple[str, ...]
    pack: dict[str, Any] | None  # the binding it must hold; None for version 1 (0.1.0)
    what: str  # its place in the pack, named in errors: "shard 3", "the catalog"
    first_record: int = 0  # the pack's number of its first record

    @property
    def member(self) -> str:
        """For messages: ``shard 3 named by data/voc/manifest.json``."""
        return f"{self.what} named by {self.manifest}"

    def mismatch(self, path: str, what: str) -> CorruptFileError:
        """The error for the file at ``path`` differing from its manifest entry."""
        return CorruptFileError(
            f"{path} does not match {self.manifest}: {what}. A shard was swapped, renamed, "
            "copied from another pack or damaged; copy the pack again or re-pack it"
        )

    def check(
        self, path: str, fields: Sequence[str], num_records: int, pack: dict[str, Any] | None
    ) -> None:
        if tuple(fields) != self.fields:
            raise self.mismatch(path, "its fields differ from the manifest's")
        if num_records != self.num_records:
            raise self.mismatch(path, f"{num_records} records, not {self.num_records}")
        if pack != self.pack:
            raise self.mismatch(path, f"its pack binding is {pack}, the manifest's {self.pack}")
