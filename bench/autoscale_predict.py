"""How well the autoscaler predicts a pool's hit rate at one replica more or fewer, offline.

The end-to-end test checks one prediction on the dev cluster (one trace, one size, noisy
timing). This bench checks many: for each trace and per-agent capacity it replays the trace
through pools of ``N`` engines (one ``KVCacheManager`` per replica, each request routed to
its rendezvous owner by ``kvpool_agent.client``'s key, as ``PoolClient`` does), and for
every ``N`` takes the operator's ``Observation`` of the second half of the trace (the
agents' token counters and their summed miss-ratio curves, the first half being warm-up),
asks the operator's ``autoscaler.predict`` for ``N - 1`` and ``N + 1`` replicas, and compares
with what the pools of those sizes measured over the same requests.

    python bench/autoscale_predict.py                       # generated traces, ~15 min
    python bench/autoscale_predict.py --traces ../shared/traces/gsp_default_bs16.jsonl

The predictor under test is the operator's; ``additive`` and ``relative`` are its two
halves (``predict`` is their mean), reported beside it to show which way each errs.
Writes ``bench/results/autoscale_predict.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool_agent.cache.gc_tuning import tune_gc
from kvpool_agent.cache.manager import KVCacheManager
from kvpool_agent.cache.mrc import BOUNDS
from kvpool_agent.client import DEFAULT_AFFINITY_BLOCKS, affinity_key, rendezvous_rank
from kvpool_agent.config import KvCacheConfig
from kvpool_agent.replay.runner import REPLAY_MODEL, block_tokens
from kvpool_agent.traces import Trace, load_trace
from kvpool_operator.autoscaler import predict
from kvpool_operator.metrics import Curve, Observation

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
GENERATED = sorted((REPO / "bench" / "traces").glob("*.jsonl"))
console = Console(stderr=True)
ESTIMATORS = (
    "predicted",
    "lru_curve",
    "additive",
    "relative",
    "policy_curve",
    "policy_anchored",
)
"""``predicted``: the operator's ``predict`` on what the agents export (the policy curve of
their miniature simulations, the LRU curve beyond its ratios); ``lru_curve``: the same
without the policy curve (older agents, or ``policy_curve_cpu_share: 0``); ``additive``,
``relative``: the LRU rule's two halves; ``policy_curve``: the policy's own curve under the
``1/N`` split, exact (each replica's stream replayed at ``K/N`` of its capacity);
``policy_anchored``: that exact curve's change added to the measured hit rate (what the
miniatures estimate)."""


@dataclass
class PoolRun:
    """What a pool of ``replicas`` engines did over the measured half of a trace."""

    replicas: int
    queries: int
    hits: int
    curve: Curve
    policy: Curve
    """The agents' summed policy curves (``cache/miniature.py``) over the measured half."""
    streams: list[list[tuple[int, list[int]]]]
    """Each replica's requests in order: (index in the trace, tokens)."""

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def observation(self) -> Observation:
        return Observation(
            at=0.0,
            queries=float(self.queries),
            hits=float(self.hits),
            capacity_misses=0.0,
            blocks_used=1.0,
            blocks_total=1.0,
            agents=self.replicas,
            curve=self.curve,
            policy_curve=self.policy,
        )


