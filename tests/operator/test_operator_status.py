"""Conditions from StatefulSet progress: Ready only when the updated replicas are ready."""

from __future__ import annotations

from typing import Any

from kvpool_operator.status import Problem, RolloutState, conditions_for


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
