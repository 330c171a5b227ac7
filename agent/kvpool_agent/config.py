"""Configuration models shared by the agent and the operator.

These pydantic models are the one source of truth for the cache configuration: the agent
loads them from its config file, the operator embeds them in the ``KVCachePool`` CRD (in
camelCase), and ``kvpool crd`` generates the CRD schema from them. Names and defaults
follow TensorRT-LLM's ``KvCacheConfig`` (see ``shared/reference/trtllm-kv-cache-system.txt``).

This module must stay light: the operator imports it, and the operator never imports torch.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kvpool_agent.cache.eviction.registry import POLICIES

DEFAULT_PRIORITY = 35
"""Priority of a block with no retention policy, and the one an expired priority reverts to."""

MIN_PRIORITY = 0
MAX_PRIORITY = 100

KvDtype = Literal["auto", "float16", "bfloat16", "fp8", "int8"]
ModelDtype = Literal["float16", "bfloat16", "float32"]

EVICTION_POLICIES: tuple[str, ...] = tuple(POLICIES)
"""Names ``KvCacheConfig.eviction_policy`` accepts: the eviction registry's."""

DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "fp8": 1, "int8": 1}


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names each bad field and what is allowed."""


class _Model(BaseModel):
    """Base for config models: snake_case names (the reference's), camelCase accepted too."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
    )