def run_pool(trace: Trace, replicas: int, capacity: int, policy: str) -> PoolRun:
    """Replay ``trace`` through ``replicas`` engines of ``capacity`` blocks each."""
    size = trace.block_size
    config = KvCacheConfig(tokens_per_block=size, event_buffer_max_size=0, eviction_policy=policy)
    names = [f"http://pool-{i}.pool.ns.svc:8000" for i in range(replicas)]
    engines = {
        n: KVCacheManager.with_capacity(REPLAY_MODEL, config, num_blocks=capacity) for n in names
    }
    half = len(trace.requests) // 2
    marks: dict[str, tuple[int, int, tuple[float, ...], tuple[int, ...], int]] = {}
    streams: dict[str, list[tuple[int, list[int]]]] = {n: [] for n in names}
    for i, request in enumerate(trace.requests):
        if i == half:
            for n, e in engines.items():
                snap = e.mrc.snapshot(adjusted=False)
                mini = e.miniature.snapshot()
                marks[n] = (
                    e.stats.queries_tokens,
                    sum(e.stats.hits_tokens),
                    snap.cumulative,
                    mini.hits,
                    mini.accesses,
                )
        if not request.hash_ids:
            continue
        tokens: list[int] = []
        for h in request.hash_ids:
            tokens.extend(block_tokens(h, size))
        key = affinity_key(tokens, size, DEFAULT_AFFINITY_BLOCKS)
        owner = rendezvous_rank(key, names)[0]
        streams[owner].append((i, tokens))
        engine = engines[owner]
        handle = engine.open_sequence(tokens, recompute_last_token=False)
        engine.release(handle.seq_id)
        engine.miniature.drain()  # the agent drains between requests
    queries = hits = 0
    cumulative = [0.0] * (len(BOUNDS) + 1)
    ratios = next(iter(engines.values())).miniature.ratios
    policy_hits = [0] * len(ratios)
    policy_accesses = 0
    for n, e in engines.items():
        q0, h0, c0, m0, a0 = marks[n]
        mini = e.miniature.snapshot()
        policy_accesses += mini.accesses - a0
        for j, (a, b) in enumerate(zip(mini.hits, m0, strict=True)):
            policy_hits[j] += a - b
        queries += e.stats.queries_tokens - q0
        hits += sum(e.stats.hits_tokens) - h0
        now = e.mrc.snapshot(adjusted=False).cumulative
        for j, (a, b) in enumerate(zip(now, c0, strict=True)):
            cumulative[j] += a - b
    curve = Curve(BOUNDS, tuple(cumulative[:-1]), cumulative[-1])
    policy_curve = Curve(ratios, tuple(float(h) for h in policy_hits), float(policy_accesses))
    return PoolRun(replicas, queries, hits, curve, policy_curve, list(streams.values()))


def policy_curve(run: PoolRun, trace: Trace, capacity: int, policy: str) -> float:
    """The pool's hit rate if each replica's own stream met a cache of ``capacity`` blocks
    of the engine's policy: the policy's own miss-ratio curve under the ``1/N`` split (the
    exact figure a sampled miniature simulation of the policy would estimate)."""
    size = trace.block_size
    config = KvCacheConfig(tokens_per_block=size, event_buffer_max_size=0, eviction_policy=policy)
    half = len(trace.requests) // 2
    queries = hits = 0
    for stream in run.streams:
        engine = KVCacheManager.with_capacity(REPLAY_MODEL, config, num_blocks=capacity)
        stats = engine.stats
        mark: tuple[int, int] | None = None
        for i, tokens in stream:
            if mark is None and i >= half:
                mark = (stats.queries_tokens, sum(stats.hits_tokens))
            handle = engine.open_sequence(tokens, recompute_last_token=False)
            engine.release(handle.seq_id)
        if mark is not None:
            queries += stats.queries_tokens - mark[0]
            hits += sum(stats.hits_tokens) - mark[1]
    return hits / queries if queries else 0.0


def halves(obs: Observation, replicas: int) -> tuple[float | None, float | None]:
    """The two estimates ``predict`` averages (additive and relative edge over LRU)."""
    if obs.curve is None or obs.hit_rate is None:
        return None, None
    here = obs.curve.hit_ratio(1.0)
    there = obs.curve.hit_ratio(replicas / obs.agents)
    if here is None or there is None:
        return None, None
    additive = min(max(obs.hit_rate + there - here, 0.0), 1.0)
    if here >= 1.0:
        return additive, additive
    relative = 1.0 - (1.0 - obs.hit_rate) * (1.0 - there) / (1.0 - here)
    return additive, min(max(relative, 0.0), 1.0)


