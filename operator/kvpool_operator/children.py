"""The objects a pool owns, built by pure functions from the pool model.

Nothing here does I/O: each ``desired_*`` function maps a parsed ``KVCachePool`` to the
manifest the operator server-side-applies, so the whole child layout is testable as data.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import yaml

from kvpool_agent.config import LIVE_FIELDS, AgentConfig
from kvpool_operator.models import (
    API_VERSION,
    COMPONENT_LABEL,
    CONFIG_HASH_ANNOTATION,
    KIND,
    POOL_LABEL,
    KVCachePool,
)

Manifest = dict[str, Any]

AGENT_PORT = 8000
CONFIG_DIR = "/etc/kvpool"
CONFIG_KEY = "agent.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
AGENT_UID = 65532
CONTAINER_NAME = "agent"
METRICS_PATH = "/metrics"
TERMINATION_MARGIN_S = 5


def config_map_name(pool: KVCachePool) -> str:
    return f"{pool.name}-agent-config"


def selector_labels(pool: KVCachePool) -> dict[str, str]:
    """Labels that select a pool's pods; never change them (StatefulSet selectors are fixed)."""
    return {"app.kubernetes.io/name": "kvpool-agent", "app.kubernetes.io/instance": pool.name}


def common_labels(pool: KVCachePool) -> dict[str, str]:
    return {
        **selector_labels(pool),
        POOL_LABEL: pool.name,
        COMPONENT_LABEL: "cache-agent",
        "app.kubernetes.io/part-of": "kvpool",
        "app.kubernetes.io/managed-by": "kvpool-operator",
    }


def selector_string(pool: KVCachePool) -> str:
    """The label selector in string form, as status.selector (the /scale labelSelectorPath)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(pool).items()))


def owner_reference(pool: KVCachePool) -> dict[str, Any]:
    """Makes the pool the controller of a child, so deleting the pool garbage-collects it."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": pool.name,
        "uid": pool.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(pool: KVCachePool, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": pool.namespace,
        "labels": common_labels(pool),
        "ownerReferences": [owner_reference(pool)],
        **extra,
    }


def agent_config_document(config: AgentConfig) -> dict[str, Any]:
    """The agent config file as plain data (snake_case, the reference's names)."""
    return config.model_dump(mode="json", exclude_none=True)


def restart_relevant(config: AgentConfig) -> dict[str, Any]:
    """The agent config without the fields the agents reload live (``LIVE_FIELDS``)."""
    doc = config.model_dump(mode="json")
    for path in LIVE_FIELDS:
        *parents, leaf = path.split(".")
        node = doc
        for step in parents:
            node = node.get(step, {})
        node.pop(leaf, None)
    return doc


