"""What the policy curve (``cache/miniature.py``) costs, beside the engine it watches.

For each eviction policy and cache size it measures, in one run:

- ``engine``: the engine's own request path, microseconds per block (open + release of
  64-block sequences drawn from a Zipf popularity over distinct prefixes, its miniature's
  queue left undrained: the request path only appends sampled keys);
- ``record``: that path's share spent queueing sampled keys (the same loop with the hook
  replaced by a no-op, subtracted);
- ``replay``: microseconds per sampled key for ``drain`` (every miniature steps once);
- ``per block``: ``replay x rate``, what simulating every block's sample costs per engine
  block, and its ratio to ``engine``;
- ``budget``: the engine blocks per second whose samples fit in the agent's default CPU share
  (``limits.policy_curve_cpu_share``, 5% of a core); beyond it the oldest queued keys are
  dropped (``kvpool_prefix_cache_policy_curve_dropped_total``).

    python bench/policy_curve.py [--policies lru mixture] [--capacities 1000 10000 100000]

Writes ``bench/results/policy_curve.json``. Absolute times are this machine's; the ratios
are what to compare.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool_agent.cache import KVCacheManager
from kvpool_agent.cache.gc_tuning import tune_gc
from kvpool_agent.cache.miniature import PolicyMiniature
from kvpool_agent.config import KvCacheConfig, LimitsConfig, ModelGeometry

TPB = 16
BLOCKS = 64
MODEL = ModelGeometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")
RESULTS = Path(__file__).resolve().parent / "results"
console = Console(stderr=True)


def prompts(capacity: int, count: int, seed: int = 5) -> list[list[int]]:
    """Sequences of 64 blocks: a prefix drawn by Zipf popularity from ``capacity / 16``
    distinct ones (32 blocks), then 32 blocks of their own."""
    rng = random.Random(seed)
    kinds = max(capacity // 16, 4)
    weights = [1.0 / (i + 1) for i in range(kinds)]
    out = []
    for n in range(count):
        prefix = rng.choices(range(kinds), weights=weights)[0]
        head = [prefix * 1_000_003 + j for j in range(BLOCKS // 2 * TPB)]
        tail = [(n + 1) * 7_919_993 + j for j in range(BLOCKS // 2 * TPB)]
        out.append(head + tail + [1])
    return out


def engine_pass(policy: str, capacity: int, seqs: list[list[int]], hook: bool) -> float:
    """Seconds per block of the request path, with or without the miniature's queueing."""
    config = KvCacheConfig(tokens_per_block=TPB, event_buffer_max_size=0, eviction_policy=policy)
    engine = KVCacheManager.with_capacity(MODEL, config, num_blocks=capacity)
    if not hook:
        engine.miniature.access_nodes = lambda nodes: None  # type: ignore[method-assign]
    start = time.perf_counter()
    for tokens in seqs:
        handle = engine.open_sequence(tokens)
        engine.commit(handle.seq_id)
        engine.release(handle.seq_id)
    return (time.perf_counter() - start) / (len(seqs) * BLOCKS)


def replay_cost(policy: str, capacity: int, seqs: list[list[int]]) -> dict[str, Any]:
    """Queue every block's sample as the engine would, then time ``drain``."""
    config = KvCacheConfig(tokens_per_block=TPB, event_buffer_max_size=0, eviction_policy=policy)
    engine = KVCacheManager.with_capacity(MODEL, config, num_blocks=capacity)
    mini = engine.miniature
    mini.max_pending = 1 << 30  # keep every sample for the timing
    for tokens in seqs:
        handle = engine.open_sequence(tokens)
        engine.commit(handle.seq_id)
        engine.release(handle.seq_id)
    keys = len(mini.pending)
    start = time.perf_counter()
    mini.drain()
    took = time.perf_counter() - start
    return {"keys": keys, "replay_s_per_key": took / keys if keys else 0.0, "mini": mini}


def measure(policy: str, capacity: int, sequences: int, repeat: int) -> dict[str, Any]:
    seqs = prompts(capacity, sequences)
    with_hook = min(engine_pass(policy, capacity, seqs, True) for _ in range(repeat))
    without = min(engine_pass(policy, capacity, seqs, False) for _ in range(repeat))
    replay = replay_cost(policy, capacity, seqs)
    mini: PolicyMiniature = replay.pop("mini")
    per_block = replay["replay_s_per_key"] * mini.rate
    share = LimitsConfig.model_validate({}).policy_curve_cpu_share
    return {
        "policy": policy,
        "capacity_blocks": capacity,
        "sample_rate": mini.rate,
        "miniature_blocks": mini.sizes(),
        "engine_us_per_block": with_hook * 1e6,
        "record_us_per_block": (with_hook - without) * 1e6,
        "replay_us_per_key": replay["replay_s_per_key"] * 1e6,
        "sampled_keys": replay["keys"],
        "replay_us_per_block": per_block * 1e6,
        "replay_vs_engine": per_block / with_hook if with_hook else None,
        "budget_blocks_per_s": share / per_block if per_block else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", default=["lru", "mixture"])
    parser.add_argument("--capacities", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--sequences", type=int, default=1500)
    parser.add_argument("--repeat", type=int, default=3, help="best of N engine passes")
    parser.add_argument("--out", type=Path, default=RESULTS / "policy_curve.json")
    args = parser.parse_args()
    tune_gc()
    rows = []
    with Progress(console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("cases", total=len(args.policies) * len(args.capacities))
        for policy in args.policies:
            for capacity in args.capacities:
                progress.update(task, description=f"{policy} {capacity}")
                rows.append(measure(policy, capacity, args.sequences, args.repeat))
                progress.advance(task)
    table = Table(title="policy curve cost (us; ratios are what to compare)")
    for col in (
        "policy",
        "blocks",
        "rate",
        "engine/block",
        "record/block",
        "replay/key",
        "replay/block",
        "vs engine",
        "5% budget blocks/s",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["policy"],
            f"{r['capacity_blocks']:,}",
            f"1/{round(1 / r['sample_rate'])}",
            f"{r['engine_us_per_block']:.2f}",
            f"{r['record_us_per_block']:+.2f}",
            f"{r['replay_us_per_key']:.1f}",
            f"{r['replay_us_per_block']:.2f}",
            f"{r['replay_vs_engine']:.0%}",
            f"{r['budget_blocks_per_s']:,.0f}",
        )
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": " ".join(["python", "bench/policy_curve.py", *sys.argv[1:]]), "rows": rows}
    args.out.write_text(json.dumps(doc, indent=2))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
