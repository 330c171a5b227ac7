"""Request and response bodies of the HTTP API (they generate the published OpenAPI spec).

Token ids are strict non-negative ints below 2**63 (no strings, floats or booleans);
unknown fields are rejected, so a typo is a 422 naming the field rather than a silent default.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from kvpool_agent.cache import KvCacheRetentionConfig
from kvpool_agent.dataplane.keys import MAX_KEY_BYTES, MAX_LAYER_GROUP, MAX_MODEL_CHARS, MAX_RANK

TokenId = Annotated[StrictInt, Field(ge=0, lt=1 << 63)]
ExtraKey = StrictInt | StrictStr
HexKey = Annotated[
    StrictStr,
    Field(
        min_length=2,
        max_length=2 * MAX_KEY_BYTES,
        pattern=r"^(?:[0-9a-fA-F]{2})+$",
        description="An engine key (1 to 64 bytes) in hex.",
    ),
]
MAX_HTTP_KEYS = 1 << 16
"""Keys one JSON body may name (the agent's ``transfer.max_keys`` bounds them further)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OpenSequenceRequest(_Body):
    tokens: list[TokenId] = Field(..., min_length=1, description="Prompt token ids.")
    cache_salt: StrictStr | None = Field(
        None, max_length=256, description="Tenant isolation: reuse only blocks of the same salt."
    )
    extra_keys: list[ExtraKey] = Field(
        default_factory=list, max_length=16, description="More namespace keys (an adapter id)."
    )
    retention: KvCacheRetentionConfig | None = Field(
        None, description="Retention policy; unset: the agent's configured default."
    )
    recompute_last_token: StrictBool = Field(
        True, description="Keep the last prompt token out of the match (the client needs logits)."
    )


class AppendTokensRequest(_Body):
    tokens: list[TokenId] = Field(..., min_length=1, description="Token ids to add.")


class SequenceResponse(BaseModel):
    seq_id: int
    num_tokens: int
    num_reused_tokens: int = Field(description="Leading tokens whose KV the cache already held.")
    block_tables: list[list[int]] = Field(
        description="Per pool, the primary block ids from first_token[pool] on."
    )
    first_token: list[int]
    tokens_per_block: int
    last_page_len: int


class AttentionRequest(_Body):
    seq_ids: list[StrictInt] = Field(..., min_length=1, max_length=4096)
    q_lens: list[StrictInt] = Field(
        ..., min_length=1, max_length=4096, description="Query tokens per sequence (its last ones)."
    )
    layer: StrictInt = Field(..., ge=0, description="Model layer.")
    num_qo_heads: StrictInt = Field(..., ge=1)
    causal: StrictBool = True
    q: StrictStr = Field(
        ...,
        description="Base64 of a tensor frame (see docs/agent.md) of shape "
        "[sum(q_lens), num_qo_heads, head_dim].",
    )


class AttentionResponse(BaseModel):
    output: str = Field(description="Base64 tensor frame [sum(q_lens), num_qo_heads, head_dim].")
    backend: str = Field(description="flashinfer or torch.")


class HandoffResponse(BaseModel):
    chains: int
    blocks_written: int
    skipped: int


class KeyNamespaceBody(_Body):
    """Where a chain of engine keys lives, inside the caller's tenant."""

    model: StrictStr = Field(
        ..., min_length=1, max_length=MAX_MODEL_CHARS, description="Model id (printable)."
    )
    rank: StrictInt = Field(0, ge=0, le=MAX_RANK, description="Parallel (TP/PP) rank.")
    layer_group: StrictInt = Field(0, ge=0, le=MAX_LAYER_GROUP, description="Layer group.")


class KeysLookupRequest(_Body):
    namespace: KeyNamespaceBody
    keys: list[HexKey] = Field(
        ...,
        min_length=1,
        max_length=MAX_HTTP_KEYS,
        description="The chain's block keys, first block first.",
    )


class KeysLookupResponse(BaseModel):
    count: int = Field(description="Leading keys whose blocks the cache holds (usable now).")
    tiers: list[str] = Field(description="The tier of each of them: primary or secondary.")


class LeaseRequest(KeysLookupRequest):
    ttl_s: StrictFloat | StrictInt | None = Field(
        None,
        gt=0,
        description="Lease lifetime in seconds; unset: transfer.lease_ttl_s; at most "
        "transfer.max_lease_ttl_s.",
    )


class LeaseResponse(BaseModel):
    lease_id: int | None = Field(description="The lease (null: no block resident, no lease).")
    count: int = Field(description="Leading blocks leased (pinned).")
    tiers: list[str] = Field(description="Where each leased block was found.")
    first_block: list[int] = Field(
        description="Per pool, the first leased block readable there (sliding windows)."
    )
    ttl_s: float | None = Field(description="Seconds the lease lasts unless released.")


class ErrorResponse(BaseModel):
    detail: Any = Field(description="Why the request was refused; nothing was changed.")


class StatsResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    queries_tokens: int
    hits_tokens: dict[str, int]
    capacity_miss_tokens: int
    miss_ratio_curve: dict[str, Any] = Field(
        description="Accessed blocks by LRU reuse distance as a fraction of capacity_blocks "
        "(cumulative, sampled estimate): buckets[i].hit_ratio is the hit ratio an LRU cache "
        "le times this size would have had (cache/mrc.py)."
    )
    policy_curve: dict[str, Any] | None = Field(
        description="The engine's own eviction policy at other sizes, from miniature "
        "simulations on sampled keys: ratios[i].hit_ratio is the hit ratio a cache of that "
        "policy, ratio times capacity_blocks, had (cache/miniature.py); null when "
        "limits.policy_curve_cpu_share is 0."
    )
    engine_core: str = Field(
        description="Which core keeps the cache's books: native (compiled, agent/native) or "
        "python (the reference, where the compiled one is not installed or KVPOOL_CORE=python)"
    )
    open_sequences: int
    pools: list[dict[str, Any]]


class ReplayedBatch(BaseModel):
    seq: int
    ts: float
    events: list[list[Any]]
