"""``lru``: least recently used first, the reference's order within a priority level."""

from __future__ import annotations

import itertools

from kvpool_agent.cache.eviction.base import Evictable, LevelQueue
from kvpool_agent.cache.eviction.heap import LazyHeap


class LRUQueue(LevelQueue):
    """Least recently used first: a heap keyed on the block's last-use tick.

    A heap rather than a linked list so that a block whose priority expires re-enters the
    default level at its true recency, not at the most-recent end.
    """

    __slots__ = ("_heap", "_live", "_order")

    def __init__(self) -> None:
        self._heap: LazyHeap[tuple[int, int, int, Evictable]] = LazyHeap()
        """Entries ``(last_used, order, stamp, block)``."""
        self._live = 0
        self._order = itertools.count()  # tie-break: never compare blocks

    def push(self, block: Evictable) -> None:
        self._heap.push((block.last_used, next(self._order), block.queue_stamp, block))
        self._live += 1

    def discard(self, block: Evictable) -> None:
        self._live -= 1
        self._heap.compact(self._live, leaving=block)

    def pop(self) -> Evictable | None:
        entry = self._heap.pop()
        if entry is None:
            return None
        self._live -= 1
        return entry[3]

    def __len__(self) -> int:
        return self._live
