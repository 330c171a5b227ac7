"""What the policy curve (``cache/miniature.py``) costs, beside the engine it watches.

For each engine core, eviction policy and cache size it measures, in one run:

- ``engine``: the engine's own request path, microseconds per block (open + release of
  64-block sequences drawn from a Zipf popularity over distinct prefixes, its miniature's
  queue left undrained: the request path only appends sampled keys);
- ``record``: that path's share spent queueing sampled keys (the same loop with the policy
  curve off, subtracted);
- ``replay``: microseconds per sampled key for ``drain`` (every miniature steps once): in
  Python on the Python core, compiled on the compiled core (``cache/native_curves.py``);
- ``per block``: ``replay x rate``, what simulating every block's sample costs per engine
  block, and its ratio to ``engine``;
- ``budget``: the engine blocks per second whose samples fit in the agent's default CPU share
  (``limits.policy_curve_cpu_share``, 5% of a core); beyond it the oldest queued keys are
  dropped (``kvpool_prefix_cache_policy_curve_dropped_total``).

    python bench/policy_curve.py [--cores native python] [--policies lru mixture]
        [--capacities 1000 10000 100000]

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
from kvpool_agent.cache.native import native_available
from kvpool_agent.cache.native_curves import AnyPolicyMiniature
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


def new_engine(core: str, policy: str, capacity: int) -> KVCacheManager:
    config = KvCacheConfig(tokens_per_block=TPB, event_buffer_max_size=0, eviction_policy=policy)
    engine = KVCacheManager.with_capacity(MODEL, config, num_blocks=capacity, core=core)
    assert engine.core_name == core
    return engine


def engine_pass(core: str, policy: str, capacity: int, seqs: list[list[int]], curve: bool) -> float:
    """Seconds per block of the request path, with or without the policy curve."""
    engine = new_engine(core, policy, capacity)
    if not curve:
        engine.policy_curve(False)
    start = time.perf_counter()
    for tokens in seqs:
        handle = engine.open_sequence(tokens)
        engine.commit(handle.seq_id)
        engine.release(handle.seq_id)
    return (time.perf_counter() - start) / (len(seqs) * BLOCKS)


def replay_cost(core: str, policy: str, capacity: int, seqs: list[list[int]]) -> dict[str, Any]:
    """Queue every block's sample as the engine would, then time ``drain``."""
    engine = new_engine(core, policy, capacity)
    mini = engine.miniature
    assert mini is not None
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


def measure(core: str, policy: str, capacity: int, sequences: int, repeat: int) -> dict[str, Any]:
    seqs = prompts(capacity, sequences)
    with_hook = min(engine_pass(core, policy, capacity, seqs, True) for _ in range(repeat))
    without = min(engine_pass(core, policy, capacity, seqs, False) for _ in range(repeat))
    replay = replay_cost(core, policy, capacity, seqs)
    mini: AnyPolicyMiniature = replay.pop("mini")
    per_block = replay["replay_s_per_key"] * mini.rate
    share = LimitsConfig.model_validate({}).policy_curve_cpu_share
    return {
        "core": core,
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
    parser.add_argument(
        "--cores",
        nargs="+",
        choices=("native", "python"),
        default=["native", "python"] if native_available() else ["python"],
        help="engine cores: native (compiled, its curves too) and/or python",
    )
    parser.add_argument("--policies", nargs="+", default=["lru", "mixture"])
    parser.add_argument("--capacities", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--sequences", type=int, default=1500)
    parser.add_argument("--repeat", type=int, default=3, help="best of N engine passes")
    parser.add_argument("--out", type=Path, default=RESULTS / "policy_curve.json")
    args = parser.parse_args()
    if "native" in args.cores and not native_available():
        parser.error("--cores native: kvpool_native is not installed (pip install ./agent/native)")
    tune_gc()
    rows = []
    cases = [(c, p, n) for c in args.cores for p in args.policies for n in args.capacities]
    with Progress(console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("cases", total=len(cases))
        for core, policy, capacity in cases:
            progress.update(task, description=f"{core} {policy} {capacity}")
            rows.append(measure(core, policy, capacity, args.sequences, args.repeat))
            progress.advance(task)
    table = Table(title="policy curve cost (us; ratios are what to compare)")
    for col in (
        "core",
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
            r["core"],
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
