"""Cost of the cache engine's request path: microseconds per block for lookup + allocate +
release, 1,000 sequences x 64 blocks, in four cases:

- distinct: every block new, the pool large enough (no eviction);
- shared: every sequence the same 64 blocks (all hits after the first);
- distinct+evict: every block new, the pool at 10% of them (every allocation evicts);
- half-shared+evict: 32 leading blocks shared by all, 32 distinct, the pool at 10%.

Each case runs twice: with the tokens already built ("tokens"), and building them from
trace hash ids inside the loop as ``kvpool replay`` does ("hash ids"). A baseline measured
in the same run, a minimal prefix cache (a dict of chained block keys with an OrderedDict
LRU, no pools, no storage), gives the ratio; absolute times on a shared machine mean little.

    python bench/cache_ops.py [--sequences 1000] [--blocks 64] [--policy NAME] [--out bench/results]

``--policy`` picks the engine's eviction policy (default: the config default); the results
of a policy other than the default are written as ``cache_ops_<policy>.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool_agent.cache import KVCacheManager
from kvpool_agent.cache.gc_tuning import tune_gc
from kvpool_agent.config import EVICTION_POLICIES, KvCacheConfig, ModelGeometry

TPB = 16
MODEL = ModelGeometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")


def hash_ids(case: str, n_seq: int, n_blocks: int) -> list[list[int]]:
    """Trace-style block ids per sequence (equal id = equal block and prefix)."""
    out = []
    for s in range(n_seq):
        if case == "shared":
            ids = list(range(n_blocks))
        elif case == "half-shared+evict":
            half = n_blocks // 2
            ids = list(range(half)) + [n_blocks + s * n_blocks + j for j in range(n_blocks - half)]
        else:
            ids = [s * n_blocks + j for j in range(n_blocks)]
        out.append(ids)
    return out


def to_tokens(ids: list[int]) -> list[int]:
    return [h * TPB + i for h in ids for i in range(TPB)]


def capacity(case: str, n_seq: int, n_blocks: int) -> int:
    if case.endswith("+evict"):
        return max(n_blocks + 1, n_seq * n_blocks // 10)
    return n_seq * n_blocks + 1


POLICY = [KvCacheConfig().eviction_policy]


def run_engine(case: str, seqs: list[list[int]], from_ids: bool, cap: int) -> float:
    config = KvCacheConfig(tokens_per_block=TPB, eviction_policy=POLICY[0])
    mgr = KVCacheManager.with_capacity(MODEL, config, cap)
    prebuilt = None if from_ids else [to_tokens(ids) for ids in seqs]
    start = time.perf_counter()
    for i, ids in enumerate(seqs):
        tokens = to_tokens(ids) if prebuilt is None else prebuilt[i]
        h = mgr.open_sequence(tokens, recompute_last_token=False)
        mgr.release(h.seq_id)
    return time.perf_counter() - start


def run_baseline(case: str, seqs: list[list[int]], from_ids: bool, cap: int) -> float:
    """A minimal prefix cache: chained keys, dict lookup, OrderedDict LRU of leaves-or-not."""
    lru: OrderedDict[int, None] = OrderedDict()
    prebuilt = None if from_ids else [to_tokens(ids) for ids in seqs]
    start = time.perf_counter()
    for i, ids in enumerate(seqs):
        tokens = to_tokens(ids) if prebuilt is None else prebuilt[i]
        key = 0
        for j in range(len(tokens) // TPB):
            key = hash((key, tuple(tokens[j * TPB : (j + 1) * TPB])))
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                if len(lru) > cap:
                    lru.popitem(last=False)
    return time.perf_counter() - start


CASES = ("distinct", "shared", "distinct+evict", "half-shared+evict")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs per cell")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--default-gc", action="store_true", help="keep CPython's GC thresholds")
    parser.add_argument("--policy", default=POLICY[0], choices=EVICTION_POLICIES)
    args = parser.parse_args()
    POLICY[0] = args.policy
    default = args.policy == KvCacheConfig().eviction_policy
    stem = "cache_ops" if default else f"cache_ops_{args.policy}"
    if not args.default_gc:
        tune_gc()
    n_seq, n_blocks = args.sequences, args.blocks
    total_blocks = n_seq * n_blocks
    rows = []
    runners: dict[str, Callable[[str, list[list[int]], bool, int], float]] = {
        "engine": run_engine,
        "baseline": run_baseline,
    }
    with Progress() as progress:
        task = progress.add_task("cache ops", total=len(CASES) * 2 * 2 * args.repeat)
        for case in CASES:
            seqs = hash_ids(case, n_seq, n_blocks)
            cap = capacity(case, n_seq, n_blocks)
            for from_ids in (False, True):
                row: dict[str, object] = {
                    "case": case,
                    "input": "hash ids" if from_ids else "tokens",
                }
                for name, fn in runners.items():
                    best = float("inf")
                    for _ in range(args.repeat):
                        best = min(best, fn(case, seqs, from_ids, cap))
                        progress.advance(task)
                    row[f"{name}_us_per_block"] = best / total_blocks * 1e6
                row["ratio"] = float(row["engine_us_per_block"]) / float(
                    row["baseline_us_per_block"]
                )  # type: ignore[arg-type]
                rows.append(row)
    table = Table(
        title=f"cache ops: {n_seq} sequences x {n_blocks} blocks, tokens_per_block={TPB}, "
        f"eviction_policy={args.policy}"
    )
    for col in ("case", "input", "engine us/block", "baseline us/block", "engine / baseline"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["case"]),
            str(r["input"]),
            f"{r['engine_us_per_block']:.2f}",
            f"{r['baseline_us_per_block']:.2f}",
            f"{r['ratio']:.1f}x",
        )
    Console().print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(rows, indent=2))
    _plot(rows, args.out / f"{stem}.png")


def _plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['case']}\n({r['input']})" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.bar(
        [i - 0.2 for i in x], [float(r["engine_us_per_block"]) for r in rows], 0.4, label="engine"
    )  # type: ignore[arg-type]
    ax.bar(
        [i + 0.2 for i in x],
        [float(r["baseline_us_per_block"]) for r in rows],
        0.4,
        label="baseline",
    )  # type: ignore[arg-type]
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("microseconds per block")
    ax.set_title("lookup + allocate + release per block")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
