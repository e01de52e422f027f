"""The ``cold`` scenario: page cache evicted before each run, beside the disk's own bandwidth.

Every variant reads the same image set after its files were evicted, opening included:
torchvision, ours (map-style random, map-style random in DataLoader-sized batches, map-style in
``BlockShuffleSampler`` order, the iterable shuffled and in storage order), the LMDB store in
the same orders, and plain readers of the pack that give the disk's sequential bandwidth (the
best of several ways to read it front to back, ``system.SEQUENTIAL_READERS``) and its random
bandwidth in this run.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tsbench import lmdb_store
from tsbench.access import tv_bytes_getter
from tsbench.context import Bench
from tsbench.core import BATCH_SIZE, IMAGE_SET, MB, PEER, SEED, Row, Stat, rates
from tsbench.system import SEQUENTIAL_READERS, files_under, pack_file_paths, read_ahead_kb

#: Minimum ratio to LMDB on the cold rows: both read through the kernel's read-ahead.
COLD_PEER_TARGET = 1.1
#: Storage-order epoch of the iterable: minimum share of the disk's sequential bandwidth.
SEQUENTIAL_SHARE = 0.9


def _iterable_class() -> tuple[Any, str | None]:
    """The iterable dataset class, or None and why it cannot be imported."""
    try:
        from torch_serialized import VOCSerializedIterableDataset
    except Exception as exc:  # missing, or broken while it is being written
        return None, f"{type(exc).__name__}: {exc}"
    return VOCSerializedIterableDataset, None


def _random_reads(paths: list[str], size: int, seed: int) -> int:
    """Read every ``size`` chunk of the files once, in random order, one ``pread`` each."""
    chunks = [(p, o) for p in paths for o in range(0, os.path.getsize(p), size)]
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}
    try:
        for k in np.random.default_rng(seed).permutation(len(chunks)):
            path, offset = chunks[int(k)]
            os.pread(fds[path], size, offset)
    finally:
        for fd in fds.values():
            os.close(fd)
    return len(chunks)


def scenario_cold(b: Bench) -> list[Row]:
    from torch_serialized import BlockShuffleSampler

    cache = b.cache
    pack = b.packed()
    source = files_under(b.voc_root)
    pack_files = pack_file_paths(pack)
    n = len(b.tv())
    order = b.indices(n)
    sampler_order = list(BlockShuffleSampler(n, seed=SEED))
    batches = [order[i : i + BATCH_SIZE] for i in range(0, n, BATCH_SIZE)]
    store = b.lmdb()
    gc.collect()
    iterable_cls, iterable_error = _iterable_class()

    def tv_run() -> int:
        get = tv_bytes_getter(b.tv())
        for i in order:
            get(i)
        return n

    def ours_in(indices: list[int]) -> Callable[[], int]:
        def run() -> int:
            get = b.ours(decode="none").__getitem__
            for i in indices:
                get(i)
            return len(indices)

        return run

    def ours_batches() -> int:
        ds = b.ours(decode="none")
        for batch in batches:
            ds.__getitems__(batch)
        return n

    def iterable_run(shuffle: bool) -> Callable[[], int]:
        def run() -> int:
            ds = iterable_cls(pack, IMAGE_SET, shuffle=shuffle, seed=SEED, decode="none")
            return sum(1 for _ in ds)

        return run

    pack_bytes = sum(os.path.getsize(p) for p in pack_files)
    record_bytes = max(4096, pack_bytes // max(1, n))
    block_bytes = 64 * record_bytes

    variants: dict[str, tuple[list[str], Callable[[], int]]] = {
        "tv": (source, tv_run),
        "ours": (pack_files, ours_in(order)),
        "ours_batches": (pack_files, ours_batches),
        "ours_sampler": (pack_files, ours_in(sampler_order)),
    }
    if iterable_cls is not None:
        variants["iterable"] = (pack_files, iterable_run(True))
        variants["iterable_in_order"] = (pack_files, iterable_run(False))
    if store is not None:
        files = lmdb_store.store_files(store)
        variants["lmdb"] = (files, lambda: lmdb_store.count_in_order(store, order))
        variants["lmdb_sampler"] = (files, lambda: lmdb_store.count_in_order(store, sampler_order))
        variants["lmdb_walk"] = (files, lambda: lmdb_store.count_walk(store))

    # The disk's own bandwidth on the pack file, no parsing: read front to back in each way of
    # SEQUENTIAL_READERS (the row is the best of them in each repeat), record-sized reads in
    # random order, and block-sized (64 records) in random order, one thread.
    def sequential_reader(read: Callable[[list[str]], None]) -> Callable[[], int]:
        def run() -> int:
            read(pack_files)
            return n

        return run

    for method, (_, read) in SEQUENTIAL_READERS.items():
        variants[f"disk_sequential_{method}"] = (pack_files, sequential_reader(read))
    variants["disk_random"] = (pack_files, lambda: _random_reads(pack_files, record_bytes, SEED))
    variants["disk_blocks"] = (pack_files, lambda: _random_reads(pack_files, block_bytes, SEED))

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
    mbps = {k: Stat.of([pack_bytes / MB / t for t in v]) for k, v in seconds.items() if v}
    methods = [f"disk_sequential_{m}" for m in SEQUENTIAL_READERS]
    best = [max(per_method) for per_method in zip(*(mbps[m].values for m in methods))]
    mbps["disk_sequential"] = Stat.of(best)
    sequential = mbps["disk_sequential"].median
    winners = [methods[[mbps[m].values[r] for m in methods].index(v)] for r, v in enumerate(best)]
    b.details["cold"] = {
        "fadvise_supported": cache.fadvise,
        "mincore_check": cache.can_check,
        "resident_fraction": residency,
        "worst_resident_after_evict": worst,
        "read_ahead_kb": read_ahead_kb(b.work),
        "samples": counts,
        "pack_mb_per_s": {k: v.median for k, v in mbps.items()},
        "record_bytes": record_bytes,
        "disk_sequential_best_of": {
            m: mbps[f"disk_sequential_{m}"].values for m in SEQUENTIAL_READERS
        },
    }
    if not cache.fadvise:
        state = "NOT COLD: posix_fadvise unsupported"
    elif worst is None:
        state = "eviction not checked (no mincore)"
    elif worst > 0.05:
        state = f"NOT FULLY COLD: {worst:.0%} of pages still cached after eviction"
    else:
        state = f"evicted (≤{worst:.1%} resident, mincore)"
    tv_stat = rates(counts["tv"], seconds["tv"])

    def share(name: str) -> str:
        return (
            f"{mbps[name].median:.0f} MB/s of the pack, {mbps[name].median / sequential:.0%} "
            "of the disk's sequential bandwidth in this run"
        )

    def row(key: str, name: str, ours: str, peer: str | None, note: str, **kw: Any) -> Row:
        if ours not in seconds or not seconds[ours]:
            return Row(
                key,
                "cold",
                name,
                "samples/s",
                "rate",
                tv_stat,
                None,
                note=f"not measured: {iterable_error}",
            )
        extra: dict[str, Any] = {"peer_missing": b.lmdb_missing or ""}
        if peer is not None and peer in seconds:
            extra = {"peer": rates(counts[peer], seconds[peer]), "peer_target": COLD_PEER_TARGET}
        return Row(
            key,
            "cold",
            name,
            "samples/s",
            "rate",
            tv_stat,
            rates(counts[ours], seconds[ours]),
            note=f"{note}; {share(ours)}; {state}",
            **extra,
            **kw,
        )

    rows = [
        row(
            "cold_random",
            "cold cache, bytes + dict target, random, incl. open",
            "ours",
            "lmdb",
            f"map-style ds[i]; {PEER}: a get per index, same order",
            target=5.0,
        ),
        row(
            "cold_random_batches",
            f"cold cache, random, batches of {BATCH_SIZE} (__getitems__), incl. open",
            "ours_batches",
            "lmdb",
            f"what a DataLoader worker does; {PEER}: a get per index, same order",
        ),
        row(
            "cold_sampler",
            "cold cache, BlockShuffleSampler order, incl. open",
            "ours_sampler",
            "lmdb_sampler",
            f"map-style ds[i] in BlockShuffleSampler order; {PEER}: the same order",
        ),
        row(
            "cold_iterable",
            "cold cache, iterable epoch (shuffle) vs tv random, incl. open",
            "iterable",
            "lmdb_sampler",
            f"{PEER}: BlockShuffleSampler order (block-shuffled, as the iterable)",
            target=8.0,
        ),
        row(
            "cold_iterable_in_order",
            "cold cache, iterable epoch in storage order (shuffle=False), incl. open",
            "iterable_in_order",
            "lmdb_walk",
            f"{PEER}: one cursor walk",
        ),
    ]
    for r in rows:
        if r.ours is None or r.target is None:
            continue
        needed = mbps[_KEYS[r.key]].median * r.target / (r.ours.median / tv_stat.median)
        disk_x = sequential * MB / (pack_bytes / n)  # samples/s at the disk's bandwidth
        r.reason = (
            f"{r.target:g}x needs {needed:.0f} MB/s from the disk, ours moved "
            f"{mbps[_KEYS[r.key]].median:.0f} MB/s; the disk's sequential bandwidth was "
            f"{sequential:.0f} MB/s in this run ({disk_x / tv_stat.median:.1f}x tv)"
        )
    in_order = rows[-1]
    if in_order.ours is not None:
        got = mbps["iterable_in_order"].median / sequential
        ok = got >= SEQUENTIAL_SHARE
        in_order.met = ok
        if not ok:
            in_order.reason = (
                f"{got:.0%} of the disk's sequential bandwidth in the same run "
                f"(target ≥ {SEQUENTIAL_SHARE:.0%})"
            )
    wins = ", ".join(
        f"{SEQUENTIAL_READERS[m][0]} {mbps[f'disk_sequential_{m}'].median:.0f} MB/s"
        f" (best in {sum(w == f'disk_sequential_{m}' for w in winners)} of {len(winners)})"
        for m in SEQUENTIAL_READERS
    )
    for key, name, note in (
        (
            "disk_sequential",
            "disk: sequential read of the pack, best of "
            f"{len(SEQUENTIAL_READERS)} ways (per repeat)",
            f"medians: {wins}",
        ),
        (
            "disk_random",
            f"disk: random reads of {record_bytes / 1e3:.0f} KB (one record)",
            "one thread, every chunk once, random order",
        ),
        (
            "disk_blocks",
            f"disk: random reads of {block_bytes / MB:.1f} MB (64 records)",
            "one thread, every chunk once, random order: the iterable's default block",
        ),
    ):
        rows.append(
            Row(
                key,
                "cold",
                name,
                "MB/s",
                "info",
                None,
                mbps[key],
                note=f"{note}; no parsing; {state}",
            )
        )
    return rows


#: The variant behind each cold row with a tv target (for the missed-target reason).
_KEYS = {"cold_random": "ours", "cold_iterable": "iterable"}
