"""The lazy heaps every eviction order keeps its entries in.

Removing an arbitrary entry from a binary heap costs O(n), so the queues never do: an entry
carries what it was made from, and once that no longer matches, the entry is *stale*. Stale
entries are skipped when they reach the top and dropped all at once when they outnumber the
live ones (``compact``, the one compaction every queue uses). Entries are tuples ending with
the block and are never equal (each holds a unique sequence number before the block), so the
order of the live entries, and with it every eviction, does not depend on when a heap was
compacted.

Most queues stamp their entries with the block's ``queue_stamp``, which ``EvictionQueue``
and ``ShadowCache`` bump whenever a block is queued or dequeued: ``LazyHeap`` is that heap.
``MixQueue`` moves blocks between its heaps without a new stamp and tells its stale entries
by a sequence number of its own, so it keeps plain lists and calls ``compact`` itself.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from functools import partial
from typing import Any, Generic, TypeVar

from kvpool_agent.cache.eviction.base import Evictable, LevelQueue

Entry = TypeVar("Entry", bound=tuple[Any, ...])

COMPACT_FLOOR = 64
"""Heaps this small are never compacted: skipping their stale entries costs less."""


def compact(entries: list[Entry], live: int, keep: Callable[[Entry], bool]) -> None:
    """Drop the stale entries of the heap ``entries`` (those ``keep`` rejects), in place,
    once it holds more than twice the ``live`` entries."""
    if len(entries) > COMPACT_FLOOR and len(entries) > 2 * live:
        entries[:] = [e for e in entries if keep(e)]
        heapq.heapify(entries)


class LazyHeap(Generic[Entry]):
    """A heap of tuples ``(*order, block)`` holding the block's ``queue_stamp`` at index
    ``stamp`` (the one before the block unless said otherwise)."""

    __slots__ = ("_stamp", "entries", "push")

    def __init__(self, stamp: int = -2) -> None:
        self._stamp = stamp
        self.entries: list[Entry] = []
        """The heap itself (live and stale entries); compaction keeps the same list."""
        self.push: Callable[[Entry], None] = partial(heapq.heappush, self.entries)
        """Add an entry (``heapq.heappush`` bound to the heap: no Python frame per push)."""

    def __len__(self) -> int:
        """Entries held, stale ones included."""
        return len(self.entries)

    def current(self, entry: Entry) -> bool:
        """Whether ``entry`` still stands for its block: the block has not been dequeued or
        queued again since the entry was made. (``peek`` and ``pop`` inline this test.)"""
        block: Evictable = entry[-1]
        return block.queue_stamp == entry[self._stamp] and block.queue_level >= 0

    def peek(self) -> Entry | None:
        """The smallest live entry, dropping the stale ones above it; None when none is left."""
        entries = self.entries
        at = self._stamp
        while entries:
            entry = entries[0]
            block = entry[-1]
            if block.queue_stamp == entry[at] and block.queue_level >= 0:
                return entry
            heapq.heappop(entries)
        return None

    def pop(self) -> Entry | None:
        """Remove and return the smallest live entry; None when none is left."""
        entries = self.entries
        at = self._stamp
        while entries:
            entry = heapq.heappop(entries)
            block = entry[-1]
            if block.queue_stamp == entry[at] and block.queue_level >= 0:
                return entry
        return None

    def compact(self, live: int, leaving: object = None) -> None:
        """``compact`` this heap. ``leaving`` is a block being discarded whose stamp is not
        bumped yet: its entries count as stale too."""
        current = self.current
        compact(self.entries, live, lambda e: e[-1] is not leaving and current(e))


class HeapQueue(LevelQueue):
    """A level queue kept in one ``LazyHeap`` of entries ``(*rank, order, stamp, block)``:
    a subclass's ``push`` ranks the block and adds the entry (with ``next(self._order)``, so
    blocks never compare, and the block's ``queue_stamp``); discarding, popping and counting
    are the same for every such order."""

    __slots__ = ("_heap", "_live", "_order")

    def __init__(self) -> None:
        self._heap: LazyHeap[tuple[Any, ...]] = LazyHeap()
        self._live = 0
        self._order = itertools.count()  # tie-break: never compare blocks

    def discard(self, block: Evictable) -> None:
        self._live -= 1
        self._heap.compact(self._live, leaving=block)

    def pop(self) -> Evictable | None:
        entry = self._heap.pop()
        if entry is None:
            return None
        self._live -= 1
        block: Evictable = entry[-1]
        return block

    def __len__(self) -> int:
        return self._live
