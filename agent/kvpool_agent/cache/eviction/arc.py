"""``arc``: ARC (Megiddo and Modha, 2003) over a cache's leaves, an expert of the mixture.

Keys seen once (T1) and keys seen again while cached or remembered (T2) are kept in two LRU
lists whose split adapts to hits on the ghosts of recently evicted keys (B1, B2). It must
see every access, so it runs only inside shadow caches (``shadow.py``), and it reads a
queued block's key from ``block_id`` (a shadow node's id is its key).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict

from kvpool_agent.cache.eviction.base import Evictable, LevelQueue
from kvpool_agent.cache.eviction.heap import LazyHeap
from kvpool_agent.cache.eviction.shadow import ShadowNode

Entry = tuple[int, int, int, Evictable]
"""``(last_used, order, stamp, block)``."""


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
        self._queued: dict[Evictable, int] = {}
        """Queued leaf -> the list whose heap holds its current entry."""
        self._heaps: tuple[LazyHeap[Entry], ...] = (LazyHeap(), LazyHeap(), LazyHeap())
        """Per list (index 1 and 2), entries ``(last_used, order, stamp, block)``. A current
        entry sits in the heap of ``_queued[block]``: it moves between heaps (``_top``), and
        a block queued again gets a new stamp, so the stamp alone tells stale entries."""
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
        self._heaps[which].push((block.last_used, next(self._order), block.queue_stamp, block))
        self._queued[block] = which

    def discard(self, block: Evictable) -> None:
        self._queued.pop(block, None)
        live = len(self._queued)
        self._heaps[1].compact(live, leaving=block)
        self._heaps[2].compact(live, leaving=block)

    def _top(self, which: int) -> Entry | None:
        """The least recent current entry of list ``which``, dropping stale ones and moving
        those whose key changed lists since to the other list's heap."""
        heap = self._heaps[which]
        while (entry := heap.peek()) is not None:
            block = entry[3]
            actual = self._list_of.get(block.block_id, 1)
            if actual == which:
                return entry
            heap.pop()
            self._queued[block] = actual
            self._heaps[actual].push(entry)
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
        heapq.heappop(self._heaps[which].entries)  # the live top ``_top`` returned
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
