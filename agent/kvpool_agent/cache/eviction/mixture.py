"""The "mixture" eviction policy: follow whichever of several policies is hitting most.

No single online policy wins on every workload: ``reuse-gap`` is best where conversations
and shared prompts come back on a schedule, an LFU-like order where a small cache must
hold a stable hot set, ARC where recency and frequency trade places. The mixture runs one
metadata-only shadow cache per expert policy (``shadow.py``), each of the
real tier's capacity and fed every request, and scores each expert by its own hits. The
expert with the highest score leads.

Scores decay with a half-life of ``horizon`` capacities of *disagreement*: each request
ages them by the spread of the experts' hits on it (the best expert's hits minus the
worst's), not by its length. A request on which every expert hits alike (a one-off prompt
that all miss, a hot prefix that all hold) says nothing about which to follow; clocked by
block accesses, such requests flushed the evidence from a small cache, where the experts
differ on a few requests in a hundred, and the lead went to whichever had been lucky
lately. Clocked by disagreement, the scores always hold about the same amount of evidence
that tells the experts apart, over a short stretch where they differ often and a long one
where they rarely do.

The real cache evicts first the evictable leaves the leader does not hold, least recently
used first, and only then (LRU) the rest. Why that converges on the leader: when the real
cache must make room, its blocks and the request's exceed the capacity, while the leader
holds the request within the capacity, so some real block is missing from the leader, and
with it (prefix closure) some leaf below it, which is not pinned. So the real cache never
evicts a block the leader holds, and becomes a subset of the leader's cache. After the
leader changes, the real cache keeps the old leader's blocks until it needs their room,
which is why the mixture can beat each of its experts.

Priorities and ``duration_ms`` are untouched: ``EvictionQueue`` (``queue.py``) orders
levels and expiry, and the mixture only orders blocks within a level. The shadows model one
prefix-closed tier; for a window group or the host tier (whose shadows get the device and host
capacity together) they are a heuristic, not a model, and the follower rule still only
reorders blocks that are evictable anyway.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

from kvpool_agent.cache.eviction.arc import ARCQueue
from kvpool_agent.cache.eviction.base import Evictable, LevelQueue, SharedPolicy, tree_node
from kvpool_agent.cache.eviction.heap import compact
from kvpool_agent.cache.eviction.lrfu import LRFUQueue
from kvpool_agent.cache.eviction.reuse_gap import ReuseGapQueue
from kvpool_agent.cache.eviction.shadow import ShadowCache

ExpertFactory = Callable[[int], LevelQueue]
"""Makes an expert's queue for a shadow of the given capacity."""

DEFAULT_EXPERTS: tuple[tuple[str, ExpertFactory], ...] = (
    ("reuse-gap", lambda capacity: ReuseGapQueue()),
    ("lrfu", LRFUQueue),
    ("arc", ARCQueue),
)
"""The experts, in the order that breaks ties in score (the first leads at start)."""


class MixturePolicy(SharedPolicy):
    """Shadow experts, their scores, and the level queues that follow the leader."""

    horizon = 0.25
    """Half-life of an expert's hit score, in capacities of disagreement: blocks by which
    the best expert's hits exceeded the worst's, summed over requests."""

    def __init__(
        self, capacity: int, experts: Sequence[tuple[str, ExpertFactory]] = DEFAULT_EXPERTS
    ) -> None:
        super().__init__(capacity)
        if not experts:
            raise ValueError("a mixture needs at least one expert")
        size = max(1, capacity)
        self.names = [name for name, _ in experts]
        self.shadows = [ShadowCache(size, make(size)) for _, make in experts]
        self.scores = [0.0] * len(experts)
        self.leader = 0
        self.switches = 0
        self._next_leader = 0
        self._decay = 0.5 ** (1.0 / (self.horizon * size))
        self._dirty: set[int] = set()
        """Queued keys whose bucket may have changed since the last ``flush`` (a key leaves
        it with ``_where``, so it never outgrows the queues). A key not queued yet needs no
        entry: it is bucketed as the shadows are when it is queued."""
        self._where: dict[int, tuple[MixQueue, Evictable]] = {}
        """Key of every queued block -> the level queue holding it, and the block."""
        for index, shadow in enumerate(self.shadows):
            shadow.on_change = self._watcher(index)

    def _watcher(self, index: int | None) -> Callable[[int], None]:
        """What a shadow calls when a key enters or leaves it: ``index`` names the shadow
        that matters (the leader's), None every shadow."""
        dirty, where = self._dirty, self._where

        def changed(key: int) -> None:
            if (index is None or self.leader == index) and key in where:
                dirty.add(key)

        return changed

    def new_level(self) -> MixQueue:
        return MixQueue(self)

    def observe(self, keys: Sequence[int], *, scored: bool = True) -> None:
        if not keys:
            return
        if self._next_leader != self.leader:
            self.leader = self._next_leader
            self.switches += 1
            self._dirty.clear()
            for key, (queue, block) in list(self._where.items()):
                queue.rebucket(block, key)
        hits = [shadow.step(keys) for shadow in self.shadows]
        if not scored:
            return
        decay = self._decay ** (max(hits) - min(hits))
        scores = self.scores
        for index, got in enumerate(hits):
            scores[index] = scores[index] * decay + got
        best = max(range(len(scores)), key=scores.__getitem__)
        if self.takes_lead(scores[best], scores[self.leader]):
            self._next_leader = best

    def takes_lead(self, challenger: float, leader: float) -> bool:
        """Whether the best-scoring expert takes the lead (from the next request on)."""
        return challenger > leader

    def leader_holds(self, key: int) -> bool:
        return key in self.shadows[self.leader]

    def bucket(self, key: int) -> int:
        """The heap a queued block under ``key`` belongs in: 1 if the leader holds the key,
        else 0."""
        return 1 if key in self.shadows[self.leader] else 0

    def eviction_order(self) -> Sequence[int]:
        """The buckets, emptied first to last: what the leader lacks goes first."""
        return _LACKS_FIRST

    def track(self, key: int, queue: MixQueue, block: Evictable) -> None:
        """``block`` (stored under ``key``) was queued in ``queue``."""
        self._where[key] = (queue, block)

    def untrack(self, key: int, block: Evictable) -> None:
        """``block`` left its queue (a newer block under the same key may have replaced it)."""
        found = self._where.get(key)
        if found is not None and found[1] is block:
            del self._where[key]
            self._dirty.discard(key)

    def flush(self) -> None:
        """Re-bucket the queued blocks whose key entered or left the leader's cache (a
        subclass may watch more shadows: ``vote.py``)."""
        where = self._where
        for key in self._dirty:
            found = where.get(key)
            if found is not None:
                found[0].rebucket(found[1], key)
        self._dirty.clear()


