"""Pydantic models of the ``KVCachePool`` custom resource.

These models are the one source of truth for the CRD: ``kvpool crd`` generates the schema
from them (``kvpool_operator.schema``), and the operator parses every object it handles
through them. The cache and model parts reuse the agent's own config models, so the CRD
and the agent config file can never disagree about a field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from kvpool_agent.config import (
    TENANT_NAME_PATTERN,
    AgentConfig,
    EventsConfig,
    KvCacheConfig,
    LifecycleConfig,
    ModelGeometry,
    RetentionDefaults,
)

GROUP = "kvpool.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "KVCachePool"
PLURAL = "kvcachepools"
SINGULAR = "kvcachepool"
SHORT_NAMES = ("kvp",)

PREFIX = "kvpool.io"
"""Prefix of every label, annotation and finalizer the operator owns."""
CONFIG_HASH_ANNOTATION = f"{PREFIX}/config-hash"
POOL_LABEL = f"{PREFIX}/pool"
TENANT_LABEL = f"{PREFIX}/tenant"
CLIENT_LABEL = f"{PREFIX}/client"
"""Default client selector of a pool's NetworkPolicy: pods labelled ``kvpool.io/client: <pool>``."""
COMPONENT_LABEL = "app.kubernetes.io/component"
FIELD_MANAGER = "kvpool-operator"

DEFAULT_IMAGE = "ghcr.io/kvpool/kvpool:0.1.0"
DEFAULT_TENANT = "default"
MAX_TENANTS = 64
MAX_SELECTOR_LABELS = 32
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class _CrModel(BaseModel):
    """Base of the CR models: snake_case in Python, camelCase in the manifest."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
    )


class PoolModel(ModelGeometry):
    """The attention shape of the served model: what one block of KV holds.

    The CRD cannot say "an integer or a list" in a structural schema, so the per-layer form
    of ``numKvHeads`` lives in its own field, ``numKvHeadsPerLayer``.
    """

    num_kv_heads: int = Field(
        ...,
        gt=0,
        description="KV heads of every layer (GQA/MQA groups). numKvHeadsPerLayer overrides it.",
    )
    num_kv_heads_per_layer: list[int] | None = Field(
        default=None,
        min_length=1,
        description="KV heads per layer, one entry per layer, for models whose layers differ.",
    )

    @model_validator(mode="after")
    def _per_layer_matches(self) -> PoolModel:
        heads = self.num_kv_heads_per_layer
        if heads is not None:
            if len(heads) != self.num_layers:
                raise ValueError(
                    f"numKvHeadsPerLayer lists {len(heads)} entries but numLayers is "
                    f"{self.num_layers}"
                )
            if any(h <= 0 for h in heads):
                raise ValueError(f"numKvHeadsPerLayer entries must be positive, got {heads}")
        return self

    def to_geometry(self) -> ModelGeometry:
        """The agent's model: the per-layer list when given, the single number otherwise."""
        heads: int | list[int] = (
            list(self.num_kv_heads_per_layer)
            if self.num_kv_heads_per_layer is not None
            else self.num_kv_heads
        )
        return ModelGeometry(
            name=self.name,
            num_layers=self.num_layers,
            num_kv_heads=heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
        )


