"""The paged KV cache engine: pools, radix tree reuse, prioritized eviction, host offload.

``KVCacheManager`` is the entry point (it validates, sizes and owns the storage; the
bookkeeping is ``core.CacheCore``, made of ``block_pool``, ``tree``, ``tiers``, ``groups``
and ``sequences``); ``plan_pools`` sizes pools without allocating.

The names below are loaded on first use, so that importing a light submodule (the eviction
policy registry, which ``kvpool_agent.config`` reads, and the operator imports the config)
does not import the engine, torch or the config itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool_agent.cache.errors import (
        CacheError,
        InvalidRetentionError,
        InvalidTokensError,
        OutOfBlocksError,
        RequestTooLargeError,
        UnknownSequenceError,
    )
    from kvpool_agent.cache.manager import KVCacheManager, SequenceHandle
    from kvpool_agent.cache.retention import KvCacheRetentionConfig, TokenRangeRetentionConfig
    from kvpool_agent.cache.sizing import PoolPlan, plan_pools

_EXPORTS = {
    "CacheError": "errors",
    "InvalidRetentionError": "errors",
    "InvalidTokensError": "errors",
    "OutOfBlocksError": "errors",
    "RequestTooLargeError": "errors",
    "UnknownSequenceError": "errors",
    "KVCacheManager": "manager",
    "SequenceHandle": "manager",
    "KvCacheRetentionConfig": "retention",
    "TokenRangeRetentionConfig": "retention",
    "PoolPlan": "sizing",
    "plan_pools": "sizing",
}
"""Exported name -> the submodule defining it."""

__all__ = [
    "CacheError",
    "InvalidRetentionError",
    "InvalidTokensError",
    "KVCacheManager",
    "KvCacheRetentionConfig",
    "OutOfBlocksError",
    "PoolPlan",
    "RequestTooLargeError",
    "SequenceHandle",
    "TokenRangeRetentionConfig",
    "UnknownSequenceError",
    "plan_pools",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
