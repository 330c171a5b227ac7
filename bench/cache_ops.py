"""Cost of the cache engine's request path: microseconds per block for lookup + allocate +
release, 1,000 sequences x 64 blocks of 16 tokens, in four cases:

- distinct: every block new, the pool large enough (no eviction);
- shared: every sequence the same 64 blocks (all hits after the first);
- distinct+evict: every block new, the pool at 10% of them (every allocation evicts);
- half-shared+evict: 32 leading blocks shared by all, 32 distinct, the pool at 10%.

Each case runs with the tokens already built ("tokens") and, with ``--hash-ids``, also
building them from trace hash ids inside the loop as ``kvpool replay`` does. The engine runs
one column per ``--cores`` and ``--policies`` entry (``native:mixture``: the compiled core,
``python:mixture``: the Python one, the engine before it), and beside it, in the same rounds:

- ``minimal``: a dict of chained block keys with an OrderedDict LRU (no pools, no storage);
- ``vllm`` and ``sglang``: the real managers (``bench/baselines.py``), when this Python has
  them: run it with ``.venv-bench/bin/python`` after ``hack/bench-venv.sh``.

Rounds are interleaved (every runner once per case per round, each the best of
``--repeat``), and a cell is the median over ``--rounds``: the machine is shared and noisy,
so compare the ratios, not the absolute figures.

    python bench/cache_ops.py [--sequences 1000] [--blocks 64] [--policies mixture,lru,guarded]
        [--cores native,python] [--rounds 5] [--repeat 3] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import baselines  # bench/baselines.py, beside this script
import series  # bench/series.py
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool_agent.cache import KVCacheManager
from kvpool_agent.cache.gc_tuning import tune_gc
from kvpool_agent.cache.native import native_available
from kvpool_agent.config import KvCacheConfig, ModelGeometry

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


Runner = Callable[[str, list[list[int]], bool, int], float]
"""Seconds to serve the sequences: (case, block ids per sequence, tokens built in the loop,
capacity in blocks)."""


def engine_runner(policy: str, core: str) -> Runner:
    def run(case: str, seqs: list[list[int]], from_ids: bool, cap: int) -> float:
        config = KvCacheConfig(tokens_per_block=TPB, eviction_policy=policy)
        mgr = KVCacheManager.with_capacity(MODEL, config, cap, core=core)
        prebuilt = None if from_ids else [to_tokens(ids) for ids in seqs]
        start = time.perf_counter()
        for i, ids in enumerate(seqs):
            tokens = to_tokens(ids) if prebuilt is None else prebuilt[i]
            h = mgr.open_sequence(tokens, recompute_last_token=False)
            mgr.release(h.seq_id)
        return time.perf_counter() - start

    return run


def baseline_runner(name: str) -> Runner:
    """Times ``name``'s manager (``bench/baselines.py``) over the same loop as the engine."""

    def run(case: str, seqs: list[list[int]], from_ids: bool, cap: int) -> float:
        manager = baselines.make(name, TPB, cap, max(map(len, seqs)) * TPB)
        prebuilt = None if from_ids else [to_tokens(ids) for ids in seqs]
        start = time.perf_counter()
        for i, ids in enumerate(seqs):
            manager.serve(i, to_tokens(ids) if prebuilt is None else prebuilt[i])
        return time.perf_counter() - start

    return run


