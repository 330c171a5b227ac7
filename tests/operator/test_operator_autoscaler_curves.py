"""The autoscaler's curve rule, replayed over recorded miss-ratio curves (10 s ticks).

A pool is modelled by its pool-level LRU curve ``H(c)``: the share of block accesses a pool
of ``c`` agents' worth of cache would hit. With rendezvous hashing, each of ``N`` agents sees
``1/N`` of the keys, so its own curve at ``x`` times its capacity is ``H(x N)``, and the
pool's measured token hit rate is ``H(N)`` (plus an offset the curve does not model). Each
agent serves the cumulative counters and the reuse-distance histogram an agent exports;
the replay runs the same scrape -> observe -> window -> decide path as the timer, with
replicas fed back from each decision (agents come and go with them).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvpool_operator.autoscaler import ScalerState, Signal, assess, decide, predict
from kvpool_operator.metrics import Observation, ScrapeTarget, observe, scrape_pool
from kvpool_operator.models import AutoscalingSpec
from kvpool_operator.reconcile import DECISION_WINDOW, window

TICK = 10.0
POLICY = AutoscalingSpec(min_replicas=1, max_replicas=4)
BOUNDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)
"""The agent's bucket bounds (``kvpool_agent.cache.mrc.BOUNDS``)."""

Curve = Callable[[float], float]


@dataclass
class AgentCounters:
    queries: float = 0.0
    hits: float = 0.0
    buckets: list[float] | None = None
    total: float = 0.0

    def page(self) -> str:
        buckets = self.buckets or [0.0] * len(BOUNDS)
        lines = [
            "# TYPE kvpool_prefix_cache_queries_tokens_total counter",
            f"kvpool_prefix_cache_queries_tokens_total {self.queries}",
            "# TYPE kvpool_prefix_cache_hits_tokens_total counter",
            f'kvpool_prefix_cache_hits_tokens_total{{tier="primary"}} {self.hits}',
            "# TYPE kvpool_prefix_cache_reuse_distance_capacity_ratio histogram",
        ]
        for bound, value in zip(BOUNDS, buckets, strict=True):
            lines.append(
                f'kvpool_prefix_cache_reuse_distance_capacity_ratio_bucket{{le="{bound}"}} {value}'
            )
        lines += [
            f'kvpool_prefix_cache_reuse_distance_capacity_ratio_bucket{{le="+Inf"}} {self.total}',
            f"kvpool_prefix_cache_reuse_distance_capacity_ratio_count {self.total}",
            "kvpool_prefix_cache_reuse_distance_capacity_ratio_sum 0",
            "# TYPE kvpool_cache_blocks_used gauge",
            'kvpool_cache_blocks_used{pool="p",tier="primary"} 990',
            "# TYPE kvpool_cache_blocks_total gauge",
            'kvpool_cache_blocks_total{pool="p",tier="primary"} 1000',
        ]
        return "\n".join(lines) + "\n"

    def serve(self, queries: float, hit_rate: float, curve: Curve, accesses: float) -> None:
        self.queries += queries
        self.hits += queries * hit_rate
        if self.buckets is None:
            self.buckets = [0.0] * len(BOUNDS)
        for i, bound in enumerate(BOUNDS):
            self.buckets[i] += accesses * curve(bound)
        self.total += accesses


def saturating(knee: float, top: float) -> Curve:
    """Pool curve rising linearly to ``top`` at ``knee`` agents' worth of cache, flat after."""
    return lambda c: top * min(c / knee, 1.0)


