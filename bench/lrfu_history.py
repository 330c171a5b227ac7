"""How long a history LRFU needs: hit rates with LRFU remembering 2, 4 or 8 times the
capacity in keys, on every trace cell where that factor binds.

LRFU (an expert of the default ``mixture``) keeps the statistics of keys it no longer caches
in a bounded history, ``max(history_floor, history_factor * capacity)`` keys: the largest
table of the default policy. The factor was 8; it is 2 now. This replays ``GuardedPolicy``
(the default when it was measured, whose experts the vote keeps; on the Python core, whose
experts can be swapped) with an LRFU of each factor on the cells of
``bench/replay_sweep.py``'s shared traces whose capacity makes ``8 * capacity`` exceed the
floor (below it every factor gives the floor, and the same figures), and prints each cell's
block hit rate by factor. The shared traces are read from ``../shared/traces`` (the script
exits when they are absent).

    python bench/lrfu_history.py [--factors 2,4,8] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import series  # bench/series.py
from plots import grouped_bars  # bench/plots.py
from replay_sweep import FRACTIONS, TRACES, trace_path  # bench/replay_sweep.py
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool_agent.cache.eviction.guarded import GUARDED_EXPERTS, GuardedPolicy
from kvpool_agent.cache.eviction.lrfu import LRFUQueue
from kvpool_agent.cache.eviction.mixture import ExpertFactory
from kvpool_agent.replay.runner import replay
from kvpool_agent.traces import load_trace


def policy_with_factor(factor: int) -> str:
    """Register the default with an LRFU of history ``factor``; returns its policy name."""
    lrfu = type(f"LRFU{factor}", (LRFUQueue,), {"history_factor": factor, "__slots__": ()})
    experts: tuple[tuple[str, ExpertFactory], ...] = tuple(
        (name, lrfu if name == "lrfu" else make) for name, make in GUARDED_EXPERTS
    )

    def init(self: GuardedPolicy, capacity: int) -> None:
        GuardedPolicy.__init__(self, capacity, experts)

    name = f"mixture(lrfu history {factor}x)"
    series.register({name: type(name, (GuardedPolicy,), {"__init__": init})})
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factors", default="2,4,8")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    factors = [int(f) for f in args.factors.split(",")]
    missing = [name for name in TRACES if not trace_path(name).exists()]
    if missing:
        raise SystemExit(f"shared traces not found: {', '.join(missing)} (../shared/traces)")
    names = {f: policy_with_factor(f) for f in factors}
    traces = {name: load_trace(trace_path(name)) for name in TRACES}
    cells = [
        (name, fraction)
        for name, trace in traces.items()
        for fraction in FRACTIONS
        if 8 * trace.capacity_blocks(fraction) > LRFUQueue.history_floor
    ]
    rows = []
    with Progress() as progress:
        task = progress.add_task("replays", total=len(cells) * len(factors))
        for name, fraction in cells:
            trace = traces[name]
            capacity = trace.capacity_blocks(fraction)
            row = {"trace": name, "fraction": fraction, "capacity_blocks": capacity}
            for f in factors:
                row[f"hit_rate_{f}x"] = replay(trace, capacity, names[f]).block_hit_rate
                progress.advance(task)
            rows.append(row)
    table = Table(title="default's block hit rate (%) by LRFU history factor")
    table.add_column("cell")
    table.add_column("capacity", justify="right")
    for f in factors:
        table.add_column(f"{f}x", justify="right")
    for row in rows:
        cell = f"{row['trace']} @ {100 * row['fraction']:g}%"
        rates = [f"{100 * row[f'hit_rate_{f}x']:.3f}" for f in factors]
        table.add_row(cell, str(row["capacity_blocks"]), *rates)
    Console().print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"command": "python bench/lrfu_history.py", "floor": LRFUQueue.history_floor}
    doc["rows"] = rows
    (args.out / "lrfu_history.json").write_text(json.dumps(doc, indent=2) + "\n")
    _plot(rows, factors, args.out / "lrfu_history.png")


def _plot(rows: list[dict[str, float | int | str]], factors: list[int], path: Path) -> None:
    groups = [f"{r['trace']}\n{100 * float(r['fraction']):g}%" for r in rows]
    series = {f"history {f}x": [100 * float(r[f"hit_rate_{f}x"]) for r in rows] for f in factors}
    title = "default policy by LRFU history factor (cells where it binds)"
    grouped_bars(path, groups, series, "block hit rate (%)", title)


if __name__ == "__main__":
    main()