class AgentSpec(_CrModel):
    """Agent settings outside the cache config: device choice and memory reservations."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Where the primary tier lives; auto picks CUDA when present."
    )
    cpu_budget_bytes: int = Field(
        default=256 << 20,
        gt=0,
        description="Primary-tier budget in bytes when it lives on the CPU.",
    )
    reserved_device_bytes: int = Field(
        default=0, ge=0, description="Device memory kept back for weights and activations."
    )
    max_seq_len: int | None = Field(
        default=None, gt=0, description="Longest sequence served; bounds full-attention windows."
    )
    events: EventsConfig = Field(
        default_factory=lambda: EventsConfig.model_validate({}),
        description="KV events (ZMQ) the agents publish. Restart-only.",
        json_schema_extra={"default": {}},
    )
    retention: RetentionDefaults = Field(
        default_factory=lambda: RetentionDefaults.model_validate({}),
        description="Retention of requests that give no policy. Live.",
        json_schema_extra={"default": {}},
    )
    lifecycle: LifecycleConfig = Field(
        default_factory=lambda: LifecycleConfig.model_validate({}),
        description="Drain and warm handoff on pod termination. With rollout.warmHandoff and "
        "no handoffPeers given, the operator lists the pool's other pods as peers.",
        json_schema_extra={"default": {}},
    )


class AutoscalingSpec(_CrModel):
    """Replica bounds and the hit-rate rule the built-in autoscaler follows.

    The rule predicts the pool's hit rate at every replica count from the agents' miss-ratio
    curves (``operator/kvpool_operator/autoscaler.py``); the usage and capacity-miss fields
    are the fallback for agents that export no curve.
    """

    mode: Literal["builtin", "external"] = Field(
        default="builtin",
        description="builtin: the operator moves spec.replicas from the agents' hit-rate "
        "metrics. external: an HPA or KEDA drives the pool's /scale subresource.",
    )
    min_replicas: int = Field(default=1, ge=1, description="Fewest replicas the autoscaler keeps.")
    max_replicas: int = Field(default=4, ge=1, description="Most replicas the autoscaler creates.")
    target_hit_rate: float = Field(
        default=0.8,
        ge=0.0,
        le=1.0,
        description="The pool runs the fewest replicas whose predicted token hit rate (from "
        "the agents' miss-ratio curves) meets this; when none does, replicas are added only "
        "while each buys at least 2 points.",
    )
    hit_rate_tolerance: float = Field(
        default=0.02,
        ge=0.0,
        le=0.5,
        description="A step down needs the smaller pool's predicted hit rate to clear "
        "targetHitRate by this much (hysteresis against flapping).",
    )
    min_hit_rate_gain_per_replica: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="When set, replaces targetHitRate: add a replica while it is predicted to "
        "buy at least this much hit rate, remove one while it buys less than half of it.",
    )
    capacity_miss_share: float = Field(
        default=0.3,
        ge=0.0,
        le=1.0,
        description="Fallback for agents without a miss-ratio curve: scale up only when at "
        "least this share of the misses are capacity misses (ghost list).",
    )
    scale_up_usage: float = Field(
        default=0.85,
        ge=0.0,
        le=1.0,
        description="Fallback for agents without a miss-ratio curve: scale up only when the "
        "cache is at least this full (used/total blocks).",
    )
    scale_down_usage: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description="Fallback for agents without a miss-ratio curve: scale down only when the "
        "cache is at most this full.",
    )
    scale_down_capacity_miss_rate: float = Field(
        default=0.01,
        ge=0.0,
        le=1.0,
        description="Fallback for agents without a miss-ratio curve: scale down only when "
        "capacity misses per queried token are at most this.",
    )
    scale_up_stabilization_seconds: int = Field(
        default=30,
        ge=0,
        le=3600,
        description="How long the scale-up signal must hold, and the least time between steps up.",
    )
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description="How long the scale-down signal (or no queries at all: down to "
        "minReplicas) must hold, and the least time after any step before a step down.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"minReplicas ({self.min_replicas}) must not exceed maxReplicas "
                f"({self.max_replicas})"
            )
        if self.scale_down_usage >= self.scale_up_usage:
            raise ValueError(
                f"scaleDownUsage ({self.scale_down_usage}) must be below scaleUpUsage "
                f"({self.scale_up_usage})"
            )
        return self


class RolloutSpec(_CrModel):
    """How restart-requiring config changes roll through the pods."""

    max_unavailable: int | str = Field(
        default=1,
        description="Pods that may be down at once during a roll and under disruptions: a "
        "number or a percentage such as 25%.",
    )
    warm_handoff: bool = Field(
        default=True,
        description="A terminating agent hands its hottest blocks to a peer of the pool "
        "(the operator fills agent.lifecycle.handoffPeers with the pool's pods).",
    )
    warm_handoff_seconds: int = Field(
        default=30,
        ge=0,
        le=3600,
        description="Seconds a restarted pod must stay ready before the next one is taken "
        "down, so its cache warms before a peer's cache goes (StatefulSet minReadySeconds).",
    )


class Toleration(_CrModel):
    """A pod toleration (the Kubernetes core/v1 Toleration fields)."""

    key: str | None = Field(default=None, description="Taint key the toleration applies to.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal."
    )
    value: str | None = Field(default=None, description="Taint value matched with Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all."
    )
    toleration_seconds: int | None = Field(
        default=None, description="How long a NoExecute taint is tolerated."
    )


class ResourceRequirements(_CrModel):
    """Container resources, e.g. limits: {nvidia.com/gpu: 1}."""

    requests: dict[str, int | str] | None = Field(default=None, description="Requested resources.")
    limits: dict[str, int | str] | None = Field(default=None, description="Resource limits.")


class PodSpec(_CrModel):
    """The part of the agent pods a pool can set."""

    image: str = Field(default=DEFAULT_IMAGE, description="Agent container image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy of the agent container."
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Agent container resources, such as nvidia.com/gpu.",
        json_schema_extra={"default": {}},
    )
    node_selector: dict[str, str] | None = Field(default=None, description="Node labels pods need.")
    tolerations: list[Toleration] | None = Field(
        default=None, description="Taints the pods tolerate."
    )
    service_account_name: str | None = Field(
        default=None, description="Service account of the pods."
    )
    priority_class_name: str | None = Field(default=None, description="Priority class of the pods.")
    labels: dict[str, str] | None = Field(default=None, description="Extra labels on the pods.")
    annotations: dict[str, str] | None = Field(default=None, description="Extra pod annotations.")
    node_socket: bool = Field(
        default=False,
        description="Also serve the transfer protocol on a Unix socket in a directory of the "
        "node (hostPath /var/run/kvpool/<namespace>/<pool>, socket transfer.sock, mode 0660, "
        "group 65532), so engines on the same node reach their pool's agent through its arena "
        "(the vLLM connector's unix_socket beside pool). At most one agent of the pool per "
        "node (required pod anti-affinity). Needs the operator's --allow-node-sockets (a "
        "hostPath volume, and an init container that runs as root to hand the directory to "
        "the agent's user). Restart-only.",
    )


class MonitoringSpec(_CrModel):
    """Prometheus scraping of the agents."""

    service_monitor: bool = Field(
        default=False,
        description="Create a ServiceMonitor (prometheus-operator) for the agents; skipped "
        "with a warning event when its CRD is not installed.",
    )
    interval: str = Field(default="30s", description="Scrape interval of the ServiceMonitor.")
    labels: dict[str, str] | None = Field(
        default=None, description="Extra labels on the ServiceMonitor (for Prometheus selectors)."
    )


class TenantSpec(_CrModel):
    """One tenant of the pool: a name, and the Secret that holds its bearer token."""

    name: str = Field(
        ...,
        max_length=63,
        pattern=TENANT_NAME_PATTERN,
        description="Tenant name (a DNS label): its cache namespace in the agents and the "
        "suffix of the Secret <pool>-tenant-<name> the operator writes its token to.",
    )
    secret_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="A Secret of yours, in the pool's namespace, whose key `token` holds the "
        "tenant's token; unset: the operator generates the token once and keeps it in "
        "<pool>-tenant-<name> (delete that Secret to rotate it).",
    )


def _default_tenants() -> list[TenantSpec]:
    return [TenantSpec(name=DEFAULT_TENANT)]


class AuthSpec(_CrModel):
    """Who may call the agents: every API call needs a tenant's bearer token."""

    tenants: list[TenantSpec] = Field(
        default_factory=_default_tenants,
        max_length=MAX_TENANTS,
        description="The pool's tenants, unique by name. Each has its own token and cache "
        "namespace; removing one revokes its token at once (no pod restarts).",
        json_schema_extra={"default": [{"name": DEFAULT_TENANT}]},
    )

    @model_validator(mode="after")
    def _unique_names(self) -> AuthSpec:
        seen: set[str] = set()
        for tenant in self.tenants:
            if tenant.name in seen:
                raise ValueError(f"tenants: name {tenant.name!r} appears more than once")
            seen.add(tenant.name)
        return self


