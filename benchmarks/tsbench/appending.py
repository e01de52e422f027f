"""The ``append`` scenario: growing a pack by 1% new images, against re-packing everything.

The benchmark's devkit is seen as it was before its last 1% of ids were added: a second
devkit whose image and annotation folders are links to the real ones and whose lists leave
those ids out. That devkit is packed once (one file, and shards of a tenth of the samples);
each repeat copies those packs (then ``sync``, so no append competes with the write-back of
its own copy), restores the full lists and times, in turn: ``append_voc`` on each copy,
``pack_voc`` of only the new ids (a devkit listing only them), a plain copy of the old
single file (``copy_file_range`` and ``fsync``: the floor a single-file append cannot go
under, since it must copy the old records), and a full re-pack of the grown devkit in both
forms. Targets (issue #15): an append costs at most twice packing the new ids alone, and a
shard folder grows at least 20x faster than it re-packs. The single-file rows say what the
copy costs: against packing the new ids alone the target is out of reach wherever copying
the old file takes longer than that, so a row also sets the append against its floor (the
copy plus the new ids). The appended packs are checked to read as the full re-pack (every
image set's ids, and the bytes of a random sample of records).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from tsbench.context import Bench
from tsbench.core import SEED, Row, Stat

#: The share of ids that are new, and the share of the samples a shard holds.
NEW_SHARE = 0.01
SHARD_SHARE = 0.1
_LINKED = ("JPEGImages", "Annotations", "SegmentationClass", "SegmentationObject")


def scenario_append(b: Bench) -> list[Row]:
    from torch_serialized import append_voc, pack_voc
    from torch_serialized.voc.layout import read_image_sets

    sets = read_image_sets(b.voc_root)
    ids = list(dict.fromkeys(i for lists in sets.values() for s in lists.values() for i in s))
    new = set(ids[-max(1, round(len(ids) * NEW_SHARE)) :])
    work = b.work / "append"
    shutil.rmtree(work, ignore_errors=True)
    grown = _devkit(b, work / "grown", sets, lambda i: True)
    only_new = _devkit(b, work / "new", sets, lambda i: i in new)
    _devkit(b, work / "grown", sets, lambda i: i not in new)  # the lists as they were
    per_shard = max(1, round(len(ids) * SHARD_SHARE))
    forms: dict[str, dict[str, Any]] = {
        "single": {},
        "shards": {"max_samples_per_shard": per_shard},
    }
    base = {
        form: pack_voc(grown, work / f"base-{form}", year=b.year, **opts).path
        for form, opts in forms.items()
    }
    _devkit(b, work / "grown", sets, lambda i: True)  # the lists as they are now
    keys = (
        "append-single",
        "append-shards",
        "new-only",
        "copy-single",
        "full-single",
        "full-shards",
    )
    seconds: dict[str, list[float]] = {k: [] for k in keys}
    written: dict[str, int] = {}
    same = True
    for r in range(b.repeats):
        copies = {form: _copy(base[form], work / f"r{r}-{form}") for form in forms}
        os.sync()  # the copies on disk: the appends do not wait for their write-back
        for form in forms:
            result = append_voc(grown, copies[form])
            seconds[f"append-{form}"].append(result.seconds)
            written[f"append-{form}"] = result.bytes_written
        fresh = pack_voc(only_new, work / f"r{r}-new.tser", year=b.year)
        seconds["new-only"].append(fresh.seconds)
        written["new-only"] = fresh.bytes_written
        seconds["copy-single"].append(_plain_copy(base["single"], work / f"r{r}-plain.tser"))
        for form, opts in forms.items():
            repacked = pack_voc(grown, work / f"r{r}-full-{form}", year=b.year, **opts)
            seconds[f"full-{form}"].append(repacked.seconds)
            written[f"full-{form}"] = repacked.bytes_written
            same = same and _same_reads(copies[form], repacked.path)
        for path in work.glob(f"r{r}-*"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    shutil.rmtree(work, ignore_errors=True)
    stats = {k: Stat.of(v) for k, v in seconds.items()}
    b.details["append"] = {
        "num_samples": len(ids),
        "new_samples": len(new),
        "samples_per_shard": per_shard,
        "seconds": seconds,
        "bytes_written": written,
        "appended_reads_as_full_repack": same,
    }
    floor = Stat.of([c + n for c, n in zip(seconds["copy-single"], seconds["new-only"])])
    copy_share = stats["copy-single"].median / stats["append-single"].median
    rows = []
    for form in forms:
        full, ours = stats[f"full-{form}"], stats[f"append-{form}"]
        rows.append(
            Row(
                f"append_vs_repack_{form}",
                "append",
                f"append {len(new)} new image{'s' * (len(new) != 1)} to a {form} pack of "
                f"{len(ids) - len(new)}",
                "s",
                "cost",
                full,
                ours,
                target=20.0 if form == "shards" else None,
                note=f"baseline: full re-pack of the grown source ({form}); "
                f"{written[f'append-{form}'] / 1e6:.1f} MB written against "
                f"{written[f'full-{form}'] / 1e6:.1f} MB",
            )
        )
        rows.append(
            Row(
                f"append_vs_new_only_{form}",
                "append",
                f"append to a {form} pack, over packing the new images alone",
                "s",
                "overhead",
                stats["new-only"],
                ours,
                target=1.0,
                note="baseline: pack_voc of a devkit listing only the new ids; target: "
                "at most 2x (overhead <= 100%)"
                + (
                    f"; a plain copy of the old file alone takes {stats['copy-single'].median:.2f}"
                    f' s ({copy_share:.0%} of this append): see the row "over its floor"'
                    if form == "single"
                    else ""
                ),
            )
        )
    rows.append(
        Row(
            "append_vs_floor_single",
            "append",
            "append to a single file, over its floor (copying the old file + packing the new)",
            "s",
            "overhead",
            floor,
            stats["append-single"],
            note="baseline: a plain copy_file_range + fsync of the old file plus pack_voc of "
            "the new ids alone, per repeat; a single-file append must copy the old records "
            "(no target: informative)",
        )
    )
    if not same:
        for row in rows:
            row.met, row.reason = False, "the appended pack does not read as the full re-pack"
    return rows


def _devkit(b: Bench, root: Path, sets: Any, keep: Any) -> Path:
    """A devkit at ``root`` whose file folders link to the benchmark's and whose lists hold
    the ids ``keep`` accepts (lists rewritten on each call, order and duplicates kept)."""
    voc = root / "VOCdevkit" / b.voc_root.name
    voc.mkdir(parents=True, exist_ok=True)
    for name in _LINKED:
        target, link = b.voc_root / name, voc / name
        if target.is_dir() and not os.path.lexists(link):
            link.symlink_to(target, target_is_directory=True)
    for task, lists in sets.items():
        folder = voc / "ImageSets" / task
        folder.mkdir(parents=True, exist_ok=True)
        for name, listed in lists.items():
            text = "".join(f"{i}\n" for i in listed if keep(i))
            (folder / f"{name}.txt").write_text(text)
    return root


def _plain_copy(path: Path, to: Path) -> float:
    """Seconds to copy the file ``path`` to ``to`` as an append copies records
    (``copy_file_range``, then ``fsync``); the copy is removed."""
    from torch_serialized.container.parallel import copy_range

    started = time.perf_counter()
    src = os.open(path, os.O_RDONLY)
    try:
        dst = os.open(to, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            copy_range(src, 0, dst, 0, os.fstat(src).st_size)
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    seconds = time.perf_counter() - started
    to.unlink()
    return seconds


def _copy(path: Path, to: Path) -> Path:
    if path.is_dir():
        shutil.copytree(path, to)
    else:
        shutil.copyfile(path, to)
    return to


def _same_reads(appended: Path, full: Path, sample: int = 64) -> bool:
    """Every image set lists the same ids, and a random sample of them reads the same bytes."""
    from torch_serialized.voc import schema
    from torch_serialized.voc.packed import VOCPackReader

    a, f = VOCPackReader(appended), VOCPackReader(full)
    for task in ("Main", "Segmentation"):
        if a.image_sets(task) != f.image_sets(task):
            return False
        for name in f.image_sets(task):
            ra, rf = a.split(task, name), f.split(task, name)
            if [a.id(int(r)) for r in ra] != [f.id(int(r)) for r in rf]:
                return False
            rng = np.random.default_rng(SEED)
            for k in rng.permutation(len(rf))[:sample].tolist():
                for field in (schema.IMAGE, schema.ANNOTATION, schema.MASK, schema.TARGET):
                    if bytes(a.field(int(ra[k]), field)) != bytes(f.field(int(rf[k]), field)):
                        return False
    return True
