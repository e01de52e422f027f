"""What a pack holds and whether it is intact: ``info(path)`` and ``verify(path)``, dataclasses
the command line prints (``info --json`` is their ``asdict``). One shard or catalog file of a
folder is no pack: ``info`` refuses it, ``part_info`` says where it belongs."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Mapping
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .container.manifest import Member, member_of, read_binding
from .container.reader import ContainerReader
from .container.shards import PackReader
from .errors import ChecksumError, FormatError, TorchSerializedError
from .remote.store import is_url
from .voc import schema
from .voc.checks import check_record_fields, check_voc_pack
from .voc.packed import VOCPackReader


@dataclass(frozen=True)
class ShardInfo:
    """One shard: records stored, samples shown (retired records are not), bytes on disk."""

    file: str
    records: int
    samples: int
    bytes: int


@dataclass(frozen=True)
class PackInfo:
    """What a pack holds (``info``). Ranges are ``{"min", "max"}`` dicts (``None`` if empty),
    ``objects_per_image`` with a ``"mean"``; ``common_sizes``: the five most common ``[width,
    height, count]``; ``classes``: objects per class in the samples, most common first."""

    path: str
    cached_in: str | None  #: for a pack at a URL, where the cache holds it (else None)
    format_version: str
    schema: str
    packed_by: str | None
    year: str
    base_dir: str
    options: dict[str, Any]
    num_samples: int
    retired: int  #: records appends replaced or dropped (bytes stay until the next full pack)
    with_annotation: int
    with_mask: int
    with_object_mask: int
    with_untyped_objects: int
    with_unparsed_annotation: int
    image_sets: dict[str, dict[str, int]]  #: task ("Main", ...) -> image set -> number of ids
    classes: dict[str, int]
    class_counts: dict[str, Any]
    num_objects: int
    objects_per_image: dict[str, Any]
    width: dict[str, Any]
    height: dict[str, Any]
    common_sizes: list[list[int]]
    bytes: int
    source_bytes: int | None
    sharded: bool
    shards: list[ShardInfo]
    skipped: list[Any]
    history: list[dict[str, Any]]  #: every pack and append of the pack, oldest first


def info(
    path: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit_bytes: int | None = None,
) -> PackInfo:
    """Describe the pack at ``path`` (a ``.tser`` file, a shard folder, or a URL read through
    the cache as the datasets read it) from its catalog alone: no shard is read."""
    remote: dict[str, Any] = dict(
        storage_options=storage_options, cache_dir=cache_dir, cache_limit_bytes=cache_limit_bytes
    )
    pack = VOCPackReader(path, **remote)
    reader, meta = pack.reader, pack.meta
    live = pack.live  # records an append retired are not samples
    columns = pack.columns[live]
    flags = columns["flags"].astype(np.int64)
    classes, counts = pack.object_classes()  # the catalog's class id of every object
    alive = np.isin(np.arange(len(pack)), pack.retired, invert=True)
    per_class = np.bincount(classes[np.repeat(alive, counts)], minlength=len(pack.classes))
    histogram = Counter({pack.classes[c]: int(n) for c, n in enumerate(per_class.tolist()) if n})
    sizes = Counter(zip(columns["width"].tolist(), columns["height"].tolist()))
    num_objects = columns["num_objects"]
    samples = np.diff(np.searchsorted(live, reader.starts)).tolist()
    major, minor = reader.version

    def count(flag: int) -> int:
        return int(np.count_nonzero(flags & flag))

    return PackInfo(
        path=reader.name,
        cached_in=reader.path if reader.url else None,
        format_version=f"{major}.{minor}",
        schema=f"{meta.get('schema')} {meta.get('schema_version')}",
        packed_by=meta.get("packed_by"),
        year=pack.year,
        base_dir=pack.base_dir,
        options={
            "image_storage": pack.image_storage,
            "max_size": meta.get("max_size"),
            **meta.get("options", {}),
        },
        num_samples=len(live),
        retired=len(pack) - len(live),
        with_annotation=count(schema.HAS_ANNOTATION),
        with_mask=count(schema.HAS_MASK),
        with_object_mask=count(schema.HAS_OBJECT_MASK),
        with_untyped_objects=count(schema.UNTYPED_OBJECTS),
        with_unparsed_annotation=count(schema.UNPARSED_ANNOTATION),
        image_sets=meta.get("splits", {}),
        classes=dict(histogram.most_common()),
        class_counts=meta.get("class_counts", {}),
        num_objects=int(num_objects.sum()),
        objects_per_image=_range(num_objects, mean=True),
        width=_range(columns["width"]),
        height=_range(columns["height"]),
        common_sizes=[[w, h, n] for (w, h), n in sizes.most_common(5)],
        bytes=reader.nbytes,
        source_bytes=meta.get("source_bytes"),
        sharded=reader.manifest is not None,
        shards=[
            ShardInfo(entry.file, entry.num_records, n, entry.bytes)
            for entry, n in zip(reader.entries, samples)
        ],
        skipped=meta.get("skipped", []),
        history=meta.get("history", []),
    )


def _range(values: np.ndarray, *, mean: bool = False) -> dict[str, Any]:
    if values.size == 0:
        return {"min": None, "max": None, **({"mean": None} if mean else {})}
    out: dict[str, Any] = {"min": int(values.min()), "max": int(values.max())}
    if mean:
        out["mean"] = round(float(values.mean()), 3)
    return out


@dataclass(frozen=True)
class PartInfo:
    """One shard or catalog file of a shard folder (``part_info``) and the pack it belongs to."""

    path: str
    member: Member  #: as what, of which folder; ``str(member)`` says so, e.g. "shard 2 of 3 of ..."
    records: int
    bytes: int


def part_info(path: str | os.PathLike[str]) -> PartInfo | None:
    """What local file ``path`` is if a shard or catalog of a shard folder (no pack), else None."""
    if is_url(os.fspath(path)) or not os.path.isfile(path):
        return None
    member = member_of(path, read_binding(path))
    if member is None:
        return None
    with closing(ContainerReader(path)) as reader:
        return PartInfo(os.fspath(path), member, len(reader), os.path.getsize(path))


@dataclass(frozen=True)
class DamagedRecord:
    """A record whose stored bytes fail their checksum (``verify``)."""

    record: int
    id: str | None  # its image id, when the pack is a readable VOC pack
    shard: str  # the file holding it
    local: int  # its number within that file
    fields: list[str]  # the fields that fail


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` found. ``ok``: every check passed."""

    path: str
    records: int
    num_shards: int
    sharded: bool
    checksums: int  #: field checksums checked (records times fields)
    bytes: int
    seconds: float
    voc: bool  #: VOC metadata checked too (a VOC pack, not one file of a folder)
    part: str | None = None  #: if ``path`` is one shard or catalog of a folder: what it is
    folder: str | None = None  #: ... and the folder to verify for the whole pack (or None)
    voc_error: str | None = None  #: why every VOC reader refuses the pack, though bytes check
    damaged_shards: list[str] = field(default_factory=list)  #: why each bad shard fails
    damaged_records: list[DamagedRecord] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.damaged_records and not self.damaged_shards and self.voc_error is None


