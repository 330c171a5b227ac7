"""Which unpinned block goes first when a tier needs room.

The reference's rule is fixed: priorities 0..100, every evictable block of the lowest
effective priority goes before any block of the next, and a priority set with a duration
reverts to 35 once that duration has passed since the block first became reusable.
Within one priority level the order is the policy's: plain LRU (the reference's), or a
policy registered in ``POLICIES`` (``KvCacheConfig.eviction_policy``).

``EvictionQueue`` owns the priority levels and the expiry heap; a ``LevelQueue`` orders the
blocks of one level. Both work on ``Evictable`` records and never allocate per operation
beyond a heap entry. A policy that must see every request, not only the blocks that become
evictable, is a ``SharedPolicy``: one per (group, tier), told each request's block keys
through ``EvictionQueue.observe`` and making the level queues of that (group, tier).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol, cast

from kvpool_agent.config import DEFAULT_PRIORITY, MAX_PRIORITY


class Evictable(Protocol):
    """What the queues need of a block (``kvpool_agent.cache.block.Block`` provides it)."""

    block_id: int
    queue_level: int
    """Priority level the block sits in while queued, -1 while not queued."""
    queue_stamp: int
    """Bumped on every enqueue; heap entries with an older stamp are stale."""

    @property
    def priority(self) -> int: ...

    @property
    def expires_at(self) -> float | None: ...

    @property
    def last_used(self) -> int: ...

    @property
    def hits(self) -> int: ...


class LevelQueue(ABC):
    """Orders the evictable blocks of one priority level."""

    @abstractmethod
    def push(self, block: Evictable) -> None:
        """The block became evictable (it was released, or its priority changed)."""

    @abstractmethod
    def discard(self, block: Evictable) -> None:
        """The block stopped being evictable (pinned again, or dropped)."""

    @abstractmethod
    def pop(self) -> Evictable | None:
        """Remove and return the victim, or None when empty."""

    @abstractmethod
    def __len__(self) -> int: ...


class LRUQueue(LevelQueue):
    """Least recently used first: a heap keyed on the block's last-use tick.

    A heap rather than a linked list so that a block whose priority expires re-enters the
    default level at its true recency, not at the most-recent end. Removal is lazy: a stale
    entry (older stamp) is skipped on pop and the heap is rebuilt when half of it is stale.
    """

    __slots__ = ("_heap", "_live", "_order")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Evictable]] = []
        self._live = 0
        self._order = itertools.count()  # tie-break: never compare blocks

    def push(self, block: Evictable) -> None:
        heapq.heappush(self._heap, (block.last_used, next(self._order), block.queue_stamp, block))
        self._live += 1

    def discard(self, block: Evictable) -> None:
        self._live -= 1
        if len(self._heap) > 64 and len(self._heap) > 2 * self._live:
            self._heap = [e for e in self._heap if e[3].queue_stamp == e[2] and e[3] is not block]
            heapq.heapify(self._heap)

    def pop(self) -> Evictable | None:
        heap = self._heap
        while heap:
            _, _, stamp, block = heapq.heappop(heap)
            if block.queue_stamp == stamp and block.queue_level >= 0:
                self._live -= 1
                return block
        return None

    def __len__(self) -> int:
        return self._live


LevelQueueFactory = Callable[[], LevelQueue]


class SharedPolicy(ABC):
    """Policy state shared by every priority level of one (group, tier).

    Made with the tier's capacity in blocks of the group. ``observe`` gets the keys of each
    request's full blocks, root first, before the engine makes room for the request.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def new_level(self) -> LevelQueue:
        """A queue for one priority level, drawing on the shared state."""

    @abstractmethod
    def observe(self, keys: Sequence[int], *, scored: bool = True) -> None:
        """A request for the blocks ``keys``. ``scored`` is False when a sequence only grew
        (decode, a further chunk): the keys extend a request already observed."""


POLICIES: dict[str, LevelQueueFactory | type[SharedPolicy]] = {"lru": LRUQueue}
"""Eviction policies by the name ``KvCacheConfig.eviction_policy`` takes."""


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
        self._expiry: list[tuple[float, int, int, Evictable]] = []
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
            heapq.heappush(self._expiry, (expires, next(self._order), block.queue_stamp, block))

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
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, _, stamp, block = heapq.heappop(heap)
            if block.queue_stamp == stamp and block.queue_level >= 0:
                self.discard(block)
                self.push(block, now)


def effective_priority(block: Evictable, now: float) -> int:
    """The block's priority, or the default once its duration has passed."""
    expires = block.expires_at
    if expires is not None and now >= expires:
        return DEFAULT_PRIORITY
    return block.priority


# Register the policies beyond LRU (the mixture imports reuse-gap's module).
import kvpool_agent.cache.mixture  # noqa: E402, F401
