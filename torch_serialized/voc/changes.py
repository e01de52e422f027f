"""Which packed ids changed in the source: the quick check of ``append_voc``.

Like rsync's quick check, each packed id's source files are compared by size and mtime with
the statistics the pack recorded (``schema``, "Source statistics"), all at once as arrays.
Files whose statistics differ, and every file with ``checksum``, are compared by content with
the stored bytes (or the stored SHA-256 of a transformed image); only those ids and the new ones
get a ``Job``. Never imports torch.
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
from .source import Job, Planned, source_paths, stores_digest

__all__ = ["Plan", "classify", "compare"]

#: How many changed ids an error message names before it counts the rest.
_NAMED = 10


@dataclass
class Plan:
    """Every listed id sorted against a pack, and notes for the user."""

    kept: np.ndarray  # record numbers of the old pack left alone, ascending
    #: int64 ``[len(pack), 4, 2]``: the kept records' source file statistics now
    stats: np.ndarray
    #: uint8 ``[len(pack), 32]``: the pack's image digests, or ``None`` (none kept)
    digests: np.ndarray | None
    replaced: list[Job]  # the changed ids, stored again
    dropped: list[str]  # the ids no longer listed
    jobs: list[Job]  # to load, in layout order: new ids and changed ones
    #: the ids among ``jobs`` the pack holds already: their old records are retired whatever
    #: the load gives, so one that ``on_error="skip"`` leaves out is retired, not replaced
    reloading: list[str] = field(default_factory=list)
    #: every listed id is packed and passed the quick check: nothing to write
    current: bool = False


def classify(
    old: VOCPackReader, planned: Planned, replace: bool, checksum: bool, retire_all: bool = False
) -> Plan:
    """Sort the ids of ``planned`` (every listed id) against the pack ``old``; raise
    ``SourceDataError`` naming the changed ids unless ``replace``, and when no listed id is in
    the pack (every sample would be retired) unless ``retire_all``."""
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
    made: dict[int, Job] = {}  # position -> the job made to compare it
    for i in np.flatnonzero(~passed & ~reload).tolist():  # compared by content if need be
        position, record = int(packed[i]), int(chosen[i])
        job = made[position] = planned.job(position)
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
    """How the source files of ``job`` differ from what ``record`` holds (empty: unchanged;
    ``None``: unchanged, but its annotation did not parse at pack time and is now needed, so
    it is loaded as if new). ``now`` and ``before``: their statistics now and at pack time
    (``None``: compare every file by content); a file whose statistics match is unchanged,
    unread; ``digest``: the stored SHA-256 of a transformed image."""
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
    """Whether ``data`` (source file ``k`` of ``job``, now) is what ``record`` was made from."""
    if k in (schema.MASK, schema.OBJECT_MASK) and job.options.max_size:
        # masks of resized images are stored resized: compared as pixels and palette, not PNG
        # bytes another Pillow may compress otherwise
        paths = source_paths(job)
        image = read_regular_file(paths[0], job.max_file_bytes, "the image")
        scale = image_scale(image, paths[0], job.options)  # its header: nothing decoded
        stored = old.field(record, k)
        return same_mask(stored, data if scale is None else resize_mask(data, paths[k], scale))
    if k == schema.IMAGE and stores_digest(job.options):
        return digest == hashlib.sha256(data).digest()  # the digest kept at pack time
    return old.field(record, k) == data  # stored as the file's own bytes


def _absent(n: int) -> np.ndarray:
    """int64 ``[n, 4, 2]`` statistics of absent files."""
    out = np.zeros((n, len(schema.SOURCE_FILES), 2), dtype=np.int64)
    out[:, :, 0] = schema.ABSENT
    return out


def _quick_stats(planned: Planned, positions: np.ndarray, files: np.ndarray) -> np.ndarray:
    """``_stat`` of each file ``load`` would read (``files``: ``Planned.reads``) for the ids at
    ``positions``: ``[len(positions), 4, 2]``. One ``stat`` per file, relative to its folder
    opened once (no path walk per file)."""
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
    """``(size, mtime_ns)`` of the regular file ``name`` in the open ``folder``, ``(ABSENT, 0)``
    when it is not there; anything else counts as changed (``load`` says what it is)."""
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
    """The refusal of changed ids. The ``unlisted`` ids the same append would retire are said
    too: another dataset whose ids overlap a few of the pack's looks like a few changed ids,
    and replacing them must not retire most of a pack unannounced."""
    named = "; ".join(f"{job.id!r} ({', '.join(v)})" for _, job, v in changed[:_NAMED])
    more = f" and {len(changed) - _NAMED} more" if len(changed) > _NAMED else ""
    retiring = ""
    if unlisted:
        check = (
            ": check that this is the folder the pack was made from" if 2 * unlisted > live else ""
        )
        retiring = (
            f" The same append would also retire {unlisted} of the pack's {live} ids, which "
            f"this folder's lists no longer name{check}."
        )
    return (
        f"{pack}: {len(changed)} packed ids changed in the source since they were packed: "
        f"{named}{more}. Pass replace_changed=True (--replace-changed) to store their new "
        f"versions (the old records are retired), or re-pack the dataset.{retiring}"
    )
