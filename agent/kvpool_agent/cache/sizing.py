"""How many blocks each pool gets: the pool plan.

Pools: one per (attention window, kv heads) combination; the layers of a pool are packed
into one block, so

    bytes per block = 2 (K, V) x layers x kv heads x head dim x tokens_per_block x dtype bytes.

Pools with the same window form a *group*: every token block needs a block in each pool of
its group, and a prefix is only usable while all of them are present, so a group's pools
share block ids, allocation and eviction (one group block = the blocks of all its pools).

Budgets: primary = ``free_gpu_memory_fraction`` x (free device memory - reserved), or an
explicit byte budget on CPU, capped by what ``max_tokens`` tokens need in every layer;
secondary = ``host_cache_size``.

Initial split between groups (the reference splits statically; kvpool only starts there):
each group's share of a tier's bytes is proportional to (bytes per token of the group) x
(its effective window), where a full-attention window counts as ``max_seq_len`` (or the
largest configured window). A group that only keeps the last 256 tokens of each sequence
needs far fewer blocks than a full-attention group of the same width. Each tier is carved
into chunks, and the engine moves wholly free chunks between groups as demand shifts
(``block_pool.TierPool.move_free_chunk``), so the split above is a starting point, not a
limit.

``place`` is the one rule for where the primary tier lives and its byte budget: the agent
(``KVCacheManager.from_agent_config``) and ``kvpool size`` both call it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvpool_agent.config import (
    DTYPE_BYTES,
    FULL_ATTENTION,
    AgentConfig,
    ConfigError,
    KvCacheConfig,
    ModelGeometry,
)

TARGET_CHUNKS = 64
"""Chunks per tier when several groups share it: the granularity of rebalancing."""

ALIGN = 256
"""Byte alignment of every block inside a tier arena."""


@dataclass(frozen=True)
class PoolSpec:
    """One pool: the layers that share a window and a kv-head count."""

    index: int
    group: int
    window: int
    kv_heads: int
    head_dim: int
    layers: tuple[int, ...]
    tokens_per_block: int
    dtype: str

    @property
    def block_bytes(self) -> int:
        return (
            2
            * len(self.layers)
            * self.kv_heads
            * self.head_dim
            * self.tokens_per_block
            * DTYPE_BYTES[self.dtype]
        )

    @property
    def is_full_attention(self) -> bool:
        return self.window >= FULL_ATTENTION


@dataclass(frozen=True)
class GroupSpec:
    """Pools with one window: they share block ids and eviction."""

    index: int
    window: int
    pools: tuple[int, ...]
    pool_offsets: tuple[int, ...]
    """Byte offset of each pool's part inside one group block."""
    block_bytes: int
    """Bytes of one group block (the pools' blocks side by side, aligned)."""
    full_attention: bool


@dataclass(frozen=True)
class TierPlan:
    """One tier's arena: chunks, and the chunks each group starts with."""

    name: str
    budget_bytes: int
    chunk_bytes: int
    num_chunks: int
    group_chunks: tuple[int, ...]
    group_blocks: tuple[int, ...]
    """Usable blocks of each group with the initial chunks."""

    @property
    def arena_bytes(self) -> int:
        return self.chunk_bytes * self.num_chunks


@dataclass(frozen=True)
class PoolPlan:
    """Everything sizing decides, before any memory is allocated."""

    tokens_per_block: int
    kv_dtype: str
    pools: tuple[PoolSpec, ...]
    groups: tuple[GroupSpec, ...]
    primary: TierPlan
    secondary: TierPlan
    layer_pool: tuple[int, ...] = field(default=())
    """Pool index of each model layer."""

    def tiers(self) -> tuple[TierPlan, TierPlan]:
        return (self.primary, self.secondary)

    def to_dict(self) -> dict[str, Any]:
        """The plan for scripts (``kvpool size --json``)."""
        out: dict[str, Any] = {
            "tokens_per_block": self.tokens_per_block,
            "kv_dtype": self.kv_dtype,
            "pools": [],
            "tiers": {t.name: asdict(t) for t in self.tiers()},
        }
        for pool in self.pools:
            entry: dict[str, Any] = {
                "index": pool.index,
                "window": None if pool.is_full_attention else pool.window,
                "kv_heads": pool.kv_heads,
                "layers": list(pool.layers),
                "bytes_per_block": pool.block_bytes,
            }
            for tier in self.tiers():
                blocks = tier.group_blocks[pool.group]
                entry[tier.name] = {
                    "blocks": blocks,
                    "tokens": blocks * self.tokens_per_block,
                    "bytes": blocks * pool.block_bytes,
                }
            out["pools"].append(entry)
        return out


def build_pools(
    model: ModelGeometry, cache: KvCacheConfig, max_seq_len: int | None = None
) -> tuple[tuple[PoolSpec, ...], tuple[GroupSpec, ...], tuple[int, ...]]:
    """Group the model's layers into pools and pools into window groups."""
    windows = model.windows_per_layer(cache)
    if max_seq_len is not None:
        windows = [FULL_ATTENTION if w >= max_seq_len else w for w in windows]
    heads = model.kv_heads_per_layer()
    dtype = model.kv_dtype(cache)
    combos: dict[tuple[int, int], list[int]] = {}
    for layer, (w, h) in enumerate(zip(windows, heads, strict=True)):
        combos.setdefault((w, h), []).append(layer)
    group_of_window: dict[int, int] = {}
    for w, _ in combos:
        group_of_window.setdefault(w, len(group_of_window))
    pools = tuple(
        PoolSpec(
            index=i,
            group=group_of_window[w],
            window=w,
            kv_heads=h,
            head_dim=model.head_dim,
            layers=tuple(layers),
            tokens_per_block=cache.tokens_per_block,
            dtype=dtype,
        )
        for i, ((w, h), layers) in enumerate(combos.items())
    )
    groups = []
    for w, g in group_of_window.items():
        members = tuple(p.index for p in pools if p.group == g)
        offsets, offset = [], 0
        for i in members:
            offsets.append(offset)
            offset += _align(pools[i].block_bytes)
        groups.append(
            GroupSpec(
                index=g,
                window=w,
                pools=members,
                pool_offsets=tuple(offsets),
                block_bytes=offset,
                full_attention=w >= FULL_ATTENTION,
            )
        )
    layer_pool = [0] * model.num_layers
    for pool in pools:
        for layer in pool.layers:
            layer_pool[layer] = pool.index
    return pools, tuple(groups), tuple(layer_pool)


