"""Measurements: scenario names, the ``Stat`` and ``Row`` records and the timing helpers."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Scenario names, in the order they run.
SCENARIOS: tuple[str, ...] = (
    "pack",
    "append",
    "bytes",
    "attributes",
    "decoded",
    "tensor",
    "cold",
    "dataloader",
    "gpu",
    "memory",
)
#: Scenarios run only when asked for (``--scenarios remote,sources``): ``remote`` needs extra
#: packages, ``sources`` compares our own streams (one pack against two).
OPTIONAL_SCENARIOS: tuple[str, ...] = ("remote", "sources")


#: The second reference beside torchvision, measured in the same run (``lmdb_store``).
PEER = "LMDB"


IMAGE_SET = "trainval"
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
BATCH_SIZE = 32
SEED = 0
MB = 1e6
MIB = 1 << 20


@dataclass
class Stat:
    """Median, minimum and maximum of repeated measurements of one quantity."""

    median: float
    min: float
    max: float
    values: list[float]

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        vals = [float(v) for v in values]
        return cls(float(np.median(vals)), min(vals), max(vals), vals)


@dataclass
class Row:
    """One line of the results table.

    ``kind`` says how ``torchvision`` (the baseline) and ``ours`` compare:
    ``"rate"`` (higher is better, ratio = ours / baseline, target = minimum ratio),
    ``"cost"`` (lower is better, ratio = baseline / ours, target = minimum ratio),
    ``"overhead"`` (ratio = ours / baseline - 1, target = maximum overhead),
    ``"limit"`` (no ratio; target = maximum value of ``ours``),
    ``"info"`` (no ratio, no target).

    ``peer`` is the LMDB store measured in the same run (``peer_missing`` says why not, e.g.
    ``lmdb`` not installed); ``peer_ratio`` is ours against it as ``ratio`` is against
    torchvision, and ``peer_target`` its minimum.
    """

    key: str
    scenario: str
    name: str
    unit: str
    kind: str
    baseline: Stat | None
    ours: Stat | None
    target: float | None = None
    note: str = ""
    ratio: float | None = None
    met: bool | None = None
    reason: str = ""  # why the target is missed, when it is
    peer: Stat | None = None
    peer_missing: str = ""
    peer_target: float | None = None
    peer_ratio: float | None = None
    missing: str = ""  # shown instead of ours when it could not be measured here

    def finish(self) -> Row:
        b = self.baseline.median if self.baseline else None
        o = self.ours.median if self.ours else None
        p = self.peer.median if self.peer else None
        if self.ratio is not None:  # set by the scenario (e.g. a median of paired ratios)
            pass
        elif self.kind == "rate" and b and o:
            self.ratio = o / b
        elif self.kind == "cost" and b and o:
            self.ratio = b / o
        elif self.kind == "overhead" and b and o:
            self.ratio = o / b - 1.0
        if self.peer_ratio is None and p and o:
            if self.kind in ("rate", "info"):
                self.peer_ratio = o / p
            elif self.kind == "cost":
                self.peer_ratio = p / o
        if self.target is not None and self.met is None:
            if self.kind in ("rate", "cost") and self.ratio is not None:
                self.met = self.ratio >= self.target
            elif self.kind == "overhead" and self.ratio is not None:
                self.met = self.ratio <= self.target
            elif self.kind == "limit" and o is not None:
                self.met = o < self.target
        if self.peer_target is not None and self.peer_ratio is not None:
            ahead = self.peer_ratio >= self.peer_target
            if not ahead:
                miss = (
                    f"{self.peer_ratio:.2f}x {PEER} in the same run "
                    f"(target ≥ {self.peer_target:g}x)"
                )
                self.reason = f"{self.reason}; {miss}" if self.met is False else miss
            self.met = ahead if self.met is None else self.met and ahead
        return self


def interleaved(
    variants: dict[str, Callable[[], Any]], repeats: int
) -> dict[str, tuple[list[float], list[float]]]:
    """Run each variant once per repeat, in turn; wall and CPU seconds of every run."""
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            wall0, cpu0 = time.perf_counter(), time.process_time()
            fn()
            times[name][0].append(time.perf_counter() - wall0)
            times[name][1].append(time.process_time() - cpu0)
    return times


def rates(n: int, seconds: Sequence[float]) -> Stat:
    return Stat.of([n / s for s in seconds])


def per_sample_us(n: int, seconds: Sequence[float]) -> Stat:
    return Stat.of([s / n * 1e6 for s in seconds])


def loop(get: Callable[[int], Any], indices: Sequence[int], passes: int = 1) -> Callable[[], None]:
    def run() -> None:
        for _ in range(passes):
            for i in indices:
                get(i)

    return run
