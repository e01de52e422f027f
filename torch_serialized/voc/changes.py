"""Which packed ids changed in the source: the quick check of ``append_voc``.

``classify`` sorts every listed id (``source.plan``) against a pack: new ids, ids left alone,
ids whose files changed, ids no longer listed. Like rsync's quick check, a packed id's source
files are compared by size and modification time with the statistics the pack recorded
(``schema``, "Source statistics"); a file whose statistics differ, every file with
``checksum``, and every file of a pack that recorded none is read and compared by content
with the stored bytes (or the stored SHA-256 of a transformed image). This module never
imports torch.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import SourceDataError
from ..safeio import read_regular_file
from . import schema
from .reader import VOCPackReader
from .source import Job, load, reads, source_paths, stores_digest

__all__ = ["Verdict", "Plan", "classify", "compare"]

_FOLDERS = ("JPEGImages", "Annotations", "SegmentationClass", "SegmentationObject")
_FLAGS = (0, schema.HAS_ANNOTATION, schema.HAS_MASK, schema.HAS_OBJECT_MASK)
#: How many changed ids an error message names before it counts the rest.
_NAMED = 10
Stat = tuple[int, int]
#: (size, mtime_ns) of each of ``schema.SOURCE_FILES`` in turn: 8 integers
Stats = tuple[int, ...]
_ABSENT = (schema.ABSENT, 0)


@dataclass
class Verdict:
    """What ``compare`` found for one packed id: the files that changed (empty: unchanged),
    the files' statistics now, the source image's digest where one is kept, and how many files
    were read to find out."""

    changes: list[str]
    stats: Stats
    digest: bytes
    files_read: int = 0


@dataclass
class Plan:
    """Every listed id sorted out: records kept (record -> verdict), jobs to load (new ids,
    then changed ones to replace), ids dropped from the lists, and notes for the user."""

    kept: dict[int, Verdict]
    new: list[Job]
    replaced: list[Job]
    dropped: list[str]
    notes: list[str]
    order: Sequence[Job]  # every listed id's job, in layout order
    #: every listed id is packed and passed the quick check: no record or statistic to write
    current: bool = False

    @property
    def jobs(self) -> list[Job]:
        """Jobs to load, in layout order (as a full pack would write them)."""
        wanted = {job.id for job in (*self.new, *self.replaced)}
        return [job for job in self.order if job.id in wanted]


def classify(old: VOCPackReader, jobs: Sequence[Job], replace: bool, checksum: bool) -> Plan:
    """Sort ``jobs`` (every listed id) against the pack ``old``; raise ``SourceDataError``
    naming the changed ids unless ``replace``."""
    arrays = old.reader.arrays()
    names = schema.decode_ids(*old.id_table())
    record_of = {names[r]: r for r in old.live.tolist()}
    has_stats = old.meta.get("source_stats") == schema.SOURCE_STATS_VERSION
    sizes, mtimes = arrays.get(schema.SIZE_ARRAY), arrays.get(schema.MTIME_ARRAY)
    digests = arrays.get(schema.DIGEST_ARRAY)
    quick = has_stats and not checksum and sizes is not None and mtimes is not None
    stored_rows: list[Stats] = []
    if quick and sizes is not None and mtimes is not None:  # one pass, not one per id
        pairs = np.stack([sizes, mtimes], axis=2).reshape(len(sizes), -1)
        stored_rows = list(map(tuple, pairs.tolist()))
    kept: dict[int, Verdict] = {}
    new: list[Job] = []
    changed: list[tuple[Job, Verdict]] = []
    read = quick_kept = 0
    for job in jobs:
        record = record_of.get(job.id)
        if record is None:
            new.append(job)
            continue
        digest = bytes(digests[record]) if digests is not None else b""
        stored: Stats | None = None
        if quick:  # rsync's quick check, inline: most ids stop here
            stored = stored_rows[record]
            now = _quick_stats(job)
            if now == stored and now[0] >= 0 and not _lacks_required(job, now):
                kept[record] = Verdict([], now, digest)
                quick_kept += 1
                continue
        verdict = compare(old, record, job, stored, digest)
        read += verdict.files_read
        if verdict.changes is None:  # a required file is missing: load says it as a pack would
            new.append(job)
        elif verdict.changes:
            changed.append((job, verdict))
        else:
            kept[record] = verdict
    if changed and not replace:
        raise SourceDataError(_changed_message(old.path, changed))
    listed = {job.id for job in jobs}
    notes = []
    if not has_stats:
        notes.append(
            f"{old.path} was packed before source statistics were kept: every packed id was "
            f"compared by content ({read} files read); they are recorded now, so the next "
            "append compares sizes and times only"
        )
    return Plan(
        kept=kept,
        new=new,
        replaced=[job for job, _ in changed],
        dropped=[i for i in record_of if i not in listed],
        notes=notes,
        order=jobs,
        current=quick_kept == len(record_of) == len(listed),
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
    the stored bytes (or the stored digest of a transformed image). ``changes`` is ``None``
    when a file the id needs is missing now."""
    paths = source_paths(job)
    wanted = reads(job)
    required = (True, job.needs_annotation, job.needs_mask, False)
    flags = int(old.columns[record]["flags"])
    now = [_stat(p) if w else _ABSENT for p, w in zip(paths, wanted)]
    verdict = Verdict([], tuple(x for pair in now for x in pair), digest)
    before = [stored[2 * k : 2 * k + 2] for k in range(len(now))] if stored else None
    for k, (path, (size, _)) in enumerate(zip(paths, now)):
        if size == schema.ABSENT and required[k]:
            verdict.changes = None  # type: ignore[assignment]
            return verdict
        if before is not None and before[k] == now[k]:
            continue
        had = k == 0 or bool(flags & _FLAGS[k])
        name = f"{_FOLDERS[k]}/{os.path.basename(path)}"
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
    return verdict


