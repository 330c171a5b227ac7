"""Small engine set-ups shared by the cache tests (a plain module: ``conftest`` names clash
across test folders)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvpool_agent.cache import KVCacheManager, SequenceHandle
from kvpool_agent.config import KvCacheConfig, ModelGeometry

TPB = 4
MODEL = ModelGeometry(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")


class FakeClock:
    """A clock tests move by hand, so retention durations are deterministic."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_manager(
    blocks: int = 16,
    *,
    model: ModelGeometry = MODEL,
    host_blocks: int = 0,
    clock: Callable[[], float] | None = None,
    **cfg: Any,
) -> KVCacheManager:
    """A manager whose primary tier holds ``blocks`` blocks (and ``host_blocks`` on the host)."""
    from kvpool_agent.cache.sizing import build_pools

    cfg.setdefault("tokens_per_block", TPB)
    # These tests pin down the reference's semantics, plain prioritized LRU included.
    cfg.setdefault("eviction_policy", "lru")
    probe = KvCacheConfig(**cfg)
    _, groups, _ = build_pools(model, probe)
    host = host_blocks * sum(g.block_bytes for g in groups)
    config = probe.model_copy(update={"host_cache_size": host})
    kwargs: dict[str, Any] = {}
    if clock is not None:
        kwargs["clock"] = clock
    return KVCacheManager.with_capacity(model, config, blocks, **kwargs)


def fill_value(tokens: list[int], position: int) -> float:
    """The KV value a client writes for ``position`` of ``tokens``: a function of the prefix."""
    return float(hash(tuple(tokens[: position + 1])) % 100_003)


def write_kv(
    mgr: KVCacheManager, handle: SequenceHandle, tokens: list[int], start: int = 0
) -> None:
    """Write deterministic KV for tokens ``start..`` of a sequence into every pool it uses."""
    tpb = mgr.tpb
    for pool, table in enumerate(handle.block_tables):
        view = mgr.pool_view(pool)
        first = handle.first_token[pool]
        for pos in range(max(start, first), len(tokens)):
            block = table[(pos - first) // tpb]
            view[:, block, :, pos % tpb] = fill_value(tokens, pos)


def read_kv(mgr: KVCacheManager, handle: SequenceHandle, upto: int) -> list[list[float]]:
    """The K value of each of the first ``upto`` tokens as the pools hold them now."""
    tpb = mgr.tpb
    out = []
    for pool, table in enumerate(handle.block_tables):
        view = mgr.pool_view(pool)
        first = handle.first_token[pool]
        out.append(
            [
                float(view[0, table[(p - first) // tpb], 0, p % tpb, 0, 0])
                for p in range(first, upto)
            ]
        )
    return out


def expected_kv(handle: SequenceHandle, tokens: list[int], upto: int) -> list[list[float]]:
    return [[fill_value(tokens, p) for p in range(first, upto)] for first in handle.first_token]


def tree_snapshot(mgr: KVCacheManager) -> list[tuple[Any, ...]]:
    """Everything observable about the tree, for before/after comparisons."""
    rows = []
    for node in mgr.iter_nodes():
        rows.append(
            (
                node.key,
                node.priority,
                tuple(
                    None if b is None else (b.tier, b.block_id, b.ref_count) for b in node.blocks
                ),
            )
        )
    return sorted(rows, key=repr)


def state_snapshot(mgr: KVCacheManager) -> tuple[Any, ...]:
    return (
        tree_snapshot(mgr),
        repr(mgr.usage()),
        repr(mgr.stats),
        mgr.num_open_sequences,
        [row["blocks_evictable"] for row in mgr.usage()],  # queued for eviction, per tier
        torch.clone(mgr.storage[0].arena),
    )
