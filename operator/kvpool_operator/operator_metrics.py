"""The operator's own Prometheus metrics: what the autoscaler's rule asks for, per pool.

With ``spec.autoscaling.mode: external`` an HPA or KEDA scales the pool; these gauges give
it the same brain as the built-in autoscaler (the desired replica count from the agents'
miss-ratio curves). Served on ``KVPOOL_OPERATOR_METRICS_PORT`` when that is set
(``kvpool_operator.handlers``); e.g. KEDA's Prometheus scaler on
``kvpool_pool_desired_replicas{namespace="ns",pool="name"}`` with threshold 1.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Gauge

from kvpool_operator.models import CacheStatus

REGISTRY = CollectorRegistry()

DESIRED = Gauge(
    "kvpool_pool_desired_replicas",
    "Replicas the autoscaler's rule asks for (predicted hit rates from the miss-ratio curves).",
    ["namespace", "pool"],
    registry=REGISTRY,
)
HIT_RATE = Gauge(
    "kvpool_pool_hit_rate",
    "Token hit rate of the pool over the last 5 minutes (NaN without queries).",
    ["namespace", "pool"],
    registry=REGISTRY,
)
PREDICTED = Gauge(
    "kvpool_pool_predicted_hit_rate",
    "Predicted token hit rate with one replica fewer (delta=-1) or more (delta=+1).",
    ["namespace", "pool", "delta"],
    registry=REGISTRY,
)

_NAN = float("nan")


def record(namespace: str, pool: str, cache: CacheStatus) -> None:
    """Publish one pool's latest figures."""
    if cache.desired_replicas is not None:
        DESIRED.labels(namespace, pool).set(cache.desired_replicas)
    HIT_RATE.labels(namespace, pool).set(_value(cache.hit_rate))
    PREDICTED.labels(namespace, pool, "-1").set(_value(cache.predicted_hit_rate_down))
    PREDICTED.labels(namespace, pool, "+1").set(_value(cache.predicted_hit_rate_up))


def forget(namespace: str, pool: str) -> None:
    """A deleted pool's series go away."""
    for gauge, extra in ((DESIRED, ()), (HIT_RATE, ()), (PREDICTED, ("-1",)), (PREDICTED, ("+1",))):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, pool, *extra)


def _value(value: float | None) -> float:
    return _NAN if value is None else value
