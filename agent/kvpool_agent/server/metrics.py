"""Prometheus metrics of one agent, in its own registry.

Cache metrics come from a custom collector that reads the engine's ``CacheStats`` and pool
usage at scrape time, so nothing is counted twice. Counters only: hit rate is
``rate(kvpool_prefix_cache_hits_tokens_total[5m])`` over
``rate(kvpool_prefix_cache_queries_tokens_total[5m])``, and the hit rate more capacity would
buy adds ``kvpool_prefix_cache_capacity_misses_tokens_total``.

The miss-ratio curve (``cache/mrc.py``) is the histogram
``kvpool_prefix_cache_reuse_distance_capacity_ratio``: accessed blocks by LRU reuse distance
as a fraction of the capacity (``le``), so bucket ``le=x`` counts the block accesses an LRU
cache ``x`` times this one would have hit: ``le<=1`` are hits by depth (``le=1`` minus
``le=0.9``: the hits the coldest 10% served), ``le>1`` capacity misses by how far beyond the
capacity (``+Inf`` adds the cold ones). The engine's own policy at other sizes
(``cache/miniature.py``) is ``kvpool_prefix_cache_policy_curve_hits_total{ratio}`` out of
``kvpool_prefix_cache_policy_curve_accesses_total``. The operator's autoscaler predicts the
hit rate at N±1 replicas from the policy curve, and from the LRU one beyond its ratios.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvpool_agent.cache.miniature import PolicyCurveSnapshot
from kvpool_agent.cache.mrc import BOUNDS

if TYPE_CHECKING:
    from kvpool_agent.server.service import AgentService

TIERS = ("primary", "secondary")

LATENCY_BUCKETS = (
    0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0
)  # fmt: skip


class CacheCollector(Collector):
    """Reads one agent's engine and service state when Prometheus scrapes."""

    def __init__(self, service: AgentService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        svc = self.service
        engine = svc.engine
        s = engine.stats

        yield _counter(
            "kvpool_prefix_cache_queries_tokens", "Prompt tokens looked up.", s.queries_tokens
        )
        hits = CounterMetricFamily(
            "kvpool_prefix_cache_hits_tokens",
            "Prompt tokens reused, by the tier they came from.",
            labels=["tier"],
        )
        for tier, value in zip(TIERS, s.hits_tokens, strict=True):
            hits.add_metric([tier], value)
        yield hits
        yield _counter(
            "kvpool_prefix_cache_capacity_misses_tokens",
            "Missed tokens whose blocks were recently evicted (a bigger cache would have hit).",
            s.capacity_miss_tokens,
        )
        curve = engine.mrc.snapshot(adjusted=False)  # counters never go down
        yield HistogramMetricFamily(
            "kvpool_prefix_cache_reuse_distance_capacity_ratio",
            "Accessed blocks (hits and stores) by LRU reuse distance as a fraction of the "
            "cache's capacity: le=x counts what a cache x times this size would have hit "
            "(sampled estimate; the miss-ratio curve).",
            buckets=[
                *(
                    (_le(bound), value)
                    for bound, value in zip(BOUNDS, curve.cumulative, strict=False)
                ),
                ("+Inf", curve.cumulative[-1]),
            ],
            sum_value=curve.distance_sum,
        )
        yield GaugeMetricFamily(
            "kvpool_prefix_cache_curve_capacity_blocks",
            "Blocks the reuse-distance histogram's fractions are of (both tiers).",
            value=curve.capacity,
        )
        yield GaugeMetricFamily(
            "kvpool_prefix_cache_curve_sample_rate",
            "Share of block keys the miss-ratio curve samples (1: exact).",
            value=curve.rate,
        )
        if engine.miniature is not None:
            yield from _policy_curve(engine.miniature.snapshot())
        evicted = CounterMetricFamily(
            "kvpool_cache_evicted_blocks", "Blocks evicted from each tier.", labels=["tier"]
        )
        for tier, value in zip(TIERS, s.evictions, strict=True):
            evicted.add_metric([tier], value)
        yield evicted
        offloaded = CounterMetricFamily(
            "kvpool_cache_offloaded_blocks",
            "Blocks copied down into a tier on eviction.",
            labels=["tier"],
        )
        offloaded.add_metric(["secondary"], s.offloads)
        yield offloaded
        onboarded = CounterMetricFamily(
            "kvpool_cache_onboarded_blocks",
            "Blocks copied back up into a tier on reuse.",
            labels=["tier"],
        )
        onboarded.add_metric(["primary"], s.onboards)
        yield onboarded
        yield _counter("kvpool_sequences_opened", "Sequences opened.", s.sequences_opened)
        core = GaugeMetricFamily(
            "kvpool_engine_core_info",
            "The core keeping the cache's books (1 for the one running): native (compiled) "
            "or python.",
            labels=["core"],
        )
        core.add_metric([engine.core_name], 1.0)
        yield core

        used = GaugeMetricFamily(
            "kvpool_cache_blocks_used",
            "Blocks in use (tree or open sequences).",
            labels=["pool", "tier"],
        )
        total = GaugeMetricFamily(
            "kvpool_cache_blocks_total", "Blocks the pool holds.", labels=["pool", "tier"]
        )
        free = GaugeMetricFamily(
            "kvpool_cache_blocks_free", "Blocks free.", labels=["pool", "tier"]
        )
        pinned = GaugeMetricFamily(
            "kvpool_cache_blocks_pinned",
            "Blocks pinned by open sequences.",
            labels=["pool", "tier"],
        )
        for row in engine.usage():
            labels = [str(row["pool"]), str(row["tier"])]
            used.add_metric(labels, float(row["blocks_used"]))
            total.add_metric(labels, float(row["blocks_total"]))
            free.add_metric(labels, float(row["blocks_free"]))
            pinned.add_metric(labels, float(row["blocks_pinned"]))
        yield from (used, total, free, pinned)
        huge = GaugeMetricFamily(
            "kvpool_cache_arena_huge_page_bytes",
            "Bytes of the tier's host arena backed by 2 MiB pages (0: 4 KiB pages, or a GPU "
            "tier); scattered copies into 4 KiB pages run slower (docs/dataplane.md).",
            labels=["tier"],
        )
        for tier, storage in zip(TIERS, engine.storage, strict=True):
            huge.add_metric([tier], float(storage.huge_page_bytes))
        yield huge
        yield GaugeMetricFamily(
            "kvpool_sequences_open", "Sequences open now.", value=engine.num_open_sequences
        )
        yield GaugeMetricFamily(
            "kvpool_cache_tree_blocks", "Reusable blocks in the radix tree.", value=engine.num_nodes
        )

        yield _counter(
            "kvpool_kv_events_published", "KV events published.", svc.publisher.published_events
        )
        yield _counter(
            "kvpool_kv_events_dropped",
            "KV events the engine's bounded queue dropped.",
            engine.events.dropped,
        )
        removed = CounterMetricFamily(
            "kvpool_kv_events_blocks_removed",
            "Blocks the KV events reported gone (their last copy), by reason (evicted, "
            "replaced, cleared, pruned): vLLM's BlockRemoved has no field for it.",
            labels=["reason"],
        )
        for reason, value in sorted(svc.publisher.encoder.removed.items()):
            removed.add_metric([reason], value)
        yield removed
        reloads = CounterMetricFamily(
            "kvpool_config_reloads", "Config file changes seen, by outcome.", labels=["result"]
        )
        r = svc.reloads
        for result, value in (
            ("applied", r.applied),
            ("restart_required", r.restart_required),
            ("invalid", r.invalid),
            ("unchanged", r.unchanged),
            ("error", r.errors),
        ):
            reloads.add_metric([result], value)
        yield reloads
        refused = CounterMetricFamily(
            "kvpool_requests_refused",
            "Requests refused before any engine work, by reason (unauthenticated, forbidden, "
            "body_too_large, body_timeout, open_sequences, pinned_blocks, malformed, "
            "transfer_connections).",
            labels=["reason"],
        )
        for reason, value in sorted(svc.refusals.items()):
            refused.add_metric([reason], value)
        yield refused
        yield _counter(
            "kvpool_sequences_expired",
            "Open sequences released after limits.sequence_idle_timeout_s without a call.",
            svc.expired_sequences,
        )
        yield _counter(
            "kvpool_leases_expired",
            "Leases released because their time ran out (the client never released them).",
            svc.expired_leases,
        )
        yield GaugeMetricFamily("kvpool_leases_open", "Leases held now.", value=len(svc.leases))
        yield _counter(
            "kvpool_reservations_expired",
            "Same-node PUT_SHM reservations aborted, their blocks freed, because they were "
            "not committed in time (or their connection closed).",
            svc.transfer.reservations_expired,
        )
        tables = svc.first_blocks.tables.values() if svc.first_blocks is not None else ()
        yield GaugeMetricFamily(
            "kvpool_first_block_chains",
            "Chains listed in the tenants' same-node first-block tables (MAP_INDEX).",
            value=sum(t.listed for t in tables),
        )
        yield _counter(
            "kvpool_first_block_overflows",
            "Chains a first-block table could not list (a full bucket: its misses are asked).",
            sum(t.overflowed for t in tables),
        )
        yield GaugeMetricFamily(
            "kvpool_stores_in_flight",
            "PUTs of the transfer port receiving their KV now (same-node reservations too).",
            value=len(svc.stores),
        )
        yield GaugeMetricFamily(
            "kvpool_transfer_connections",
            "Open connections of the transfer port.",
            value=svc.transfer.connections,
        )
        moved = CounterMetricFamily(
            "kvpool_transfer_bytes",
            "KV bytes of the transfer port, by direction (received: PUT, sent: GET).",
            labels=["direction"],
        )
        moved.add_metric(["received"], svc.transfer.bytes_received)
        moved.add_metric(["sent"], svc.transfer.bytes_sent)
        yield moved
        yield _counter(
            "kvpool_credential_reload_errors",
            "Credential file changes that could not be read (the running credentials stay).",
            svc.credentials.reload_errors,
        )
        yield GaugeMetricFamily(
            "kvpool_config_restart_pending",
            "1 while the config file holds a restart-only change not applied yet.",
            value=1.0 if r.pending_restart else 0.0,
        )
        yield GaugeMetricFamily(
            "kvpool_agent_ready", "1 when /readyz says ready.", value=float(svc.ready)
        )
        yield GaugeMetricFamily(
            "kvpool_agent_draining", "1 while draining.", value=float(svc.draining)
        )


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class AgentMetrics:
    """The registry of one agent: the cache collector and the request latency histogram."""

    def __init__(self, service: AgentService) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(CacheCollector(service))
        self.request_duration = Histogram(
            "kvpool_request_duration_seconds",
            "HTTP request latency by route template.",
            labelnames=["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )


def _le(bound: float) -> str:
    return f"{bound:g}"


def _policy_curve(mini: PolicyCurveSnapshot) -> Iterator[Metric]:
    """The policy's own curve (``cache/miniature.py``): per ratio of the capacity, the
    sampled accesses a cache of the engine's policy that size hit, out of the accesses."""
    hits = CounterMetricFamily(
        "kvpool_prefix_cache_policy_curve_hits",
        "Sampled block accesses a cache of the engine's eviction policy, ratio times this "
        "cache's capacity, hit (miniature simulation; the policy's miss-ratio curve).",
        labels=["ratio"],
    )
    for ratio, value in zip(mini.ratios, mini.hits, strict=True):
        hits.add_metric([_le(ratio)], value)
    yield hits
    yield _counter(
        "kvpool_prefix_cache_policy_curve_accesses",
        "Sampled block accesses the policy curve's miniatures counted (hits and misses).",
        mini.accesses,
    )
    yield _counter(
        "kvpool_prefix_cache_policy_curve_dropped",
        "Sampled block accesses dropped unsimulated (the CPU budget fell behind).",
        mini.dropped,
    )
    yield GaugeMetricFamily(
        "kvpool_prefix_cache_policy_curve_sample_rate",
        "Share of block keys the policy curve's miniatures simulate (1: every key).",
        value=mini.rate,
    )
