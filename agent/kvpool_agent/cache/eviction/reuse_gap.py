"""``reuse-gap``: evict the leaf whose chain is expected back last.

``ReuseGapQueue`` estimates how long until each evictable leaf is used again
and evicts the one expected back last, an online stand-in for Belady's MIN:

- A leaf is judged by its *chain*: the run of single-child blocks above it, up to the first
  block that branches (or the root). Every block of a chain is needed by the same future
  requests (a conversation's history, a document's body), so the chain's head carries the
  statistics: ``m``, the mean gap between its uses over its life.
- A chain seen only once has no gap yet: it gets the mean first-reuse gap of all chains
  divided by the share of chains ever reused. Where most first-seen chains never come back
  (unique suffixes under a shared prompt) that puts them out first, which is admission
  control without a separate filter; where they usually come back (multi-turn chat) it
  keeps them.
- With ``t`` the chain's last use and ``age = now - t``, the expected time to the next use
  is ``max(m, k * (age - m))``: a chain on schedule is expected back one mean gap from now
  (rarely used chains go first, LFU with the mean gap as the rate, which is what a skewed
  popularity wants); a chain overdue by more than its gap is likely finished (a closed
  conversation) and recedes ``k`` times as fast as it is late. In a loop larger than the
  cache the ranking by ``m`` does not change as chains are used, so the cache keeps a
  stable subset of the loop instead of thrashing like LRU, which always evicts the chain
  that comes back next.
- In the on-schedule term ``m`` is shrunk towards the mean first-reuse gap of all chains
  by ``w`` pseudo-reuses: ``(n * m + w * fresh) / (n + w)`` for a chain reused ``n`` times.
  One or two gaps say little about a chain's rate: without the shrinkage a chain whose only
  reuse came quickly outranks chains used steadily for a long time. The overdue term keeps the
  chain's own ``m``: lateness is judged against the chain's own schedule.
- Both terms have static keys (``-m`` shrunk and ``t + m``), so two heaps find the victim in
  O(log n): the largest estimate is the larger of the two heaps' maxima.
- Statistics of a chain head outlive its eviction (a bounded history), so a block that
  comes back after being evicted resumes with its gap.

``k`` (``overdue_weight``) and ``w`` (``prior_weight``) are the two constants; they were
chosen once, across all the traces in ``shared/traces`` (``bench/replay_sweep.py``), not per
trace.

The queue sees only ``push``, ``discard`` and ``pop``. A push whose block has a new
``last_used`` is a use; a push with an unchanged one is a block that became a leaf again
after its child was evicted, and keeps its earlier estimate. Time is the engine's
``last_used`` tick.
"""

from __future__ import annotations

import heapq
from collections.abc import Sized
from dataclasses import dataclass
from typing import Protocol

from kvpool_agent.cache.eviction.base import Evictable, LevelQueue, tree_node
from kvpool_agent.cache.eviction.heap import LazyHeap


class ChainNode(Protocol):
    """What the policy reads of a radix tree node (``TreeNode`` provides it)."""

    key: int
    last_used: int
    hits: int

    @property
    def parent(self) -> ChainNode | None: ...

    @property
    def children(self) -> Sized: ...


Entry = tuple[float, int, int, Evictable]
"""``(term, stamp, sequence, block)``: the stamp sorts before the sequence number."""


@dataclass(slots=True)
class _Chain:
    """What a chain head's history says: when it was first and last seen, and how often
    it has come back since it was first seen."""

    first: int
    last: int
    reuses: int = 0


