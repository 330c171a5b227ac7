"""One idempotent reconcile of a pool: parse, (optionally) read metrics and autoscale, apply
the children, report what changed, write status.

The kopf handlers call ``reconcile`` for create, update, resume and every timer tick; it
reads the world, never trusts the previous run, and does nothing twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError

from kvpool_agent.config import AgentConfig, changed_fields, format_validation_error, restart_fields
from kvpool_operator import children, operator_metrics, tokens
from kvpool_operator.autoscaler import Decision, ScalerState, decide, predict
from kvpool_operator.kube import KubeApi, KubeError
from kvpool_operator.metrics import (
    Observation,
    PoolSample,
    Scraper,
    ScrapeTarget,
    http_scraper,
    merge,
    observe,
    scrape_pool,
)
from kvpool_operator.models import API_VERSION, KIND, CacheStatus, KVCachePool, KVCachePoolStatus
from kvpool_operator.policy import HANDOFF_PEER_NOT_ALLOWED, IMAGE_NOT_ALLOWED, OperatorPolicy
from kvpool_operator.status import Problem, RolloutState, compute_status, rfc3339, write_status

log = logging.getLogger(__name__)

CACHE_STATUS_PERIOD = 30.0
"""Cache figures reach the pool's status at most this often."""
STATUS_WINDOW = 300.0
"""status.cache.hitRate and the predictions cover this much of the past (5 minutes)."""
DECISION_WINDOW = 30.0
"""The autoscaler judges the last this-many seconds of traffic at each timer run (since the
last step at most), so one quiet or noisy interval does not reset a signal."""

SERVICE_MONITOR_API = "monitoring.coreos.com/v1"
NETWORK_POLICY_API = "networking.k8s.io/v1"
TENANT_SECRET_MISSING = "TenantSecretMissing"


@dataclass
class PoolRuntime:
    """What the operator keeps in memory about one pool between runs."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    previous_sample: PoolSample | None = None
    scaler: ScalerState = field(default_factory=ScalerState)
    cache: CacheStatus | None = None
    cache_written_at: float | None = None
    history: deque[Observation] = field(default_factory=deque)
    """The intervals of the last ``STATUS_WINDOW`` seconds, oldest first."""
    scale_reason: str | None = None
    reported: dict[str, str] = field(default_factory=dict)
    """Last message per event reason, so a repeated warning is not posted every tick."""


@dataclass
class OperatorContext:
    """Clients and per-pool memory shared by every handler of this operator process."""

    api: KubeApi
    scraper: Scraper = http_scraper
    clock: Callable[[], float] = time.time
    metrics_port: int = children.AGENT_PORT
    policy: OperatorPolicy = field(default_factory=OperatorPolicy)
    """The operator's bounds on pools (allowed images, handoff peers) and its own pods."""
    runtimes: dict[str, PoolRuntime] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def runtime(self, key: str) -> PoolRuntime:
        with self._guard:
            return self.runtimes.setdefault(key, PoolRuntime())

    def forget(self, key: str) -> None:
        with self._guard:
            self.runtimes.pop(key, None)


def pool_key(body: dict[str, Any]) -> str:
    meta = body.get("metadata") or {}
    return str(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}")


class Reporter:
    """Posts Kubernetes events about a pool; a repeated warning is posted once."""

    def __init__(self, api: KubeApi, body: dict[str, Any], runtime: PoolRuntime) -> None:
        self.api = api
        self.body = body
        self.runtime = runtime

    def event(self, event_type: str, reason: str, message: str, *, once: bool = False) -> None:
        if once and self.runtime.reported.get(reason) == message:
            return
        self.runtime.reported[reason] = message
        log.info("%s %s: %s", event_type, reason, message)
        involved = {"apiVersion": API_VERSION, "kind": KIND, **self.body}
        try:
            self.api.post_event(involved, event_type, reason, message)
        except KubeError as err:  # events are best effort: never fail a reconcile over one
            log.warning("could not post event %s: %s", reason, err)

    def resolved(self, reason: str) -> None:
        """The condition behind a once-only warning is gone; post it again if it comes back."""
        self.runtime.reported.pop(reason, None)