def plan_pools(
    model: ModelGeometry,
    cache: KvCacheConfig,
    *,
    primary_bytes: int,
    max_seq_len: int | None = None,
) -> PoolPlan:
    """Size every pool for a primary budget (already the fraction of free memory, or the CPU
    budget) and the config's ``host_cache_size``; ``max_tokens`` caps the primary tier."""
    pools, groups, layer_pool = build_pools(model, cache, max_seq_len)
    tpb = cache.tokens_per_block
    if cache.max_tokens is not None:
        blocks = -(-cache.max_tokens // tpb)
        primary_bytes = min(primary_bytes, blocks * sum(g.block_bytes for g in groups))
    weights = _group_weights(groups, tpb, max_seq_len)
    primary = _plan_tier("primary", primary_bytes, groups, weights)
    secondary = _plan_tier("secondary", cache.host_cache_size, groups, weights)
    return PoolPlan(
        tokens_per_block=tpb,
        kv_dtype=pools[0].dtype,
        pools=pools,
        groups=groups,
        primary=primary,
        secondary=secondary,
        layer_pool=layer_pool,
    )


def _group_weights(
    groups: tuple[GroupSpec, ...], tokens_per_block: int, max_seq_len: int | None
) -> list[float]:
    finite = [g.window for g in groups if not g.full_attention]
    full_window = max_seq_len or (max(finite) if finite else 1)
    weights: list[float] = []
    for g in groups:
        window = full_window if g.full_attention else min(g.window, full_window)
        # A window group holds at most window/tpb + 1 blocks of each sequence.
        weights.append(g.block_bytes * (window + tokens_per_block))
    return weights


def _plan_tier(
    name: str, budget: int, groups: tuple[GroupSpec, ...], weights: list[float]
) -> TierPlan:
    n = len(groups)
    biggest = max(g.block_bytes for g in groups)
    if budget < biggest * n:
        return TierPlan(name, budget, biggest, 0, (0,) * n, (0,) * n)
    if n == 1:
        count = budget // biggest
        return TierPlan(name, budget, biggest * count, 1, (1,), (count,))
    chunk = max(biggest, (budget // TARGET_CHUNKS) // biggest * biggest)
    num_chunks = budget // chunk
    total = sum(weights)
    exact = [num_chunks * w / total for w in weights]
    counts = [max(1, int(x)) for x in exact]
    while sum(counts) > num_chunks:
        counts[counts.index(max(counts))] -= 1
    order = sorted(range(n), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in order[: num_chunks - sum(counts)]:
        counts[i] += 1
    blocks: list[int] = []
    first = 0
    for c, g in zip(counts, groups, strict=True):
        blocks.append(
            sum(len(block_ids_in_chunk(k, chunk, g.block_bytes)) for k in range(first, first + c))
        )
        first += c
    return TierPlan(name, budget, chunk, num_chunks, tuple(counts), tuple(blocks))


def block_ids_in_chunk(chunk: int, chunk_bytes: int, block_bytes: int) -> range:
    """Ids of the blocks of a group (size ``block_bytes``) that lie wholly inside a chunk.

    A group addresses the whole arena in steps of its block size, so block ``i`` spans bytes
    ``[i * block_bytes, (i + 1) * block_bytes)``.
    """
    start = -(-(chunk * chunk_bytes) // block_bytes)
    stop = ((chunk + 1) * chunk_bytes) // block_bytes
    return range(start, max(start, stop))


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def primary_budget(config: KvCacheConfig, free_bytes: int, reserved_bytes: int = 0) -> int:
    """The primary tier's bytes on a GPU: ``free_gpu_memory_fraction`` x (free - reserved)."""
    return int(config.free_gpu_memory_fraction * max(0, free_bytes - reserved_bytes))


def free_device_bytes(device: str = "cuda") -> int:
    """Free memory the CUDA driver reports for ``device`` (what weights left over)."""
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


@dataclass(frozen=True)
class Placement:
    """Where the primary tier lives and how many bytes it gets."""

    device: str
    """``cuda`` or ``cpu``."""
    primary_bytes: int


def place(cfg: AgentConfig, free_bytes: int | None = None) -> Placement:
    """The agent's device and primary budget: ``device`` (``auto`` picks CUDA when present);
    on CUDA the fraction of free memory (``free_bytes`` when given, else what the device
    reports), on CPU ``cpu_budget_bytes``. ``free_bytes`` also sizes a CPU config as if on a
    GPU of that much free memory (``kvpool size --free-bytes``)."""
    cache, reserved = cfg.kv_cache_config, cfg.reserved_device_bytes
    if free_bytes is not None:
        return Placement("cuda", primary_budget(cache, free_bytes, reserved))
    cuda = _cuda_available()
    if cfg.device == "cuda" and not cuda:
        raise ConfigError("device: cuda requested but no CUDA device is available")
    if cfg.device == "cpu" or not cuda:
        return Placement("cpu", cfg.cpu_budget_bytes)
    return Placement("cuda", primary_budget(cache, free_device_bytes(), reserved))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