class MixQueue(LevelQueue):
    """One priority level's blocks in LRU heaps, one per bucket the policy names
    (``bucket``), emptied in the policy's order (``eviction_order``). For the mixture: those
    the leader lacks, evicted first, and those it holds."""

    __slots__ = ("_count", "_entries", "_heaps", "_policy")

    def __init__(self, policy: MixturePolicy) -> None:
        self._policy = policy
        self._heaps: dict[int, list[tuple[int, int, int, Evictable]]] = {}
        """Bucket -> entries ``(last_used, order, sequence, block)``: ``order`` is when the
        block was queued, so blocks of one tick leave in the order they came, whatever
        order they changed bucket in. A block moves between buckets without a new
        ``queue_stamp``, so an entry is current while its sequence number is the one
        ``_entries`` records for the block."""
        self._entries: dict[Evictable, tuple[int, int, int, int]] = {}
        """Queued block -> (its key, its order, the sequence number of its current entry,
        its bucket)."""
        self._count = itertools.count()
        """Numbers both the blocks queued (their order) and the entries made."""

    def push(self, block: Evictable) -> None:
        key: int = tree_node(block).key
        order = next(self._count)  # its first entry's sequence number too
        self._place(block, key, self._policy.bucket(key), order, order)
        self._policy.track(key, self, block)

    def _place(self, block: Evictable, key: int, bucket: int, order: int, seq: int) -> None:
        heap = self._heaps.get(bucket)
        if heap is None:
            heap = self._heaps[bucket] = []
        heapq.heappush(heap, (block.last_used, order, seq, block))
        self._entries[block] = (key, order, seq, bucket)

    def rebucket(self, block: Evictable, key: int) -> None:
        """Move ``block`` to the bucket the policy now says, in its place among its tick's."""
        entry = self._entries.get(block)
        if entry is not None:
            bucket = self._policy.bucket(key)
            if bucket != entry[3]:
                self._place(block, key, bucket, entry[1], next(self._count))
                self._compact()

    def discard(self, block: Evictable) -> None:
        entry = self._entries.pop(block, None)
        if entry is not None:
            self._policy.untrack(entry[0], block)
        self._compact()

    def pop(self) -> Evictable | None:
        self._policy.flush()
        entries = self._entries
        heaps = self._heaps
        for bucket in self._policy.eviction_order():
            heap = heaps.get(bucket)
            while heap:
                _, _, seq, block = heapq.heappop(heap)
                entry = entries.get(block)
                if entry is not None and entry[2] == seq:
                    del entries[block]
                    self._policy.untrack(entry[0], block)
                    return block
        return None

    def __len__(self) -> int:
        return len(self._entries)

    def _compact(self) -> None:
        entries = self._entries
        live = len(entries)
        for heap in self._heaps.values():
            compact(heap, live, lambda e: (entries.get(e[3]) or _GONE)[2] == e[2])


_GONE = (0, 0, -1, 0)
"""Stands in for the record of a block no longer queued (no sequence number is -1)."""
_LACKS_FIRST = (0, 1)