def reconcile(ctx: OperatorContext, body: dict[str, Any], *, observe_metrics: bool) -> None:
    """Bring one pool's children and status in line with its spec.

    Raises KubeError when the API server refuses a child (the handler retries later).
    """
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        return  # being deleted: the garbage collector takes the children, nothing to apply
    runtime = ctx.runtime(pool_key(body))
    with runtime.lock:
        _reconcile_locked(ctx, runtime, body, observe_metrics=observe_metrics)


def _reconcile_locked(
    ctx: OperatorContext, runtime: PoolRuntime, body: dict[str, Any], *, observe_metrics: bool
) -> None:
    now = ctx.clock()
    meta = body.get("metadata") or {}
    namespace, name = str(meta.get("namespace") or "default"), str(meta["name"])
    report = Reporter(ctx.api, body, runtime)
    current_status = body.get("status") or {}
    previous_status = _parse_status(current_status)

    try:
        pool = KVCachePool.model_validate({**body, "apiVersion": API_VERSION, "kind": KIND})
        children.pod_agent_config(pool)
    except ValidationError as err:
        message = format_validation_error(err, f"KVCachePool {namespace}/{name}")
        report.event("Warning", "InvalidSpec", message, once=True)
        selector = current_status.get("selector", "")
        problem = Problem("InvalidSpec", message)
        _refuse(ctx, meta, selector, problem, current_status, previous_status, now)
        return
    report.resolved("InvalidSpec")

    refused = ctx.policy.violation(pool)
    for reason in (IMAGE_NOT_ALLOWED, HANDOFF_PEER_NOT_ALLOWED):
        if refused is None or refused.reason != reason:
            report.resolved(reason)
    if refused is not None:
        # Not applied at all: a running pool keeps its pods as they were.
        report.event("Warning", refused.reason, refused.message, once=True)
        selector = children.selector_string(pool)
        _refuse(ctx, meta, selector, refused, current_status, previous_status, now)
        return

    replicas = pool.spec.desired_replicas()
    last_scale_time: str | None = None
    if observe_metrics:
        replicas, last_scale_time = _metrics_step(ctx, runtime, pool, replicas, report, now)

    monitor = pool.spec.monitoring.service_monitor and _service_monitor_ready(ctx, report)
    config = children.pool_agent_config(pool, replicas)
    new_hash = children.config_hash(config)

    old_sts = ctx.api.get("apps/v1", "StatefulSet", namespace, name)
    old_cm = ctx.api.get("v1", "ConfigMap", namespace, children.config_map_name(pool))
    applied: dict[str, dict[str, Any]] = {}
    try:
        resolved = tokens.resolve_credentials(ctx.api, pool)
        desired = children.desired_children(
            pool,
            replicas=replicas,
            service_monitor=monitor,
            credentials=resolved.credentials,
            operator=ctx.policy.operator_peer,
        )
        for manifest in desired:
            applied[manifest["kind"]] = ctx.api.apply(manifest)
        revoked = tokens.delete_stale(ctx.api, pool, resolved.stale)
        policy_removed = not pool.spec.network.policy and _remove_network_policy(ctx, pool)
    except KubeError as err:
        problem = Problem("ApplyFailed", f"applying children failed: {err}")
        report.event("Warning", "ApplyFailed", problem.message, once=True)
        _write(ctx, pool, old_sts, replicas, new_hash, problem, previous_status, runtime, now)
        raise
    report.resolved("ApplyFailed")

    problem = None
    if resolved.missing:
        problem = Problem(TENANT_SECRET_MISSING, "; ".join(resolved.missing))
        report.event("Warning", TENANT_SECRET_MISSING, problem.message, once=True)
    else:
        report.resolved(TENANT_SECRET_MISSING)

    _report_changes(report, pool, old_sts, old_cm, config, new_hash, replicas, monitor)
    if old_sts is not None:
        _report_credentials(report, pool, resolved, revoked, policy_removed)
    _write(
        ctx,
        pool,
        applied.get("StatefulSet"),
        replicas,
        new_hash,
        problem,
        previous_status,
        runtime,
        now,
        last_scale_time,
    )


