"""The ``cold`` scenario: page cache evicted before each run, against I/O ceilings."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .access import tv_bytes_getter
from .context import Bench
from .core import IMAGE_SET, MB, MIB, SEED, Row, rates
from .system import files_under, pack_file_paths, read_ahead_kb, read_all


def _iterable_class() -> tuple[Any, str | None]:
    """The iterable dataset class, or None and why it cannot be imported."""
    try:
        from torch_serialized import VOCSerializedIterableDataset
    except Exception as exc:  # missing, or broken while it is being written
        return None, f"{type(exc).__name__}: {exc}"
    return VOCSerializedIterableDataset, None


def scenario_cold(b: Bench) -> list[Row]:
    cache = b.cache
    pack = b.packed()
    source = files_under(b.voc_root)
    pack_files = pack_file_paths(pack)
    n = len(b.tv())
    order = b.indices(n)
    gc.collect()
    iterable_cls, iterable_error = _iterable_class()

    def tv_run() -> int:
        get = tv_bytes_getter(b.tv())
        for i in order:
            get(i)
        return len(order)

    def ours_run() -> int:
        ds = b.ours(decode="none")
        get = ds.__getitem__
        for i in order:
            get(i)
        return len(order)

    def iterable_run() -> int:
        ds = iterable_cls(pack, IMAGE_SET, shuffle=True, seed=SEED, decode="none")
        return sum(1 for _ in ds)

    def iterable_in_order_run() -> int:
        ds = iterable_cls(pack, IMAGE_SET, shuffle=False, decode="none")
        return sum(1 for _ in ds)

    variants: dict[str, tuple[list[str], Callable[[], int]]] = {
        "tv": (source, tv_run),
        "ours": (pack_files, ours_run),
    }
    if iterable_cls is not None:
        variants["iterable"] = (pack_files, iterable_run)
        variants["iterable_in_order"] = (pack_files, iterable_in_order_run)

    def ceiling_run() -> int:
        read_all(pack_files, chunk=MIB)
        return len(order)

    # A block-shuffled reader (the iterable) cannot read in file order: its ceiling is the
    # same bytes read in chunks of one block (64 records) taken in random order.
    block_bytes = 64 * max(1, sum(os.path.getsize(p) for p in pack_files) // max(1, n))

    def shuffled_blocks_run() -> int:
        chunks = [(p, o) for p in pack_files for o in range(0, os.path.getsize(p), block_bytes)]
        for k in np.random.default_rng(SEED).permutation(len(chunks)):
            path, offset = chunks[int(k)]
            fd = os.open(path, os.O_RDONLY)
            try:
                os.pread(fd, block_bytes, offset)
            finally:
                os.close(fd)
        return len(order)

    variants["ceiling"] = (pack_files, ceiling_run)
    variants["ceiling_blocks"] = (pack_files, shuffled_blocks_run)
    seconds: dict[str, list[float]] = {k: [] for k in variants}
    counts: dict[str, int] = {}
    residency: dict[str, dict[str, list[float | None]]] = {
        k: {"before": [], "after_evict": [], "after_run": []} for k in variants
    }
    for _ in range(b.repeats):
        for name, (files, run) in list(variants.items()):
            gc.collect()  # no dataset of ours may keep the pack mapped: mapped pages stay
            residency[name]["before"].append(cache.resident(files))
            cache.evict(files)
            residency[name]["after_evict"].append(cache.resident(files))
            start = time.perf_counter()
            try:
                counts[name] = run()
            except Exception as exc:  # a broken iterable must not hide the other results
                if not name.startswith("iterable"):
                    raise
                iterable_error = f"{type(exc).__name__}: {exc}"
                del variants[name]
                continue
            seconds[name].append(time.perf_counter() - start)
            residency[name]["after_run"].append(cache.resident(files))
    if iterable_error is not None:
        iterable_cls = None
    evicted = [r for v in residency.values() for r in v["after_evict"] if r is not None]
    worst = max(evicted) if evicted else None
    b.details["cold"] = {
        "fadvise_supported": cache.fadvise,
        "mincore_check": cache.can_check,
        "resident_fraction": residency,
        "worst_resident_after_evict": worst,
        "read_ahead_kb": read_ahead_kb(b.work),
        "samples": counts,
    }
    if not cache.fadvise:
        state = "NOT COLD: posix_fadvise unsupported"
    elif worst is None:
        state = "eviction not checked (no mincore)"
    elif worst > 0.05:
        state = f"NOT FULLY COLD: {worst:.0%} of pages still cached after eviction"
    else:
        state = f"evicted (≤{worst:.1%} resident, mincore)"
    tv_rate = float(np.median([counts["tv"] / t for t in seconds["tv"]]))
    pack_mb = sum(os.path.getsize(p) for p in pack_files) / MB

    def why(name: str, target: float, limit: str) -> str:
        reference = float(np.median([counts[limit] / t for t in seconds[limit]])) / tv_rate
        how = {
            "ceiling": "a plain sequential read()",
            "ceiling_blocks": "reading shuffled 64-record chunks",
        }
        ours = pack_mb / float(np.median(seconds[name]))
        need = (
            ours * target / (float(np.median([counts[name] / t for t in seconds[name]])) / tv_rate)
        )
        text = (
            f"{target:g}x needs {need:.0f} MB/s from the disk, ours moved {ours:.0f} MB/s; in "
            f"the same run {how[limit]} of this pack moved "
            f"{pack_mb / float(np.median(seconds[limit])):.0f} MB/s ({reference:.1f}x tv)"
        )
        if reference < target:
            return text + ": this disk, not the reader, is the limit"
        return text + ": the reader is the limit"

    rows = [
        Row(
            "cold_random",
            "cold",
            "cold cache, bytes + dict target, random, incl. open",
            "samples/s",
            "rate",
            rates(counts["tv"], seconds["tv"]),
            rates(counts["ours"], seconds["ours"]),
            target=5.0,
            note=state,
            reason=why("ours", 5.0, "ceiling"),
        )
    ]
    iterable_note = state
    if iterable_error is not None:
        iterable_note = f"torch_serialized.iterable failed, not measured: {iterable_error}"
    rows.append(
        Row(
            "cold_iterable",
            "cold",
            "cold cache, iterable epoch (shuffle) vs tv random, incl. open",
            "samples/s",
            "rate",
            rates(counts["tv"], seconds["tv"]),
            rates(counts["iterable"], seconds["iterable"]) if iterable_cls else None,
            target=8.0,
            note=iterable_note,
            reason=why("iterable", 8.0, "ceiling_blocks") if iterable_cls else "",
        )
    )
    if iterable_cls is not None and "iterable_in_order" in counts:
        rows.append(
            Row(
                "cold_iterable_in_order",
                "cold",
                "cold cache, iterable epoch in storage order (shuffle=False), incl. open",
                "samples/s",
                "rate",
                rates(counts["tv"], seconds["tv"]),
                rates(counts["iterable_in_order"], seconds["iterable_in_order"]),
                note="an unshuffled pass (evaluation, or warming a cache): sequential reads "
                "that kernel read-ahead streams; compare with the plain read() ceiling",
            )
        )
    rows.append(
        Row(
            "cold_ceiling",
            "cold",
            "cold cache, plain read() of the whole pack (disk reference)",
            "samples/s",
            "rate",
            rates(counts["tv"], seconds["tv"]),
            rates(counts["ceiling"], seconds["ceiling"]),
            note="sequential 1 MiB reads in one thread, no parsing: what a plain reader gets "
            "from this disk (readers that overlap their reads can do better)",
        )
    )
    rows.append(
        Row(
            "cold_ceiling_blocks",
            "cold",
            "cold cache, read() of the pack in shuffled 64-record chunks (disk reference)",
            "samples/s",
            "rate",
            rates(counts["tv"], seconds["tv"]),
            rates(counts["ceiling_blocks"], seconds["ceiling_blocks"]),
            note=f"{block_bytes / MB:.1f} MB preads in random order, one thread: what a plain "
            "reader that shuffles 64-record blocks (the iterable's default) gets",
        )
    )
    return rows
