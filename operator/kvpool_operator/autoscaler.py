"""The built-in autoscaler's decision rule: pure, so recorded metric series can drive it.

The question is the one every cache operator asks: what would one replica more, or one
fewer, buy or cost? Each agent exports its miss-ratio curve (``cache/mrc.py``: accessed
blocks by LRU reuse distance as a fraction of its capacity). With rendezvous hashing a
replica's share of the keys and of the pool's capacity both scale as ``1/N``: going from
``N`` to ``K`` replicas, each agent sees ``N/K`` times the keys between two accesses to one
of them, so an access hits at ``K`` replicas when its distance is within ``K/N`` of an
agent's capacity: an LRU pool of ``K`` replicas hits ``H(K/N)`` (``H``: share of accesses
within a distance). The engine's policy is not LRU (priorities, and the default ``mixture``
resists scans: on the end-to-end trace it hits 0.94 where LRU hits 0.70), so the measured
hit rate anchors the prediction and the curve moves it. Two ways to move it bracket the
policy: the same absolute edge over LRU at every size (``measured + H(K/N) - H(1)``) and the
same relative one (misses scaled by ``(1 - H(K/N)) / (1 - H(1))``). A scan-resistant policy's
edge is largest below the working set, where the first under-predicts a smaller pool and the
second over-predicts it (20 points or more each on the end-to-end trace); the prediction is
their mean, within about 5 points there (``docs/operations.md``, measured).

Where the agents export the policy's own curve (``cache/miniature.py``: miniature
simulations of the engine's policy at a few ratios of the capacity), no bracketing is needed:
the prediction is the measured hit rate plus the policy curve's change from ``1`` to
``K/N`` (beyond the miniatures' ratios, the LRU curve carries it on). Offline that put every
step up within 5 points (``bench/autoscale_predict.py``).

- **target rule** (default): the pool wants the smallest ``K`` in ``[minReplicas,
  maxReplicas]`` whose predicted hit rate meets ``targetHitRate``; when no ``K`` meets it,
  the marginal rule below with a gain of ``PLATEAU`` (replicas that buy nothing are not
  added: compulsory misses do not scale).
- **marginal rule** (``minHitRateGainPerReplica`` set): up while the next replica would buy
  at least that gain, down while the last one buys less than half of it.
- A step down under the target rule needs the smaller pool to clear the target by
  ``hitRateTolerance``, so a prediction that wobbles around the target holds instead of
  flapping.
- **idle**: no queries at all for the down window takes the pool to ``minReplicas``.
- Agents that export no curve (older images) fall back to the usage and ghost-list rule
  (``signal_without_curve``).

A signal must hold for its stabilization window (short up, long down), every step restarts
the count, and no step down comes sooner than the down window after any step: no flapping.
While the agents that served the interval are not the replicas asked for (a step under way)
the rule holds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from kvpool_operator.metrics import Curve, Observation
from kvpool_operator.models import AutoscalingSpec

PLATEAU = 0.02
"""Without a reachable target, replicas are added while each buys at least this much."""


class Signal(enum.Enum):
    UP = "up"
    DOWN = "down"
    IDLE = "idle"
    HOLD = "hold"


def signal_without_curve(obs: Observation | None, policy: AutoscalingSpec) -> Signal:
    """The rule for agents that export no miss-ratio curve: up when the hit rate is under
    target, capacity misses are a significant share of the misses and the cache is full;
    down when the cache is mostly empty and capacity misses are near zero."""
    if obs is None or obs.usage is None:
        return Signal.HOLD
    hit_rate = obs.hit_rate
    if (
        hit_rate is not None
        and hit_rate < policy.target_hit_rate
        and obs.capacity_miss_share >= policy.capacity_miss_share
        and obs.usage >= policy.scale_up_usage
    ):
        return Signal.UP
    if (
        obs.usage <= policy.scale_down_usage
        and obs.capacity_miss_rate <= policy.scale_down_capacity_miss_rate
    ):
        return Signal.DOWN
    return Signal.HOLD


MIN_POLICY_ACCESSES = 100
"""Fewest sampled accesses in the policy curve for it to lead the prediction."""


def policy_hit_ratio(policy: Curve, lru: Curve | None, ratio: float) -> float | None:
    """The engine policy's hit ratio at ``ratio`` of the capacity: its miniatures' within
    their range of ratios, and beyond it the nearest miniature's plus the LRU curve's change
    from there (flat without an LRU curve)."""
    lo, hi = policy.bounds[0], policy.bounds[-1]
    edge = min(max(ratio, lo), hi)
    at_edge = policy.hit_ratio(edge)
    if at_edge is None or edge == ratio or lru is None:
        return at_edge
    there, here = lru.hit_ratio(ratio), lru.hit_ratio(edge)
    if there is None or here is None:
        return at_edge
    return min(max(at_edge + there - here, 0.0), 1.0)


def uses_policy_curve(obs: Observation) -> bool:
    """Whether ``predict`` reads the policy's own curve (else the LRU curve)."""
    policy = obs.policy_curve
    return policy is not None and policy.total >= MIN_POLICY_ACCESSES


