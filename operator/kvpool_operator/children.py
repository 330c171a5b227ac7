"""The objects a pool owns, built by pure functions from the pool model.

Nothing here does I/O: each ``desired_*`` function maps a parsed ``KVCachePool`` to the
manifest the operator server-side-applies, so the whole child layout is testable as data.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvpool_agent.client import stable_url
from kvpool_agent.config import LIVE_FIELDS, AgentConfig
from kvpool_agent.credentials import token_digest
from kvpool_operator.models import (
    API_VERSION,
    COMPONENT_LABEL,
    CONFIG_HASH_ANNOTATION,
    KIND,
    POOL_LABEL,
    TENANT_LABEL,
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

SERVE_HOST = "0.0.0.0"
"""What agents in pods bind: the pod network, behind credentials and the NetworkPolicy."""
NODE_SOCKET_ROOT = "/var/run/kvpool"
"""Where on a node the pools' socket directories are (``spec.pod.nodeSocket``)."""
NODE_SOCKET_MOUNT = "/var/run/kvpool-node"
NODE_SOCKET_PATH = f"{NODE_SOCKET_MOUNT}/transfer.sock"
NODE_SOCKET_MODE = 0o660
AUTH_DIR = "/etc/kvpool-auth"
TENANTS_KEY = "tenants.yaml"
PEER_TOKEN_KEY = "peer-token"
TOKEN_KEY = "token"
"""Key of a tenant Secret (generated or the user's own) that holds the bearer token."""
TENANTS_PATH = f"{AUTH_DIR}/{TENANTS_KEY}"
PEER_TOKEN_PATH = f"{AUTH_DIR}/{PEER_TOKEN_KEY}"
AUTH_FILE_MODE = 0o440
"""Owner and group (the pod's fsGroup) may read the mounted credentials, nobody else."""
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def config_map_name(pool: KVCachePool) -> str:
    return f"{pool.name}-agent-config"


def auth_secret_name(pool: KVCachePool) -> str:
    """The agents' credentials: tenant token digests and the pool's peer token."""
    return f"{pool.name}-auth"


def tenant_secret_name(pool: KVCachePool, tenant: str) -> str:
    """The Secret the operator keeps a generated tenant token in (clients mount it)."""
    return f"{pool.name}-tenant-{tenant}"


def network_policy_name(pool: KVCachePool) -> str:
    return pool.name


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
        stable_url(f"{pool.name}-{i}", pool.name, pool.namespace, AGENT_PORT)
        for i in range(replicas)
    ]


def own_peer_url(pool: KVCachePool, url: str) -> bool:
    """Whether ``url`` names a pod of this pool, in ``peer_urls``' form, for any ordinal
    (``.cluster.local`` and a trailing slash allowed)."""
    name, ns = re.escape(pool.name), re.escape(pool.namespace)
    pattern = rf"http://{name}-(0|[1-9][0-9]*)\.{name}\.{ns}\.svc(\.cluster\.local)?:{AGENT_PORT}/?"
    return re.fullmatch(pattern, url) is not None


def pod_agent_config(pool: KVCachePool) -> AgentConfig:
    """The spec's agent config as the pods run it: serving the pod network, with the
    credentials of the mounted ``<pool>-auth`` Secret. Only the file paths are in the config
    (and its hash): tokens change in the Secret, which agents re-read, and roll no pod."""
    doc = pool.spec.agent_config().model_dump(mode="python")
    doc["server"]["host"] = SERVE_HOST
    # One config for every pod: each agent finds its own name in the ring from POD_NAME
    # (the handoff peer named after its pod), so a selfUrl here would name one pod for all.
    doc["lifecycle"]["self_url"] = None
    doc["auth"] = {
        "tenants_file": TENANTS_PATH,
        "peer_token_file": PEER_TOKEN_PATH,
        "allow_unauthenticated": False,
    }
    if pool.spec.pod.node_socket:
        # Group-writable: engine pods on the node connect as members of the agent's group.
        doc["transfer"]["unix_socket"] = NODE_SOCKET_PATH
        doc["transfer"]["unix_socket_mode"] = NODE_SOCKET_MODE
    return AgentConfig.model_validate(doc)


def node_socket_dir(pool: KVCachePool) -> str:
    """The pool's socket directory on each of its nodes (``spec.pod.nodeSocket``)."""
    return f"{NODE_SOCKET_ROOT}/{pool.namespace}/{pool.name}"


