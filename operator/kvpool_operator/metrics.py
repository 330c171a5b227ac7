"""Read the agents' Prometheus metrics and turn two scrapes into interval figures.

Scraping is a plain function ``(ScrapeTarget) -> str`` so tests feed recorded text and the
end-to-end tests point it at agents listening on loopback addresses.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

QUERIES = "kvpool_prefix_cache_queries_tokens_total"
HITS = "kvpool_prefix_cache_hits_tokens_total"
CAPACITY_MISSES = "kvpool_prefix_cache_capacity_misses_tokens_total"
BLOCKS_USED = "kvpool_cache_blocks_used"
BLOCKS_TOTAL = "kvpool_cache_blocks_total"
REUSE_DISTANCE = "kvpool_prefix_cache_reuse_distance_capacity_ratio"
REUSE_DISTANCE_BUCKET = REUSE_DISTANCE + "_bucket"
"""The agents' miss-ratio curve (``agent/kvpool_agent/cache/mrc.py``): accessed blocks by
LRU reuse distance as a fraction of the capacity, cumulative by ``le``."""
POLICY_HITS = "kvpool_prefix_cache_policy_curve_hits_total"
POLICY_ACCESSES = "kvpool_prefix_cache_policy_curve_accesses_total"
"""The engine's own policy at other sizes (``agent/kvpool_agent/cache/miniature.py``):
sampled accesses, and per ``ratio`` of the capacity the hits a cache that size had."""
PRIMARY_TIER = "primary"

SCRAPE_TIMEOUT = 2.0
SCRAPE_WORKERS = 16


@dataclass(frozen=True)
class ScrapeTarget:
    """One agent pod to scrape."""

    pod: str
    url: str


Scraper = Callable[[ScrapeTarget], str]
"""Returns the Prometheus text exposition of one agent; raises OSError when unreachable."""


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Pod IPs are reached directly: an HTTP(S)_PROXY in the environment must not catch them."""


def http_scraper(target: ScrapeTarget) -> str:
    """GET the metrics page over HTTP."""
    with _DIRECT.open(target.url, timeout=SCRAPE_TIMEOUT) as resp:
        body: bytes = resp.read()
    return body.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class AgentSample:
    """Counter and gauge values of one agent at one scrape (counters are cumulative)."""

    queries: float = 0.0
    hits: float = 0.0
    capacity_misses: float = 0.0
    blocks_used: float = 0.0
    blocks_total: float = 0.0
    curve: Curve | None = None
    """The miss-ratio curve's cumulative counters; None from an agent that exports none."""
    policy_curve: Curve | None = None
    """The policy curve's counters as a ``Curve`` (bounds: the ratios; cumulative: the hits
    at each; total: the accesses); None from an agent that exports none."""


