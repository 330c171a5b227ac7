"""The autoscaler's decision rule, replayed over recorded metric series (10 s ticks).

Each series is what the operator would scrape from the agents: cumulative token counters
and block gauges in Prometheus text. The replay runs the same parse -> observe -> decide
path as the timer, with replicas fed back from each decision.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import pytest

from kvpool_operator.autoscaler import ScalerState, Signal, decide
from kvpool_operator.autoscaler import signal_without_curve as signal
from kvpool_operator.metrics import Observation, ScrapeTarget, observe, scrape_pool
from kvpool_operator.models import AutoscalingSpec

TICK = 10.0
POLICY = AutoscalingSpec(min_replicas=1, max_replicas=4)


def exposition(queries: float, hits: float, capacity: float, used: int, total: int) -> str:
    """One agent's metrics page with the names the agent exports."""
    primary = hits * 0.75
    return f"""\
# TYPE kvpool_prefix_cache_queries_tokens_total counter
kvpool_prefix_cache_queries_tokens_total {queries}
# TYPE kvpool_prefix_cache_hits_tokens_total counter
kvpool_prefix_cache_hits_tokens_total{{tier="primary"}} {primary}
kvpool_prefix_cache_hits_tokens_total{{tier="secondary"}} {hits - primary}
# TYPE kvpool_prefix_cache_capacity_misses_tokens_total counter
kvpool_prefix_cache_capacity_misses_tokens_total {capacity}
# TYPE kvpool_cache_blocks_used gauge
kvpool_cache_blocks_used{{pool="w4096_h8",tier="primary"}} {used}
kvpool_cache_blocks_used{{pool="w4096_h8",tier="secondary"}} 999
# TYPE kvpool_cache_blocks_total gauge
kvpool_cache_blocks_total{{pool="w4096_h8",tier="primary"}} {total}
kvpool_cache_blocks_total{{pool="w4096_h8",tier="secondary"}} 1000
"""


@dataclass(frozen=True)
class Tick:
    """Per-interval pool behaviour: query tokens, hit rate, capacity share of misses, usage."""

    queries: float
    hit_rate: float
    capacity_share: float
    usage: float


def record(ticks: Iterable[Tick], blocks: int = 1000) -> list[str]:
    """Turn interval behaviour into the cumulative exposition an agent would serve."""
    q = h = c = 0.0
    pages = [exposition(0, 0, 0, 0, blocks)]
    for t in ticks:
        q += t.queries
        h += t.queries * t.hit_rate
        c += t.queries * (1 - t.hit_rate) * t.capacity_share
        pages.append(exposition(q, h, c, int(t.usage * blocks), blocks))
    return pages


def replay(
    pages: list[str], replicas: int, policy: AutoscalingSpec = POLICY
) -> list[tuple[float, int]]:
    """Drive the rule over one agent's recorded pages; returns (time, replicas) per step."""
    state = ScalerState()
    previous = None
    changes = []
    for i, page in enumerate(pages):
        now = i * TICK
        sample, errors = scrape_pool([ScrapeTarget("a-0", "x")], lambda _t, p=page: p, now)
        assert errors == {}
        obs = observe(previous, sample)
        previous = sample
        decision = decide(state, obs, replicas, policy, now)
        state = decision.state
        if decision.changed:
            changes.append((now, decision.replicas))
            replicas = decision.replicas
    return changes


HOT = Tick(queries=50_000, hit_rate=0.55, capacity_share=0.6, usage=0.95)
IDLE = Tick(queries=2_000, hit_rate=0.9, capacity_share=0.0, usage=0.2)
STEADY = Tick(queries=50_000, hit_rate=0.85, capacity_share=0.1, usage=0.7)
COLD_MISSES = Tick(queries=50_000, hit_rate=0.4, capacity_share=0.05, usage=0.95)


def test_sustained_pressure_scales_up_one_step_per_window_to_max() -> None:
    changes = replay(record([HOT] * 30), replicas=1)
    assert [r for _, r in changes] == [2, 3, 4]
    times = [t for t, _ in changes]
    assert times[0] == POLICY.scale_up_stabilization_seconds + TICK  # first interval at t=10
    assert all(b - a >= POLICY.scale_up_stabilization_seconds for a, b in itertools.pairwise(times))


