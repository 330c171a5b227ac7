"""The paged KV cache engine: pools, radix tree reuse, prioritized eviction, host offload.

``KVCacheManager`` is the entry point; ``plan_pools`` sizes pools without allocating.
"""

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