def _refuse(
    ctx: OperatorContext,
    meta: dict[str, Any],
    selector: str,
    problem: Problem,
    current: dict[str, Any],
    previous: KVCachePoolStatus | None,
    now: float,
) -> None:
    """Status of a pool the operator will not apply: Degraded with the reason, the rest
    from whatever StatefulSet is there (left as it was)."""
    namespace, name = str(meta.get("namespace") or "default"), str(meta["name"])
    sts = ctx.api.get("apps/v1", "StatefulSet", namespace, name)
    status = compute_status(
        rollout=RolloutState.from_statefulset(sts, 0),
        generation=meta.get("generation"),
        selector=selector,
        config_hash=None,
        problem=problem,
        previous=previous,
        cache=None,
        last_scale_time=None,
        now=now,
    )
    write_status(ctx.api, namespace, name, status, current)


def _remove_network_policy(ctx: OperatorContext, pool: KVCachePool) -> bool:
    """spec.network.policy turned off: delete the pool's NetworkPolicy if it has one."""
    name = children.network_policy_name(pool)
    existing = ctx.api.get(NETWORK_POLICY_API, "NetworkPolicy", pool.namespace, name)
    if not tokens.controlled_by(existing, pool):
        return False
    return ctx.api.delete(NETWORK_POLICY_API, "NetworkPolicy", pool.namespace, name)


def _report_credentials(
    report: Reporter,
    pool: KVCachePool,
    resolved: tokens.ResolvedCredentials,
    revoked: list[str],
    policy_removed: bool,
) -> None:
    """Events for credential changes of a running pool (agents re-read them, no restart)."""
    if resolved.issued:
        secrets = ", ".join(children.tenant_secret_name(pool, t) for t in resolved.issued)
        report.event(
            "Normal",
            "TokenIssued",
            f"generated a new token for tenant {', '.join(resolved.issued)} in Secret "
            f"{secrets}; agents accept it once kubelet refreshes the mounted "
            f"{children.auth_secret_name(pool)} (no restart)",
        )
    if resolved.peer_issued:
        report.event(
            "Normal",
            "PeerTokenIssued",
            f"generated a new peer token in Secret {children.auth_secret_name(pool)}",
        )
    if revoked:
        report.event(
            "Normal",
            "TenantRevoked",
            f"tenants removed from spec.auth.tenants: deleted Secret {', '.join(revoked)}",
        )
    if policy_removed:
        report.event(
            "Normal",
            "NetworkPolicyRemoved",
            f"spec.network.policy is false: deleted NetworkPolicy "
            f"{children.network_policy_name(pool)}",
        )


def _write(
    ctx: OperatorContext,
    pool: KVCachePool,
    sts: dict[str, Any] | None,
    replicas: int,
    config_hash: str,
    problem: Problem | None,
    previous: KVCachePoolStatus | None,
    runtime: PoolRuntime,
    now: float,
    last_scale_time: str | None = None,
) -> None:
    cache = None
    if runtime.cache is not None and (
        runtime.cache_written_at is None or now - runtime.cache_written_at >= CACHE_STATUS_PERIOD
    ):
        cache = runtime.cache
    status = compute_status(
        rollout=RolloutState.from_statefulset(sts, replicas),
        generation=pool.generation,
        selector=children.selector_string(pool),
        config_hash=config_hash,
        problem=problem,
        previous=previous,
        cache=cache,
        last_scale_time=last_scale_time,
        now=now,
        last_scale_reason=runtime.scale_reason if last_scale_time is not None else None,
    )
    current = (
        pool.status.model_dump(mode="json", by_alias=True, exclude_none=True)
        if pool.status is not None
        else None
    )
    write_status(ctx.api, pool.namespace, pool.name, status, current)
    if cache is not None:
        runtime.cache_written_at = now


