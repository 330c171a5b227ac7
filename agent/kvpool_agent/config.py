"""Configuration models shared by the agent and the operator.

These pydantic models are the one source of truth for the cache configuration: the agent
loads them from its config file, the operator embeds them in the ``KVCachePool`` CRD (in
camelCase), and ``kvpool crd`` generates the CRD schema from them. Names and defaults
follow TensorRT-LLM's ``KvCacheConfig`` (see ``shared/reference/trtllm-kv-cache-system.txt``).

This module must stay light: the operator imports it, and the operator never imports torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

DEFAULT_PRIORITY = 35
"""Priority of a block with no retention policy, and the one an expired priority reverts to."""

MIN_PRIORITY = 0
MAX_PRIORITY = 100

KvDtype = Literal["auto", "float16", "bfloat16", "fp8", "int8"]
ModelDtype = Literal["float16", "bfloat16", "float32"]

EVICTION_POLICIES: tuple[str, ...] = ("lru", "reuse-gap", "mixture")
"""Names ``KvCacheConfig.eviction_policy`` accepts (``kvpool_agent.cache.eviction`` has them)."""

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
        "default, best across the traces in shared/traces: follows whichever of reuse-gap, "
        "LRFU and ARC has been hitting most), reuse-gap, or lru (the reference's plain LRU). "
        "Priorities and retention durations always come first.",
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


class ServerConfig(_Model):
    """Where the agent serves its HTTP API, metrics and probes. Restart-only."""

    host: str = Field("0.0.0.0", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (API, /metrics, probes).")


class EventsConfig(_Model):
    """KV events in vLLM's wire format (ZMQ PUB of msgpack batches, ROUTER replay). Restart-only.

    A ``*`` host in an endpoint is replaced by the server host when the agent is started with
    an explicit ``--host`` (several agents on one machine bind distinct loopback addresses).
    """

    endpoint: str | None = Field(
        "tcp://*:5557", description="ZMQ PUB endpoint to bind; unset disables ZMQ publishing."
    )
    replay_endpoint: str | None = Field(
        "tcp://*:5558", description="ZMQ ROUTER endpoint serving replays; unset disables it."
    )
    topic: str = Field("kv-events", description="Topic frame of every published message.")
    replay_buffer: int = Field(
        10_000, ge=1, description="Published batches kept for replay (by sequence number)."
    )


class RetentionDefaults(_Model):
    """The retention policy of a request that gives none. Live."""

    priority: int = Field(
        DEFAULT_PRIORITY,
        ge=MIN_PRIORITY,
        le=MAX_PRIORITY,
        description="Priority of the blocks of requests without a retention policy.",
    )
    duration_ms: int | None = Field(
        None, ge=0, description="How long that priority lasts; unset: until evicted."
    )


class LifecycleConfig(_Model):
    """Drain on SIGTERM and warm handoff of the hottest blocks."""

    grace_period_s: float = Field(
        25.0,
        gt=0,
        description="Seconds from SIGTERM to exit: in-flight sequences, then the handoff. "
        "Keep it below the pod's terminationGracePeriodSeconds. Live.",
    )
    handoff_peers: list[str] = Field(
        default_factory=list,
        description="Base URLs of peer agents of the same pool; the first that accepts gets "
        "the hottest blocks on drain. Live.",
    )
    handoff_max_blocks: int | None = Field(
        None, gt=0, description="Cap on the blocks handed off; unset: all that fit. Live."
    )
    snapshot_path: str | None = Field(
        None,
        description="Snapshot file written on drain when no peer took the blocks, and loaded "
        "at start when its geometry matches. Restart-only.",
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
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config {path} is not valid YAML: {err}") from None
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
