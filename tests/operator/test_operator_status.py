"""Conditions from StatefulSet progress: Ready only when the updated replicas are ready."""

from __future__ import annotations

from collections import deque
from typing import Any

from kvpool_operator.metrics import Curve, Observation
from kvpool_operator.models import CacheStatus, KVCachePoolStatus
from kvpool_operator.reconcile import STATUS_WINDOW, _cache_status
from kvpool_operator.status import (
    Problem,
    RolloutState,
    _same,
    conditions_for,
    status_document,
)


def sts(desired: int = 3, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"generation": 2},
        "spec": {"replicas": desired},
        "status": {"observedGeneration": 2, **status},
    }


def by_type(rollout: RolloutState, problem: Problem | None = None, previous=None, now=0.0):
    return {c.type: c for c in conditions_for(rollout, problem, 2, previous, now)}


def test_all_updated_and_ready_is_ready() -> None:
    state = RolloutState.from_statefulset(
        sts(3, **{"replicas": 3, "readyReplicas": 3, "updatedReplicas": 3}),
        3,
    )
    conds = by_type(state)
    assert conds["Ready"].status == "True"
    assert conds["Progressing"].status == "False"
    assert conds["Degraded"].status == "False"


def test_ready_old_pods_do_not_make_the_pool_ready() -> None:
    raw: dict[str, Any] = {
        "replicas": 3,
        "readyReplicas": 3,
        "updatedReplicas": 1,
        "currentRevision": "a",
        "updateRevision": "b",
    }
    conds = by_type(RolloutState.from_statefulset(sts(**raw), 3))
    assert conds["Ready"].status == "False" and conds["Ready"].reason == "RolloutInProgress"
    assert conds["Progressing"].reason == "RollingUpdate"


def test_unobserved_generation_is_progressing() -> None:
    raw = sts(3)
    raw["status"]["observedGeneration"] = 1
    conds = by_type(RolloutState.from_statefulset(raw, 3))
    assert conds["Progressing"].reason == "StatefulSetUpdating"
    assert conds["Ready"].status == "False"


def test_scaling_and_waiting_for_ready() -> None:
    scaling = RolloutState.from_statefulset(
        sts(4, **{"replicas": 3, "readyReplicas": 3, "updatedReplicas": 4}), 4
    )
    assert by_type(scaling)["Progressing"].reason == "Scaling"
    waiting = RolloutState.from_statefulset(
        sts(3, **{"replicas": 3, "readyReplicas": 2, "updatedReplicas": 3}), 3
    )
    conds = by_type(waiting)
    assert conds["Progressing"].reason == "WaitingForReady"
    assert conds["Ready"].reason == "ReplicasNotReady"


def test_problem_sets_degraded_and_transition_time_moves_only_on_flips() -> None:
    state = RolloutState.from_statefulset(None, 2)
    first = conditions_for(state, Problem("InvalidSpec", "bad"), 1, None, now=100.0)
    again = conditions_for(state, Problem("InvalidSpec", "bad"), 1, first, now=200.0)
    fixed = conditions_for(state, None, 1, again, now=300.0)
    degraded = [next(c for c in conds if c.type == "Degraded") for conds in (first, again, fixed)]
    assert degraded[0].status == "True" and degraded[0].reason == "InvalidSpec"
    assert degraded[1].last_transition_time == degraded[0].last_transition_time
    assert degraded[2].status == "False"
    assert degraded[2].last_transition_time != degraded[1].last_transition_time


# -- cache figures over a stated window ------------------------------------------------------


def _interval(at: float, queries: float, hits: float, agents: int = 1) -> Observation:
    return Observation(
        at=at,
        queries=queries,
        hits=hits,
        capacity_misses=0.0,
        blocks_used=90.0,
        blocks_total=100.0,
        agents=agents,
        curve=Curve((0.5, 1.0, 2.0), (queries * 0.2, queries * 0.5, queries * 0.8), queries),
        seconds=10.0,
    )


def test_hit_rate_covers_the_window_and_predicts_both_neighbours() -> None:
    history = deque([_interval(10, 1000, 400), _interval(20, 1000, 600)])
    cache = _cache_status(history, history[-1], 20.0, 1, None, None)
    assert cache.hit_rate == 0.5 and cache.window_seconds == STATUS_WINDOW
    assert cache.queries_per_second == 100.0
    assert cache.predicted_hit_rate_up == 0.8  # 0.5 + H(2) - H(1) = 0.5 + 0.3
    assert cache.predicted_hit_rate_down is None  # one replica: nothing below


def test_no_queries_in_the_window_leaves_the_hit_rate_empty_and_clears_it() -> None:
    history = deque([_interval(400, 0, 0)])
    cache = _cache_status(history, history[-1], 400.0, 1, None, None)
    assert cache.hit_rate is None and cache.predicted_hit_rate_up is None
    doc = status_document(KVCachePoolStatus(cache=cache))
    # A merge patch with an explicit null removes the stale figure.
    assert "hitRate" in doc["cache"] and doc["cache"]["hitRate"] is None
    assert doc["cache"]["usage"] == 0.9


def test_same_treats_null_cache_fields_as_absent() -> None:
    doc = {"cache": {"hitRate": None, "usage": 0.5}}
    assert _same(doc, {"cache": {"usage": 0.5}})
    assert not _same(doc, {"cache": {"usage": 0.5, "hitRate": 0.86}})


def test_desired_replicas_is_exported_for_external_scalers() -> None:
    from kvpool_operator import operator_metrics

    cache = CacheStatus(desired_replicas=3, hit_rate=0.5, predicted_hit_rate_up=0.7)
    operator_metrics.record("ns", "p", cache)
    reg = operator_metrics.REGISTRY
    assert (
        reg.get_sample_value("kvpool_pool_desired_replicas", {"namespace": "ns", "pool": "p"}) == 3
    )
    up = {"namespace": "ns", "pool": "p", "delta": "+1"}
    assert reg.get_sample_value("kvpool_pool_predicted_hit_rate", up) == 0.7
    operator_metrics.forget("ns", "p")
    assert (
        reg.get_sample_value("kvpool_pool_desired_replicas", {"namespace": "ns", "pool": "p"})
        is None
    )