class KvCacheConfig(_Model):
    """How the paged KV cache is sized and how it reuses, evicts and offloads blocks."""

    tokens_per_block: int = Field(
        32,
        description="Tokens held by one block. A power of two greater than 1. Restart-only.",
    )
    free_gpu_memory_fraction: float = Field(
        0.9,
        gt=0.0,
        lt=1.0,
        description="Share of free device memory given to the primary (GPU) tier, in (0, 1).",
    )
    max_tokens: int | None = Field(
        None,
        gt=0,
        description="Cap on the tokens the primary tier holds; the lesser of this and the "
        "fraction wins. Unset means no cap.",
    )
    host_cache_size: int = Field(
        0,
        ge=0,
        description="Bytes of pinned host memory for the secondary (offload) tier; 0 disables it.",
    )
    enable_block_reuse: bool = Field(
        True, description="Keep filled blocks in the radix tree for reuse across requests."
    )
    enable_partial_reuse: bool = Field(
        True, description="Reuse a block whose leading tokens, but not all, match."
    )
    copy_on_partial_reuse: bool = Field(
        True,
        description="Copy a partially matched block into a new one instead of taking it over, "
        "so several requests can partially reuse it.",
    )
    max_attention_window: list[int] | None = Field(
        None,
        min_length=1,
        description="Attention window per layer, repeated over the layers when shorter than "
        "the model. Unset means full attention everywhere.",
    )
    secondary_offload_min_priority: int = Field(
        DEFAULT_PRIORITY,
        ge=MIN_PRIORITY,
        le=MAX_PRIORITY,
        description="Blocks with a priority lower than this are dropped, not offloaded to host "
        "memory, when evicted from the primary tier.",
    )
    dtype: KvDtype = Field(
        "auto", description="Data type held in the cache; auto takes the model's dtype."
    )
    onboard_blocks: bool = Field(
        True, description="Copy offloaded blocks back to the primary tier when they are reused."
    )
    event_buffer_max_size: int = Field(
        10_000, ge=0, description="Bound of the KV event queue; 0 disables KV events."
    )
    eviction_policy: str = Field(
        "mixture",
        description="How blocks of equal priority are ordered for eviction: mixture (the "
        "default: plain LRU, reuse-gap, LRFU and ARC vote, each weighed by how much it has "
        "been hitting, and the blocks of least summed weight go first; within about 1% of "
        "requested blocks of plain LRU on adversarial traces), reuse-gap, or lru (the "
        "reference's plain LRU). Priorities and retention durations always come first.",
    )

    @field_validator("tokens_per_block")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value <= 1 or value & (value - 1):
            raise ValueError(
                f"must be a power of two greater than 1 (2, 4, 8, 16, ...), got {value}"
            )
        return value

    @field_validator("max_attention_window")
    @classmethod
    def _positive_windows(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(w <= 0 for w in value):
            raise ValueError(f"every window must be a positive number of tokens, got {value}")
        return value

    @field_validator("eviction_policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in EVICTION_POLICIES:
            raise ValueError(f"must be one of {', '.join(EVICTION_POLICIES)}; got {value!r}")
        return value


class ModelGeometry(_Model):
    """The attention shape of the served model: what a block of KV holds."""

    name: str | None = Field(None, description="Free-form model name, for humans.")
    num_layers: int = Field(..., gt=0, description="Attention layers.")
    num_kv_heads: int | list[int] = Field(
        ...,
        description="KV heads: one number for every layer, or one entry per layer.",
    )
    head_dim: int = Field(..., gt=0, description="Size of one attention head.")
    dtype: ModelDtype = Field("bfloat16", description="Model activation dtype.")

    @model_validator(mode="after")
    def _heads_match_layers(self) -> ModelGeometry:
        heads = self.num_kv_heads
        if isinstance(heads, list):
            if len(heads) != self.num_layers:
                raise ValueError(
                    f"num_kv_heads lists {len(heads)} entries but num_layers is {self.num_layers}"
                )
            if any(h <= 0 for h in heads):
                raise ValueError(f"num_kv_heads entries must be positive, got {heads}")
        elif heads <= 0:
            raise ValueError(f"num_kv_heads must be positive, got {heads}")
        return self

    def kv_heads_per_layer(self) -> list[int]:
        heads = self.num_kv_heads
        return list(heads) if isinstance(heads, list) else [heads] * self.num_layers

    def windows_per_layer(self, cache: KvCacheConfig, max_seq_len: int | None = None) -> list[int]:
        """The reference's rule: the window list is repeated until it covers every layer."""
        windows = cache.max_attention_window
        if not windows:
            full = max_seq_len if max_seq_len is not None else FULL_ATTENTION
            return [full] * self.num_layers
        return [windows[i % len(windows)] for i in range(self.num_layers)]

    def kv_dtype(self, cache: KvCacheConfig) -> str:
        """The dtype stored in the cache: the config's, or the model's when ``auto``."""
        return self.dtype if cache.dtype == "auto" else cache.dtype


FULL_ATTENTION = 1 << 62
"""Window used for full-attention layers when no maximum sequence length is known."""


def is_loopback(host: str) -> bool:
    """Whether an agent may bind ``host`` without credentials (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


ZMQ_ENDPOINT_PATTERN = (
    r"^(tcp://(\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):([0-9]{1,5}|\*)|ipc:///?[^\s]+)$"
)
"""What ``events.endpoint``/``replay_endpoint`` accept: ``tcp://HOST:PORT`` (a ``*`` port: any
free one) or ``ipc://PATH``."""

UNIX_PATH_MAX = 108
"""Bytes of a Unix socket address (Linux's ``sun_path``, its terminating NUL included)."""
PEER_URL_PATTERN = r"^https?://[A-Za-z0-9.\-]+(:[0-9]{1,5})?/?$"
"""What a handoff peer may be: a plain http(s) base URL, no path, query or credentials."""

TENANT_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
"""Tenant names: DNS labels, so they can name Secrets and appear in metrics."""


class ServerConfig(_Model):
    """Where the agent serves its HTTP API, metrics and probes. Restart-only."""

    host: str = Field(
        "127.0.0.1",
        description="Address the HTTP server binds. Loopback by default; any other address "
        "needs credentials (auth) or auth.allowUnauthenticated.",
    )
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (API, /metrics, probes).")


class EventsConfig(_Model):
    """KV events in vLLM's wire format (ZMQ PUB of msgpack batches, ROUTER replay). Restart-only.

    A ``*`` host in an endpoint stands for the server host (``server.host`` or ``--host``):
    loopback unless the agent serves beyond it. The ZMQ sockets carry no credential; in a
    pool, the NetworkPolicy admits only the event consumers to them (docs/security.md).
    """

    endpoint: str | None = Field(
        "tcp://*:5557",
        max_length=256,
        pattern=ZMQ_ENDPOINT_PATTERN,
        description="ZMQ PUB endpoint to bind (tcp://HOST:PORT or ipc://PATH, * = the server "
        "host); unset disables ZMQ publishing.",
    )
    replay_endpoint: str | None = Field(
        "tcp://*:5558",
        max_length=256,
        pattern=ZMQ_ENDPOINT_PATTERN,
        description="ZMQ ROUTER endpoint serving replays (tcp://HOST:PORT or ipc://PATH); "
        "unset disables it.",
    )
    topic: str = Field(
        "kv@{pod}@{model}",
        min_length=1,
        max_length=256,
        description="Topic frame of every published message: {pod} is the pod's address "
        "($POD_IP, else $POD_NAME, else $HOSTNAME), {model} is model.name. The default is the "
        "kv@<pod>@<model> topic llm-d's KV indexer reads the pod and model from.",
    )
    replay_buffer: int = Field(
        10_000, ge=1, le=1_000_000, description="Published batches kept for replay."
    )


class AuthConfig(_Model):
    """Who may call the agent (docs/security.md). Restart-only; the files are re-read live.

    With ``tenants_file`` set, every route but ``/healthz``, ``/readyz`` and ``/metrics`` needs
    ``Authorization: Bearer TOKEN``: a tenant's token (its own sequences, in its own cache
    namespace) or the pool's peer token (handoff, the event replay). Without it the agent
    serves one anonymous tenant and refuses to bind beyond loopback unless
    ``allow_unauthenticated`` says so.
    """

    tenants_file: str | None = Field(
        None,
        description="YAML mapping of tenant name to the SHA-256 hex digest of its token "
        "(the operator's <pool>-auth Secret). Re-read when it changes.",
    )
    peer_token_file: str | None = Field(
        None,
        description="File holding the pool's peer token: agents of the pool present it to "
        "each other for warm handoff; it also reads /v1/events. Re-read when it changes.",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Serve without credentials on a non-loopback address (trusted networks "
        "only: every client is then the same anonymous tenant).",
    )


class LimitsConfig(_Model):
    """Bounds that keep one client from stalling or filling the agent. Restart-only."""

    max_json_body_bytes: int = Field(
        8 << 20, gt=0, description="Largest JSON request body (chunked bodies counted too)."
    )
    max_payload_bytes: int = Field(
        1 << 30, gt=0, description="Largest binary KV payload of one PUT."
    )
    max_handoff_bytes: int = Field(
        4 << 30, gt=0, description="Largest handoff snapshot a peer may send."
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="Seconds a connection may take to send a request's headers."
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="Seconds a request may take to send its body."
    )
    idle_timeout_s: float = Field(
        30.0, gt=0, description="Seconds an idle keep-alive connection stays open."
    )
    max_connections: int = Field(
        1024, gt=0, description="Concurrent connections and requests; beyond it: 503."
    )
    tenant_max_open_sequences: int = Field(
        4096, gt=0, description="Open sequences per tenant; beyond it: 429."
    )
    tenant_max_pinned_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Share of a pool group's primary blocks one tenant may pin with open "
        "sequences when the agent serves more than one tenant; beyond it: 429.",
    )
    sequence_idle_timeout_s: float = Field(
        600.0,
        gt=0,
        description="An open sequence untouched for this long is released (its unwritten KV "
        "dropped), so a crashed client leaves nothing pinned.",
    )
    max_replay_batches: int = Field(
        1000, gt=0, description="Event batches one replay request returns at most."
    )
    engine_stall_s: float = Field(
        30.0,
        gt=0,
        description="/readyz fails while one engine call has held the engine this long, and "
        "/healthz at twice that, so Kubernetes restarts a wedged agent.",
    )
    policy_curve_cpu_share: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Share of one core the policy curve's miniature simulations may use, "
        "replayed between requests (cache/miniature.py); 0 turns them off (the autoscaler "
        "then predicts from the LRU curve alone).",
    )


