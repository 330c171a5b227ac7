"""The pool's status contract: computed by pure functions, written by one function.

``compute_status`` derives replicas, conditions and the config hash from the StatefulSet the
operator applied; ``write_status`` is the only code that patches ``status`` of a pool.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from kvpool_operator.kube import KubeApi
from kvpool_operator.models import CacheStatus, Condition, KVCachePoolStatus

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"


def rfc3339(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Problem:
    """Why the operator could not act on a pool (sets Degraded)."""

    reason: str
    message: str


@dataclass(frozen=True)
class RolloutState:
    """The StatefulSet's progress towards the desired replicas and template."""

    desired: int
    replicas: int
    ready: int
    updated: int
    current: bool
    """The StatefulSet controller has seen the latest StatefulSet spec."""
    revisions_match: bool

    @classmethod
    def from_statefulset(cls, sts: dict[str, Any] | None, desired: int) -> RolloutState:
        if sts is None:
            return cls(desired, 0, 0, 0, current=False, revisions_match=False)
        st = sts.get("status") or {}
        generation = (sts.get("metadata") or {}).get("generation")
        observed = st.get("observedGeneration")
        current = generation is None or (observed is not None and observed >= generation)
        update_rev, current_rev = st.get("updateRevision"), st.get("currentRevision")
        return cls(
            desired=int((sts.get("spec") or {}).get("replicas", desired)),
            replicas=int(st.get("replicas") or 0),
            ready=int(st.get("readyReplicas") or 0),
            updated=int(st.get("updatedReplicas") or 0),
            current=current,
            revisions_match=update_rev is None or update_rev == current_rev,
        )

    @property
    def rolled(self) -> bool:
        """Every pod runs the current template and the controller caught up."""
        return self.current and self.updated >= self.desired and self.replicas == self.desired

    @property
    def ready_now(self) -> bool:
        """Ready only when the updated replicas are ready: rolled and all pods ready."""
        return self.rolled and self.ready >= self.desired


def _condition(
    kind: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int | None,
    previous: dict[str, Condition],
    now: float,
) -> Condition:
    status = "True" if ok else "False"
    old = previous.get(kind)
    since = old.last_transition_time if old is not None and old.status == status else rfc3339(now)
    return Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )


def conditions_for(
    rollout: RolloutState,
    problem: Problem | None,
    generation: int | None,
    previous: list[Condition] | None,
    now: float,
) -> list[Condition]:
    """Ready, Progressing and Degraded; a transition time moves only when a status flips."""
    prev = {c.type: c for c in previous or []}
    r = rollout
    counts = f"{r.ready}/{r.desired} ready, {r.updated}/{r.desired} updated"
    if r.ready_now:
        ready = (True, "AllReplicasReady", counts)
    elif not r.rolled:
        ready = (False, "RolloutInProgress", counts)
    else:
        ready = (False, "ReplicasNotReady", counts)

    if not r.current:
        progressing = (True, "StatefulSetUpdating", "waiting for the StatefulSet controller")
    elif r.updated < r.desired or not r.revisions_match:
        progressing = (True, "RollingUpdate", f"{r.updated}/{r.desired} pods updated")
    elif r.replicas != r.desired:
        progressing = (True, "Scaling", f"{r.replicas} pods, {r.desired} wanted")
    elif r.ready < r.desired:
        progressing = (True, "WaitingForReady", counts)
    else:
        progressing = (False, "RolloutComplete", counts)

    degraded = (
        (True, problem.reason, problem.message)
        if problem is not None
        else (False, "AsExpected", "the operator applied the desired state")
    )
    return [
        _condition(READY, *ready, generation, prev, now),
        _condition(PROGRESSING, *progressing, generation, prev, now),
        _condition(DEGRADED, *degraded, generation, prev, now),
    ]


def compute_status(
    *,
    rollout: RolloutState,
    generation: int | None,
    selector: str,
    config_hash: str | None,
    problem: Problem | None,
    previous: KVCachePoolStatus | None,
    cache: CacheStatus | None,
    last_scale_time: str | None,
    now: float,
    last_scale_reason: str | None = None,
) -> KVCachePoolStatus:
    prev = previous or KVCachePoolStatus()
    return KVCachePoolStatus(
        observed_generation=generation,
        replicas=rollout.replicas,
        ready_replicas=rollout.ready,
        updated_replicas=rollout.updated,
        selector=selector,
        config_hash=config_hash if config_hash is not None else prev.config_hash,
        conditions=conditions_for(rollout, problem, generation, prev.conditions, now),
        cache=cache if cache is not None else prev.cache,
        last_scale_time=last_scale_time if last_scale_time is not None else prev.last_scale_time,
        last_scale_reason=(
            last_scale_reason if last_scale_reason is not None else prev.last_scale_reason
        ),
    )


def status_document(status: KVCachePoolStatus) -> dict[str, Any]:
    """The status as written (a merge patch): the cache figures keep their empty fields as
    nulls, so a hit rate with no queries behind it is removed rather than left standing."""
    doc = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    if status.cache is not None:
        doc["cache"] = status.cache.model_dump(mode="json", by_alias=True)
    return doc


def write_status(
    api: KubeApi,
    namespace: str,
    name: str,
    status: KVCachePoolStatus,
    current: dict[str, Any] | None,
) -> bool:
    """Patch the status subresource when it differs from ``current``; True when written."""
    doc = status_document(status)
    if current is not None and _same(doc, current):
        return False
    api.patch_pool_status(namespace, name, doc)
    return True


def _same(doc: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether every field we would write already has that value (a null: is absent)."""
    for key, value in doc.items():
        if isinstance(value, dict) and key == "cache":
            have = current.get(key) or {}
            if any(have.get(k) != v for k, v in value.items()):
                return False
        elif current.get(key) != value:
            return False
    return True
