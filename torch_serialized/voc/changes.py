"""Which packed ids changed in the source: ``append_voc``'s quick check. As rsync's, source files
are compared by size and mtime with the pack's statistics, as arrays; those that differ (all,
with ``checksum``) by content. Only those ids and new ones get a ``Job``. No torch."""

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
from .source import Job, Planned, source_paths

__all__ = ["Plan", "classify", "compare"]

_NAMED = 10  #: How many changed ids an error message names before it counts the rest.


@dataclass
class Plan:
    """Every listed id sorted against a pack."""

    kept: np.ndarray  # record numbers of the old pack left alone, ascending
    stats: np.ndarray  # int64 [len(pack), 4, 2]: the kept records' source statistics now
    digests: np.ndarray | None  # uint8 [len(pack), 32]: the pack's image digests, if any
    replaced: list[Job]  # the changed ids, stored again
    dropped: list[str]  # the ids no longer listed
    jobs: list[Job]  # to load, in layout order: new ids and changed ones
    #: the ids among ``jobs`` the pack holds already: their old records are retired whatever
    #: the load gives, so one that ``on_error="skip"`` leaves out is retired, not replaced
    reloading: list[str] = field(default_factory=list)
    current: bool = False  # every listed id is packed and unchanged: nothing to write


def classify(
    old: VOCPackReader, planned: Planned, replace: bool, checksum: bool, retire_all: bool
) -> Plan:
    """Sort the listed ids of ``planned`` against ``old``. ``SourceDataError`` for changed
    ids unless ``replace``, and for no listed id in the pack unless ``retire_all``."""
    arrays = old.reader.arrays()
    names = schema.decode_ids(*old.id_table())
    record_of = {names[r]: r for r in old.live.tolist()}
    records = np.fromiter(
        (record_of.get(i, -1) for i in planned.ids), dtype=np.int64, count=len(planned)
    )
    packed = np.flatnonzero(records >= 0)
    if record_of and not len(packed) and not retire_all:
        raise SourceDataError(
            f"{planned.voc_root}: none of the {len(record_of)} ids of {old.name} is in this "
            "folder's image sets, so appending would retire every sample of the pack. Check "
            "that this is the folder the pack was made from; if the pack should now hold only "
            "this folder's samples, pass retire_all=True (`--retire-all`), or pack it anew"
        )
    chosen = records[packed]
    files, needs = planned.reads(packed.tolist())
    now = _quick_stats(planned, packed, files)
    reload = (  # a file the lists require is missing: load says so, as a full pack would
        (now[:, 0, 0] == schema.ABSENT)
        | (needs[:, 0] & (now[:, 1, 0] == schema.ABSENT))
        | (needs[:, 1] & (now[:, 2, 0] == schema.ABSENT))
    )
    unparsed = (old.columns["flags"][chosen] & schema.UNPARSED_ANNOTATION) != 0
    before = np.stack([arrays[schema.SIZE_ARRAY], arrays[schema.MTIME_ARRAY]], axis=2)[chosen]
    same = (now == before).all(axis=(1, 2)) & (now[:, 0, 0] >= 0) & (not checksum)
    passed = same & ~reload & ~(needs[:, 0] & unparsed)
    stored_digests = arrays.get(schema.DIGEST_ARRAY)
    stats = _absent(len(old))
    stats[chosen[passed]] = now[passed]
    kept = chosen[passed].tolist()
    new = [*np.flatnonzero(records < 0).tolist(), *packed[reload].tolist()]  # positions
    changed: list[tuple[int, Job, list[str]]] = []
    compared = np.flatnonzero(~passed & ~reload)  # compared by content if need be
    made = dict(zip(packed[compared].tolist(), planned.jobs(packed[compared].tolist())))
    for i, (position, job) in zip(compared.tolist(), made.items()):
        record = int(chosen[i])
        digest = bytes(stored_digests[record]) if stored_digests is not None else b""
        changes = compare(old, record, job, now[i], None if checksum else before[i], digest)
        if changes is None:
            new.append(position)
        elif changes:
            changed.append((position, job, changes))
        else:
            kept.append(record)
            stats[record] = now[i]
    listed = set(planned.ids)
    dropped = [i for i in record_of if i not in listed]
    if changed and not replace:
        raise SourceDataError(_changed_message(old.name, changed, len(dropped), len(record_of)))
    loads = sorted([*new, *(p for p, _, _ in changed)])
    jobs = [made[p] if p in made else planned.job(p) for p in loads]
    return Plan(
        kept=np.array(sorted(kept), dtype=np.int64),
        stats=stats,
        digests=stored_digests,
        replaced=[job for _, job, _ in changed],
        dropped=dropped,
        jobs=jobs,
        current=int(passed.sum()) == len(record_of) == len(planned),
        reloading=[job.id for p, job in zip(loads, jobs) if records[p] >= 0],
    )


