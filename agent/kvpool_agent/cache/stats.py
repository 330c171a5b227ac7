"""Counters the engine keeps (the agent exports them as Prometheus metrics)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class CacheStats:
    """Monotonic counters since start. Hit rate = hits / queries over an interval."""

    queries_tokens: int = 0
    queries_blocks: int = 0
    hits_tokens: list[int] = field(default_factory=lambda: [0, 0])
    """Reused tokens by the tier they were found in (primary, secondary)."""
    hits_blocks: list[int] = field(default_factory=lambda: [0, 0])
    partial_hit_tokens: int = 0
    capacity_miss_tokens: int = 0
    """Missed tokens a bigger cache would have hit (their blocks were in the ghost list)."""
    capacity_miss_blocks: int = 0
    evictions: list[int] = field(default_factory=lambda: [0, 0])
    """Blocks evicted from each tier (an offload counts as an eviction from primary)."""
    offloads: int = 0
    onboards: int = 0
    chunk_moves: int = 0
    sequences_opened: int = 0

    @property
    def miss_tokens(self) -> int:
        return self.queries_tokens - sum(self.hits_tokens)


QUERY_COUNTERS = (
    "queries_tokens",
    "queries_blocks",
    "hits_tokens",
    "hits_blocks",
    "partial_hit_tokens",
    "capacity_miss_tokens",
    "capacity_miss_blocks",
    "sequences_opened",
)
"""The counters of client queries (hit rates come from them): work the agent does for itself
(a store through the transfer port, a snapshot import) is kept out of them
(``KVCacheManager.uncounted``)."""


class GhostList:
    """Keys of recently dropped blocks, bounded, oldest forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def add(self, key: int) -> None:
        if self.capacity <= 0:
            return
        keys = self._keys
        keys[key] = None
        keys.move_to_end(key)
        if len(keys) > self.capacity:
            keys.popitem(last=False)

    def discard(self, key: int) -> None:
        self._keys.pop(key, None)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def keys(self) -> list[int]:
        """The remembered keys, oldest first."""
        return list(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