def config_hash(config: AgentConfig) -> str:
    """Hash of the restart-relevant config: it changes (and rolls the pods) only when a
    restart is needed; a live field change leaves it, and the pods, alone."""
    canonical = json.dumps(restart_relevant(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def peer_urls(pool: KVCachePool, replicas: int) -> list[str]:
    """Stable per-pod URLs of a pool (StatefulSet pod DNS names behind the headless Service)."""
    return [
        f"http://{pool.name}-{i}.{pool.name}.{pool.namespace}.svc:{AGENT_PORT}"
        for i in range(replicas)
    ]


def pool_agent_config(pool: KVCachePool, replicas: int | None = None) -> AgentConfig:
    """The spec's agent config, plus the pool's pods as handoff peers for warm handoff.

    Peers are a live field, so scaling rewrites the ConfigMap without rolling the pods.
    """
    config = pool.spec.agent_config()
    if pool.spec.rollout.warm_handoff and not config.lifecycle.handoff_peers:
        count = pool.spec.desired_replicas() if replicas is None else replicas
        lifecycle = config.lifecycle.model_copy(update={"handoff_peers": peer_urls(pool, count)})
        config = config.model_copy(update={"lifecycle": lifecycle})
    return config


def event_ports(config: AgentConfig) -> list[tuple[str, int]]:
    """Named TCP ports of the KV event endpoints that are enabled (``tcp://*:5557``)."""
    ports = []
    for name, endpoint in (
        ("kv-events", config.events.endpoint),
        ("kv-replay", config.events.replay_endpoint),
    ):
        if endpoint and endpoint.rsplit(":", 1)[-1].isdigit():
            ports.append((name, int(endpoint.rsplit(":", 1)[-1])))
    return ports


def desired_configmap(pool: KVCachePool, replicas: int | None = None) -> Manifest:
    """The agent config file, mounted in every pod; agents reload its live fields."""
    config = pool_agent_config(pool, replicas)
    text = yaml.safe_dump(agent_config_document(config), sort_keys=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(pool, config_map_name(pool)),
        "data": {CONFIG_KEY: text},
    }


def desired_service(pool: KVCachePool) -> Manifest:
    """Headless: one stable DNS name per pod, so clients can hash prefixes to agents."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(pool, pool.name),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(pool),
            "ports": [
                {"name": "http", "port": AGENT_PORT, "targetPort": "http", "protocol": "TCP"},
                *(
                    {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
                    for name, port in event_ports(pool.spec.agent_config())
                ),
            ],
        },
    }


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def _env() -> list[dict[str, Any]]:
    def field(path: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": path}}

    return [
        {"name": "POD_NAME", "valueFrom": field("metadata.name")},
        {"name": "POD_NAMESPACE", "valueFrom": field("metadata.namespace")},
        {"name": "POD_IP", "valueFrom": field("status.podIP")},
    ]


def desired_pod_template(pool: KVCachePool) -> Manifest:
    pod = pool.spec.pod
    config = pool.spec.agent_config()
    annotations = {**(pod.annotations or {}), CONFIG_HASH_ANNOTATION: config_hash(config)}
    resources = pod.resources.model_dump(exclude_none=True)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": pod.image,
        "imagePullPolicy": pod.image_pull_policy,
        "command": ["kvpool"],
        "args": ["agent", "--config", CONFIG_PATH],
        "ports": [
            {"name": "http", "containerPort": AGENT_PORT, "protocol": "TCP"},
            *(
                {"name": name, "containerPort": port, "protocol": "TCP"}
                for name, port in event_ports(config)
            ),
        ],
        "env": _env(),
        "readinessProbe": _probe("/readyz", period=5, failures=3),
        "livenessProbe": {**_probe("/healthz", period=10, failures=3), "initialDelaySeconds": 10},
        "resources": resources,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    spec: dict[str, Any] = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": AGENT_UID,
            "runAsGroup": AGENT_UID,
            "fsGroup": AGENT_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "enableServiceLinks": False,
        # The agent drains and hands off within its grace period: give it that and a margin.
        "terminationGracePeriodSeconds": math.ceil(config.lifecycle.grace_period_s)
        + TERMINATION_MARGIN_S,
        "containers": [container],
        "volumes": [
            # A directory mount, not subPath: kubelet updates it in place, so agents see
            # ConfigMap edits and reload their live fields.
            {"name": "config", "configMap": {"name": config_map_name(pool)}},
            {"name": "tmp", "emptyDir": {}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    if pod.node_selector:
        spec["nodeSelector"] = dict(pod.node_selector)
    if pod.tolerations:
        spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in pod.tolerations
        ]
    if pod.service_account_name:
        spec["serviceAccountName"] = pod.service_account_name
    if pod.priority_class_name:
        spec["priorityClassName"] = pod.priority_class_name
    return {
        "metadata": {
            "labels": {**(pod.labels or {}), **common_labels(pool)},
            "annotations": annotations,
        },
        "spec": spec,
    }


def desired_statefulset(pool: KVCachePool, replicas: int | None = None) -> Manifest:
    """Agent pods with stable names (a stable hash ring for prefix affinity).

    ``replicas`` overrides the spec's count (the reconciler passes what it decided).
    """
    rollout = pool.spec.rollout
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(pool, pool.name),
        "spec": {
            "replicas": pool.spec.desired_replicas() if replicas is None else replicas,
            "serviceName": pool.name,
            # Pods do not depend on each other: start and stop them in parallel.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(pool)},
            "minReadySeconds": rollout.warm_handoff_seconds,
            "updateStrategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": rollout.max_unavailable, "partition": 0},
            },
            "template": desired_pod_template(pool),
        },
    }


def desired_pdb(pool: KVCachePool) -> Manifest:
    """Voluntary disruptions take down no more pods at once than a rollout would."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(pool, pool.name),
        "spec": {
            "maxUnavailable": pool.spec.rollout.max_unavailable,
            "selector": {"matchLabels": selector_labels(pool)},
        },
    }


def desired_servicemonitor(pool: KVCachePool) -> Manifest:
    """Scrape config for prometheus-operator; only applied when asked for and its CRD exists."""
    mon = pool.spec.monitoring
    meta = _metadata(pool, pool.name)
    meta["labels"] = {**(mon.labels or {}), **meta["labels"]}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": selector_labels(pool)},
            "endpoints": [{"port": "http", "path": METRICS_PATH, "interval": mon.interval}],
        },
    }


def desired_children(
    pool: KVCachePool, *, replicas: int | None = None, service_monitor: bool = False
) -> list[Manifest]:
    """Every child in apply order: config first, so new pods mount the current config."""
    children = [
        desired_configmap(pool, replicas),
        desired_service(pool),
        desired_statefulset(pool, replicas),
        desired_pdb(pool),
    ]
    if service_monitor:
        children.append(desired_servicemonitor(pool))
    return children
