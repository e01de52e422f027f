"""The ``sources`` scenario (on request): a stream over two packs against one pack of the same
samples (issue #35: within 5%, warm and cold).

The one-pack stream reads image set ``trainval`` of the benchmark's pack; the two-pack stream
reads ``train`` of that pack and ``val`` of a second pack of the same devkit, the same samples
(checked). Both ``decode="none"`` with torchvision's dict targets, shuffled, in this process
(warm, and after evicting both files) and through ``DataLoader`` workers (warm). The
``×tv`` column holds two packs' rate over one pack's.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from tsbench.context import Bench
from tsbench.core import IMAGE_SET, Row, Stat, rates
from tsbench.loader import make_loader, run_epoch, shutdown_loader
from tsbench.system import pack_file_paths

#: Two packs' rate over one pack's, at least.
TARGET = 0.95


def scenario_sources(b: Bench) -> list[Row]:
    from torch_serialized import VOCSerializedIterableDataset, pack_voc

    one = b.packed()
    other = pack_voc(b.tv_root, b.work / "voc-second.tser", year=b.year).path
    options: dict[str, Any] = {"decode": "none", "shuffle": True}

    def streams() -> dict[str, Any]:
        return {
            "one": VOCSerializedIterableDataset(one, IMAGE_SET, **options),
            "two": VOCSerializedIterableDataset([(one, "train"), (other, "val")], **options),
        }

    n = len(streams()["one"])
    if len(streams()["two"]) != n:
        raise RuntimeError(f"{b.voc_root}: train + val is not trainval here; no like-for-like")
    files = {"one": pack_file_paths(one), "two": pack_file_paths(one) + pack_file_paths(other)}
    seconds: dict[tuple[str, str], list[float]] = {}
    for _ in range(b.repeats):
        for how in ("warm", "cold"):
            for name, ds in streams().items():  # fresh datasets: nothing mapped before a run
                if how == "cold":
                    gc.collect()
                    b.cache.evict(files[name])
                start = time.perf_counter()
                count = sum(1 for _ in ds)
                seconds.setdefault((how, name), []).append(time.perf_counter() - start)
                assert count == n
                del ds
    loaders = {name: make_loader(ds, b.workers, shuffle=False) for name, ds in streams().items()}
    try:
        for loader in loaders.values():
            run_epoch(loader)()  # warm-up: workers started, pages cached
        for _ in range(b.repeats):
            for name, loader in loaders.items():
                start = time.perf_counter()
                run_epoch(loader)()
                seconds.setdefault(("loader", name), []).append(time.perf_counter() - start)
    finally:
        for loader in loaders.values():
            shutdown_loader(loader)

    def row(how: str, title: str) -> Row:
        single, double = rates(n, seconds[how, "one"]), rates(n, seconds[how, "two"])
        return Row(
            f"sources_{how}",
            "sources",
            f"stream over 2 packs vs 1 pack of the same {n} samples, {title}",
            "samples/s",
            "rate",
            None,
            double,
            target=TARGET,
            ratio=double.median / single.median,
            note=f"one pack: {_text(single)}; two packs (train of one, val of another): "
            f"{_text(double)}; ×tv column: two packs over one",
        )

    return [
        row("warm", "warm, in-process"),
        row("cold", "cold (both files evicted), in-process"),
        row("loader", f"warm, DataLoader {b.workers} workers"),
    ]


def _text(stat: Stat) -> str:
    return f"{stat.median:,.0f}/s ({stat.min:,.0f}-{stat.max:,.0f})"