def verify(
    path: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit_bytes: int | None = None,
) -> VerifyReport:
    """Check the pack at ``path`` (a URL: via the cache): header, footer, metadata, index, arrays,
    VOC metadata, every field checksum. Damage is reported; what cannot be opened raises."""
    remote: dict[str, Any] = dict(
        storage_options=storage_options, cache_dir=cache_dir, cache_limit_bytes=cache_limit_bytes
    )
    started = time.perf_counter()
    # header, footer, metadata, index and arrays; each shard's columns against its fields
    reader = PackReader(path, check_records=check_record_fields, **remote)
    # one file of a shard folder (a shard, a catalog, one kept for readers) is no VOC pack
    member = None if reader.manifest is not None else member_of(reader.name, reader.binding)
    voc = reader.user.get("schema") == schema.SCHEMA and member is None
    voc_error = None
    if voc:
        try:
            check_voc_pack(reader)
        except FormatError as exc:
            voc_error = str(exc)
    bad: list[int] = []
    bad_shards: list[str] = []
    for s, start in enumerate(reader.starts[:-1].tolist()):
        try:
            shard = reader.shard(s)
        except (TorchSerializedError, OSError) as exc:
            bad_shards.append(describe_error(exc))
            continue
        bad.extend(start + i for i in shard.verify())
    seconds = time.perf_counter() - started
    damaged = []
    if bad:  # which fields fail, and the id when the pack reads as a VOC pack
        checked = PackReader(path, checked=True, **remote)
        named = voc and voc_error is None  # ids checked by check_voc_pack
        damaged = [_damaged(reader, checked, named, record) for record in bad]
    return VerifyReport(
        path=reader.name,
        records=len(reader),
        num_shards=reader.num_shards,
        sharded=reader.manifest is not None,
        checksums=len(reader) * len(reader.fields),
        bytes=reader.nbytes,
        seconds=seconds,
        voc=voc,
        part=None if member is None else str(member),
        folder=None if member is None else member.folder,
        voc_error=voc_error,
        damaged_shards=bad_shards,
        damaged_records=damaged,
    )


def _damaged(reader: PackReader, checked: PackReader, named: bool, record: int) -> DamagedRecord:
    """A damaged record: the fields that fail (read ``checked``), its id if ``named``, its file."""
    failing = []
    for k, name in enumerate(reader.fields):
        try:
            checked.field(record, k)
        except ChecksumError:
            failing.append(name)
    arrays = reader.arrays()
    image_id = schema.decode_id(arrays["ids"], arrays["id_offsets"], record) if named else None
    shard, local = reader.locate(record)
    return DamagedRecord(record, image_id, os.path.basename(shard.path), local, failing)


def describe_error(exc: BaseException) -> str:
    """The message of an error, without ``[Errno N]`` and with the file an OSError names."""
    if isinstance(exc, OSError) and exc.strerror:
        if exc.filename is not None and str(exc.filename) not in exc.strerror:
            return f"{exc.filename}: {exc.strerror}"
        return exc.strerror
    return str(exc) or type(exc).__name__
