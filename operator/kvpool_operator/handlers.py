"""kopf wiring: register handlers that delegate to ``kvpool_operator.reconcile``.

Handlers return nothing (a return value would land in ``status``); the reconcile writes
status through its one status writer. Every annotation and the finalizer the operator
might use carry the ``kvpool.io/`` prefix instead of kopf's defaults.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf
from prometheus_client import start_http_server

from kvpool_operator import operator_metrics
from kvpool_operator.kube import KubeApi, KubeError
from kvpool_operator.models import GROUP, PLURAL, PREFIX, VERSION
from kvpool_operator.policy import OperatorPolicy
from kvpool_operator.reconcile import OperatorContext, pool_key, reconcile

log = logging.getLogger(__name__)

registry = kopf.OperatorRegistry()
"""The handlers of this module only: ``kopf.run(registry=...)`` and tests use it."""

RESOURCE = (GROUP, VERSION, PLURAL)
TIMER_INTERVAL = float(os.environ.get("KVPOOL_TIMER_INTERVAL", "10"))
RETRY_DELAY = 10.0
METRICS_PORT = int(os.environ.get("KVPOOL_OPERATOR_METRICS_PORT", "0"))
"""Where the operator serves its own metrics (``operator_metrics``); 0: not served."""
CONTEXT_KEY = "kvpool"


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """Own prefix for kopf's bookkeeping, explicit watch timeouts; kopf itself posts only
    warnings as Kubernetes events (the reconcile posts its own, one per action)."""
    settings.persistence.finalizer = f"{PREFIX}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.execution.max_workers = 8


@kopf.on.startup(registry=registry)
def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Settings, and the API client every handler shares (kopf runs this before login)."""
    configure_settings(settings)
    if CONTEXT_KEY not in memo:
        policy = OperatorPolicy.from_environment()
        if policy.operator_peer is None:
            log.warning(
                "the operator's namespace and pod labels are unknown (--operator-namespace or "
                "POD_NAMESPACE, --operator-pod-labels): pools' NetworkPolicies will not admit "
                "the operator's metrics scrapes"
            )
        memo[CONTEXT_KEY] = OperatorContext(api=KubeApi.from_environment(), policy=policy)
        if METRICS_PORT:
            start_http_server(METRICS_PORT, registry=operator_metrics.REGISTRY)
            log.info("operator metrics on :%d/metrics", METRICS_PORT)


@kopf.on.login(registry=registry)
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """kopf watches with the credentials our own client loaded (in-cluster or kubeconfig)."""
    return _context(memo).api.connection_info()


def _context(memo: kopf.Memo) -> OperatorContext:
    ctx = memo[CONTEXT_KEY]
    assert isinstance(ctx, OperatorContext)
    return ctx


def _run(memo: kopf.Memo, body: kopf.Body, *, observe_metrics: bool) -> None:
    try:
        reconcile(_context(memo), dict(body), observe_metrics=observe_metrics)
    except KubeError as err:
        raise kopf.TemporaryError(str(err), delay=RETRY_DELAY) from err


@kopf.on.create(*RESOURCE, registry=registry)
@kopf.on.update(*RESOURCE, registry=registry)
@kopf.on.resume(*RESOURCE, registry=registry)
def on_change(memo: kopf.Memo, body: kopf.Body, **_: Any) -> None:
    """Create, update and resume share one idempotent reconcile."""
    _run(memo, body, observe_metrics=False)


@kopf.timer(*RESOURCE, interval=TIMER_INTERVAL, initial_delay=TIMER_INTERVAL, registry=registry)
def on_timer(memo: kopf.Memo, body: kopf.Body, **_: Any) -> None:
    """Level-triggered pass: children, status, cache figures and built-in autoscaling."""
    _run(memo, body, observe_metrics=True)


@kopf.on.delete(*RESOURCE, optional=True, registry=registry)
def on_delete(memo: kopf.Memo, body: kopf.Body, **_: Any) -> None:
    """Forget the pool's in-memory state; owner references garbage-collect the children."""
    _context(memo).forget(pool_key(dict(body)))
    meta = body.get("metadata") or {}
    operator_metrics.forget(str(meta.get("namespace") or "default"), str(meta.get("name")))