def run_minimal(case: str, seqs: list[list[int]], from_ids: bool, cap: int) -> float:
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
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs per round")
    parser.add_argument("--hash-ids", action="store_true", help="also build tokens in the loop")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--default-gc", action="store_true", help="keep CPython's GC thresholds")
    parser.add_argument(
        "--policies",
        default=f"{KvCacheConfig().eviction_policy},lru",
        help="comma-separated engine policies: the config's, and the defaults before it "
        f"({', '.join(series.EXTRA_SERIES)}, bench/series.py)",
    )
    parser.add_argument(
        "--cores",
        default="native,python",
        help="comma-separated engine cores: native (compiled) and/or python",
    )
    parser.add_argument("--stem", default="cache_ops", help="result file name stem")
    args = parser.parse_args()
    policies = series.policies(parser, args.policies)
    cores = [c for c in args.cores.split(",") if c]
    if not cores or any(c not in ("native", "python") for c in cores):
        parser.error("--cores: native and/or python")
    if "native" in cores and not native_available():
        parser.error("--cores native: kvpool_native is not installed (pip install ./agent/native)")
    if not args.default_gc:
        tune_gc()
    n_seq, n_blocks = args.sequences, args.blocks
    total_blocks = n_seq * n_blocks
    missing = {name: why for name, why in baselines.available().items() if why is not None}
    engines = [f"{c}:{p}" for c in cores for p in policies]
    runners: dict[str, Runner] = {f"{c}:{p}": engine_runner(p, c) for c in cores for p in policies}
    runners["minimal"] = run_minimal
    runners.update(
        {name: baseline_runner(name) for name in baselines.available() if name not in missing}
    )
    inputs = (False, True) if args.hash_ids else (False,)
    cells = [(case, from_ids) for case in CASES for from_ids in inputs]
    samples: dict[tuple[str, bool, str], list[float]] = {}
    with Progress() as progress:
        task = progress.add_task(
            "cache ops", total=args.rounds * len(cells) * len(runners) * args.repeat
        )
        for _ in range(args.rounds):
            for case, from_ids in cells:
                seqs = hash_ids(case, n_seq, n_blocks)
                cap = capacity(case, n_seq, n_blocks)
                for name, fn in runners.items():
                    best = float("inf")
                    for _ in range(args.repeat):
                        best = min(best, fn(case, seqs, from_ids, cap))
                        progress.advance(task)
                    samples.setdefault((case, from_ids, name), []).append(best / total_blocks * 1e6)
    rows: list[dict[str, object]] = []
    for case, from_ids in cells:
        row: dict[str, object] = {"case": case, "input": "hash ids" if from_ids else "tokens"}
        for name in runners:
            row[f"{name}_us_per_block"] = statistics.median(samples[(case, from_ids, name)])
        rows.append(row)
    table = Table(
        title=f"cache ops: µs per block, {n_seq} sequences x {n_blocks} blocks, "
        f"tokens_per_block={TPB}, median of {args.rounds} interleaved rounds "
        f"(each the best of {args.repeat})"
    )
    ratios = Table(title="engine / baseline (same run)")
    for t in (table, ratios):
        t.add_column("case")
        t.add_column("input")
    for name in runners:
        table.add_column(name, justify="right")
    refs = [r for r in ("vllm", "sglang", "minimal") if r in runners]
    if "native" in cores and "python" in cores:
        refs = [*refs, "python"]  # the compiled core against the Python one, policy by policy
    for e in engines:
        for ref in refs:
            if ref == "python" and not e.startswith("native:"):
                continue
            ratios.add_column(f"{e} / {ref}", justify="right")
    for r in rows:
        us = {name: float(r[f"{name}_us_per_block"]) for name in runners}  # type: ignore[arg-type]
        table.add_row(str(r["case"]), str(r["input"]), *(f"{us[n]:.2f}" for n in runners))
        ratios.add_row(
            str(r["case"]),
            str(r["input"]),
            *(
                f"{us[e] / us[_ref(e, ref)]:.2f}x"
                for e in engines
                for ref in refs
                if ref != "python" or e.startswith("native:")
            ),
        )
    Console().print(table)
    Console().print(ratios)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "sequences": n_seq,
        "blocks": n_blocks,
        "tokens_per_block": TPB,
        "rounds": args.rounds,
        "repeat": args.repeat,
        "runners": list(runners),
        "left_out": missing,
    }
    (args.out / f"{args.stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    _plot(rows, list(runners), args.out / f"{args.stem}.png")


def _ref(engine: str, ref: str) -> str:
    """The column an engine column is compared with (``python``: its policy on that core)."""
    return "python:" + engine.split(":", 1)[1] if ref == "python" else ref


def _plot(rows: list[dict[str, object]], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['case']}\n({r['input']})" for r in rows]
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(11, 4))
    for k, name in enumerate(names):
        xs = [i - 0.4 + width * (k + 0.5) for i in range(len(rows))]
        ax.bar(xs, [float(r[f"{name}_us_per_block"]) for r in rows], width, label=name)  # type: ignore[arg-type]
    ax.set_xticks(list(range(len(rows))), labels, fontsize=7)
    ax.set_ylabel("microseconds per block")
    ax.set_title("lookup + allocate + release per block (median of interleaved rounds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
