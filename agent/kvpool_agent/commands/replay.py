"""``kvpool replay TRACE``: replay a workload trace through the real cache engine.

Prints block and token hit rates for one capacity and policy (``--optimal`` adds the
offline optimum), or with ``--sweep`` replays every policy at several capacities and writes
a PNG of hit rate against capacity.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

HELP = "Replay a prefix trace through the cache engine and report hit rates (or --sweep)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="trace file (JSON Lines with hash_ids per request)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--capacity", type=int, help="pool capacity in blocks")
    size.add_argument(
        "--capacity-fraction",
        type=float,
        help="pool capacity as a share of the trace's unique blocks (default 0.10)",
    )
    parser.add_argument(
        "--policy", help="eviction policy within a priority (default: the config default)"
    )
    parser.add_argument(
        "--optimal", action="store_true", help="also compute the offline optimum (Belady MIN)"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument(
        "--limit",
        type=int,
        help="replay only the first N requests (a subsample for quick looks; capacities "
        "are then shares of the subsample's unique blocks)",
    )
    parser.add_argument(
        "--block-size", type=int, help="tokens per trace block (default: inferred from the file)"
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="replay every policy at several capacities and write a PNG",
    )
    parser.add_argument(
        "--policies", help="comma-separated policies for --sweep (default: all registered)"
    )
    parser.add_argument(
        "--fractions",
        default="0.01,0.05,0.10,0.25",
        help="comma-separated capacity shares for --sweep (default %(default)s)",
    )
    parser.add_argument("--output", help="PNG path for --sweep (default: TRACE-STEM-sweep.png)")


def run(args: argparse.Namespace) -> int:
    from kvpool_agent.cache.gc_tuning import tune_gc
    from kvpool_agent.config import ConfigError, KvCacheConfig
    from kvpool_agent.traces import load_trace

    tune_gc()  # a replay builds a tree of up to millions of nodes: default GC would dominate
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {args.limit}")
    trace = load_trace(args.trace, block_size=args.block_size).head(args.limit)
    if args.sweep:
        return _run_sweep(args, trace)
    policy = args.policy or KvCacheConfig().eviction_policy
    _check_policies([policy])
    if args.capacity is not None:
        if args.capacity < 1:
            raise ConfigError(f"--capacity must be at least 1 block, got {args.capacity}")
        capacity = args.capacity
    else:
        capacity = trace.capacity_blocks(args.capacity_fraction or 0.10)
    return _run_one(args, trace, policy, capacity)


def _check_policies(names: list[str]) -> None:
    from kvpool_agent.cache.eviction import POLICIES
    from kvpool_agent.config import ConfigError

    for name in names:
        if name not in POLICIES:
            raise ConfigError(f"--policy: unknown {name!r}; choose from {', '.join(POLICIES)}")


def _progress(enabled: bool) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )


def _run_one(args: argparse.Namespace, trace: Any, policy: str, capacity: int) -> int:
    from kvpool_agent.cache.errors import RequestTooLargeError
    from kvpool_agent.config import ConfigError
    from kvpool_agent.replay.optimal import optimal_hits
    from kvpool_agent.replay.prefix import prefix_paths
    from kvpool_agent.replay.runner import replay

    with _progress(not args.json) as bar:
        task = bar.add_task(f"{trace.name} {policy} @ {capacity} blocks", total=len(trace.requests))
        try:
            result = replay(trace, capacity, policy, progress=lambda n: bar.advance(task, n))
        except RequestTooLargeError as err:
            raise ConfigError(f"--capacity {capacity} is too small for this trace: {err}") from None
    out: dict[str, Any] = {
        "trace": trace.name,
        "block_size": trace.block_size,
        "unique_blocks": trace.unique_blocks(),
        "capacity_fraction": capacity / trace.unique_blocks(),
        **result.as_dict(),
    }
    if args.optimal:
        best = optimal_hits(prefix_paths(trace), capacity)
        out["optimal_hit_blocks"] = best.hit_blocks
        out["optimal_block_hit_rate"] = best.block_hit_rate
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"{trace.name}: {result.requests} requests, {result.query_blocks} blocks of "
        f"{trace.block_size} tokens ({out['unique_blocks']} unique)"
    )
    print(
        f"capacity {capacity} blocks ({100 * out['capacity_fraction']:.1f}% of unique), "
        f"policy {policy}"
    )
    print(f"block hit rate  {100 * result.block_hit_rate:6.2f}%  ({result.hit_blocks} blocks)")
    print(f"token hit rate  {100 * result.token_hit_rate:6.2f}%  ({result.hit_tokens} tokens)")
    if args.optimal:
        print(
            f"optimum         {100 * out['optimal_block_hit_rate']:6.2f}%  "
            f"({out['optimal_hit_blocks']} blocks)"
        )
    return 0


def _run_sweep(args: argparse.Namespace, trace: Any) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvpool_agent.cache.eviction import POLICIES
    from kvpool_agent.config import ConfigError
    from kvpool_agent.replay.sweep import OPTIMAL, plot_sweep, sweep

    policies = (
        [p.strip() for p in args.policies.split(",") if p.strip()]
        if args.policies
        else list(POLICIES)
    )
    _check_policies(policies)
    try:
        fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    except ValueError:
        raise ConfigError(f"--fractions: expected numbers, got {args.fractions!r}") from None
    if not fractions or any(f <= 0 for f in fractions):
        raise ConfigError(f"--fractions: expected positive shares, got {args.fractions!r}")
    with _progress(not args.json) as bar:

        def progress_for(policy: str, fraction: float) -> Any:
            task = bar.add_task(f"{policy} @ {100 * fraction:g}%", total=len(trace.requests))
            return lambda n: bar.advance(task, n)

        points = sweep(trace, policies, fractions, progress_for=progress_for)
    output = args.output or f"{trace.name}-sweep.png"
    plot_sweep(points, f"{trace.name}: block hit rate by capacity", output)
    if args.json:
        print(
            json.dumps(
                {
                    "trace": trace.name,
                    "png": str(output),
                    "points": [
                        {
                            "series": p.series,
                            "fraction": p.fraction,
                            "capacity_blocks": p.capacity_blocks,
                            "block_hit_rate": p.block_hit_rate,
                            "token_hit_rate": p.token_hit_rate,
                        }
                        for p in points
                    ],
                }
            )
        )
        return 0
    table = Table(title=f"{trace.name}: block hit rate (%) by capacity")
    table.add_column("series")
    for f in fractions:
        table.add_column(f"{100 * f:g}%", justify="right")
    for name in [*policies, OPTIMAL]:
        row = {p.fraction: p for p in points if p.series == name}
        table.add_row(name, *(f"{100 * row[f].block_hit_rate:.1f}" for f in fractions))
    Console().print(table)
    print(f"wrote {output}")
    return 0