def pool_agent_config(pool: KVCachePool, replicas: int | None = None) -> AgentConfig:
    """The pods' agent config, plus the pool's pods as handoff peers for warm handoff.

    Peers are a live field, so scaling rewrites the ConfigMap without rolling the pods. They
    are also the ring the agents rank chains over for the ring-aware handoff
    (``lifecycle.ring_aware``, ``kvpool_agent.server.rebalance``): the same stable names the
    pool's clients rank (``peer_urls``), so a chain handed off or taken back lands on the pod
    the clients ask for it. Each agent finds itself among them by its ``POD_NAME``.
    """
    config = pod_agent_config(pool)
    if pool.spec.rollout.warm_handoff and not config.lifecycle.handoff_peers:
        count = pool.spec.desired_replicas() if replicas is None else replicas
        lifecycle = config.lifecycle.model_copy(update={"handoff_peers": peer_urls(pool, count)})
        config = config.model_copy(update={"lifecycle": lifecycle})
    return config


def client_ports(config: AgentConfig) -> list[tuple[str, int]]:
    """Named TCP ports the pool's clients use: the HTTP API and, when enabled, the binary
    transfer port of inference-engine connectors (docs/dataplane.md)."""
    ports = [("http", AGENT_PORT)]
    if config.transfer.port:
        ports.append(("transfer", config.transfer.port))
    return ports


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
    config = pod_agent_config(pool)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(pool, pool.name),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(pool),
            "ports": [
                {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
                for name, port in (*client_ports(config), *event_ports(config))
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
    config = pod_agent_config(pool)
    annotations = {**(pod.annotations or {}), CONFIG_HASH_ANNOTATION: config_hash(config)}
    resources = pod.resources.model_dump(exclude_none=True)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": pod.image,
        "imagePullPolicy": pod.image_pull_policy,
        "command": ["kvpool"],
        "args": ["agent", "--config", CONFIG_PATH],
        "ports": [
            {"name": name, "containerPort": port, "protocol": "TCP"}
            for name, port in (*client_ports(config), *event_ports(config))
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
            {"name": "auth", "mountPath": AUTH_DIR, "readOnly": True},
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
        # Agents never call the Kubernetes API: no service account token in the pod.
        "automountServiceAccountToken": False,
        # The agent drains and hands off within its grace period: give it that and a margin.
        "terminationGracePeriodSeconds": math.ceil(config.lifecycle.grace_period_s)
        + TERMINATION_MARGIN_S,
        "containers": [container],
        "volumes": [
            # A directory mount, not subPath: kubelet updates it in place, so agents see
            # ConfigMap edits and reload their live fields.
            {"name": "config", "configMap": {"name": config_map_name(pool)}},
            # Also a directory mount: kubelet refreshes it in place and the agents re-read
            # the files, so a tenant added, removed or rotated reaches them with no restart.
            {
                "name": "auth",
                "secret": {"secretName": auth_secret_name(pool), "defaultMode": AUTH_FILE_MODE},
            },
            {"name": "tmp", "emptyDir": {}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    if pod.node_socket:
        _add_node_socket(pool, spec, container)
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


def _add_node_socket(pool: KVCachePool, spec: dict[str, Any], container: dict[str, Any]) -> None:
    """The node's socket directory of the pool (hostPath), handed to the agent's user by
    an init container (a new hostPath directory belongs to root), and one agent of the
    pool per node: each node's directory holds one agent's socket."""
    spec["volumes"].append(
        {
            "name": "node-socket",
            "hostPath": {"path": node_socket_dir(pool), "type": "DirectoryOrCreate"},
        }
    )
    mount = {"name": "node-socket", "mountPath": NODE_SOCKET_MOUNT}
    container["volumeMounts"].append(mount)
    # chmod while root still owns it (no CAP_FOWNER needed), then hand it over (CAP_CHOWN).
    script = (
        "import os, sys; d = sys.argv[1]; os.chmod(d, 0o750); "
        f"os.chown(d, {AGENT_UID}, {AGENT_UID})"
    )
    spec["initContainers"] = [
        {
            "name": "node-socket-dir",
            "image": pool.spec.pod.image,
            "imagePullPolicy": pool.spec.pod.image_pull_policy,
            "command": ["python3", "-c", script, NODE_SOCKET_MOUNT],
            "securityContext": {
                "runAsUser": 0,
                "runAsNonRoot": False,
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
            },
            "volumeMounts": [mount],
        }
    ]
    spec["affinity"] = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": selector_labels(pool)},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
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


@dataclass(frozen=True)
class PoolCredentials:
    """The tokens of a pool, as the operator decided them for one reconcile."""

    peer_token: str
    tenant_tokens: Mapping[str, str]
    """Tenant name -> token, for every tenant with a usable token (generated or the user's)."""
    generated: frozenset[str] = field(default_factory=frozenset)
    """Tenants whose token the operator keeps in ``<pool>-tenant-<name>``."""


@dataclass(frozen=True)
class OperatorPeer:
    """Where the operator's pods run, so each pool's NetworkPolicy lets them scrape metrics."""

    namespace: str
    labels: Mapping[str, str]


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def tenants_file(credentials: PoolCredentials) -> str:
    """The agents' tenants file: ``{tenant: "sha256:<hex>"}``, no token in clear."""
    digests = {name: token_digest(tok) for name, tok in sorted(credentials.tenant_tokens.items())}
    return yaml.safe_dump(digests, sort_keys=True)


def desired_auth_secret(pool: KVCachePool, credentials: PoolCredentials) -> Manifest:
    """What the agents mount at ``AUTH_DIR``: tenant digests and the peer token."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(pool, auth_secret_name(pool)),
        "type": "Opaque",
        "data": {
            TENANTS_KEY: _b64(tenants_file(credentials)),
            PEER_TOKEN_KEY: _b64(credentials.peer_token),
        },
    }


def desired_tenant_secret(pool: KVCachePool, tenant: str, token: str) -> Manifest:
    """A generated tenant token, for the tenant's client pods to mount (key ``token``)."""
    meta = _metadata(pool, tenant_secret_name(pool, tenant))
    meta["labels"] = {**meta["labels"], TENANT_LABEL: tenant}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "data": {TOKEN_KEY: _b64(token)},
    }


def desired_secrets(pool: KVCachePool, credentials: PoolCredentials) -> list[Manifest]:
    """Generated tenant Secrets first, then the agents' Secret that names their digests."""
    tenants = [
        desired_tenant_secret(pool, t.name, credentials.tenant_tokens[t.name])
        for t in pool.spec.auth.tenants
        if t.name in credentials.generated
    ]
    return [*tenants, desired_auth_secret(pool, credentials)]


def desired_network_policy(pool: KVCachePool, operator: OperatorPeer | None = None) -> Manifest:
    """Ingress to the agent pods: the HTTP port from the clients, the pool's own pods (warm
    handoff) and the operator's pods (metrics); the KV event ports from the event consumers
    only (none unless ``spec.network.eventConsumerSelector`` is set)."""
    net = pool.spec.network

    def in_client_namespaces(labels: Mapping[str, str]) -> dict[str, Any]:
        peer: dict[str, Any] = {"podSelector": {"matchLabels": dict(labels)}}
        if net.client_namespace_selector is not None:
            peer["namespaceSelector"] = {"matchLabels": dict(net.client_namespace_selector)}
        return peer

    http_from = [
        in_client_namespaces(net.clients(pool.name)),
        {"podSelector": {"matchLabels": selector_labels(pool)}},
    ]
    if operator is not None:
        http_from.append(
            {
                "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: operator.namespace}},
                "podSelector": {"matchLabels": dict(operator.labels)},
            }
        )
    config = pod_agent_config(pool)
    ingress: list[dict[str, Any]] = [
        {
            "from": http_from,
            "ports": [{"protocol": "TCP", "port": name} for name, _ in client_ports(config)],
        }
    ]
    ports = event_ports(config)
    if net.event_consumer_selector is not None and ports:
        ingress.append(
            {
                "from": [in_client_namespaces(net.event_consumer_selector)],
                "ports": [{"protocol": "TCP", "port": name} for name, _ in ports],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(pool, network_policy_name(pool)),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(pool)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def desired_children(
    pool: KVCachePool,
    *,
    replicas: int | None = None,
    service_monitor: bool = False,
    credentials: PoolCredentials | None = None,
    operator: OperatorPeer | None = None,
) -> list[Manifest]:
    """Every child in apply order: credentials and config first, so new pods mount the
    current ones, and the NetworkPolicy before the pods it protects."""
    children = desired_secrets(pool, credentials) if credentials is not None else []
    children += [desired_configmap(pool, replicas), desired_service(pool)]
    if pool.spec.network.policy:
        children.append(desired_network_policy(pool, operator))
    children += [desired_statefulset(pool, replicas), desired_pdb(pool)]
    if service_monitor:
        children.append(desired_servicemonitor(pool))
    return children