@dataclass(frozen=True)
class Curve:
    """A cumulative reuse-distance histogram: ``bounds`` (fractions of capacity, rising),
    ``cumulative[i]`` the accesses within ``bounds[i]``, ``total`` every access (+Inf)."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    total: float

    def hit_ratio(self, ratio: float) -> float | None:
        """Share of the accesses an LRU cache ``ratio`` times the capacity would hit, linear
        between bounds, flat beyond the last one; None without accesses."""
        if self.total <= 0:
            return None
        if ratio <= 0:
            return 0.0
        lo_x = lo_y = 0.0
        for x, y in zip(self.bounds, self.cumulative, strict=True):
            if ratio <= x:
                share = (ratio - lo_x) / (x - lo_x) if x > lo_x else 1.0
                return min(max((lo_y + share * (y - lo_y)) / self.total, 0.0), 1.0)
            lo_x, lo_y = x, y
        return min(max(lo_y / self.total, 0.0), 1.0)

    def plus(self, other: Curve) -> Curve:
        if other.bounds != self.bounds:
            return self if self.total >= other.total else other
        return Curve(
            self.bounds,
            tuple(a + b for a, b in zip(self.cumulative, other.cumulative, strict=True)),
            self.total + other.total,
        )

    def since(self, before: Curve | None) -> Curve:
        """The accesses between two scrapes; the whole curve after a reset (restart)."""
        if before is None or before.bounds != self.bounds or self.total < before.total:
            return self
        return Curve(
            self.bounds,
            tuple(a - b for a, b in zip(self.cumulative, before.cumulative, strict=True)),
            self.total - before.total,
        )


def parse_agent_metrics(text: str) -> AgentSample:
    """Sum the kvpool series of one exposition: hits over tiers, blocks over the primary tier."""
    values = {QUERIES: 0.0, HITS: 0.0, CAPACITY_MISSES: 0.0, BLOCKS_USED: 0.0, BLOCKS_TOTAL: 0.0}
    counters = {QUERIES, HITS, CAPACITY_MISSES}
    buckets: dict[float, float] = {}
    policy_hits: dict[float, float] = {}
    policy_accesses: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == REUSE_DISTANCE_BUCKET:
                buckets[float(sample.labels["le"])] = float(sample.value)
                continue
            if name == POLICY_HITS:
                policy_hits[float(sample.labels["ratio"])] = float(sample.value)
                continue
            if name == POLICY_ACCESSES:
                policy_accesses = float(sample.value)
                continue
            if name not in values:
                continue
            if name in counters or sample.labels.get("tier", PRIMARY_TIER) == PRIMARY_TIER:
                values[name] += float(sample.value)
    curve = None
    total = buckets.pop(float("inf"), None)
    if total is not None:
        bounds = tuple(sorted(buckets))
        curve = Curve(bounds, tuple(buckets[b] for b in bounds), total)
    policy_curve = None
    if policy_accesses is not None and policy_hits:
        ratios = tuple(sorted(policy_hits))
        policy_curve = Curve(ratios, tuple(policy_hits[r] for r in ratios), policy_accesses)
    return AgentSample(
        queries=values[QUERIES],
        hits=values[HITS],
        capacity_misses=values[CAPACITY_MISSES],
        blocks_used=values[BLOCKS_USED],
        blocks_total=values[BLOCKS_TOTAL],
        curve=curve,
        policy_curve=policy_curve,
    )


@dataclass(frozen=True)
class PoolSample:
    """One scrape of every reachable agent of a pool."""

    at: float
    agents: Mapping[str, AgentSample] = field(default_factory=dict)


def scrape_pool(
    targets: Iterable[ScrapeTarget], scraper: Scraper, at: float
) -> tuple[PoolSample, dict[str, str]]:
    """Scrape each target; returns the sample and, per unreachable pod, why."""

    def one(target: ScrapeTarget) -> AgentSample | str:
        try:
            return parse_agent_metrics(scraper(target))
        except (OSError, ValueError) as err:
            return str(err) or type(err).__name__

    todo = list(targets)
    agents: dict[str, AgentSample] = {}
    errors: dict[str, str] = {}
    if not todo:
        return PoolSample(at=at, agents=agents), errors
    # Concurrently: one slow or unreachable pod must not stretch the timer by its timeout each.
    with ThreadPoolExecutor(max_workers=min(SCRAPE_WORKERS, len(todo))) as pool:
        for target, result in zip(todo, pool.map(one, todo), strict=True):
            if isinstance(result, AgentSample):
                agents[target.pod] = result
            else:
                errors[target.pod] = result
    return PoolSample(at=at, agents=agents), errors


@dataclass(frozen=True)
class Observation:
    """What a pool did between two scrapes (token counts) and how full it is now."""

    at: float
    queries: float
    hits: float
    capacity_misses: float
    blocks_used: float
    blocks_total: float
    agents: int = 0
    """Agents whose counters the interval covers (the replicas that served it)."""
    curve: Curve | None = None
    """The interval's reuse-distance histogram, summed over those agents."""
    policy_curve: Curve | None = None
    """The interval's policy-curve counts, summed over those agents."""
    seconds: float = 0.0
    """How long the interval was."""

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None

    @property
    def misses(self) -> float:
        return max(self.queries - self.hits, 0.0)

    @property
    def capacity_miss_share(self) -> float:
        """Share of the misses a bigger cache would have hit."""
        return min(self.capacity_misses / self.misses, 1.0) if self.misses > 0 else 0.0

    @property
    def capacity_miss_rate(self) -> float:
        """Capacity misses per queried token."""
        return min(self.capacity_misses / self.queries, 1.0) if self.queries > 0 else 0.0

    @property
    def usage(self) -> float | None:
        return self.blocks_used / self.blocks_total if self.blocks_total > 0 else None


def _delta(now: float, before: float) -> float:
    """Counter increase; a counter that went down was reset (agent restart): count from 0."""
    return now - before if now >= before else now


def observe(previous: PoolSample | None, current: PoolSample) -> Observation | None:
    """Interval figures from two scrapes; None when there is no earlier scrape to compare.

    Rates cover the agents present in both scrapes; usage covers every current agent.
    """
    if previous is None:
        return None
    queries = hits = capacity = 0.0
    agents = 0
    curve: Curve | None = None
    policy: Curve | None = None
    for pod, now in current.agents.items():
        before = previous.agents.get(pod)
        if before is None:
            continue
        agents += 1
        queries += _delta(now.queries, before.queries)
        hits += _delta(now.hits, before.hits)
        capacity += _delta(now.capacity_misses, before.capacity_misses)
        if now.curve is not None:
            delta = now.curve.since(before.curve)
            curve = delta if curve is None else curve.plus(delta)
        if now.policy_curve is not None:
            delta = now.policy_curve.since(before.policy_curve)
            policy = delta if policy is None else policy.plus(delta)
    return Observation(
        at=current.at,
        queries=queries,
        hits=min(hits, queries),
        capacity_misses=capacity,
        blocks_used=sum(a.blocks_used for a in current.agents.values()),
        blocks_total=sum(a.blocks_total for a in current.agents.values()),
        agents=agents,
        curve=curve,
        policy_curve=policy,
        seconds=max(current.at - previous.at, 0.0),
    )


def merge(observations: Sequence[Observation]) -> Observation | None:
    """The observations of consecutive intervals as one (counts summed, gauges and the
    agent count of the latest); None for none."""
    if not observations:
        return None
    last = observations[-1]
    curve: Curve | None = None
    policy: Curve | None = None
    for obs in observations:
        if obs.curve is not None:
            curve = obs.curve if curve is None else curve.plus(obs.curve)
        if obs.policy_curve is not None:
            policy = obs.policy_curve if policy is None else policy.plus(obs.policy_curve)
    return Observation(
        at=last.at,
        queries=sum(o.queries for o in observations),
        hits=sum(o.hits for o in observations),
        capacity_misses=sum(o.capacity_misses for o in observations),
        blocks_used=last.blocks_used,
        blocks_total=last.blocks_total,
        agents=last.agents,
        curve=curve,
        policy_curve=policy,
        seconds=sum(o.seconds for o in observations),
    )