def compare(
    old: VOCPackReader,
    record: int,
    job: Job,
    now: np.ndarray,
    before: np.ndarray | None,
    digest: bytes,
) -> list[str] | None:
    """How ``job``'s source files differ from ``record`` (empty: unchanged; ``None``:
    unchanged but its unparsed annotation is now needed, so it loads as new). ``now``/``before``:
    statistics (``before=None``: compare all by content); ``digest``: a transformed image's."""
    flags = int(old.columns[record]["flags"])
    changes: list[str] = []
    for k, path in enumerate(source_paths(job)):
        size = int(now[k, 0])
        if before is not None and (before[k] == now[k]).all():
            continue
        had = k == 0 or bool(flags & schema.SOURCE_FLAGS[k])
        name = f"{schema.SOURCE_FOLDERS[k]}/{os.path.basename(path)}"
        if size == schema.ABSENT:
            if had:
                changes.append(f"{name} was removed")
            continue
        if not had:
            changes.append(f"{name} was added")
            continue
        data = read_regular_file(path, job.max_file_bytes, "the file")
        if _same_content(old, record, job, k, data, digest):
            continue
        if before is not None and before[k, 0] != size:
            changes.append(f"{name} changed size ({before[k, 0]} -> {size} bytes)")
        else:
            changes.append(f"{name} changed content")
    if not changes and job.needs_annotation and flags & schema.UNPARSED_ANNOTATION:
        return None
    return changes


def _same_content(
    old: VOCPackReader, record: int, job: Job, k: int, data: bytes, digest: bytes
) -> bool:
    """Whether ``data`` (``job``'s source file ``k``, now) is what ``record`` was made of."""
    if k in (schema.MASK, schema.OBJECT_MASK) and job.options.max_size:
        # stored resized: compare pixels and palette, not PNG bytes another Pillow may differ in
        paths = source_paths(job)
        image = read_regular_file(paths[0], job.max_file_bytes, "the image")
        scale = image_scale(image, paths[0], job.options)  # its header: nothing decoded
        stored = old.field(record, k)
        return same_mask(stored, data if scale is None else resize_mask(data, paths[k], scale))
    if k == schema.IMAGE and job.options.transformed:
        return digest == hashlib.sha256(data).digest()  # the digest kept at pack time
    return old.field(record, k) == data  # stored as the file's own bytes


def _absent(n: int) -> np.ndarray:
    """int64 ``[n, 4, 2]`` statistics of absent files."""
    out = np.zeros((n, len(schema.SOURCE_FILES), 2), dtype=np.int64)
    out[:, :, 0] = schema.ABSENT
    return out


def _quick_stats(planned: Planned, positions: np.ndarray, files: np.ndarray) -> np.ndarray:
    """``_stat`` per file ``files`` marks: ``[n, 4, 2]``, one ``stat`` each, folders opened once."""
    out = _absent(len(positions))
    for k, (folder, ext) in enumerate(zip(schema.SOURCE_FOLDERS, schema.SOURCE_EXTENSIONS)):
        rows = np.flatnonzero(files[:, k])
        if not rows.size:
            continue
        try:
            path = os.path.join(planned.voc_root, folder)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            continue  # no folder: no file
        try:
            out[rows, k] = [_stat(planned.ids[p] + ext, fd) for p in positions[rows].tolist()]
        finally:
            os.close(fd)
    return out


def _stat(name: str, folder: int) -> tuple[int, int]:
    """``(size, mtime_ns)`` of regular file ``name`` in ``folder``; ``(ABSENT, 0)`` if missing."""
    try:
        st = os.stat(name, dir_fd=folder)
    except (FileNotFoundError, NotADirectoryError):
        return schema.ABSENT, 0
    if not stat.S_ISREG(st.st_mode):
        return -2, 0  # never equal to stored statistics, never absent
    return st.st_size, st.st_mtime_ns


def _changed_message(
    pack: str, changed: Sequence[tuple[int, Job, list[str]]], unlisted: int, live: int
) -> str:
    """The refusal of changed ids, naming the ``unlisted`` ids the append would retire too:
    another dataset overlapping a few ids looks like a few changed ids."""
    named = "; ".join(f"{job.id!r} ({', '.join(v)})" for _, job, v in changed[:_NAMED])
    more = f" and {len(changed) - _NAMED} more" if len(changed) > _NAMED else ""
    check = ": check that this is the folder the pack was made from" if 2 * unlisted > live else ""
    retiring = (
        f" It would also retire {unlisted} of the pack's {live} ids{check}." if unlisted else ""
    )
    return (
        f"{pack}: {len(changed)} packed ids changed since they were packed: {named}{more}. "
        "Pass replace_changed=True (--replace-changed) to store their new versions, or re-pack."
        f"{retiring}"
    )