def _same_content(
    old: VOCPackReader, record: int, job: Job, k: int, data: bytes, verdict: Verdict
) -> bool:
    """Whether ``data`` (source file ``k`` of ``job``, now) is what ``record`` was made from."""
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


def _quick_stats(job: Job) -> Stats:
    """``_stat`` of each file ``load`` would read for ``job`` (``reads``), ``(ABSENT, 0)``
    for the others, flat: the quick check's only system calls."""
    voc, name, listed = job.voc_root, job.id, job.listed_in_folders
    sep = os.sep
    return (
        *_stat(f"{voc}{sep}JPEGImages{sep}{name}.jpg"),
        *(
            _stat(f"{voc}{sep}Annotations{sep}{name}.xml")
            if job.needs_annotation or "Annotations" in listed
            else _ABSENT
        ),
        *(
            _stat(f"{voc}{sep}SegmentationClass{sep}{name}.png")
            if job.needs_mask or "SegmentationClass" in listed
            else _ABSENT
        ),
        *(
            _stat(f"{voc}{sep}SegmentationObject{sep}{name}.png")
            if "SegmentationObject" in listed
            else _ABSENT
        ),
    )


def _lacks_required(job: Job, now: Stats) -> bool:
    """Whether a file ``job``'s lists require (annotation for Main, mask for Segmentation) is
    missing: then ``load`` must say so, as a full pack would."""
    return (job.needs_annotation and now[2] == schema.ABSENT) or (
        job.needs_mask and now[4] == schema.ABSENT
    )


def _stat(path: str) -> Stat:
    """``(size, mtime_ns)`` of a regular file, ``(ABSENT, 0)`` when it is not there; anything
    that is not a regular file counts as changed (``load`` then says what it is)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return _ABSENT
    if st.st_mode & 0o170000 != stat.S_IFREG:
        return -2, 0  # never equal to stored statistics, never absent
    return st.st_size, st.st_mtime_ns


def _changed_message(pack: str, changed: Sequence[tuple[Job, Verdict]]) -> str:
    named = "; ".join(f"{job.id!r} ({', '.join(v.changes)})" for job, v in changed[:_NAMED])
    more = f" and {len(changed) - _NAMED} more" if len(changed) > _NAMED else ""
    return (
        f"{pack}: {len(changed)} packed ids changed in the source since they were packed: "
        f"{named}{more}. Pass replace_changed=True (--replace-changed) to store their new "
        "versions (the old records are retired), or re-pack the dataset"
    )