def test_idle_pool_scales_down_only_after_the_down_window() -> None:
    changes = replay(record([IDLE] * 70), replicas=3)
    assert [r for _, r in changes] == [2, 1]
    first, second = (t for t, _ in changes)
    assert first >= 300 and second - first >= 300


def test_no_traffic_and_empty_cache_counts_as_idle() -> None:
    pages = record([Tick(0, 0, 0, 0.0)] * 35)
    assert replay(pages, replicas=2) == [(310.0, 1)]


def test_misses_a_bigger_cache_would_not_fix_do_not_scale() -> None:
    """Low hit rate from cold misses (capacity share tiny): more replicas would not help."""
    assert replay(record([COLD_MISSES] * 40), replicas=1) == []


def test_steady_state_holds() -> None:
    assert replay(record([STEADY] * 60), replicas=2) == []


def test_alternating_signals_do_not_flap() -> None:
    """Pressure and idleness alternating every 20 s: neither signal holds long enough."""
    series = ([HOT, HOT, IDLE, IDLE] * 25)[:100]
    assert replay(record(series), replicas=2) == []


def test_burst_then_idle_steps_up_then_waits_before_stepping_down() -> None:
    series = [HOT] * 5 + [IDLE] * 60
    changes = replay(record(series), replicas=1)
    assert changes[0][1] == 2
    (up_at, _), (down_at, down_to) = changes[0], changes[1]
    assert down_to == 1 and down_at - up_at >= POLICY.scale_down_stabilization_seconds


def test_replicas_outside_bounds_are_clamped_at_once() -> None:
    policy = AutoscalingSpec(min_replicas=2, max_replicas=3)
    assert decide(ScalerState(), None, 7, policy, 0.0).replicas == 3
    assert decide(ScalerState(), None, 1, policy, 0.0).replicas == 2


def test_counter_reset_after_agent_restart_is_not_negative() -> None:
    pages = record([STEADY] * 3)
    restarted = exposition(1000, 900, 10, 100, 1000)
    before, _ = scrape_pool([ScrapeTarget("a", "")], lambda _t: pages[-1], 0.0)
    after, _ = scrape_pool([ScrapeTarget("a", "")], lambda _t: restarted, 10.0)
    obs = observe(before, after)
    assert obs is not None and obs.queries == 1000 and obs.hit_rate == pytest.approx(0.9)


def test_secondary_tier_blocks_do_not_count_as_usage() -> None:
    sample, _ = scrape_pool([ScrapeTarget("a", "")], lambda _t: exposition(0, 0, 0, 250, 1000), 0)
    assert sample.agents["a"].blocks_used == 250 and sample.agents["a"].blocks_total == 1000


def test_unreachable_agent_is_skipped_with_a_reason() -> None:
    def scraper(target: ScrapeTarget) -> str:
        if target.pod == "b":
            raise ConnectionRefusedError("refused")
        return exposition(10, 5, 1, 1, 2)

    sample, errors = scrape_pool([ScrapeTarget("a", ""), ScrapeTarget("b", "")], scraper, 0)
    assert list(sample.agents) == ["a"] and "refused" in errors["b"]


def test_signal_needs_every_condition_to_scale_up() -> None:
    base = dict(at=0.0, queries=100.0, blocks_total=100.0)
    hot = Observation(hits=50, capacity_misses=40, blocks_used=95, **base)
    assert signal(hot, POLICY) is Signal.UP
    assert signal(Observation(hits=90, capacity_misses=9, blocks_used=95, **base), POLICY) is (
        Signal.HOLD
    )
    assert signal(Observation(hits=50, capacity_misses=40, blocks_used=60, **base), POLICY) is (
        Signal.HOLD
    )
    assert signal(Observation(hits=50, capacity_misses=0, blocks_used=10, **base), POLICY) is (
        Signal.DOWN
    )