def predict(obs: Observation, replicas: int) -> float | None:
    """The pool's token hit rate at ``replicas`` for the traffic of ``obs``; None without a
    measured hit rate or a curve."""
    hit_rate = obs.hit_rate
    if hit_rate is None or obs.agents <= 0 or replicas <= 0:
        return None
    if obs.policy_curve is not None and uses_policy_curve(obs):
        here = policy_hit_ratio(obs.policy_curve, obs.curve, 1.0)
        there = policy_hit_ratio(obs.policy_curve, obs.curve, replicas / obs.agents)
        if here is not None and there is not None:
            return min(max(hit_rate + there - here, 0.0), 1.0)
    if obs.curve is None:
        return None
    here = obs.curve.hit_ratio(1.0)
    there = obs.curve.hit_ratio(replicas / obs.agents)
    if here is None or there is None:
        return None
    additive = hit_rate + there - here
    if here >= 1.0:
        return min(max(additive, 0.0), 1.0)
    multiplicative = 1.0 - (1.0 - hit_rate) * (1.0 - there) / (1.0 - here)
    both = min(max(additive, 0.0), 1.0) + min(max(multiplicative, 0.0), 1.0)
    return both / 2


@dataclass(frozen=True)
class Assessment:
    """What one observation asks for, before any stabilization."""

    signal: Signal
    desired: int
    why: str
    predicted: dict[int, float] = field(default_factory=dict)
    """Predicted hit rate per replica count within the bounds (empty without a curve)."""


def assess(obs: Observation | None, replicas: int, policy: AutoscalingSpec) -> Assessment:
    lo, hi = policy.min_replicas, policy.max_replicas
    if obs is None:
        return Assessment(Signal.HOLD, replicas, "no metrics yet")
    if obs.blocks_total <= 0:
        # No agent answered the scrape: silence is not idleness.
        return Assessment(Signal.HOLD, replicas, "no agent metrics")
    if obs.queries <= 0:
        return Assessment(Signal.IDLE, lo, "no queries")
    if obs.curve is None and obs.policy_curve is None:
        sig = signal_without_curve(obs, policy)
        desired = {Signal.UP: replicas + 1, Signal.DOWN: replicas - 1}.get(sig, replicas)
        return Assessment(sig, min(max(desired, lo), hi), _legacy_why(obs, policy))
    if obs.agents != replicas:
        return Assessment(
            Signal.HOLD, replicas, f"{obs.agents} agents served the interval, {replicas} wanted"
        )
    predicted: dict[int, float] = {}
    for k in range(lo, hi + 1):
        p = predict(obs, k)
        if p is not None:
            predicted[k] = p
    if replicas not in predicted:
        return Assessment(Signal.HOLD, replicas, "no hit rate to predict from")
    desired = _desired(predicted, replicas, policy)
    sig = Signal.UP if desired > replicas else Signal.DOWN if desired < replicas else Signal.HOLD
    return Assessment(sig, desired, _curve_why(obs, predicted, replicas, policy), predicted)


def _desired(predicted: dict[int, float], replicas: int, policy: AutoscalingSpec) -> int:
    """The replica count the predictions ask for (``predicted`` holds ``replicas``)."""
    gain = policy.min_hit_rate_gain_per_replica
    if gain is None:
        target, tol = policy.target_hit_rate, policy.hit_rate_tolerance
        ks = sorted(predicted)
        reach = [k for k in ks if predicted[k] >= target]
        if reach:
            if reach[0] >= replicas:
                return reach[0]
            # Down only as far as the smaller pool clears the target with the tolerance.
            clear = [k for k in ks if predicted[k] >= target + tol]
            return min(clear[0], replicas) if clear else replicas
        gain = PLATEAU
    return _marginal(predicted, replicas, gain)


