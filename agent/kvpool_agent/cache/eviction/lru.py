"""``lru``: least recently used first, the reference's order within a priority level."""

from __future__ import annotations

from kvpool_agent.cache.eviction.base import Evictable
from kvpool_agent.cache.eviction.heap import HeapQueue


class LRUQueue(HeapQueue):
    """Least recently used first: a heap keyed on the block's last-use tick.

    A heap rather than a linked list so that a block whose priority expires re-enters the
    default level at its true recency, not at the most-recent end.
    """

    __slots__ = ()

    def push(self, block: Evictable) -> None:
        self._heap.push((block.last_used, next(self._order), block.queue_stamp, block))
        self._live += 1