def _parse_status(raw: dict[str, Any]) -> KVCachePoolStatus | None:
    try:
        return KVCachePoolStatus.model_validate(raw) if raw else None
    except ValidationError:
        return None


def _service_monitor_ready(ctx: OperatorContext, report: Reporter) -> bool:
    if ctx.api.api_group_served(SERVICE_MONITOR_API):
        report.resolved("ServiceMonitorUnavailable")
        return True
    report.event(
        "Warning",
        "ServiceMonitorUnavailable",
        "spec.monitoring.serviceMonitor is set but the ServiceMonitor CRD "
        f"({SERVICE_MONITOR_API}) is not installed; skipping it",
        once=True,
    )
    return False


def scrape_targets(ctx: OperatorContext, pool: KVCachePool) -> list[ScrapeTarget]:
    """Running pods of the pool that have an IP."""
    pods = ctx.api.list("v1", "Pod", pool.namespace, children.selector_string(pool))
    targets = []
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        phase = (pod.get("status") or {}).get("phase")
        if ip and phase == "Running" and not pod["metadata"].get("deletionTimestamp"):
            url = f"http://{ip}:{ctx.metrics_port}{children.METRICS_PATH}"
            targets.append(ScrapeTarget(pod=pod["metadata"]["name"], url=url))
    return sorted(targets, key=lambda t: t.pod)


def _metrics_step(
    ctx: OperatorContext,
    runtime: PoolRuntime,
    pool: KVCachePool,
    replicas: int,
    report: Reporter,
    now: float,
) -> tuple[int, str | None]:
    """Scrape the agents, refresh the cache figures, and let the autoscaler move replicas."""
    sample, errors = scrape_pool(scrape_targets(ctx, pool), ctx.scraper, now)
    for pod, why in errors.items():
        log.debug("scraping %s failed: %s", pod, why)
    obs = observe(runtime.previous_sample, sample)
    runtime.previous_sample = sample
    history = runtime.history
    if obs is not None:
        history.append(obs)
    while history and history[0].at <= now - STATUS_WINDOW:
        history.popleft()
    auto = pool.spec.autoscaling
    # The spec's own count, so one out of bounds (bounds were edited) is written back clamped.
    current = replicas
    if auto is not None and auto.mode == "builtin":
        current = pool.spec.replicas if pool.spec.replicas is not None else auto.min_replicas
    last_step = runtime.scaler.last_scale_at
    decision: Decision | None = None
    if auto is not None:
        recent = window(history, now - DECISION_WINDOW, last_step)
        decision = decide(runtime.scaler, recent, current, auto, now)
    if obs is not None and sample.agents:
        runtime.cache = _cache_status(history, obs, now, current, last_step, decision)
        operator_metrics.record(pool.namespace, pool.name, runtime.cache)
    if auto is None or auto.mode != "builtin" or decision is None:
        return replicas, None
    runtime.scaler = decision.state
    if not decision.changed:
        return replicas, None
    replicas = current
    ctx.api.scale_pool(pool.namespace, pool.name, decision.replicas)
    verb = "ScaledUp" if decision.replicas > replicas else "ScaledDown"
    message = f"spec.replicas {replicas} -> {decision.replicas}: {decision.reason}"
    runtime.scale_reason = message
    report.event("Normal", verb, message)
    return decision.replicas, rfc3339(now)


def window(
    history: deque[Observation] | list[Observation], start: float, last_step: float | None
) -> Observation | None:
    """The intervals that ended after ``start`` and after the last step, served by as many
    agents as the latest one, merged; None when there are none."""
    if not history:
        return None
    latest = history[-1]
    cut = start if last_step is None else max(start, last_step)
    picked = [o for o in history if o.at > cut and o.agents == latest.agents]
    return merge(picked) if picked else merge([latest])


