"""Hit rate against capacity for several policies and the offline optimum, and its plot."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpool_agent.replay.optimal import next_uses, optimal_hits
from kvpool_agent.replay.prefix import prefix_paths
from kvpool_agent.replay.runner import Progress, replay
from kvpool_agent.traces import Trace

OPTIMAL = "optimal"
"""Series name of the offline optimum in a sweep."""

DEFAULT_FRACTIONS: tuple[float, ...] = (0.01, 0.05, 0.10, 0.25)


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One (series, capacity) cell of a sweep."""

    series: str
    fraction: float
    capacity_blocks: int
    block_hit_rate: float
    token_hit_rate: float | None
    """None for the optimum, which is computed in blocks only."""


def sweep(
    trace: Trace,
    policies: Sequence[str],
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    *,
    with_optimal: bool = True,
    progress_for: Callable[[str, float], Progress | None] | None = None,
) -> list[SweepPoint]:
    """Replay ``trace`` at each capacity fraction with each policy, plus the optimum."""
    points: list[SweepPoint] = []
    unique = trace.unique_blocks()
    capacities = [(f, max(1, round(f * unique))) for f in fractions]
    if with_optimal:
        prefix = prefix_paths(trace)
        nexts = next_uses(prefix)
        for f, cap in capacities:
            best = optimal_hits(prefix, cap, nexts)
            points.append(SweepPoint(OPTIMAL, f, cap, best.block_hit_rate, None))
    for policy in policies:
        for f, cap in capacities:
            progress = progress_for(policy, f) if progress_for is not None else None
            result = replay(trace, cap, policy, progress=progress)
            points.append(SweepPoint(policy, f, cap, result.block_hit_rate, result.token_hit_rate))
    return points


def plot_sweep(points: Sequence[SweepPoint], title: str, path: str | Path) -> Path:
    """Write a PNG of block hit rate against capacity, one line per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[SweepPoint]] = {}
    for p in points:
        series.setdefault(p.series, []).append(p)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in series.items():
        pts = sorted(pts, key=lambda p: p.fraction)
        style = "k--" if name == OPTIMAL else "-o"
        ax.plot(
            [100 * p.fraction for p in pts],
            [100 * p.block_hit_rate for p in pts],
            style,
            label=name,
        )
    ax.set_xscale("log")
    ticks = sorted({100 * p.fraction for p in points})
    ax.set_xticks(ticks, [f"{t:g}%" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("capacity (% of the trace's unique blocks)")
    ax.set_ylabel("block hit rate (%)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
