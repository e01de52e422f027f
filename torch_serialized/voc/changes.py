"""Which packed ids changed in the source: the quick check of ``append_voc``.

``classify`` sorts every listed id (``source.survey``) against a pack: new ids, ids left
alone, ids whose files changed, ids no longer listed. Like rsync's quick check, a packed id's
source files are compared by size and modification time with the statistics the pack
recorded (``schema``, "Source statistics"): one ``stat`` per file, relative to its folder, all
compared at once as arrays, no per-id object. A file whose statistics differ, every file with
``checksum``, and every file of a pack that recorded none is read and compared by content
with the stored bytes (or the stored SHA-256 of a transformed image); only those ids and the
new ones get a ``Job``. This module never imports torch.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..container.fileio import read_regular_file
from ..errors import SourceDataError
from . import schema
from .images import image_scale, resize_mask, same_mask
from .packed import VOCPackReader
from .source import Job, Planned, load, reads, source_paths, stores_digest

__all__ = ["Verdict", "Plan", "classify", "compare"]

#: How many changed ids an error message names before it counts the rest.
_NAMED = 10
Stat = tuple[int, int]
#: (size, mtime_ns) of each of ``schema.SOURCE_FILES`` in turn: 8 integers
Stats = tuple[int, ...]
_ABSENT = (schema.ABSENT, 0)


@dataclass
class Verdict:
    """What ``compare`` found for one packed id: the files that changed (empty: unchanged),
    the files' statistics now, the source image's digest where one is kept, how many files
    were read to find out, and whether the id must be loaded as if new instead (``load`` then
    raises, naming the file, as a full pack would)."""

    changes: list[str]
    stats: Stats
    digest: bytes
    files_read: int = 0
    reload: bool = False


@dataclass
class Plan:
    """Every listed id sorted out: records kept (their numbers, and the statistics and
    digests to record for them), jobs to load (new ids and changed ones to replace, the
    changed ones also in ``replaced``), ids dropped from the lists, and notes for the user."""

    kept: np.ndarray  # record numbers of the old pack left alone, ascending
    #: int64 ``[len(pack), 4, 2]``: size and mtime_ns of each source file of each kept record
    #: now (``ABSENT, 0`` for the other records)
    stats: np.ndarray
    #: uint8 ``[len(pack), 32]``: each kept record's source image digest (zeros: not known),
    #: or ``None`` where the pack keeps none and none was learnt
    digests: np.ndarray | None
    replaced: list[Job]
    dropped: list[str]
    notes: list[str]
    jobs: list[Job]  # jobs to load, in layout order (as a full pack would write them)
    #: the ids among ``jobs`` that the pack holds already (changed, or loaded again): their
    #: old records are retired whatever the load gives, so one that ``on_error="skip"``
    #: leaves out is retired, not replaced
    reloading: list[str] = field(default_factory=list)
    #: every listed id is packed and passed the quick check: no record or statistic to write
    current: bool = False


def classify(
    old: VOCPackReader, planned: Planned, replace: bool, checksum: bool, retire_all: bool = False
) -> Plan:
    """Sort the ids of ``planned`` (every listed id) against the pack ``old``; raise
    ``SourceDataError`` naming the changed ids unless ``replace``, and if no listed id is in
    the pack (every sample would be retired) unless ``retire_all``.

    Jobs are made only for ids that are new or fail the quick check; the quick check stats
    each file an id's load would read, relative to its folder, once, and compares them all
    with the pack's statistics at once."""
    arrays = old.reader.arrays()
    names = schema.decode_ids(*old.id_table())
    live = old.live.tolist()
    record_of = {names[r]: r for r in live}
    # with source_stats, the pack holds the statistics (check_voc_pack): rsync's quick check
    has_stats = old.meta.get("source_stats") == schema.SOURCE_STATS_VERSION
    stored_digests = arrays.get(schema.DIGEST_ARRAY)
    records = np.fromiter(
        (record_of.get(i, -1) for i in planned.ids), dtype=np.int64, count=len(planned)
    )
    packed = np.flatnonzero(records >= 0)
    if live and not len(packed) and not retire_all:
        raise SourceDataError(
            f"{planned.voc_root}: none of the {len(live)} ids of {old.name} is in this "
            "folder's image sets, so appending would retire every sample of the pack. Check "
            "that this is the folder the pack was made from; if the pack should now hold only "
            "this folder's samples, pass retire_all=True (`--retire-all`), or pack it anew"
        )
    stats = np.zeros((len(old), len(schema.SOURCE_FILES), 2), dtype=np.int64)
    stats[:, :, 0] = schema.ABSENT
    digests = None if stored_digests is None else np.zeros((len(old), 32), dtype=np.uint8)
    passed = np.zeros(len(packed), dtype=bool)
    pairs = None  # the pack's statistics, [len(pack), 4, 2]
    if has_stats and not checksum:
        pairs = np.stack([arrays[schema.SIZE_ARRAY], arrays[schema.MTIME_ARRAY]], axis=2)
        files, needs = planned.reads(packed.tolist())
        now = _quick_stats(planned, packed, files)
        chosen = records[packed]
        unparsed = (old.columns["flags"][chosen] & schema.UNPARSED_ANNOTATION) != 0
        lacks = (
            (needs[:, 0] & (now[:, 1, 0] == schema.ABSENT))
            | (needs[:, 1] & (now[:, 2, 0] == schema.ABSENT))
            | (needs[:, 0] & unparsed)
        )  # a file the lists require is missing or unparsed: load must say so, as a pack would
        passed = (now == pairs[chosen]).all(axis=(1, 2)) & (now[:, 0, 0] >= 0) & ~lacks
        stats[chosen[passed]] = now[passed]
        if digests is not None and stored_digests is not None:
            digests[chosen[passed]] = stored_digests[chosen[passed]]
    kept = records[packed[passed]].tolist()
    new = np.flatnonzero(records < 0).tolist()  # positions in planned
    changed: list[tuple[int, Job, Verdict]] = []
    read = 0
    made: dict[int, Job] = {}  # position -> the job made to compare it
    for position in packed[~passed].tolist():  # compared file by file, by content if need be
        record = int(records[position])
        job = made[position] = planned.job(position)
        digest = bytes(stored_digests[record]) if stored_digests is not None else b""
        before = None if pairs is None else tuple(pairs[record].ravel().tolist())
        verdict = compare(old, record, job, before, digest)
        read += verdict.files_read
        if verdict.reload:  # a required file is missing or unparsed: load says it
            new.append(position)
        elif verdict.changes:
            changed.append((position, job, verdict))
        else:
            kept.append(record)
            stats[record] = np.array(verdict.stats, dtype=np.int64).reshape(-1, 2)
            if any(verdict.digest):
                if digests is None:
                    digests = np.zeros((len(old), 32), dtype=np.uint8)
                digests[record] = np.frombuffer(verdict.digest, dtype=np.uint8)
    listed = set(planned.ids)
    if changed and not replace:
        unlisted = sum(1 for i in record_of if i not in listed)
        raise SourceDataError(
            _changed_message(old.name, [(j, v) for _, j, v in changed], unlisted, len(live))
        )
    notes = []
    if not has_stats:
        notes.append(
            f"{old.name} was packed before source statistics were kept: every packed id was "
            f"compared by content ({read} files read); they are recorded now, so the next "
            "append compares sizes and times only"
        )
    loads = sorted([*new, *(p for p, _, _ in changed)])
    jobs = [made[p] if p in made else planned.job(p) for p in loads]
    return Plan(
        kept=np.array(sorted(kept), dtype=np.int64),
        stats=stats,
        digests=digests,
        replaced=[job for _, job, _ in changed],
        dropped=[i for i in record_of if i not in listed],
        notes=notes,
        jobs=jobs,
        current=int(passed.sum()) == len(record_of) == len(planned),
        reloading=[job.id for p, job in zip(loads, jobs) if records[p] >= 0],
    )


