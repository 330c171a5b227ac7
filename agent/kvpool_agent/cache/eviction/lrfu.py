"""``lrfu``: LRFU (Lee et al., 2001), an expert of the mixture, run only inside shadow caches.

Each key's combined recency and frequency, ``C = sum over its uses of 2 ** (-decay * age)``,
and the key with the smallest ``C`` goes first. With a small ``decay`` it is close to LFU, so
it keeps a long-lived hot set that LRU would flush with one scan; that is what small caches
on skewed traces need. It must see every access, not only the blocks that become evictable,
so it runs in a shadow cache (``shadow.py``), which calls ``on_access`` for every block a
request touches. It keeps a bounded history of keys no longer cached, so a key that comes
back resumes its statistics, and reads a queued block's key from ``block_id`` (a shadow
node's id is its key).
"""

from __future__ import annotations

import math
from collections import OrderedDict

from kvpool_agent.cache.eviction.base import Evictable
from kvpool_agent.cache.eviction.heap import HeapQueue
from kvpool_agent.cache.eviction.shadow import ShadowNode


class LRFUQueue(HeapQueue):
    """Evict the leaf with the smallest combined recency-frequency value ``C``."""

    decay = 1e-5
    """``lambda``: the weight of one use halves every ``1 / decay`` accesses."""
    history_factor = 2
    """Keys remembered: this many times the capacity (at least ``history_floor``). It was 8:
    on every trace cell where the factor binds (capacities above 8,192 blocks: synthetic at
    25%, mrqa at 10 and 25%, gsp_zipf at 5, 10 and 25%), 2, 4 and 8 gave the default of
    the day (``guarded``) the same hit rate within 0.035 points
    (``bench/results/lrfu_history.json``). A quarter of the memory of 8 where the factor
    binds, on the largest table of the default policy."""
    history_floor = 65_536
    """The fewest keys remembered, however small the cache (small caches lose most from
    forgetting: a floor of 16,384 cost ``guarded``, then the default, 0.27 points on
    synthetic at 10%)."""

    __slots__ = ("_capacity", "_history")

    def __init__(self, capacity: int) -> None:
        super().__init__()  # entries ``(value, last_used, order, stamp, block)``
        self._capacity = capacity
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
        self._heap.push((value, block.last_used, next(self._order), block.queue_stamp, block))
        self._live += 1