class NetworkSpec(_CrModel):
    """The pool's NetworkPolicy: who may open connections to the agent pods."""

    policy: bool = Field(
        default=True,
        description="Create a NetworkPolicy admitting only the clients, the pool's own pods "
        "(handoff) and the operator (metrics) to the HTTP port, and only the event consumers "
        "to the KV event ports. Needs a CNI that enforces NetworkPolicy.",
    )
    client_selector: dict[str, str] | None = Field(
        default=None,
        max_length=MAX_SELECTOR_LABELS,
        description="Labels of the client pods admitted to the HTTP port; unset: pods "
        "labelled kvpool.io/client: <pool name>.",
    )
    client_namespace_selector: dict[str, str] | None = Field(
        default=None,
        max_length=MAX_SELECTOR_LABELS,
        description="Labels of the namespaces the clients and event consumers run in; unset: "
        "the pool's namespace only; {}: every namespace.",
    )
    event_consumer_selector: dict[str, str] | None = Field(
        default=None,
        max_length=MAX_SELECTOR_LABELS,
        description="Labels of the pods admitted to the KV event ports (ZMQ, no credential), "
        "in the clients' namespaces; unset: none.",
    )

    def clients(self, pool_name: str) -> dict[str, str]:
        """The effective client selector (the default names the pool)."""
        if self.client_selector is not None:
            return dict(self.client_selector)
        return {CLIENT_LABEL: pool_name}


