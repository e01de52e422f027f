"""Reports: the Markdown table, the PNG chart and JSON serialisation."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from tsbench.core import IMAGE_SET, PEER, Row, Stat

#: Below this many images a run's per-sample figures are mostly fixed costs (opening a file,
#: starting workers, the first batch), so the table says not to read them as speeds.
SMALL_SET = 500


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "–"
    if unit in ("ms/sample", "µs/access"):
        return f"{value:.2f}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}"


def _cell(stat: Stat | None, unit: str) -> str:
    if stat is None:
        return "–"
    if stat.min == stat.max:
        return _fmt(stat.median, unit)
    return f"{_fmt(stat.median, unit)} ({_fmt(stat.min, unit)}–{_fmt(stat.max, unit)})"


def _ratio_cell(row: Row) -> str:
    if row.ratio is None:
        return "–"
    if row.kind == "overhead":
        return f"{row.ratio:+.1%}"
    return f"{row.ratio:.2f}x"


def _target_cell(row: Row) -> str:
    if row.target is None:
        return "–"
    if row.kind == "overhead":
        return f"≤ {row.target:+.0%}"
    if row.kind == "limit":
        return f"< {row.target:g} {row.unit}"
    return f"≥ {row.target:g}x"


def _peer_cell(row: Row) -> str:
    if row.peer is None:
        return row.peer_missing or "–"
    return _cell(row.peer, row.unit)


def _peer_ratio_cell(row: Row) -> str:
    return "–" if row.peer_ratio is None else f"{row.peer_ratio:.2f}x"


def _ours_cell(row: Row) -> str:
    return row.missing if row.ours is None and row.missing else _cell(row.ours, row.unit)


def _verdict(row: Row) -> str:
    return {True: "met", False: "**MISSED**", None: "–"}[row.met]


def _small_set_caveat(num_images: int) -> list[str]:
    """A warning paragraph for a set too small to time (``SMALL_SET``), else nothing."""
    if num_images >= SMALL_SET:
        return []
    return [
        f"**Only {num_images} images: read this table as a smoke test, not as speeds.** Each "
        "row's time is mostly fixed costs (opening the pack and the store, starting DataLoader "
        "workers, the first batch) spread over few samples, so ratios swing from run to run "
        f"and the targets (set for 2,000 images) do not apply. Measure at least {SMALL_SET} "
        "images (`--num-images`, or a larger ROOT).",
        "",
    ]


def render_markdown(result: dict[str, Any]) -> str:
    """The results table (with environment line and misses) as Markdown. A set too small to
    time (``SMALL_SET``) gets no verdicts: its caveat says the targets do not apply."""
    env, cfg = result["environment"], result["config"]
    small = cfg["num_images"] < SMALL_SET
    lines = [
        "# torch_serialized vs torchvision VOCDetection",
        "",
        f"{cfg['num_images']} images ({cfg['data']}), image set {IMAGE_SET!r}, "
        f"{cfg['repeats']} repeat(s), median (min–max); {env['cpus_usable']} usable CPUs "
        f"({env['cpu_model']}), torch {env['torch']}, torchvision {env['torchvision']}, "
        f"Pillow {env['pillow']}, read-ahead {env['read_ahead_kb']} KiB; {env['date']}.",
        "",
        *_small_set_caveat(cfg["num_images"]),
        f"| scenario | unit | torchvision | {PEER} | torch_serialized | ×tv | ×{PEER} | target "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [r for s in result["scenarios"].values() for r in s["rows"]]
    for r in rows:
        row = row_from_dict(r)
        lines.append(
            f"| {row.name} | {row.unit} | {_cell(row.baseline, row.unit)} | "
            f"{_peer_cell(row)} | {_ours_cell(row)} | {_ratio_cell(row)} | "
            f"{_peer_ratio_cell(row)} | {_target_cell(row)} | "
            f"{'–' if small else _verdict(row)} |"
        )
    notes = [f"- {r['name']}: {r['note']}" for r in rows if r["note"]]
    if notes:
        lines += ["", "Notes:", "", *notes]
    if result["misses"] and not small:
        lines += ["", "Missed targets:", "", *[f"- {m}" for m in result["misses"]]]
    return "\n".join(lines) + "\n"


def row_from_dict(d: dict[str, Any]) -> Row:
    stats = {k: Stat(**d[k]) if d.get(k) else None for k in ("baseline", "ours", "peer")}
    return Row(**{**d, **stats})


def miss_text(row: Row) -> str:
    value = _ratio_cell(row) if row.ratio is not None else _ours_cell(row)
    return f"{row.name}: {value} vs target {_target_cell(row)}: {row.reason or 'see details'}"


COLOURS = {True: "#2a7", False: "#d55", None: "#89a"}  # a row's target: met, missed, none


def plot_chart(result: dict[str, Any], path: Path) -> bool:
    """Bar chart of the ratios to torchvision with their targets; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [
        row_from_dict(r)
        for s in result["scenarios"].values()
        for r in s["rows"]
        if r["kind"] in ("rate", "cost") and r["ratio"] is not None
    ]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    y = np.arange(len(rows))[::-1]
    colours = [COLOURS[r.met] for r in rows]
    ratios = [float(r.ratio or 0.0) for r in rows]
    ax.barh(y, ratios, color=colours)
    for yi, r, ratio in zip(y, rows, ratios):
        ax.text(ratio * 1.03, yi, f"{ratio:.2f}x", va="center", fontsize=8)
        if r.target is not None:
            ax.plot([r.target], [yi], "k|", markersize=14)
        if r.peer_ratio is not None and r.ratio:  # LMDB's ratio to torchvision
            ax.plot([r.ratio / r.peer_ratio], [yi], "bx", markersize=6)
    ax.axvline(1.0, color="grey", lw=0.8)
    from matplotlib.patches import Patch

    shown = {r.met for r in rows}
    meaning = {True: "target met", False: "target missed", None: "no target"}
    handles = [Patch(color=COLOURS[k], label=meaning[k]) for k in (True, False, None) if k in shown]
    ax.legend(handles=handles, loc="lower right", fontsize=8)
    ax.set_xscale("log")
    ax.set_yticks(y, [r.name for r in rows], fontsize=8)
    ax.set_xlabel(f"ratio to torchvision VOCDetection (log; | target, x {PEER} in this run)")
    ax.set_title(f"torch_serialized, {result['config']['num_images']} images")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    raise TypeError(f"cannot serialise {type(value).__name__}")