def _marginal(predicted: dict[int, float], replicas: int, gain: float) -> int:
    """Up while the next replica buys at least ``gain``; else down while the last one buys
    less than half of it (the band between is the hysteresis)."""
    want = replicas
    while want + 1 in predicted and predicted[want + 1] - predicted[want] >= gain:
        want += 1
    if want > replicas:
        return want
    while want - 1 in predicted and predicted[want] - predicted[want - 1] < gain / 2:
        want -= 1
    return want


def _fmt(predicted: dict[int, float], replicas: int) -> str:
    near = [k for k in (replicas - 1, replicas, replicas + 1) if k in predicted]
    return ", ".join(f"{predicted[k]:.2f} at {k}" for k in near)


def _curve_why(
    obs: Observation, predicted: dict[int, float], replicas: int, policy: AutoscalingSpec
) -> str:
    assert obs.hit_rate is not None
    rule = (
        f"min gain {policy.min_hit_rate_gain_per_replica:.2f}/replica"
        if policy.min_hit_rate_gain_per_replica is not None
        else f"target {policy.target_hit_rate:.2f}"
    )
    source = "policy" if uses_policy_curve(obs) else "LRU"
    return (
        f"predicted hit rate {_fmt(predicted, replicas)} replicas ({rule}, {source} curve); "
        "measured "
        f"{obs.hit_rate:.2f} at {replicas}, capacity misses {obs.capacity_miss_rate:.0%} of "
        f"queries, over {obs.seconds:.0f}s"
    )


def _legacy_why(obs: Observation, policy: AutoscalingSpec) -> str:
    hit = "n/a" if obs.hit_rate is None else f"{obs.hit_rate:.2f}"
    usage = "n/a" if obs.usage is None else f"{obs.usage:.0%}"
    return (
        f"no miss-ratio curve from the agents: hit rate {hit} (target "
        f"{policy.target_hit_rate:.2f}), capacity misses {obs.capacity_miss_share:.0%} of "
        f"misses, usage {usage}"
    )


@dataclass(frozen=True)
class ScalerState:
    """What the autoscaler remembers of a pool between timer runs."""

    signal: Signal = Signal.HOLD
    since: float | None = None
    last_scale_at: float | None = None


@dataclass(frozen=True)
class Decision:
    replicas: int
    previous: int
    reason: str
    state: ScalerState
    assessment: Assessment | None = None
    desired: int | None = None
    """The replica count the pool's metrics ask for now (the target of the steps; the
    figure an external HPA or KEDA can follow)."""

    @property
    def changed(self) -> bool:
        return self.replicas != self.previous


def decide(
    state: ScalerState,
    obs: Observation | None,
    replicas: int,
    policy: AutoscalingSpec,
    now: float,
) -> Decision:
    """The replica count for this tick and the state to keep for the next one."""
    lo, hi = policy.min_replicas, policy.max_replicas
    if replicas < lo or replicas > hi:
        target = min(max(replicas, lo), hi)
        scaled = ScalerState(signal=Signal.HOLD, since=now, last_scale_at=now)
        return Decision(
            target, replicas, f"replicas {replicas} outside [{lo}, {hi}]", scaled, desired=target
        )

    a = assess(obs, replicas, policy)
    sig = a.signal
    since = state.since if sig == state.signal and state.since is not None else now
    current = replace(state, signal=sig, since=since)
    held = now - since
    quiet = float("inf") if state.last_scale_at is None else now - state.last_scale_at
    stepped = ScalerState(signal=sig, since=now, last_scale_at=now)

    if sig is Signal.UP and replicas < hi:
        window = policy.scale_up_stabilization_seconds
        if held >= window and quiet >= window:
            reason = f"{a.why}; for {held:.0f}s"
            return Decision(replicas + 1, replicas, reason, stepped, a, a.desired)
    if sig in (Signal.DOWN, Signal.IDLE) and replicas > lo:
        window = policy.scale_down_stabilization_seconds
        if held >= window and quiet >= window:
            to = lo if sig is Signal.IDLE else replicas - 1
            reason = f"{a.why}; for {held:.0f}s"
            return Decision(to, replicas, reason, stepped, a, a.desired)
    return Decision(
        replicas, replicas, f"hold ({sig.value} for {held:.0f}s): {a.why}", current, a, a.desired
    )