class KVCachePoolSpec(_CrModel):
    """The desired state of a pool of paged KV cache agents."""

    model: PoolModel = Field(..., description="Attention geometry of the served model. Immutable.")
    kv_cache_config: KvCacheConfig = Field(
        default_factory=KvCacheConfig,
        description="The cache configuration (TensorRT-LLM KvCacheConfig names, camelCase).",
        json_schema_extra={"default": {}},
    )
    agent: AgentSpec = Field(
        default_factory=AgentSpec,
        description="Agent settings besides the cache config.",
        json_schema_extra={"default": {}},
    )
    replicas: int | None = Field(
        default=None,
        ge=0,
        description="Agent pods. Owned by the user, by the built-in autoscaler or by an "
        "HPA/KEDA through /scale; not together with built-in autoscaling on create.",
    )
    autoscaling: AutoscalingSpec | None = Field(
        default=None, description="Autoscaling from hit-rate metrics; unset means fixed replicas."
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        description="How restart-requiring changes roll through the pods.",
        json_schema_extra={"default": {}},
    )
    pod: PodSpec = Field(
        default_factory=PodSpec,
        description="Image, resources and placement of the agent pods.",
        json_schema_extra={"default": {}},
    )
    monitoring: MonitoringSpec = Field(
        default_factory=MonitoringSpec,
        description="Prometheus integration.",
        json_schema_extra={"default": {}},
    )
    auth: AuthSpec = Field(
        default_factory=AuthSpec,
        description="Tenants and their tokens (Secrets the operator manages).",
        json_schema_extra={"default": {}},
    )
    network: NetworkSpec = Field(
        default_factory=NetworkSpec,
        description="The NetworkPolicy of the agent pods.",
        json_schema_extra={"default": {}},
    )

    def agent_config(self) -> AgentConfig:
        """The agent config file this spec asks for (what the ConfigMap holds)."""
        return AgentConfig.model_validate(
            {
                "model": self.model.to_geometry(),
                "kv_cache_config": self.kv_cache_config,
                **{name: getattr(self.agent, name) for name in type(self.agent).model_fields},
            }
        )

    def builtin_autoscaling(self) -> bool:
        return self.autoscaling is not None and self.autoscaling.mode == "builtin"

    def desired_replicas(self) -> int:
        """spec.replicas, else the autoscaling floor, else 1; clamped to bounds when built-in."""
        auto = self.autoscaling
        if self.replicas is None:
            return auto.min_replicas if auto is not None else 1
        if auto is not None and auto.mode == "builtin":
            return max(auto.min_replicas, min(auto.max_replicas, self.replicas))
        return self.replicas