def unique_blocks(trace: Trace) -> int:
    return len({h for r in trace.requests for h in r.hash_ids})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, nargs="+", default=GENERATED)
    parser.add_argument(
        "--capacities",
        type=float,
        nargs="+",
        default=[0.02, 0.05, 0.1],
        help="per-agent capacity as a fraction of the trace's distinct blocks",
    )
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--policy", default="mixture", help="eviction policy of the engines")
    parser.add_argument("--limit", type=int, default=None, help="first N requests of a trace")
    parser.add_argument("--out", type=Path, default=RESULTS / "autoscale_predict.json")
    args = parser.parse_args()
    tune_gc()
    traces = [load_trace(p).head(args.limit) for p in args.traces]
    jobs = len(traces) * len(args.capacities) * len(args.replicas)
    rows: list[dict[str, Any]] = []
    with Progress(console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("pools", total=jobs)
        for trace in traces:
            distinct = unique_blocks(trace)
            longest = max(len(r.hash_ids) for r in trace.requests)
            for fraction in args.capacities:
                capacity = max(int(distinct * fraction), longest + 1)
                runs = {}
                for n in args.replicas:
                    progress.update(task, description=f"{trace.name} {fraction:.0%} x{n}")
                    runs[n] = run_pool(trace, n, capacity, args.policy)
                    progress.advance(task)
                for n, run in runs.items():
                    obs = run.observation()
                    for k in (n - 1, n + 1):
                        if k not in runs:
                            continue
                        additive, relative = halves(obs, k)
                        mini = max(int(capacity * k / n), longest + 1)
                        own = policy_curve(run, trace, mini, args.policy)
                        anchored = min(
                            max(
                                run.hit_rate
                                + own
                                - policy_curve(run, trace, capacity, args.policy),
                                0.0,
                            ),
                            1.0,
                        )
                        rows.append(
                            {
                                "trace": trace.name,
                                "capacity_fraction": fraction,
                                "capacity_blocks": capacity,
                                "from": n,
                                "to": k,
                                "measured_from": run.hit_rate,
                                "measured": runs[k].hit_rate,
                                "predicted": predict(obs, k),
                                "lru_curve": predict(replace(obs, policy_curve=None), k),
                                "additive": additive,
                                "relative": relative,
                                "policy_curve": own,
                                "policy_anchored": anchored,
                            }
                        )
    report(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": " ".join(["python", "bench/autoscale_predict.py", *sys.argv[1:]])}
    doc |= {"policy": args.policy, "rows": rows, "summary": summary(rows)}
    args.out.write_text(json.dumps(doc, indent=2))
    plot(rows, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Absolute error in points of hit rate, per estimator and direction."""
    out: dict[str, dict[str, float]] = {}
    for name in ESTIMATORS:
        for direction, keep in (("up", 1), ("down", -1)):
            errors = [
                100 * abs(r[name] - r["measured"])
                for r in rows
                if r.get(name) is not None and (r["to"] - r["from"]) == keep
            ]
            if errors:
                errors.sort()
                out[f"{name} {direction}"] = {
                    "median": statistics.median(errors),
                    "p90": errors[min(len(errors) - 1, int(0.9 * len(errors)))],
                    "max": errors[-1],
                    "within_5": sum(e <= 5 for e in errors) / len(errors),
                }
    return out


def report(rows: list[dict[str, Any]]) -> None:
    table = Table(title="hit rate predicted at one replica more or fewer vs measured (%)")
    for col in ("trace", "cap", "N -> K", "at N", "at K", *ESTIMATORS):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["trace"],
            f"{r['capacity_fraction']:.0%}",
            f"{r['from']} -> {r['to']}",
            f"{100 * r['measured_from']:.1f}",
            f"{100 * r['measured']:.1f}",
            *(_err(r.get(k), r["measured"]) for k in ESTIMATORS),
        )
    Console().print(table)
    table = Table(title="absolute error, points of hit rate")
    for col in ("estimator", "median", "p90", "max", "within 5 points"):
        table.add_column(col, justify="right")
    for name, s in summary(rows).items():
        table.add_row(
            name, f"{s['median']:.1f}", f"{s['p90']:.1f}", f"{s['max']:.1f}", f"{s['within_5']:.0%}"
        )
    Console().print(table)


def _err(value: float | None, measured: float) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f} ({100 * (value - measured):+.1f})"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    for name, marker in (("predicted", "o"), ("policy_curve", "s"), ("policy_anchored", "D")):
        pts = [(r["measured"], r[name]) for r in rows if r.get(name) is not None]
        ax.scatter(
            [100 * m for m, _ in pts], [100 * p for _, p in pts], label=name, marker=marker, s=18
        )
    ax.plot([0, 100], [0, 100], color="grey", linewidth=1)
    ax.fill_between([0, 100], [-5, 95], [5, 105], color="grey", alpha=0.15, label="within 5")
    ax.set_xlabel("measured hit rate at K replicas (%)")
    ax.set_ylabel("predicted from N = K -/+ 1 (%)")
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)
    ax.set_title("Autoscaler prediction at one replica more or fewer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