class TransferConfig(_Model):
    """The binary transfer port for inference-engine connectors (docs/dataplane.md): engine
    keys, lookups, leases, KV get/put. It binds the server host. Restart-only."""

    port: int | None = Field(
        8100,
        ge=0,
        le=65535,
        description="TCP port of the transfer protocol on the server host; 0 picks a free "
        "port (tests); unset (null) disables it.",
    )
    max_frame_bytes: int = Field(
        1 << 30, gt=0, description="Largest KV data of one frame (a PUT request, a GET reply)."
    )
    max_meta_bytes: int = Field(
        1 << 20, gt=0, le=1 << 30, description="Largest metadata map of one frame."
    )
    max_keys: int = Field(4096, gt=0, description="Most engine keys in one request.")
    max_inflight: int = Field(
        8,
        gt=0,
        description="Replies one connection may have queued but not yet sent (GETs streaming "
        "out); beyond it the agent stops reading that connection until one is sent.",
    )
    max_connections: int = Field(
        1024, gt=0, description="Open transfer connections; beyond it a new one is refused."
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="Seconds a frame's header and metadata may take once begun."
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="Seconds a frame's KV data may take to arrive or to be sent."
    )
    idle_timeout_s: float = Field(
        300.0, gt=0, description="Seconds an idle connection (no request, no reply) stays open."
    )
    lease_ttl_s: float = Field(
        30.0, gt=0, description="Lease lifetime when the request names none."
    )
    max_lease_ttl_s: float = Field(
        600.0, gt=0, description="Longest lease a request may ask for (longer asks get this)."
    )
    unix_socket: str | None = Field(
        None,
        description="Absolute path of a Unix socket speaking the same protocol (same AUTH) "
        "plus the same-node ops: an engine on this node maps the agent's arena (its memfd, "
        "handed over after AUTH) and copies KV itself; unset (null) disables it, and the arena "
        "is then allocated as before.",
    )
    unix_socket_mode: int = Field(
        0o600,
        ge=0,
        le=0o777,
        description="Permission bits of the Unix socket (0600: the agent's user only; 0660 "
        "lets its group connect). Connecting still needs a token when auth is on.",
    )

    @field_validator("unix_socket")
    @classmethod
    def _unix_path(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith("/"):
            raise ValueError(f"transfer.unix_socket: an absolute path, got {value!r}")
        if len(value.encode()) >= UNIX_PATH_MAX:
            raise ValueError(
                f"transfer.unix_socket: at most {UNIX_PATH_MAX - 1} bytes (the kernel's "
                f"sun_path), got {len(value.encode())}"
            )
        return value

    @field_validator("unix_socket_mode")
    @classmethod
    def _unix_mode(cls, value: int) -> int:
        if value & 0o007:
            raise ValueError(
                f"transfer.unix_socket_mode: {value:#o} lets any local user connect; "
                "use 0600 or 0660 (the owner's group)"
            )
        return value


class RetentionDefaults(_Model):
    """The retention policy of a request that gives none. Live."""

    priority: int = Field(
        DEFAULT_PRIORITY,
        ge=MIN_PRIORITY,
        le=MAX_PRIORITY,
        description="Priority of the blocks of requests without a retention policy.",
    )
    duration_ms: int | None = Field(
        None,
        ge=0,
        le=366 * 24 * 3600 * 1000,
        description="How long that priority lasts (at most a year); unset: until evicted.",
    )


class LifecycleConfig(_Model):
    """Drain on SIGTERM and warm handoff of the hottest blocks."""

    grace_period_s: float = Field(
        25.0,
        gt=0,
        description="Seconds from SIGTERM to exit: in-flight sequences, then the handoff. "
        "Keep it below the pod's terminationGracePeriodSeconds. Live.",
    )
    handoff_peers: list[Annotated[str, Field(max_length=512, pattern=PEER_URL_PATTERN)]] = Field(
        default_factory=list,
        max_length=256,
        description="Base URLs (http(s)://HOST[:PORT]) of peer agents of the same pool; the "
        "first that accepts gets the hottest blocks on drain. Live.",
    )
    handoff_max_blocks: int | None = Field(
        None, gt=0, description="Cap on the blocks handed off; unset: all that fit. Live."
    )
    snapshot_path: str | None = Field(
        None,
        description="Snapshot file written on drain when no peer took the blocks, and loaded "
        "at start when its geometry matches. Restart-only.",
    )
    ring_aware: bool = Field(
        True,
        description="Hand blocks to the peers that own their keys: on drain each chain goes "
        "to its rendezvous owner among the ready peers, and a starting agent takes back "
        "from its peers the chains it owns (server/rebalance.py). Off: the first peer that "
        "accepts gets all. Live.",
    )
    self_url: str | None = Field(
        None,
        max_length=512,
        pattern=PEER_URL_PATTERN,
        description="This agent's own base URL as the clients rank it (as in handoff_peers); "
        "unset: KVPOOL_SELF_URL, else the handoff peer whose host's first label is POD_NAME. "
        "The operator clears it (one config serves every pod). Live.",
    )
    affinity_blocks: int = Field(
        4,  # kvpool_agent.client.DEFAULT_AFFINITY_BLOCKS
        ge=1,
        le=1024,
        description="Leading blocks the clients route a sequence by (PoolClient's "
        "affinity_blocks): must equal theirs for the ring-aware handoff to find owners. Live.",
    )
    handback_timeout_s: float = Field(
        10.0,
        ge=0,
        le=600,
        description="Seconds a starting agent waits for its peers to return the chains it "
        "owns before it reports ready (0: take nothing back). Live.",
    )


class AgentConfig(_Model):
    """The agent's config file (in a pod: the ConfigMap the operator writes)."""

    model: ModelGeometry
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the primary tier lives; auto picks CUDA when present."
    )
    cpu_budget_bytes: int = Field(
        256 << 20,
        gt=0,
        description="Primary-tier budget in bytes when the primary tier lives on the CPU.",
    )
    reserved_device_bytes: int = Field(
        0,
        ge=0,
        description="Device memory kept for weights and activations before the fraction applies.",
    )
    max_seq_len: int | None = Field(
        None, gt=0, description="Longest sequence served; bounds full-attention windows."
    )
    server: ServerConfig = Field(default_factory=lambda: ServerConfig.model_validate({}))
    events: EventsConfig = Field(default_factory=lambda: EventsConfig.model_validate({}))
    retention: RetentionDefaults = Field(
        default_factory=lambda: RetentionDefaults.model_validate({})
    )
    lifecycle: LifecycleConfig = Field(default_factory=lambda: LifecycleConfig.model_validate({}))
    auth: AuthConfig = Field(default_factory=lambda: AuthConfig.model_validate({}))
    limits: LimitsConfig = Field(default_factory=lambda: LimitsConfig.model_validate({}))
    transfer: TransferConfig = Field(default_factory=lambda: TransferConfig.model_validate({}))

    @model_validator(mode="after")
    def _loopback_unless_authenticated(self) -> AgentConfig:
        a = self.auth
        if (
            not is_loopback(self.server.host)
            and a.tenants_file is None
            and not a.allow_unauthenticated
        ):
            raise ValueError(
                f"server.host {self.server.host!r} is not loopback: set auth.tenants_file "
                "(credentials) or auth.allow_unauthenticated: true"
            )
        return self


