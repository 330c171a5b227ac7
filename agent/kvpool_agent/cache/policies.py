"""Eviction policies beyond plain LRU, for blocks of one priority level.

``ReuseGapQueue`` ("reuse-gap") predicts when each evictable leaf will be used next and
evicts the one predicted farthest away, an online stand-in for Belady's MIN:

- A leaf is judged by its *chain*: the run of single-child blocks above it, up to the first
  block that branches (or the root). Every block of a chain is needed by the same future
  requests (a conversation's history, a document's body), so the chain's head carries the
  statistics: the gap between its last two uses.
- A chain with a known gap ``g`` last used at ``t`` is predicted back at ``t + g``; once it
  is ``slack * g`` overdue it is presumed dead and goes before any live chain (finished
  conversations, groups that went cold).
- A chain seen once has no gap: it gets the mean first-reuse gap of all chains divided by
  the share of chains ever reused. Where most first-seen blocks are never reused (unique
  suffixes under a shared prompt) that sends them out first, which is admission control
  without a separate filter; where they usually come back (multi-turn chat) they are kept.
- Statistics of a chain head outlive its eviction (a bounded history), so a block that
  comes back after being evicted resumes with its gap.

The queue sees only ``push``, ``discard`` and ``pop``. A push whose block has a new
``last_used`` is a use; a push with an unchanged one is a block that became a leaf again
after its child was evicted, and keeps its earlier prediction.
"""

from __future__ import annotations

import heapq
from typing import Protocol

from kvpool_agent.cache.eviction import POLICIES, Evictable, LevelQueue


class ChainNode(Protocol):
    """What the policy reads of a radix tree node (``TreeNode`` provides it)."""

    key: int
    last_used: int
    hits: int

    @property
    def parent(self) -> ChainNode | None: ...

    @property
    def children(self) -> dict[tuple[int, ...], ChainNode]: ...


def _node(block: Evictable) -> ChainNode:
    node: ChainNode | None = getattr(block, "node", None)
    if node is None:
        raise TypeError(f"block {block.block_id} has no tree node; only stored blocks are queued")
    return node


class ReuseGapQueue(LevelQueue):
    """Farthest predicted reuse first, dead chains before live ones (see module doc)."""

    slack = 2.0
    """A chain overdue by this many of its gaps is presumed dead."""
    gap_weight = 0.5
    """Weight of the newest gap in a chain's running gap estimate."""
    fresh_weight = 0.01
    """Weight of a new sample in the running mean of first-reuse gaps."""
    history_floor = 65_536
    """Chain heads remembered beyond the queued blocks before old ones are forgotten."""

    __slots__ = (
        "_death",
        "_fresh_gap",
        "_gap",
        "_head_of",
        "_last_seen",
        "_live",
        "_new_heads",
        "_now",
        "_pred",
        "_reused_heads",
        "_stamped",
    )

    def __init__(self) -> None:
        self._pred: list[tuple[float, int, int, Evictable]] = []  # (-predicted use, ...)
        self._death: list[tuple[float, int, int, Evictable]] = []  # (presumed dead at, ...)
        self._live = 0
        self._stamped: dict[int, tuple[float, float, int]] = {}
        """Node key -> (predicted use, dead at, last_used the prediction was made at)."""
        self._head_of: dict[int, ChainNode] = {}
        self._last_seen: dict[int, int] = {}
        """Chain head key -> its last_used when last observed."""
        self._gap: dict[int, float] = {}
        self._now = 0
        self._fresh_gap = 0.0
        self._new_heads = 1
        self._reused_heads = 1

    # -- LevelQueue

    def push(self, block: Evictable) -> None:
        node = _node(block)
        used = node.last_used
        if used > self._now:
            self._now = used
        known = self._stamped.get(node.key)
        if known is not None and known[2] == used:
            predicted, dead_at = known[0], known[1]
        else:
            predicted, dead_at = self._predict(node, used)
            self._stamped[node.key] = (predicted, dead_at, used)
        stamp = block.queue_stamp
        heapq.heappush(self._pred, (-predicted, stamp, block.block_id, block))
        heapq.heappush(self._death, (dead_at, stamp, block.block_id, block))
        self._live += 1

    def discard(self, block: Evictable) -> None:
        self._live -= 1
        if len(self._pred) > 64 and len(self._pred) > 2 * self._live:
            self._pred = [e for e in self._pred if _current(e) and e[3] is not block]
            self._death = [e for e in self._death if _current(e) and e[3] is not block]
            heapq.heapify(self._pred)
            heapq.heapify(self._death)

    def pop(self) -> Evictable | None:
        death = self._death
        while death:
            entry = death[0]
            if not _current(entry):
                heapq.heappop(death)
                continue
            if entry[0] < self._now:
                heapq.heappop(death)
                return self._taken(entry[3])
            break
        pred = self._pred
        while pred:
            entry = heapq.heappop(pred)
            if _current(entry):
                return self._taken(entry[3])
        return None

    def __len__(self) -> int:
        return self._live

    # -- prediction

    def _predict(self, node: ChainNode, used: int) -> tuple[float, float]:
        head = self._head(node)
        key = head.key
        head_used = head.last_used
        previous = self._last_seen.get(key)
        if previous is None:
            self._new_heads += 1
        elif head_used > previous:
            sample = float(head_used - previous)
            gap = self._gap.get(key)
            if gap is None:
                self._reused_heads += 1
                fresh = self._fresh_gap
                self._fresh_gap = sample if fresh == 0.0 else fresh + self.fresh_weight * (
                    sample - fresh
                )
                self._gap[key] = sample
            else:
                self._gap[key] = gap + self.gap_weight * (sample - gap)
        self._last_seen[key] = head_used
        if len(self._last_seen) > self.history_floor + 4 * len(self._stamped):
            self._forget()
        gap = self._gap.get(key)
        if gap is None:
            fresh = self._fresh_gap or 1.0
            reuse_share = self._reused_heads / self._new_heads
            return used + fresh / max(reuse_share, 1e-3), used + self.slack * fresh
        return used + gap, used + self.slack * gap

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

    def _taken(self, block: Evictable) -> Evictable:
        self._live -= 1
        key = _node(block).key
        self._stamped.pop(key, None)
        self._head_of.pop(key, None)
        return block

    def _forget(self) -> None:
        """Drop the older half of the chain history (and stale chain-head shortcuts)."""
        seen = sorted(self._last_seen.items(), key=lambda kv: kv[1])
        for key, _ in seen[: len(seen) // 2]:
            del self._last_seen[key]
            self._gap.pop(key, None)
        self._head_of = {k: v for k, v in self._head_of.items() if k in self._stamped}


def _current(entry: tuple[float, int, int, Evictable]) -> bool:
    block = entry[3]
    return block.queue_stamp == entry[1] and block.queue_level >= 0


POLICIES["reuse-gap"] = ReuseGapQueue
