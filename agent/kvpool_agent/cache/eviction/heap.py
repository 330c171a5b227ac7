"""The lazy heap every eviction order keeps its entries in.

Removing an arbitrary entry from a binary heap costs O(n), so the queues never do: an entry
carries what it was made from (the block's ``queue_stamp``, or a sequence number the queue
records), and once that no longer matches, the entry is *stale*. Stale entries are skipped
when they reach the top and dropped all at once when they outnumber the live ones
(compaction). Entries are tuples ending with the block and are never equal (each holds a
unique sequence number before the block), so the order of the live entries, and with it
every eviction, does not depend on when the heap was compacted.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from functools import partial
from typing import Any, Generic, TypeVar

from kvpool_agent.cache.eviction.base import Evictable

Entry = TypeVar("Entry", bound=tuple[Any, ...])

COMPACT_FLOOR = 64
"""Heaps this small are never compacted: skipping their stale entries costs less."""


def stamp_at(index: int) -> Callable[[tuple[Any, ...]], bool]:
    """The test of entries holding the block's ``queue_stamp`` at ``index`` (the block
    last): an entry is current while its block has not been dequeued or queued again since
    the entry was made."""

    def current(entry: tuple[Any, ...]) -> bool:
        block: Evictable = entry[-1]
        return block.queue_stamp == entry[index] and block.queue_level >= 0

    return current


stamped = stamp_at(-2)
"""The test for the usual layout, ``(*order, stamp, block)``."""


class LazyHeap(Generic[Entry]):
    """A heap of tuples ``(*order, block)`` whose stale entries ``current`` rejects."""

    __slots__ = ("_current", "entries", "push")

    def __init__(self, current: Callable[[Entry], bool] = stamped) -> None:
        self.entries: list[Entry] = []
        """The heap itself (live and stale entries); compaction keeps the same list."""
        self._current = current
        self.push: Callable[[Entry], None] = partial(heapq.heappush, self.entries)
        """Add an entry (``heapq.heappush`` bound to the heap: no Python frame per push)."""

    def __len__(self) -> int:
        """Entries held, stale ones included."""
        return len(self.entries)

    def peek(self) -> Entry | None:
        """The smallest live entry, dropping the stale ones above it; None when none is left."""
        entries = self.entries
        current = self._current
        while entries:
            entry = entries[0]
            if current(entry):
                return entry
            heapq.heappop(entries)
        return None

    def pop(self) -> Entry | None:
        """Remove and return the smallest live entry; None when none is left."""
        entries = self.entries
        current = self._current
        while entries:
            entry = heapq.heappop(entries)
            if current(entry):
                return entry
        return None

    def compact(self, live: int, leaving: object = None) -> None:
        """Drop every stale entry once the heap holds more than twice the ``live`` entries.
        ``leaving`` is a block being discarded whose stamp is not bumped yet: its entries
        count as stale too."""
        entries = self.entries
        if len(entries) > COMPACT_FLOOR and len(entries) > 2 * live:
            current = self._current
            entries[:] = [e for e in entries if current(e) and e[-1] is not leaving]
            heapq.heapify(entries)
