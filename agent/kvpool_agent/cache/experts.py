"""Eviction orders that need to see every access, run only inside shadow caches.

The engine's level queues see a block only when it becomes evictable (a leaf, unpinned),
so they cannot count how often interior blocks are used. A shadow cache
(``kvpool_agent.cache.shadow``) calls ``on_access`` for every block a request touches,
which is what these two classic policies are built on:

- ``LRFUQueue``: LRFU (Lee et al., 2001). Each key's combined recency and frequency,
  ``C = sum over its uses of 2 ** (-decay * age)``, and the key with the smallest ``C``
  goes first. With a small ``decay`` it is close to LFU, so it keeps a long-lived hot set
  that LRU would flush with one scan; that is what small caches on skewed traces need.
- ``ARCQueue``: ARC (Megiddo and Modha, 2003) restricted to leaves. Keys seen once (T1)
  and keys seen again while cached or remembered (T2) are kept in two LRU lists whose
  split adapts to hits on the ghosts of recently evicted keys.

Both keep a bounded history of keys no longer cached, so a key that comes back resumes
its statistics. They read a queued block's key from ``block_id``: a shadow node's id is its
key.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict

from kvpool_agent.cache.eviction import Evictable, LevelQueue
from kvpool_agent.cache.shadow import ShadowNode


class LRFUQueue(LevelQueue):
    """Evict the leaf with the smallest combined recency-frequency value ``C``."""

    decay = 1e-5
    """``lambda``: the weight of one use halves every ``1 / decay`` accesses."""
    history_factor = 8
    """Keys remembered: this many times the capacity (at least ``history_floor``)."""
    history_floor = 65_536

    __slots__ = ("_capacity", "_heap", "_history", "_live", "_order")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._heap: list[tuple[float, int, int, int, Evictable]] = []
        self._live = 0
        self._order = itertools.count()
        self._history: OrderedDict[int, tuple[int, float]] = OrderedDict()
        """Key -> (tick of its last use, ``C`` at that tick)."""

    def on_access(self, node: ShadowNode) -> None:
        history = self._history
        now = node.last_used
        seen = history.pop(node.key, None)
        crf = 1.0 if seen is None else 1.0 + seen[1] * 2.0 ** (-self.decay * (now - seen[0]))
        history[node.key] = (now, crf)
        if len(history) > max(self.history_floor, self.history_factor * self._capacity):
            history.popitem(last=False)

    def push(self, block: Evictable) -> None:
        key = block.block_id
        seen = self._history.get(key)
        used, crf = seen if seen is not None else (block.last_used, 1.0)
        # log2 C(now) = log2 C(used) - decay * (now - used): ranking by decay*used + log2 C
        # is the same at every "now", so the heap key never goes stale.
        value = self.decay * used + math.log2(crf)
        heapq.heappush(
            self._heap, (value, block.last_used, next(self._order), block.queue_stamp, block)
        )
        self._live += 1

    def discard(self, block: Evictable) -> None:
        self._live -= 1
        if len(self._heap) > 64 and len(self._heap) > 2 * self._live:
            self._heap = [e for e in self._heap if _current(e[4], e[3]) and e[4] is not block]
            heapq.heapify(self._heap)

    def pop(self) -> Evictable | None:
        heap = self._heap
        while heap:
            entry = heapq.heappop(heap)
            block = entry[4]
            if _current(block, entry[3]):
                self._live -= 1
                return block
        return None

    def __len__(self) -> int:
        return self._live


class ARCQueue(LevelQueue):
    """ARC over the cache's leaves: evict the least recent leaf of T1 while T1 is larger
    than its adaptive target ``p``, else of T2."""

    ghost_factor = 4
    """Each ghost list remembers up to this many times the capacity in evicted keys."""

    __slots__ = ("_capacity", "_ghosts", "_heaps", "_list_of", "_order", "_p", "_queued", "_sizes")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._p = 0.0
        self._list_of: dict[int, int] = {}
        """Cached key -> 1 (seen once: T1) or 2 (seen again: T2)."""
        self._sizes = [0, 0, 0]
        self._ghosts: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (
            OrderedDict(),
            OrderedDict(),
        )
        """Keys evicted from T1 and from T2, oldest first (B1 and B2)."""
        self._heaps: tuple[list[tuple[int, int, int, Evictable]], ...] = ([], [], [])
        self._queued: dict[Evictable, int] = {}
        """Queued leaf -> the list whose heap holds its current entry."""
        self._order = itertools.count()

    def on_access(self, node: ShadowNode) -> None:
        key = node.key
        current = self._list_of.get(key)
        if current == 2:
            return
        if current == 1:
            self._move(key, 1, 2)
            return
        b1, b2 = self._ghosts
        if key in b1:
            self._p = min(float(self._capacity), self._p + max(len(b2) / max(len(b1), 1), 1.0))
            del b1[key]
            target = 2
        elif key in b2:
            self._p = max(0.0, self._p - max(len(b1) / max(len(b2), 1), 1.0))
            del b2[key]
            target = 2
        else:
            target = 1
        self._list_of[key] = target
        self._sizes[target] += 1

    def _move(self, key: int, old: int, new: int) -> None:
        self._list_of[key] = new
        self._sizes[old] -= 1
        self._sizes[new] += 1

    def push(self, block: Evictable) -> None:
        which = self._list_of.get(block.block_id, 1)
        entry = (block.last_used, next(self._order), block.queue_stamp, block)
        heapq.heappush(self._heaps[which], entry)
        self._queued[block] = which

    def discard(self, block: Evictable) -> None:
        self._queued.pop(block, None)
        live = len(self._queued)
        for which in (1, 2):
            heap = self._heaps[which]
            if len(heap) > 64 and len(heap) > 2 * live:
                queued = self._queued
                heap[:] = [e for e in heap if queued.get(e[3]) == which and _current(e[3], e[2])]
                heapq.heapify(heap)

    def _top(self, which: int) -> tuple[int, int, int, Evictable] | None:
        """The least recent current entry of list ``which``, dropping stale ones."""
        heap = self._heaps[which]
        while heap:
            entry = heap[0]
            block = entry[3]
            if self._queued.get(block) == which and _current(block, entry[2]):
                actual = self._list_of.get(block.block_id, 1)
                if actual == which:
                    return entry
                heapq.heappop(heap)
                self._queued[block] = actual
                heapq.heappush(self._heaps[actual], entry)
                continue
            heapq.heappop(heap)
        return None

    def pop(self) -> Evictable | None:
        first, second = self._top(1), self._top(2)
        if first is None and second is None:
            return None
        if second is None or (first is not None and self._sizes[1] > self._p):
            which, entry = 1, first
        else:
            which, entry = 2, second
        assert entry is not None
        heapq.heappop(self._heaps[which])
        block = entry[3]
        del self._queued[block]
        key = block.block_id
        self._list_of.pop(key, None)
        self._sizes[which] -= 1
        ghosts = self._ghosts[which - 1]
        ghosts[key] = None
        while len(ghosts) > self.ghost_factor * self._capacity:
            ghosts.popitem(last=False)
        return block

    def __len__(self) -> int:
        return len(self._queued)


def _current(block: Evictable, stamp: int) -> bool:
    """Whether a heap entry made with ``stamp`` is still the block's queue record."""
    return block.queue_stamp == stamp and block.queue_level >= 0