class Condition(_CrModel):
    """A status condition in the Kubernetes convention."""

    type: str = Field(..., description="Ready, Progressing or Degraded.")
    status: Literal["True", "False", "Unknown"] = Field(..., description="True, False, Unknown.")
    reason: str = Field(..., description="CamelCase reason of the last transition.")
    message: str = Field(default="", description="Human-readable details.")
    last_transition_time: str = Field(..., description="When the status last changed (RFC 3339).")
    observed_generation: int | None = Field(
        default=None, description="metadata.generation the condition was computed from."
    )


class CacheStatus(_CrModel):
    """Coarse cache figures from the agents' metrics, refreshed at most every 30 s."""

    hit_rate: float | None = Field(
        default=None,
        description="Token hit rate over the last windowSeconds; empty when there were no "
        "queries in that window.",
    )
    window_seconds: int | None = Field(
        default=None, description="The window hitRate and capacityMissRate cover."
    )
    queries_per_second: float | None = Field(
        default=None, description="Queried tokens per second over the window."
    )
    usage: float | None = Field(default=None, description="Used share of the primary-tier blocks.")
    capacity_miss_rate: float | None = Field(
        default=None, description="Capacity misses per queried token over the window."
    )
    predicted_hit_rate_down: float | None = Field(
        default=None,
        description="Predicted hit rate with one replica fewer, from the agents' miss-ratio "
        "curves over the last 30 s of traffic (what the autoscaler judges); empty without "
        "queries or curves, or at one replica.",
    )
    predicted_hit_rate_up: float | None = Field(
        default=None,
        description="Predicted hit rate with one replica more; empty without queries or curves.",
    )
    desired_replicas: int | None = Field(
        default=None,
        description="The replica count the autoscaler's rule asks for now (steps move towards "
        "it); also computed in external mode, for an HPA or KEDA to follow.",
    )
    updated_at: str | None = Field(default=None, description="When these figures were measured.")


class KVCachePoolStatus(_CrModel):
    """What the operator observed; written by the operator only."""

    observed_generation: int | None = Field(
        default=None, description="metadata.generation the operator last acted on."
    )
    replicas: int | None = Field(default=None, description="Agent pods that exist.")
    ready_replicas: int | None = Field(default=None, description="Agent pods that are ready.")
    updated_replicas: int | None = Field(
        default=None, description="Agent pods running the current pod template."
    )
    selector: str | None = Field(
        default=None, description="Label selector of the pods (for /scale)."
    )
    config_hash: str | None = Field(
        default=None, description="Hash of the restart-requiring agent config the pods should run."
    )
    conditions: list[Condition] | None = Field(
        default=None, description="Ready, Progressing and Degraded."
    )
    cache: CacheStatus | None = Field(default=None, description="Coarse cache figures.")
    last_scale_time: str | None = Field(
        default=None, description="When the built-in autoscaler last changed spec.replicas."
    )
    last_scale_reason: str | None = Field(
        default=None,
        description="Why the built-in autoscaler last changed spec.replicas, with the "
        "predicted and measured hit rates.",
    )


class KVCachePool(_CrModel):
    """A pool of paged KV cache agents served by one StatefulSet."""

    api_version: Literal["kvpool.io/v1alpha1"] = "kvpool.io/v1alpha1"
    kind: Literal["KVCachePool"] = "KVCachePool"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: KVCachePoolSpec
    status: KVCachePoolStatus | None = None

    model_config = ConfigDict(extra="ignore")

    @property
    def name(self) -> str:
        return str(self.metadata["name"])

    @property
    def namespace(self) -> str:
        return str(self.metadata.get("namespace") or "default")

    @property
    def uid(self) -> str:
        return str(self.metadata.get("uid", ""))

    @property
    def generation(self) -> int | None:
        gen = self.metadata.get("generation")
        return int(gen) if gen is not None else None
