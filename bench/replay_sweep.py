"""Hit rates of every eviction policy on the shared traces, through the real engine.

For each trace and capacity (a share of the trace's unique blocks) it replays each policy
through ``KVCacheManager`` and computes the offline optimum, then prints one table per
trace with the baseline (plain LRU, measured in the same run), the policies, the optimum and
the best online figure published in ``shared/traces/README.md``, plus each policy's ratio
to LRU and to that best-known figure.

    python bench/replay_sweep.py                                 # everything (slow)
    python bench/replay_sweep.py --traces synthetic --policies lru,reuse-gap
    python bench/replay_sweep.py --traces mrqa --out bench/results/replay_mrqa.json

Results are appended per cell to ``--out`` (JSON Lines) as they finish, so runs can be
split across processes and merged with ``--report`` (which replays nothing).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvpool_agent.cache.eviction import POLICIES
from kvpool_agent.replay.optimal import next_uses, optimal_hits
from kvpool_agent.replay.prefix import prefix_paths
from kvpool_agent.replay.runner import replay
from kvpool_agent.traces import load_trace

TRACE_DIR = Path(__file__).resolve().parents[2] / "shared" / "traces"
TRACES = {
    "synthetic": "synthetic_trace.jsonl",
    "gsp_zipf": "gsp_zipf1.0_1024g_bs16.jsonl",
    "mrqa": "mrqa_100active_500users_10rounds_bs16.jsonl",
    "gsp_default": "gsp_default_bs16.jsonl",
}
FRACTIONS = (0.01, 0.05, 0.10, 0.25)
BEST_KNOWN = {  # shared/traces/README.md, second table (best of ~60 online configurations)
    "synthetic": (4.9, 17.2, 28.3, 46.9),
    "gsp_zipf": (43.3, 62.7, 70.8, 81.5),
    "mrqa": (28.2, 46.7, 65.9, 91.1),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="synthetic,gsp_zipf,mrqa")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    parser.add_argument("--out", default="bench/results/replay_sweep.jsonl")
    parser.add_argument("--report", action="store_true", help="only print tables from --out")
    args = parser.parse_args()
    out = Path(args.out)
    traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    fractions = [float(f) for f in args.fractions.split(",")]
    if not args.report:
        out.parent.mkdir(parents=True, exist_ok=True)
        _measure(traces, [p for p in args.policies.split(",") if p], fractions, out)
    _report(out, traces)


def _measure(traces: list[str], policies: list[str], fractions: list[float], out: Path) -> None:
    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as bar:
        for name in traces:
            trace = load_trace(TRACE_DIR / TRACES[name])
            prefix = prefix_paths(trace)
            nexts = next_uses(prefix)
            for f in fractions:
                cap = trace.capacity_blocks(f)
                best = optimal_hits(prefix, cap, nexts)
                _append(out, name, "optimal", f, cap, best.block_hit_rate, None, 0.0)
                for policy in policies:
                    task = bar.add_task(
                        f"{name} {policy} @ {100 * f:g}%", total=len(trace.requests)
                    )
                    start = time.perf_counter()
                    res = replay(trace, cap, policy, progress=lambda n, t=task: bar.advance(t, n))
                    seconds = time.perf_counter() - start
                    _append(
                        out, name, policy, f, cap, res.block_hit_rate, res.token_hit_rate, seconds
                    )


def _append(
    out: Path,
    trace: str,
    series: str,
    fraction: float,
    capacity: int,
    block_rate: float,
    token_rate: float | None,
    seconds: float,
) -> None:
    row = {
        "trace": trace,
        "series": series,
        "fraction": fraction,
        "capacity_blocks": capacity,
        "block_hit_rate": block_rate,
        "token_hit_rate": token_rate,
        "seconds": round(seconds, 1),
    }
    with out.open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def _report(out: Path, traces: list[str]) -> None:
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    cells: dict[tuple[str, str, float], float] = {}
    for r in rows:  # the latest measurement of a cell wins
        cells[(r["trace"], r["series"], r["fraction"])] = 100 * r["block_hit_rate"]
    console = Console()
    for name in traces:
        fractions = sorted({f for (t, _, f) in cells if t == name})
        series = sorted({s for (t, s, _) in cells if t == name}, key=_series_order)
        table = Table(title=f"{name}: block hit rate (%)")
        table.add_column("series")
        for f in fractions:
            table.add_column(f"{100 * f:g}%", justify="right")
        for s in series:
            table.add_row(s, *(_cell(cells, name, s, f) for f in fractions))
        if name in BEST_KNOWN:
            table.add_row(
                "best known online",
                *(f"{BEST_KNOWN[name][FRACTIONS.index(f)]:.1f}" for f in fractions),
            )
        for s in series:
            if s in ("lru", "optimal"):
                continue
            table.add_row(
                f"{s} / lru",
                *(_ratio(cells, (name, s, f), (name, "lru", f)) for f in fractions),
            )
            if name in BEST_KNOWN:
                table.add_row(
                    f"{s} / best known",
                    *(
                        _ratio_to(cells.get((name, s, f)), BEST_KNOWN[name][FRACTIONS.index(f)])
                        for f in fractions
                    ),
                )
        console.print(table)


def _series_order(s: str) -> tuple[int, str]:
    return (0 if s == "lru" else 2 if s == "optimal" else 1, s)


def _cell(cells: dict[tuple[str, str, float], float], t: str, s: str, f: float) -> str:
    v = cells.get((t, s, f))
    return "-" if v is None else f"{v:.1f}"


def _ratio(
    cells: dict[tuple[str, str, float], float],
    a: tuple[str, str, float],
    b: tuple[str, str, float],
) -> str:
    return _ratio_to(cells.get(a), cells.get(b))


def _ratio_to(a: float | None, b: float | None) -> str:
    if a is None or not b:
        return "-"
    return f"{100 * a / b:.0f}%"


if __name__ == "__main__":
    main()
