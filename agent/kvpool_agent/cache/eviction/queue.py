"""The evictable blocks of one (pool group, tier): priority levels, expiry, and the policy.

The reference's rule is fixed: priorities 0..100, every evictable block of the lowest
effective priority goes before any block of the next, and a priority set with a duration
reverts to 35 once that duration has passed since the block first became reusable.
Within one priority level the order is the policy's (``registry.POLICIES``, named by
``KvCacheConfig.eviction_policy``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import cast

from kvpool_agent.cache.eviction.base import (
    Evictable,
    LevelQueue,
    LevelQueueFactory,
    Prioritized,
    SharedPolicy,
)
from kvpool_agent.cache.eviction.heap import LazyHeap
from kvpool_agent.cache.eviction.lru import LRUQueue
from kvpool_agent.cache.eviction.registry import POLICIES
from kvpool_agent.config import DEFAULT_PRIORITY, MAX_PRIORITY


def effective_priority(record: Prioritized, now: float) -> int:
    """The priority of a block or tree node, or the default once its duration has passed."""
    expires = record.expires_at
    if expires is not None and now >= expires:
        return DEFAULT_PRIORITY
    return record.priority


def new_eviction_queue(policy: str, capacity: int) -> EvictionQueue:
    """The queue of one (group, tier) holding ``capacity`` blocks, under ``policy``."""
    entry = POLICIES[policy]
    if isinstance(entry, type) and issubclass(entry, SharedPolicy):
        shared = entry(capacity)
        return EvictionQueue(shared.new_level, shared)
    return EvictionQueue(cast(LevelQueueFactory, entry))


class EvictionQueue:
    """The evictable blocks of one (pool group, tier), by effective priority then policy.

    ``pop(now)`` first moves blocks whose priority duration has passed to the default level,
    so an expired priority never protects a block. Invariant: a block is in at most one
    level, recorded in ``block.queue_level``; ``queue_stamp`` invalidates old heap entries.
    Nothing allocates per operation beyond a heap entry.
    """

    __slots__ = ("_expiry", "_factory", "_levels", "_nonempty", "_order", "_size", "shared")

    def __init__(
        self, factory: LevelQueueFactory = LRUQueue, shared: SharedPolicy | None = None
    ) -> None:
        self._factory = factory
        self.shared = shared
        """The policy's state across levels, when it has any (it then observes requests)."""
        self._levels: list[LevelQueue | None] = [None] * (MAX_PRIORITY + 1)
        self._nonempty = 0  # bit p set while level p may hold blocks
        self._size = 0
        self._expiry: LazyHeap[tuple[float, int, int, Evictable]] = LazyHeap()
        """Entries ``(expires_at, order, stamp, block)`` of queued blocks above the default."""
        self._order = itertools.count()

    def __len__(self) -> int:
        return self._size

    def __contains__(self, block: Evictable) -> bool:
        return block.queue_level >= 0

    def push(self, block: Evictable, now: float) -> None:
        """Make ``block`` evictable at its effective priority."""
        if block.queue_level >= 0:
            raise RuntimeError(f"block {block.block_id} is already evictable")
        level = effective_priority(block, now)
        block.queue_stamp += 1
        block.queue_level = level
        queue = self._levels[level]
        if queue is None:
            queue = self._levels[level] = self._factory()
        queue.push(block)
        self._nonempty |= 1 << level
        self._size += 1
        expires = block.expires_at
        if expires is not None and level != DEFAULT_PRIORITY and expires > now:
            self._expiry.compact(self._size)
            self._expiry.push((expires, next(self._order), block.queue_stamp, block))

    def discard(self, block: Evictable) -> None:
        """Stop ``block`` being evictable (no-op when it is not queued)."""
        level = block.queue_level
        if level < 0:
            return
        queue = self._levels[level]
        assert queue is not None
        queue.discard(block)
        block.queue_level = -1
        block.queue_stamp += 1
        self._size -= 1

    def pop(self, now: float) -> Evictable | None:
        """Remove and return the next victim, or None when nothing is evictable."""
        self._expire(now)
        bits = self._nonempty
        while bits:
            level = (bits & -bits).bit_length() - 1
            queue = self._levels[level]
            assert queue is not None
            block = queue.pop()
            if block is not None:
                block.queue_level = -1
                block.queue_stamp += 1
                self._size -= 1
                return block
            bits &= ~(1 << level)
            self._nonempty = bits
        return None

    def observe(self, keys: Sequence[int], *, scored: bool = True) -> None:
        """Tell a policy that watches requests about one (see ``SharedPolicy.observe``)."""
        if self.shared is not None:
            self.shared.observe(keys, scored=scored)

    def requeue(self, block: Evictable, now: float) -> None:
        """Re-sort a queued block after its priority or expiry changed."""
        if block.queue_level >= 0:
            self.discard(block)
            self.push(block, now)

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry.entries and (entry := expiry.peek()) is not None and entry[0] <= now:
            expiry.pop()
            block = entry[3]
            self.discard(block)
            self.push(block, now)
