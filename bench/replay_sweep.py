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

Traces are the shared ones (``synthetic``, ``gsp_zipf``, ``mrqa``, ``gsp_default``; skipped
when ``../shared/traces`` is absent) and the generated ones committed in ``bench/traces``
(``agentic``, ``tenants``, ``rag``, ``shift``, ``phases``, ``scan``; ``kvpool trace generate``).
For a generated trace the "best known online" figure of a cell is the best online series
measured in the same run (every registered policy and every ``--leave-one-out`` variant).

``--leave-one-out`` also replays every variant (``VARIANTS``) of the default's constants
(``vote``) and of the default's before it (``guarded``) and, for each trace in turn, chooses
the variant whose worst cell on the *other* traces is best (hit rate over the best known, and
over LRU), then reports that variant's cells on the trace left out, and the worst of them:

    python bench/replay_sweep.py --traces agentic,tenants,rag,shift,phases,scan,gsp_default \
        --policies lru,reuse-gap,mixture-v1 --leave-one-out
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import series  # bench/series.py, beside this script
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvpool_agent.cache.eviction import POLICIES
from kvpool_agent.cache.eviction.guarded import GuardedPolicy
from kvpool_agent.cache.eviction.mixture import MixturePolicy
from kvpool_agent.cache.eviction.vote import VotePolicy
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
GENERATED_DIR = Path(__file__).resolve().parent / "traces"
GENERATED = ("agentic", "tenants", "rag", "shift", "phases", "scan")
VARIANTS: dict[str, tuple[type[MixturePolicy], dict[str, float]]] = {
    **{
        f"guarded(h={h:g},y={y:g})": (GuardedPolicy, {"horizon": h, "hysteresis": y})
        for h in (0.25, 1.0)
        for y in (0.0, 0.02, 0.05)
    },
    **{f"vote(eta={e:g})": (VotePolicy, {"eta": e}) for e in (2.0, 4.0, 8.0)},
}
"""What a leave-one-out round chooses among: the default's weights' sharpness ``eta``
(``vote.py``), and the constants of the default before it (``guarded.py``: horizon,
hysteresis)."""
DEFAULT_VARIANT = f"vote(eta={VotePolicy.eta:g})"
"""The variant whose constants are the default's (its rows are the default's figures)."""
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
    parser.add_argument(
        "--leave-one-out",
        action="store_true",
        help="also replay the default's constant variants and report leave-one-out choices",
    )
    args = parser.parse_args()
    out = Path(args.out)
    traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    fractions = [float(f) for f in args.fractions.split(",")]
    policies = [p for p in args.policies.split(",") if p]
    series.register()  # guarded, mixture-v1 (bench/series.py)
    if args.leave_one_out:
        policies += _register_variants()
    if not args.report:
        out.parent.mkdir(parents=True, exist_ok=True)
        _measure(traces, policies, fractions, out)
    cells = _report(out, traces)
    if args.leave_one_out:
        _leave_one_out(cells, traces)


def trace_path(name: str) -> Path:
    """A shared trace by its short name, or a generated one in ``bench/traces``."""
    if name in TRACES:
        return TRACE_DIR / TRACES[name]
    return GENERATED_DIR / f"{name}.jsonl"


def _register_variants() -> list[str]:
    """Register each variant (``VARIANTS``) as an engine policy (they run on the Python core)."""
    return series.register(
        {name: type(name, (base,), attrs) for name, (base, attrs) in VARIANTS.items()}
    )


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
            trace = load_trace(trace_path(name))
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


Cells = dict[tuple[str, str, float], float]


def best_known(cells: Cells, trace: str, fraction: float) -> float | None:
    """The README's best known online figure, or the best online series measured here."""
    if trace in BEST_KNOWN and fraction in FRACTIONS:
        published = BEST_KNOWN[trace][FRACTIONS.index(fraction)]
    else:
        published = 0.0
    measured = [v for (t, s, f), v in cells.items() if t == trace and f == fraction]
    online = [
        v for (t, s, f), v in cells.items() if t == trace and f == fraction and s != "optimal"
    ]
    if not measured:
        return None
    return max([published, *online])


def _report(out: Path, traces: list[str]) -> Cells:
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    cells: Cells = {}
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
        table.add_row("best known online", *(_fmt(best_known(cells, name, f)) for f in fractions))
        for s in series:
            if s in ("lru", "optimal") or (s in VARIANTS and s != DEFAULT_VARIANT):
                continue
            table.add_row(
                f"{s} / lru",
                *(_ratio(cells, (name, s, f), (name, "lru", f)) for f in fractions),
            )
            table.add_row(
                f"{s} / best known",
                *(
                    _ratio_to(cells.get((name, s, f)), best_known(cells, name, f))
                    for f in fractions
                ),
            )
        console.print(table)
    return cells


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _worst(cells: Cells, series: str, traces: list[str]) -> tuple[float, str]:
    """The worst cell of ``series`` over ``traces``: min of hit / best known and hit / LRU."""
    worst = (float("inf"), "-")
    for (t, s, f), v in cells.items():
        if s != series or t not in traces:
            continue
        best = best_known(cells, t, f) or 0.0
        lru = cells.get((t, "lru", f), 0.0)
        for ratio, what in ((v / best if best else 1.0, "best"), (v / lru if lru else 1.0, "lru")):
            if ratio < worst[0]:
                worst = (ratio, f"{t} @ {100 * f:g}% vs {what}")
    return worst


def _leave_one_out(cells: Cells, traces: list[str]) -> None:
    table = Table(title="leave one out: constants chosen on the other traces, judged on this one")
    for column in ("held out", "chosen", "fit on others", "held-out worst"):
        table.add_column(column)
    overall = (float("inf"), "-")
    for held in traces:
        others = [t for t in traces if t != held]
        chosen = max(VARIANTS, key=lambda v: _worst(cells, v, others)[0])
        fit = _worst(cells, chosen, others)
        judged = _worst(cells, chosen, [held])
        overall = min(overall, judged)
        table.add_row(held, chosen, f"{100 * fit[0]:.1f}%", f"{100 * judged[0]:.1f}% ({judged[1]})")
    Console().print(table)
    Console().print(f"worst held-out cell: {100 * overall[0]:.1f}% ({overall[1]})")


def _series_order(s: str) -> tuple[int, str]:
    return (0 if s == "lru" else 2 if s == "optimal" else 1, s)


def _cell(cells: Cells, t: str, s: str, f: float) -> str:
    v = cells.get((t, s, f))
    return "-" if v is None else f"{v:.1f}"


def _ratio(
    cells: Cells,
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