def _cache_status(
    history: deque[Observation],
    latest: Observation,
    now: float,
    replicas: int,
    last_step: float | None,
    decision: Decision | None,
) -> CacheStatus:
    """Hit rate over the status window (empty without queries); predictions at N-1 and N+1
    from what the autoscaler judges (the last ``DECISION_WINDOW`` seconds since the last
    step: after a step the keys that moved make a transient it should not average in)."""
    whole = merge(list(history)) or latest
    steady = window(history, now - DECISION_WINDOW, last_step)
    down = up = None
    if steady is not None and steady.queries > 0:
        n = steady.agents
        down = predict(steady, n - 1) if n > 1 else None
        up = predict(steady, n + 1)
    return CacheStatus(
        hit_rate=_round(whole.hit_rate),
        window_seconds=int(STATUS_WINDOW),
        queries_per_second=_round(whole.queries / whole.seconds) if whole.seconds > 0 else None,
        usage=_round(latest.usage),
        capacity_miss_rate=_round(whole.capacity_miss_rate) if whole.queries > 0 else None,
        predicted_hit_rate_down=_round(down),
        predicted_hit_rate_up=_round(up),
        desired_replicas=decision.desired if decision is not None else None,
        updated_at=rfc3339(now),
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _old_agent_config(cm: dict[str, Any] | None) -> AgentConfig | None:
    if cm is None:
        return None
    try:
        text = (cm.get("data") or {})[children.CONFIG_KEY]
        return AgentConfig.model_validate(yaml.safe_load(text))
    except (KeyError, yaml.YAMLError, ValidationError):
        return None


def _report_changes(
    report: Reporter,
    pool: KVCachePool,
    old_sts: dict[str, Any] | None,
    old_cm: dict[str, Any] | None,
    config: AgentConfig,
    new_hash: str,
    replicas: int,
    monitor: bool,
) -> None:
    """One event per thing the operator did: created, reloaded live config, rolled, scaled."""
    if old_sts is None:
        extra = ", ServiceMonitor" if monitor else ""
        if pool.spec.network.policy:
            extra = f", NetworkPolicy{extra}"
        tenants = [
            children.tenant_secret_name(pool, t.name)
            for t in pool.spec.auth.tenants
            if not t.secret_name
        ]
        report.event(
            "Normal",
            "Created",
            f"created StatefulSet {pool.name} ({replicas} replicas), headless Service, "
            f"ConfigMap {children.config_map_name(pool)}, PodDisruptionBudget, Secrets "
            f"{', '.join([children.auth_secret_name(pool), *tenants])}{extra}",
        )
        return
    old_config = _old_agent_config(old_cm)
    if old_config is not None:
        changed = changed_fields(old_config, config)
        restart = set(restart_fields(old_config, config))
        live = [f for f in changed if f not in restart]
        if live:
            report.event(
                "Normal",
                "ConfigReloaded",
                "live fields changed, agents reload them without a restart: " + ", ".join(live),
            )
    old_template = ((old_sts.get("spec") or {}).get("template") or {}).get("metadata") or {}
    old_hash = (old_template.get("annotations") or {}).get(children.CONFIG_HASH_ANNOTATION)
    if old_hash is not None and old_hash != new_hash:
        fields = (
            ", ".join(restart_fields(old_config, config)) if old_config is not None else "unknown"
        )
        report.event(
            "Normal",
            "RollingRestart",
            f"restart fields changed ({fields}): config hash {old_hash} -> {new_hash}, rolling "
            f"pods with maxUnavailable={pool.spec.rollout.max_unavailable}",
        )
    old_replicas = (old_sts.get("spec") or {}).get("replicas")
    if old_replicas is not None and old_replicas != replicas:
        report.event("Normal", "Scaled", f"StatefulSet replicas {old_replicas} -> {replicas}")