def compare(
    old: VOCPackReader,
    record: int,
    job: Job,
    stored: Stats | None,
    digest: bytes,
) -> Verdict:
    """Whether the source files of ``job`` are what ``record`` holds. ``stored``: their
    statistics at pack time (``None``: compare every file by content). A file whose size and
    time match is taken as unchanged without reading it; any other is read and compared with
    the stored bytes (or the stored digest of a transformed image). ``reload`` is set when a
    file the id needs is missing now, or when the id is now in an ``ImageSets/Main`` list and
    its annotation, which did not parse when it was packed, is unchanged."""
    paths = source_paths(job)
    wanted = reads(job)
    required = (True, job.needs_annotation, job.needs_mask, False)
    flags = int(old.columns[record]["flags"])
    now = [_stat(p) if w else _ABSENT for p, w in zip(paths, wanted)]
    verdict = Verdict([], tuple(x for pair in now for x in pair), digest)
    before = [stored[2 * k : 2 * k + 2] for k in range(len(now))] if stored else None
    for k, (path, (size, _)) in enumerate(zip(paths, now)):
        if size == schema.ABSENT and required[k]:
            verdict.reload = True
            return verdict
        if before is not None and before[k] == now[k]:
            continue
        had = k == 0 or bool(flags & schema.SOURCE_FLAGS[k])
        name = f"{schema.SOURCE_FOLDERS[k]}/{os.path.basename(path)}"
        if size == schema.ABSENT:
            if had:
                verdict.changes.append(f"{name} was removed")
            continue
        if not had:
            verdict.changes.append(f"{name} was added")
            continue
        verdict.files_read += 1
        data = read_regular_file(path, job.max_file_bytes, "the file")
        if _same_content(old, record, job, k, data, verdict):
            continue
        if before is not None and before[k][0] != size:
            verdict.changes.append(f"{name} changed size ({before[k][0]} -> {size} bytes)")
        else:
            verdict.changes.append(f"{name} changed content")
    if not verdict.changes and job.needs_annotation and flags & schema.UNPARSED_ANNOTATION:
        verdict.reload = True
    return verdict