def replay(
    pool_curve: Curve | Callable[[float], Curve],
    replicas: int,
    ticks: int,
    *,
    policy: AutoscalingSpec = POLICY,
    load: Callable[[int], float] = lambda _i: 40_000.0,
    offset: float = -0.02,
    noise: float = 0.0,
    seed: int = 1,
) -> list[tuple[float, int, str]]:
    """Drive the rule; returns (time, new replicas, reason) per step."""
    rng = random.Random(seed)
    agents: dict[int, AgentCounters] = {}
    state = ScalerState()
    previous = None
    history: deque[Observation] = deque()
    changes = []
    for i in range(ticks):
        now = i * TICK
        for k in list(agents):
            if k >= replicas:
                del agents[k]
        queries = load(i)
        curve = pool_curve(i) if _is_series(pool_curve) else pool_curve
        for k in range(replicas):
            agent = agents.setdefault(k, AgentCounters())
            if queries <= 0:
                continue
            jitter = rng.gauss(0.0, noise) if noise else 0.0
            per_agent: Curve = lambda x, n=replicas, j=jitter, h=curve: min(  # noqa: E731
                max(h(x * n) + j, 0.0), 1.0
            )
            hit = min(max(curve(replicas) + offset + jitter, 0.0), 1.0)
            agent.serve(queries / replicas, hit, per_agent, queries / replicas / 16)
        targets = [ScrapeTarget(f"a-{k}", str(k)) for k in sorted(agents)]
        sample, errors = scrape_pool(targets, lambda t: agents[int(t.url)].page(), now)
        assert errors == {}
        obs = observe(previous, sample)
        previous = sample
        if obs is not None:
            history.append(obs)
        recent = window(history, now - DECISION_WINDOW, state.last_scale_at)
        decision = decide(state, recent, replicas, policy, now)
        state = decision.state
        if decision.changed:
            changes.append((now, decision.replicas, decision.reason))
            replicas = decision.replicas
    return changes


def _is_series(value: object) -> bool:
    return getattr(value, "series", False) is True


def series(fn: Callable[[int], Curve]) -> Callable[[int], Curve]:
    fn.series = True  # type: ignore[attr-defined]
    return fn


def test_step_up_when_one_replica_more_would_serve_many() -> None:
    """Working set two agents' worth: at 1 replica the curve says x=2 reaches 0.9."""
    changes = replay(saturating(2.0, 0.92), replicas=1, ticks=30)
    assert [r for _, r, _ in changes] == [2]
    at, _, reason = changes[0]
    assert at == POLICY.scale_up_stabilization_seconds + TICK
    assert "predicted hit rate" in reason and "0.91 at 2" in reason and "0.44 at 1" in reason


def test_step_down_when_the_coldest_share_serves_almost_no_hits() -> None:
    """Two replicas, working set well inside one agent: removing one costs nothing."""
    changes = replay(saturating(0.6, 0.9), replicas=2, ticks=80)
    assert [r for _, r, _ in changes] == [1]
    at, _, reason = changes[0]
    assert at >= POLICY.scale_down_stabilization_seconds
    assert "0.88 at 1" in reason


def test_no_step_down_when_the_smaller_pool_would_miss_the_target() -> None:
    """Knee at 1.5 agents: one replica predicts 0.59, under target: two stay."""
    assert replay(saturating(1.5, 0.9), replicas=2, ticks=80) == []


def test_replicas_that_buy_nothing_are_not_added() -> None:
    """Compulsory misses: the curve is flat beyond 0.5 agents, hit rate 0.4 < target."""
    assert replay(saturating(0.5, 0.42), replicas=1, ticks=40) == []


def test_scales_to_the_smallest_count_that_meets_the_target_step_by_step() -> None:
    changes = replay(saturating(3.0, 0.95), replicas=1, ticks=40)
    assert [r for _, r, _ in changes] == [2, 3]


def test_idle_pool_goes_to_min_replicas_after_the_down_window() -> None:
    def load(i: int) -> float:
        return 40_000.0 if i < 10 else 0.0

    changes = replay(saturating(3.0, 0.95), replicas=3, ticks=60, load=load)
    assert [r for _, r, _ in changes] == [1]
    at, _, reason = changes[0]
    stopped = 10 * TICK
    window = POLICY.scale_down_stabilization_seconds
    assert stopped + window <= at <= stopped + window + DECISION_WINDOW + 2 * TICK
    assert "no queries" in reason


