"""``kvpool plan TRACE --target-hit-rate R``: how big a pool must be to reach a hit rate.

Searches the capacity (in blocks) at which the default eviction policy, replayed through
the engine, reaches the target block hit rate on the trace, and the capacity the offline
optimum would need; with ``--model`` it converts both to GiB for that model geometry.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

HELP = "Capacity planning: blocks (and GiB for a model) a pool needs to reach a hit rate."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="trace file (JSON Lines with hash_ids per request)")
    parser.add_argument(
        "--target-hit-rate",
        type=float,
        required=True,
        help="block hit rate to reach, as a share (0.5) or a percentage (50)",
    )
    parser.add_argument(
        "--model",
        help="model geometry: a YAML/JSON file (a ModelGeometry or an agent config) or "
        "inline layers=32,kv_heads=8,head_dim=128[,dtype=bfloat16]",
    )
    parser.add_argument(
        "--policy", help="eviction policy to plan for (default: the config default)"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.02,
        help="relative precision of the policy's capacity (each probe is a full replay; "
        "default %(default)s)",
    )
    parser.add_argument("--limit", type=int, help="use only the first N requests")
    parser.add_argument(
        "--block-size", type=int, help="tokens per trace block (default: inferred from the file)"
    )
    parser.add_argument("--json", action="store_true", help="print the answer as one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvpool_agent.cache.eviction import POLICIES
    from kvpool_agent.config import ConfigError, KvCacheConfig
    from kvpool_agent.replay.optimal import next_uses, optimal_hits
    from kvpool_agent.replay.plan import bytes_per_block, parse_geometry, smallest_capacity
    from kvpool_agent.replay.prefix import prefix_paths
    from kvpool_agent.replay.runner import replay
    from kvpool_agent.traces import load_trace

    target = args.target_hit_rate
    if target > 1.0:
        target /= 100.0
    if not 0.0 < target <= 1.0:
        raise ConfigError(
            f"--target-hit-rate must be in (0, 1] or (0, 100], got {args.target_hit_rate}"
        )
    if args.tolerance < 0:
        raise ConfigError(f"--tolerance must be non-negative, got {args.tolerance}")
    policy = args.policy or KvCacheConfig().eviction_policy
    if policy not in POLICIES:
        raise ConfigError(f"--policy: unknown {policy!r}; choose from {', '.join(POLICIES)}")
    model = parse_geometry(args.model) if args.model else None
    trace = load_trace(args.trace, block_size=args.block_size).head(args.limit)
    unique = trace.unique_blocks()
    longest = max(len(r.hash_ids) for r in trace.requests)

    prefix = prefix_paths(trace)
    nexts = next_uses(prefix)
    ceiling = optimal_hits(prefix, unique, nexts).block_hit_rate
    best = smallest_capacity(
        lambda cap: optimal_hits(prefix, cap, nexts).block_hit_rate,
        target,
        unique,
        max_rate=ceiling,
    )
    with _progress(not args.json) as bar:
        task = bar.add_task(f"searching {policy}", total=None)

        def policy_rate(cap: int) -> float:
            bar.update(task, description=f"{policy} @ {cap} blocks")
            return replay(trace, cap, policy).block_hit_rate

        online = smallest_capacity(
            policy_rate,
            target,
            unique,
            # No online policy beats the optimum, so its capacity is a lower bound.
            min_blocks=max(longest, best.capacity_blocks or 1),
            rel_tol=args.tolerance,
            max_rate=ceiling,
        )
    block_bytes = bytes_per_block(model, trace.block_size) if model is not None else None
    out: dict[str, Any] = {
        "trace": trace.name,
        "target_hit_rate": target,
        "infinite_cache_hit_rate": ceiling,
        "unique_blocks": unique,
        "block_size": trace.block_size,
        "policy": policy,
        "policy_blocks": online.capacity_blocks,
        "policy_hit_rate": online.hit_rate,
        "policy_probes": online.probes,
        "optimal_blocks": best.capacity_blocks,
        "optimal_hit_rate": best.hit_rate,
        "bytes_per_block": block_bytes,
        "policy_gib": _gib(online.capacity_blocks, block_bytes),
        "optimal_gib": _gib(best.capacity_blocks, block_bytes),
    }
    if args.json:
        print(json.dumps(out))
        return 0 if online.capacity_blocks is not None else 1
    print(f"{trace.name}: target block hit rate {100 * target:.1f}%")
    if online.capacity_blocks is None:
        print(
            f"out of reach: even an unbounded cache hits {100 * ceiling:.1f}% "
            "(the rest are first uses)"
        )
        return 1
    gib = f", {out['policy_gib']:.2f} GiB" if block_bytes else ""
    print(
        f"{policy}: {online.capacity_blocks} blocks{gib} "
        f"({100 * online.capacity_blocks / unique:.1f}% of unique; "
        f"hits {100 * (online.hit_rate or 0):.1f}%, {online.probes} replays)"
    )
    gib = f", {out['optimal_gib']:.2f} GiB" if block_bytes else ""
    print(
        f"optimum: {best.capacity_blocks} blocks{gib} "
        f"({100 * (best.capacity_blocks or 0) / unique:.1f}% of unique)"
    )
    if block_bytes:
        print(f"({block_bytes} bytes per {trace.block_size}-token block for this model)")
    return 0


def _gib(blocks: int | None, block_bytes: int | None) -> float | None:
    if blocks is None or block_bytes is None:
        return None
    return blocks * block_bytes / float(1 << 30)


def _progress(enabled: bool) -> Any:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )
