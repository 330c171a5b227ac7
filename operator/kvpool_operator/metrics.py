"""Read the agents' Prometheus metrics and turn two scrapes into interval figures.

Scraping is a plain function ``(ScrapeTarget) -> str`` so tests feed recorded text and the
end-to-end tests point it at agents listening on loopback addresses.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

QUERIES = "kvpool_prefix_cache_queries_tokens_total"
HITS = "kvpool_prefix_cache_hits_tokens_total"
CAPACITY_MISSES = "kvpool_prefix_cache_capacity_misses_tokens_total"
BLOCKS_USED = "kvpool_cache_blocks_used"
BLOCKS_TOTAL = "kvpool_cache_blocks_total"
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


def parse_agent_metrics(text: str) -> AgentSample:
    """Sum the kvpool series of one exposition: hits over tiers, blocks over the primary tier."""
    values = {QUERIES: 0.0, HITS: 0.0, CAPACITY_MISSES: 0.0, BLOCKS_USED: 0.0, BLOCKS_TOTAL: 0.0}
    counters = {QUERIES, HITS, CAPACITY_MISSES}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name not in values:
                continue
            if name in counters or sample.labels.get("tier", PRIMARY_TIER) == PRIMARY_TIER:
                values[name] += float(sample.value)
    return AgentSample(
        queries=values[QUERIES],
        hits=values[HITS],
        capacity_misses=values[CAPACITY_MISSES],
        blocks_used=values[BLOCKS_USED],
        blocks_total=values[BLOCKS_TOTAL],
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
    for pod, now in current.agents.items():
        before = previous.agents.get(pod)
        if before is None:
            continue
        queries += _delta(now.queries, before.queries)
        hits += _delta(now.hits, before.hits)
        capacity += _delta(now.capacity_misses, before.capacity_misses)
    return Observation(
        at=current.at,
        queries=queries,
        hits=min(hits, queries),
        capacity_misses=capacity,
        blocks_used=sum(a.blocks_used for a in current.agents.values()),
        blocks_total=sum(a.blocks_total for a in current.agents.values()),
    )