@pytest.mark.parametrize("seed", range(4))
def test_noisy_predictions_around_the_target_do_not_flap(seed: int) -> None:
    """One replica measures (and two predict for one) 0.81 against target 0.80, with noise
    of 3 points per tick: at most one step up in 3000 s, never back down (a step down needs
    0.82 for the whole down window)."""
    curve = saturating(0.95 / 0.83, 0.95)
    assert replay(curve, replicas=2, ticks=300, noise=0.03, seed=seed) == []
    changes = replay(curve, replicas=1, ticks=300, noise=0.03, seed=seed)
    assert [r for _, r, _ in changes] in ([], [2])


def test_alternating_burst_and_idle_does_not_flap() -> None:
    def load(i: int) -> float:
        return 40_000.0 if (i // 3) % 2 == 0 else 0.0

    changes = replay(saturating(2.0, 0.92), replicas=1, ticks=200, load=load)
    assert [r for _, r, _ in changes] == [2]


def test_marginal_gain_rule() -> None:
    policy = AutoscalingSpec(min_replicas=1, max_replicas=6, min_hit_rate_gain_per_replica=0.05)
    # 0.25 of hit rate per agent's worth until 3.5 agents: up to 4 (3 -> 4 buys 0.125).
    changes = replay(saturating(3.5, 0.875), replicas=1, ticks=60, policy=policy)
    assert [r for _, r, _ in changes] == [2, 3, 4]


def test_predictions_shift_the_measured_rate_by_the_curve() -> None:
    obs = _obs(hit_rate=0.5, agents=2, curve=saturating(2.0, 0.8), replicas=2)
    # Agent curve H(x) = 0.8 min(x, 1): H(1) = 0.8, H(0.5) = 0.4. At one replica, the same
    # absolute edge over LRU gives 0.5 - 0.4 = 0.1; the same relative one gives misses
    # 0.5 x 0.6 / 0.2 = 1.5 (hit rate 0 once clamped); the prediction is their mean.
    assert predict(obs, 2) == pytest.approx(0.5)
    assert predict(obs, 1) == pytest.approx((0.1 + 0.0) / 2)
    assert predict(obs, 3) == pytest.approx(0.5)  # flat beyond the knee
    a = assess(obs, 2, POLICY)
    assert a.signal is Signal.UP or a.signal is Signal.HOLD
    assert set(a.predicted) == {1, 2, 3, 4}


def test_agents_not_matching_replicas_hold() -> None:
    obs = _obs(hit_rate=0.3, agents=1, curve=saturating(2.0, 0.9), replicas=1)
    assert assess(obs, 2, POLICY).signal is Signal.HOLD


def _obs(hit_rate: float, agents: int, curve: Curve, replicas: int) -> Observation:
    counters = AgentCounters()
    counters.serve(1000, hit_rate, lambda x: curve(x * replicas), 100)
    sample, _ = scrape_pool([ScrapeTarget("a", "")], lambda _t: counters.page(), 10.0)
    empty, _ = scrape_pool([ScrapeTarget("a", "")], lambda _t: AgentCounters().page(), 0.0)
    obs = observe(empty, sample)
    assert obs is not None
    return Observation(
        at=obs.at,
        queries=obs.queries,
        hits=obs.hits,
        capacity_misses=0.0,
        blocks_used=obs.blocks_used,
        blocks_total=obs.blocks_total,
        agents=agents,
        curve=obs.curve,
        seconds=10.0,
    )


def test_unreachable_agents_are_not_taken_for_an_idle_pool() -> None:
    silent = Observation(
        at=10.0, queries=0.0, hits=0.0, capacity_misses=0.0, blocks_used=0.0, blocks_total=0.0
    )
    assert assess(silent, 3, POLICY).signal is Signal.HOLD
    state = ScalerState()
    for i in range(100):
        decision = decide(state, silent, 3, POLICY, i * TICK)
        state = decision.state
        assert not decision.changed


POLICY_RATIOS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
"""The agent's miniature ratios (``kvpool_agent.cache.miniature.RATIOS``)."""


def _policy_page(hits: dict[float, float], accesses: float) -> str:
    lines = ["# TYPE kvpool_prefix_cache_policy_curve_hits_total counter"]
    for ratio, value in hits.items():
        lines.append(f'kvpool_prefix_cache_policy_curve_hits_total{{ratio="{ratio:g}"}} {value}')
    lines += [
        "# TYPE kvpool_prefix_cache_policy_curve_accesses_total counter",
        f"kvpool_prefix_cache_policy_curve_accesses_total {accesses}",
    ]
    return "\n".join(lines) + "\n"


def _policy_obs(policy_hit: Curve, accesses: float, lru: Curve | None = None) -> Observation:
    """One agent at hit rate 0.7 whose policy curve is ``policy_hit`` at its ratios (LRU
    curve: ``lru``, by default 0.5 x its capacity's share, flat from 1), scraped twice like
    the timer does."""
    counters = AgentCounters()
    counters.serve(1000, 0.7, lru or saturating(1.0, 0.5), 100)
    hits = {r: accesses * policy_hit(r) for r in POLICY_RATIOS}
    zero = {r: 0.0 for r in POLICY_RATIOS}
    sample, _ = scrape_pool(
        [ScrapeTarget("a", "")], lambda _t: counters.page() + _policy_page(hits, accesses), 10.0
    )
    empty, _ = scrape_pool(
        [ScrapeTarget("a", "")], lambda _t: AgentCounters().page() + _policy_page(zero, 0), 0.0
    )
    obs = observe(empty, sample)
    assert obs is not None
    return obs


def test_the_policy_curve_is_scraped_as_hits_per_ratio_over_accesses() -> None:
    obs = _policy_obs(lambda r: min(0.8 * r, 0.9), 400)
    assert obs.policy_curve is not None
    assert obs.policy_curve.bounds == POLICY_RATIOS and obs.policy_curve.total == 400
    assert obs.policy_curve.hit_ratio(0.5) == pytest.approx(0.4)
    assert obs.policy_curve.hit_ratio(1.25) == pytest.approx(0.85)  # between 0.8 and 0.9


def test_with_a_policy_curve_the_prediction_moves_by_its_change() -> None:
    # The policy hits 0.6 at its own size, 0.3 at half, 0.8 at twice; LRU is flat at 0.5
    # from one agent's worth up, so only the policy curve can tell 2 agents from 1.
    shape = {0.25: 0.1, 0.5: 0.3, 0.75: 0.45, 1.0: 0.6, 1.5: 0.7, 2.0: 0.8}
    obs = _policy_obs(lambda r: shape[r], 400)
    assert predict(obs, 1) == pytest.approx(0.7)
    assert predict(obs, 2) == pytest.approx(0.7 + 0.8 - 0.6)
    # Beyond the miniatures, the LRU curve carries on from the edge: flat there.
    assert predict(obs, 3) == pytest.approx(0.9)
    a = assess(obs, 1, POLICY)
    assert a.signal is Signal.UP and a.desired == 2
    assert "policy curve" in a.why and "0.90 at 2" in a.why


def test_a_policy_curve_below_the_share_of_lru_reaches_down_through_lru() -> None:
    # Below the smallest miniature (0.25), the LRU curve's change from there is added.
    shape = {0.25: 0.2, 0.5: 0.3, 0.75: 0.45, 1.0: 0.6, 1.5: 0.7, 2.0: 0.8}
    obs = _policy_obs(lambda r: shape[r], 400, lru=saturating(1.0, 0.8))
    ratio = 1 / 8
    lru_change = 0.8 * ratio - 0.8 * 0.25
    from kvpool_operator.autoscaler import policy_hit_ratio

    assert obs.policy_curve is not None
    got = policy_hit_ratio(obs.policy_curve, obs.curve, ratio)
    assert got == pytest.approx(0.2 + lru_change)


def test_too_few_policy_samples_fall_back_to_the_lru_curve() -> None:
    shape = {0.25: 0.1, 0.5: 0.3, 0.75: 0.45, 1.0: 0.6, 1.5: 0.7, 2.0: 0.8}
    thin = _policy_obs(lambda r: shape[r], 20)
    assert predict(thin, 2) == pytest.approx(0.7)  # LRU flat beyond 1: no change
    assert "LRU curve" in assess(thin, 1, POLICY).why