def format_validation_error(err: ValidationError, source: str = "config") -> str:
    """One line per bad field: dotted path, what is wrong, and (for choices) what is allowed."""
    lines = [f"invalid {source}:"]
    for item in err.errors():
        path = ".".join(str(p) for p in item["loc"]) or "(root)"
        msg = item["msg"].removeprefix("Value error, ")
        lines.append(f"  {path}: {msg}")
    return "\n".join(lines)


def load_agent_config(path: str | Path) -> AgentConfig:
    """Read and validate an agent config (YAML or JSON); raises ConfigError naming the fields."""
    data = _read_mapping(path)
    try:
        return AgentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, str(path))) from None


def _read_mapping(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML/JSON file; every way it can be wrong is a ConfigError naming it."""
    try:
        raw = Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror or err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config {path} is not UTF-8 text (byte {err.start}: {err.reason})"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config {path} is not valid YAML: {err}") from None
    except RecursionError:
        raise ConfigError(f"config {path} is nested too deeply") from None
    except ValueError as err:  # a constructor's, such as a timestamp out of range
        raise ConfigError(f"config {path} has a value YAML cannot read: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping, got {type(data).__name__}")
    return data


LIVE_FIELDS: frozenset[str] = frozenset(
    {
        "kv_cache_config.enable_block_reuse",
        "kv_cache_config.enable_partial_reuse",
        "kv_cache_config.copy_on_partial_reuse",
        "kv_cache_config.secondary_offload_min_priority",
        "kv_cache_config.onboard_blocks",
        "kv_cache_config.eviction_policy",
        "kv_cache_config.event_buffer_max_size",
        "retention.priority",
        "retention.duration_ms",
        "lifecycle.grace_period_s",
        "lifecycle.handoff_peers",
        "lifecycle.handoff_max_blocks",
        "lifecycle.ring_aware",
        "lifecycle.self_url",
        "lifecycle.affinity_blocks",
        "lifecycle.handback_timeout_s",
    }
)
"""Dotted field paths a running agent applies from its reloaded config file with no restart.

Every other field (model geometry, ``tokens_per_block``, memory sizing, windows, dtype,
device) changes the layout of allocated memory, so a change to it needs a restart: the
operator rolls the pods for those and only writes the ConfigMap for these.
"""


def changed_fields(old: BaseModel, new: BaseModel, prefix: str = "") -> list[str]:
    """Dotted paths of the leaf fields that differ between two configs of the same model."""
    out: list[str] = []
    for name in type(old).model_fields:
        a, b = getattr(old, name), getattr(new, name)
        path = f"{prefix}{name}"
        if isinstance(a, BaseModel) and isinstance(b, BaseModel) and type(a) is type(b):
            out.extend(changed_fields(a, b, prefix=f"{path}."))
        elif a != b:
            out.append(path)
    return out


def restart_fields(old: AgentConfig, new: AgentConfig) -> list[str]:
    """The changed fields that need a restart (not in ``LIVE_FIELDS``)."""
    return [f for f in changed_fields(old, new) if f not in LIVE_FIELDS]
