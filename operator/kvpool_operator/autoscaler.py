"""The built-in autoscaler's decision rule: pure, so recorded metric series can drive it.

Scale up while the hit rate is under target, capacity misses (misses a bigger cache would
have hit) are a significant share of the misses and the cache is full; scale down when the
cache is mostly empty and capacity misses are near zero. A signal must hold for its
stabilization window (short up, long down) before a step, every step restarts the count,
and no step down comes sooner than the down window after any step: no flapping.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from kvpool_operator.metrics import Observation
from kvpool_operator.models import AutoscalingSpec


class Signal(enum.Enum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


def signal(obs: Observation | None, policy: AutoscalingSpec) -> Signal:
    """What one interval of metrics asks for, before any stabilization."""
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
        return Decision(target, replicas, f"replicas {replicas} outside [{lo}, {hi}]", scaled)

    sig = signal(obs, policy)
    since = state.since if sig == state.signal and state.since is not None else now
    current = replace(state, signal=sig, since=since)
    held = now - since
    quiet = float("inf") if state.last_scale_at is None else now - state.last_scale_at
    stepped = ScalerState(signal=sig, since=now, last_scale_at=now)

    if sig is Signal.UP and replicas < hi:
        window = policy.scale_up_stabilization_seconds
        if held >= window and quiet >= window:
            assert obs is not None and obs.hit_rate is not None and obs.usage is not None
            reason = (
                f"hit rate {obs.hit_rate:.2f} < target {policy.target_hit_rate:.2f}, capacity "
                f"misses {obs.capacity_miss_share:.0%} of misses, usage {obs.usage:.0%} "
                f"for {held:.0f}s"
            )
            return Decision(replicas + 1, replicas, reason, stepped)
    if sig is Signal.DOWN and replicas > lo:
        window = policy.scale_down_stabilization_seconds
        if held >= window and quiet >= window:
            assert obs is not None and obs.usage is not None
            reason = (
                f"usage {obs.usage:.0%} <= {policy.scale_down_usage:.0%} and capacity misses "
                f"{obs.capacity_miss_rate:.1%} of queries for {held:.0f}s"
            )
            return Decision(replicas - 1, replicas, reason, stepped)
    return Decision(replicas, replicas, f"hold ({sig.value} for {held:.0f}s)", current)