def _same_content(
    old: VOCPackReader, record: int, job: Job, k: int, data: bytes, verdict: Verdict
) -> bool:
    """Whether ``data`` (source file ``k`` of ``job``, now) is what ``record`` was made from."""
    if k in (schema.MASK, schema.OBJECT_MASK) and job.options.max_size:
        # masks of resized images are stored resized: compared, as pixels and palette (not
        # PNG bytes, which another Pillow may encode otherwise), with what packing stores
        # now; a pack from before masks were resized stored the file's own bytes
        stored = old.field(record, k)
        if stored == data:
            return True
        paths = source_paths(job)
        image_path, path = paths[0], paths[k]
        image = read_regular_file(image_path, job.max_file_bytes, "the image")
        verdict.files_read += 1
        scale = image_scale(image, image_path, job.options)  # its header: nothing decoded
        return same_mask(stored, data if scale is None else resize_mask(data, path, scale))
    if k != schema.IMAGE or not stores_digest(job.options):
        return old.field(record, k) == data  # stored as the file's own bytes
    now = hashlib.sha256(data).digest()
    if any(verdict.digest):  # the digest kept at pack time
        return verdict.digest == now
    # a pack written before digests were kept: store the image again and compare the results
    loaded = load(job)
    same = old.field(record, k) == loaded.payloads[schema.IMAGE]
    if same:
        verdict.digest = now
    return same


def _quick_stats(planned: Planned, positions: np.ndarray, files: np.ndarray) -> np.ndarray:
    """``_stat`` of each file ``load`` would read (``files``: ``Planned.reads``) for the ids
    at ``positions``, ``(ABSENT, 0)`` for the others: int64 ``[len(positions), 4, 2]``. The
    quick check's only system calls: one ``stat`` per file, relative to its folder opened
    once (no path walk per file)."""
    out = np.zeros((len(positions), len(schema.SOURCE_FILES), 2), dtype=np.int64)
    out[:, :, 0] = schema.ABSENT
    ids = planned.ids
    for k, (folder, ext) in enumerate(zip(schema.SOURCE_FOLDERS, schema.SOURCE_EXTENSIONS)):
        rows = np.flatnonzero(files[:, k])
        if rows.size:
            wanted = [ids[p] + ext for p in positions[rows].tolist()]
            out[rows, k] = _stat_in(os.path.join(planned.voc_root, folder), wanted)
    return out


def _stat_in(folder: str, names: Sequence[str]) -> np.ndarray:
    """``_stat`` of each of ``names`` in ``folder``: int64 ``[len(names), 2]``."""
    out = np.zeros((len(names), 2), dtype=np.int64)
    out[:, 0] = schema.ABSENT
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return out  # no folder: no file
    try:
        out[:] = [_stat(name, fd) for name in names]
    finally:
        os.close(fd)
    return out


def _stat(path: str, folder: int | None = None) -> Stat:
    """``(size, mtime_ns)`` of a regular file (``path`` relative to the open folder ``folder``
    if given), ``(ABSENT, 0)`` when it is not there; anything that is not a regular file counts
    as changed (``load`` then says what it is)."""
    try:
        st = os.stat(path, dir_fd=folder)
    except (FileNotFoundError, NotADirectoryError):
        return _ABSENT
    if st.st_mode & 0o170000 != stat.S_IFREG:
        return -2, 0  # never equal to stored statistics, never absent
    return st.st_size, st.st_mtime_ns


def _changed_message(
    pack: str, changed: Sequence[tuple[Job, Verdict]], unlisted: int, live: int
) -> str:
    """The refusal of changed ids; ``unlisted`` of the pack's ``live`` ids are in no list any
    more, which the same append would retire: said too, so that following the advice to
    replace the changed ones never retires most of a pack unannounced (another dataset whose
    ids happen to overlap a few of the pack's looks like a few changed ids)."""
    named = "; ".join(f"{job.id!r} ({', '.join(v.changes)})" for job, v in changed[:_NAMED])
    more = f" and {len(changed) - _NAMED} more" if len(changed) > _NAMED else ""
    retiring = ""
    if unlisted:
        retiring = (
            f" The same append would also retire {unlisted} of the pack's {live} ids, which "
            "this folder's lists no longer name"
            + (
                ": check that this is the folder the pack was made from."
                if 2 * unlisted > live
                else "."
            )
        )
    return (
        f"{pack}: {len(changed)} packed ids changed in the source since they were packed: "
        f"{named}{more}. Pass replace_changed=True (--replace-changed) to store their new "
        f"versions (the old records are retired), or re-pack the dataset.{retiring}"
    )