class ReuseGapQueue(LevelQueue):
    """Evict the leaf whose chain is expected back last (see the module doc)."""

    overdue_weight = 3.25
    """``k``: how fast an overdue chain's expected next use recedes (finished conversations)."""
    prior_weight = 2.0
    """Pseudo-reuses at the mean first-reuse gap added to a chain's own gaps in the rate
    term, so a chain with one lucky short gap does not outrank steadily used ones."""
    fresh_weight = 0.01
    """Weight of a new sample in the running mean of first-reuse gaps."""
    history_floor = 65_536
    """Chain heads remembered beyond the queued blocks before old ones are forgotten."""

    __slots__ = (
        "_by_overdue",
        "_by_rate",
        "_chains",
        "_estimates",
        "_fresh_gap",
        "_head_of",
        "_live",
        "_new_heads",
        "_now",
        "_reused_heads",
        "_seq",
    )

    def __init__(self) -> None:
        # One heap per term of the estimate.
        self._by_overdue: LazyHeap[Entry] = LazyHeap(stamp=1)  # t + m
        self._by_rate: LazyHeap[Entry] = LazyHeap(stamp=1)  # -(m shrunk)
        self._live = 0
        self._seq = 0
        self._estimates: dict[int, tuple[float, float, int]] = {}
        """Node key -> (mean gap, shrunk mean gap, the last_used they were made at)."""
        self._head_of: dict[int, ChainNode] = {}
        self._chains: dict[int, _Chain] = {}
        """Chain head key -> what has been observed of that chain."""
        self._now = 0
        self._fresh_gap = 0.0
        self._new_heads = 1
        self._reused_heads = 1

    # -- LevelQueue

    def push(self, block: Evictable) -> None:
        node: ChainNode = tree_node(block)
        used = node.last_used
        if used > self._now:
            self._now = used
        known = self._estimates.get(node.key)
        if known is not None and known[2] == used:
            mean_gap, rate_gap = known[0], known[1]
        else:
            mean_gap, rate_gap = self._estimate(node)
            self._estimates[node.key] = (mean_gap, rate_gap, used)
        stamp = block.queue_stamp
        seq = self._seq = self._seq + 1  # unique: ties never compare blocks
        self._by_overdue.push((used + mean_gap, stamp, seq, block))
        self._by_rate.push((-rate_gap, stamp, seq, block))
        self._live += 1

    def discard(self, block: Evictable) -> None:
        self._live -= 1
        self._by_overdue.compact(self._live, leaving=block)
        self._by_rate.compact(self._live, leaving=block)

    def pop(self) -> Evictable | None:
        """The block with the latest expected next use: the larger of the two terms'
        maxima, since the estimate of each block is the larger of its two terms."""
        now = self._now
        best: LazyHeap[Entry] | None = None
        best_value = 0.0
        for heap in (self._by_overdue, self._by_rate):
            top = heap.peek()
            if top is None:
                continue
            key = top[0]
            value = self.overdue_weight * (now - key) if heap is self._by_overdue else -key
            if best is None or value > best_value:
                best, best_value = heap, value
        if best is None:
            return None
        block = heapq.heappop(best.entries)[3]  # the live top just peeked
        self._live -= 1
        key = tree_node(block).key
        self._estimates.pop(key, None)
        self._head_of.pop(key, None)
        return block

    def __len__(self) -> int:
        return self._live

    # -- estimates

    def _estimate(self, node: ChainNode) -> tuple[float, float]:
        """The mean reuse gap of ``node``'s chain (or the fresh-chain estimate), and the
        same mean shrunk towards the mean first-reuse gap for the rate term."""
        head = self._head(node)
        key = head.key
        head_used = head.last_used
        chain = self._chains.get(key)
        if chain is None:
            self._new_heads += 1
            chain = self._chains[key] = _Chain(first=head_used, last=head_used)
        elif head_used > chain.last:
            chain.reuses += 1
            if chain.reuses == 1:  # first reuse: a sample of the fresh-chain gap
                self._reused_heads += 1
                sample = float(head_used - chain.last)
                fresh = self._fresh_gap
                self._fresh_gap = (
                    sample if fresh == 0.0 else fresh + self.fresh_weight * (sample - fresh)
                )
            chain.last = head_used
        count = chain.reuses
        span = head_used - chain.first
        if len(self._chains) > self.history_floor + 4 * len(self._estimates):
            self._forget()
        fresh = self._fresh_gap or 1.0
        if not count:
            reuse_share = self._reused_heads / self._new_heads
            unseen = fresh / max(reuse_share, 1e-3)
            return unseen, unseen
        weight = self.prior_weight
        return span / count, (span + weight * fresh) / (count + weight)

    def _head(self, node: ChainNode) -> ChainNode:
        """The top of the single-child chain ``node`` hangs from (cached per queued leaf)."""
        head_of = self._head_of
        cur = node
        while True:
            parent = cur.parent
            if parent is None or parent.parent is None or len(parent.children) != 1:
                break
            known = head_of.get(parent.key)
            if known is not None:
                cur = known
                break
            cur = parent
        head_of[node.key] = cur
        return cur

    def _forget(self) -> None:
        """Drop the older half of the chain history (and stale chain-head shortcuts)."""
        seen = sorted(self._chains.items(), key=lambda kv: kv[1].last)
        for key, _ in seen[: len(seen) // 2]:
            del self._chains[key]
        self._head_of = {k: v for k, v in self._head_of.items() if k in self._estimates}
