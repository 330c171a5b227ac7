"""Where the autoscaler's prediction errs, in process: the key sample, and the ``1/N`` model.

``bench/autoscale_e2e.py`` measured the 2 -> 1 prediction 2 to 5 points high on the dev
cluster in every run. This bench replays the cluster's sequence in process
(``KVCacheManager`` per replica, the story's slice of 300 requests routed to each replica's
rendezvous owner, 5,120 blocks per agent, every key salted by the tenant as the agents salt
it): six rounds at one replica, ten at two (the first keeping its cache), fourteen back at
one (the survivor keeping its own). Two rings of replica names: those of the cluster's run
3 (its agents' loopback proxies), and a StatefulSet's DNS names. It compares:

- down: ``autoscaler.predict`` at 1 from the last round at 2 (the operator's observation:
  token counters, summed curves) against the mean hit rate of rounds 6-14 back at 1;
- up: the prediction at 2 from the last round at 1 against the mean of rounds 4-10 at 2;

with two curves moving the same anchor (the measured rate):

- the agents' own, their miniatures (``cache/miniature.py``) on a spatial sample of the
  keys, for several key samples (the tenant name salts every key, so the sample is fixed
  per tenant: ``default``, ``t1``, ...) and several ``min_blocks`` (the fewest blocks the
  smallest miniature keeps, which sets the sampling rate);
- the exact curve under the same ``1/N`` model: each replica's share replayed alone through
  the policy at ``K/N`` of its capacity, with no sampling.

So the error splits into what the ``1/N`` model itself misses (the exact row) and what the
sample adds (the miniature rows, by ``min_blocks``).

    python bench/autoscale_sampling.py [--min-blocks 64 128 256 2048] [--samples 12]

Writes ``bench/results/autoscale_sampling.{json,png}``. Deterministic: no timing involved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool_agent.cache.gc_tuning import tune_gc
from kvpool_agent.cache.manager import KVCacheManager
from kvpool_agent.cache.miniature import RATIOS, PolicyMiniature
from kvpool_agent.cache.mrc import BOUNDS
from kvpool_agent.client import DEFAULT_AFFINITY_BLOCKS, affinity_key, rendezvous_rank, stable_url
from kvpool_agent.config import KvCacheConfig
from kvpool_agent.drive import request_tokens
from kvpool_agent.replay.runner import REPLAY_MODEL
from kvpool_agent.replay.synth import SAMPLE_TRACE
from kvpool_agent.server.service import tenant_salt
from kvpool_agent.traces import Trace, load_trace
from kvpool_operator.autoscaler import predict
from kvpool_operator.metrics import Curve, Observation

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
console = Console(stderr=True, width=150)
SLICE = 300
BLOCKS = 5120
TOKENS_PER_BLOCK = 16
ROUNDS = (6, 10, 14)
"""Rounds at one replica, then at two, then back at one."""
RINGS: dict[str, tuple[str, str]] = {
    "cluster": ("http://127.0.0.1:37915", "http://127.0.0.1:43089"),
    "statefulset": tuple(stable_url(f"story-{i}", "story", "bench", 8000) for i in range(2)),
}
"""Ring names of the two replicas: those of ``bench/autoscale_e2e.py``'s run 3 (the dev
cluster ranks its agents' loopback proxies), and a StatefulSet's DNS names."""


@dataclass
class _Mark:
    queries: int
    hits: int
    lru: tuple[float, ...]
    policy: tuple[int, ...]
    accesses: int


def _mark(engine: KVCacheManager) -> _Mark:
    hits, accesses = _policy_counts(engine)
    return _Mark(
        engine.stats.queries_tokens,
        sum(engine.stats.hits_tokens),
        tuple(engine.mrc.snapshot(adjusted=False).cumulative),
        hits,
        accesses,
    )


def _policy_counts(engine: KVCacheManager) -> tuple[tuple[int, ...], int]:
    """Hits per ratio and accesses of the policy curve."""
    mini = engine.miniature
    assert mini is not None
    snap = mini.snapshot()
    return snap.hits, snap.accesses


class Pool:
    """Replicas of one run: engines by ring name, fed as ``PoolClient`` routes."""

    def __init__(self, trace: Trace, ring: tuple[str, str], salt: str, min_blocks: int) -> None:
        config = KvCacheConfig(
            tokens_per_block=TOKENS_PER_BLOCK, event_buffer_max_size=0, enable_partial_reuse=False
        )
        self.trace, self.salt = trace, salt
        self.engines: dict[str, KVCacheManager] = {}
        for name in ring:
            engine = KVCacheManager.with_capacity(REPLAY_MODEL, config, num_blocks=BLOCKS)
            engine.miniature = PolicyMiniature(
                config.eviction_policy, BLOCKS, min_blocks=min_blocks
            )
            self.engines[name] = engine
        self.rate = PolicyMiniature(config.eviction_policy, BLOCKS, min_blocks=min_blocks).rate

    def round(self, live: list[str]) -> Observation:
        """One pass of the slice through the ``live`` replicas; what the operator observes."""
        marks = {n: _mark(self.engines[n]) for n in live}
        for request in self.trace.requests:
            if not request.hash_ids:
                continue
            tokens = request_tokens(request, TOKENS_PER_BLOCK)
            key = affinity_key(tokens, TOKENS_PER_BLOCK, DEFAULT_AFFINITY_BLOCKS)
            owner = rendezvous_rank(key, live)[0]
            engine = self.engines[owner]
            handle = engine.open_sequence(tokens, cache_salt=self.salt, recompute_last_token=False)
            engine.release(handle.seq_id)
            mini = engine.miniature
            assert mini is not None
            mini.drain()  # the agent drains between requests
        return self._observe(live, marks)

    def _observe(self, live: list[str], marks: dict[str, _Mark]) -> Observation:
        queries = hits = accesses = 0
        lru = [0.0] * (len(BOUNDS) + 1)
        policy: list[float] | None = None
        for name in live:
            engine, before = self.engines[name], marks[name]
            now_hits, now_accesses = _policy_counts(engine)
            policy = policy or [0.0] * len(RATIOS)
            accesses += now_accesses - before.accesses
            for j, (now, was) in enumerate(zip(now_hits, before.policy, strict=True)):
                policy[j] += now - was
            queries += engine.stats.queries_tokens - before.queries
            hits += sum(engine.stats.hits_tokens) - before.hits
            cumulative = engine.mrc.snapshot(adjusted=False).cumulative
            for j, (now_c, was_c) in enumerate(zip(cumulative, before.lru, strict=True)):
                lru[j] += now_c - was_c
        return Observation(
            at=0.0,
            queries=float(queries),
            hits=float(hits),
            capacity_misses=0.0,
            blocks_used=1.0,
            blocks_total=1.0,
            agents=len(live),
            curve=Curve(BOUNDS, tuple(lru[:-1]), lru[-1]),
            policy_curve=Curve(RATIOS, tuple(policy or ()), float(accesses)),
        )


def _steady(requests: list[list[int]], blocks: int, salt: str) -> tuple[int, int]:
    """Token queries and hits of rounds 7-12 of ``requests`` through one fresh engine."""
    config = KvCacheConfig(
        tokens_per_block=TOKENS_PER_BLOCK, event_buffer_max_size=0, enable_partial_reuse=False
    )
    engine = KVCacheManager.with_capacity(REPLAY_MODEL, config, num_blocks=blocks)
    engine.policy_curve(False)
    queries = hits = 0
    for i in range(12):
        q0, h0 = engine.stats.queries_tokens, sum(engine.stats.hits_tokens)
        for tokens in requests:
            handle = engine.open_sequence(tokens, cache_salt=salt, recompute_last_token=False)
            engine.release(handle.seq_id)
        if i >= 6:
            queries += engine.stats.queries_tokens - q0
            hits += sum(engine.stats.hits_tokens) - h0
    return queries, hits


def exact_model(trace: Trace, ring_name: str) -> dict[str, float]:
    """The ``1/N`` model with the policy's exact curve instead of a sample: each replica's
    share of the slice replayed alone through the policy at ``K/N`` of its capacity."""
    ring = RINGS[ring_name]
    salt = tenant_salt("default", None) or ""
    shares: dict[str, list[list[int]]] = {name: [] for name in ring}
    whole: list[list[int]] = []
    for request in trace.requests:
        if request.hash_ids:
            tokens = request_tokens(request, TOKENS_PER_BLOCK)
            key = affinity_key(tokens, TOKENS_PER_BLOCK, DEFAULT_AFFINITY_BLOCKS)
            shares[rendezvous_rank(key, ring)[0]].append(tokens)
            whole.append(tokens)

    def rate(parts: list[list[list[int]]], blocks: int) -> float:
        counts = [_steady(part, blocks, salt) for part in parts]
        return sum(h for _, h in counts) / sum(q for q, _ in counts)

    return {
        "at_2_half": rate(list(shares.values()), BLOCKS // 2),
        "at_2_whole": rate(list(shares.values()), BLOCKS),
        "at_1_whole": rate([whole], BLOCKS),
        "at_1_double": rate([whole], 2 * BLOCKS),
    }


def one_run(
    trace: Trace,
    ring_name: str,
    tenant: str,
    min_blocks: int,
    exact: dict[str, float],
) -> dict[str, Any]:
    ring = RINGS[ring_name]
    pool = Pool(trace, ring, tenant_salt(tenant, None) or "", min_blocks)
    at1 = [pool.round([ring[0]]) for _ in range(ROUNDS[0])]
    at2 = [pool.round(list(ring)) for _ in range(ROUNDS[1])]
    back = [pool.round([ring[0]]) for _ in range(ROUNDS[2])]
    measured_down = statistics.fmean(o.hit_rate or 0.0 for o in back[5:])
    measured_up = statistics.fmean(o.hit_rate or 0.0 for o in at2[3:])
    down, up = predict(at2[-1], 1), predict(at1[-1], 2)
    # The same anchor (the measured rate), moved by the exact curve instead of the sample's.
    model_down = (at2[-1].hit_rate or 0.0) + exact["at_2_half"] - exact["at_2_whole"]
    model_up = (at1[-1].hit_rate or 0.0) + exact["at_1_double"] - exact["at_1_whole"]
    return {
        "ring": ring_name,
        "tenant": tenant,
        "min_blocks": min_blocks,
        "rate": pool.rate,
        "rounds_at_1": [o.hit_rate for o in at1],
        "rounds_at_2": [o.hit_rate for o in at2],
        "rounds_back_at_1": [o.hit_rate for o in back],
        "predicted_down": down,
        "measured_down": measured_down,
        "error_down": None if down is None else down - measured_down,
        "predicted_up": up,
        "measured_up": measured_up,
        "error_up": None if up is None else up - measured_up,
        "exact_model_down": model_down,
        "error_model_down": model_down - measured_down,
        "exact_model_up": model_up,
        "error_model_up": model_up - measured_up,
    }


def summary(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    errors = [r[key] for r in rows if r[key] is not None]
    return {
        "mean": statistics.fmean(errors),
        "max_abs": max(abs(e) for e in errors),
        "within_5": sum(abs(e) <= 0.05 for e in errors) / len(errors),
    }


def report(rows: list[dict[str, Any]], min_blocks: list[int]) -> dict[str, Any]:
    table = Table(title="prediction error, points (predicted - measured), both rings")
    for col in ("curve", "rate", "down: mean", "down: max |err|", "down: within 5"):
        table.add_column(col, justify="right")
    for col in ("up: mean", "up: max |err|", "up: within 5"):
        table.add_column(col, justify="right")
    out: dict[str, Any] = {}
    # The exact curve does not depend on the key sample: one row per ring.
    per_ring = [r for r in rows if r["tenant"] == "default" and r["min_blocks"] == min_blocks[0]]
    groups = [("exact, 1/N model", per_ring, "error_model_down", "error_model_up", "1")]
    for mb in sorted({r["min_blocks"] for r in rows}):
        mine = [r for r in rows if r["min_blocks"] == mb]
        rates = " ".join(f"1/{round(1 / r)}" for r in sorted({r["rate"] for r in mine}))
        groups.append((f"miniatures, min_blocks {mb}", mine, "error_down", "error_up", rates))
    for label, mine, down_key, up_key, rates in groups:
        down, up = summary(mine, down_key), summary(mine, up_key)
        out[label] = {"down": down, "up": up, "rates": rates}
        table.add_row(
            label,
            rates,
            f"{100 * down['mean']:+.1f}",
            f"{100 * down['max_abs']:.1f}",
            f"{100 * down['within_5']:.0f}%",
            f"{100 * up['mean']:+.1f}",
            f"{100 * up['max_abs']:.1f}",
            f"{100 * up['within_5']:.0f}%",
        )
    console.print(table)
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = sorted({r["min_blocks"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    panels = (("down", "2 -> 1"), ("up", "1 -> 2"))
    for ax, (way, title) in zip(axes, panels, strict=True):
        for ring, marker, dx in zip(RINGS, "ox", (-0.1, 0.1), strict=False):
            mine = [r for r in rows if r["ring"] == ring]
            ax.scatter([dx], [100 * mine[0][f"error_model_{way}"]], marker=marker, color="k")
            for i, mb in enumerate(columns, start=1):
                ys = [100 * r[f"error_{way}"] for r in mine if r["min_blocks"] == mb]
                color = "tab:blue" if ring == next(iter(RINGS)) else "tab:orange"
                ax.scatter([i + dx] * len(ys), ys, marker=marker, color=color, alpha=0.7)
        ax.axhspan(-5, 5, color="green", alpha=0.08)
        ax.axhline(0, color="grey", lw=0.8)
        ticks = ["exact"] + [str(mb) for mb in columns]
        ax.set_xticks(range(len(ticks)), ticks)
        ax.set_xlabel("curve: exact; the agents' miniatures at min_blocks")
        ax.set_title(f"prediction error, {title} (o: cluster ring, x: StatefulSet ring)")
    axes[0].set_ylabel("predicted - measured (points)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--min-blocks",
        type=int,
        nargs="+",
        default=[64, 128, 256, 2048],
        help="64 is the agents' (MIN_BLOCKS); 2048 samples every key at 5,120 blocks",
    )
    parser.add_argument("--samples", type=int, default=12, help="tenant salts: default, t1, ...")
    parser.add_argument("--out", type=Path, default=RESULTS / "autoscale_sampling.json")
    args = parser.parse_args()
    tune_gc()
    trace = load_trace(SAMPLE_TRACE).head(SLICE)
    tenants = ["default"] + [f"t{i}" for i in range(1, args.samples)]
    # At a rate of 1 every key is simulated whatever the salt: one sample is enough.
    todo = [
        (mb, ring, t)
        for mb in args.min_blocks
        for ring in RINGS
        for t in (
            tenants if PolicyMiniature("mixture", BLOCKS, min_blocks=mb).rate < 1 else ["default"]
        )
    ]
    rows: list[dict[str, Any]] = []
    with Progress(console=console) as progress:
        task = progress.add_task("runs", total=len(RINGS) + len(todo))
        exact: dict[str, dict[str, float]] = {}
        for ring in RINGS:
            exact[ring] = exact_model(trace, ring)
            progress.advance(task)
        for mb, ring, tenant in todo:
            rows.append(one_run(trace, ring, tenant, mb, exact[ring]))
            progress.advance(task)
    figures = report(rows, args.min_blocks)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"summary": figures, "exact": exact, "runs": rows}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
