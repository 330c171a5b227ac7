"""The cache's miss-ratio curve: what a cache of another size would have hit.

Choice: a sampled reuse-distance (stack-distance) estimator, SHARDS-style (Waldspurger et
al., FAST '15), rather than "hit depth in the eviction order plus the ghost list". One
structure answers both halves of the question the autoscaler asks:

- for hits, how deep in LRU order the block sat: an access whose reuse distance is ``d``
  blocks hits in any LRU cache of more than ``d`` blocks, so the share of accesses with a
  distance in ``(0.9 C, C]`` is the share of hits the coldest 10% of a cache of ``C`` blocks
  served;
- for capacity misses, how far beyond the capacity: a distance in ``(C, 1.5 C]`` is a miss
  a cache half as big again would have hit (the ghost list says only "a bigger cache");

and it is independent of what the engine's own policy evicted (priorities, window layers),
so it is the same figure on every replica. Depth in the eviction order would need a rank
query on the policy's queue at every hit, which the queues do not offer.

Cost: spatial sampling. A block key is sampled when its low ``shift`` bits are zero (the
keys are hashes already), rate ``R = 2**-shift``; every access to a sampled key is
measured, and each one stands for ``1/R`` accesses at ``1/R`` times its sampled distance.
``R`` is chosen once from the capacity: at most 1/8, and small enough that at most about
``max_samples`` keys are tracked over the range the curve covers (``max_ratio`` x
capacity); ``min_shift=0`` measures a small cache exactly (the tests). Per block the engine
pays one mask and compare; per sampled access a Fenwick-tree update over access times,
``O(log max_samples)``. Keys not accessed
within the covered range are forgotten (oldest first), and their next access counts as cold,
like a first access.

Counts are per accessed block: a hit (a matched block of an opened sequence) or a store
(a block a sequence filled and the cache inserted, a miss). The histogram's bucket ``le=x``
holds the accesses that an LRU cache of ``x`` x capacity blocks would have hit; ``+Inf``
adds the cold ones (first accesses and distances beyond the covered range).

The compiled core runs a compiled twin of this class, fed by the engine itself
(``agent/native/src/curves/mrc.rs``, wrapped by ``native_curves.NativeMissRatioCurve``),
whose snapshots equal this class's to the last bit (``tests/native/test_curves.py``). This
class is its specification, and the curve of the Python core.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool_agent.cache.block import TreeNode

BOUNDS: tuple[float, ...] = (
    0.1,
    0.2,
    0.3,
    0.4,
    0.5,
    0.6,
    0.7,
    0.8,
    0.9,
    1.0,
    1.25,
    1.5,
    2.0,
    2.5,
    3.0,
    4.0,
)
"""Bucket upper bounds, as multiples of the capacity (the histogram's ``le``)."""

MAX_RATIO = BOUNDS[-1]
MAX_SAMPLES = 2048
"""Most keys tracked over the covered range (the rate falls as the cache grows)."""
MIN_SHIFT = 3
"""At most one key in 8 is sampled, whatever the size: a sampled access costs a few
microseconds (Fenwick-tree updates in Python), an unsampled one a mask and a compare."""


@dataclass(frozen=True)
class CurveSnapshot:
    """Cumulative estimated block accesses per bucket (``le`` order, then ``+Inf``)."""

    capacity: int
    rate: float
    cumulative: tuple[float, ...]
    distance_sum: float
    """Sum of the finite distances, as multiples of the capacity (the histogram's ``_sum``)."""

    @property
    def accesses(self) -> float:
        return self.cumulative[-1]

    def hit_ratio(self, ratio: float) -> float | None:
        """Share of accesses an LRU cache of ``ratio`` x capacity blocks would hit
        (linear between bucket bounds); None before any access."""
        return hit_ratio_at(BOUNDS, self.cumulative, ratio)


def hit_ratio_at(
    bounds: tuple[float, ...] | list[float],
    cumulative: tuple[float, ...] | list[float],
    ratio: float,
) -> float | None:
    """Interpolated hit ratio at ``ratio`` from a cumulative histogram (last entry: +Inf).

    Beyond the last finite bound the curve is taken as flat (no more is known)."""
    total = cumulative[-1] if cumulative else 0.0
    if total <= 0:
        return None
    if ratio <= 0:
        return 0.0
    lo_x, lo_y = 0.0, 0.0
    for x, y in zip(bounds, cumulative, strict=False):
        if ratio <= x:
            share = (ratio - lo_x) / (x - lo_x) if x > lo_x else 1.0
            return (lo_y + share * (y - lo_y)) / total
        lo_x, lo_y = x, y
    return lo_y / total


class MissRatioCurve:
    """Sampled LRU reuse distances of the block keys a cache of ``capacity`` blocks sees."""

    def __init__(
        self,
        capacity: int,
        *,
        max_samples: int = MAX_SAMPLES,
        min_shift: int = MIN_SHIFT,
        max_ratio: float = MAX_RATIO,
    ) -> None:
        self.capacity = max(int(capacity), 1)
        span = max_ratio * self.capacity
        shift = min_shift
        while span / (1 << shift) > max_samples:
            shift += 1
        self.shift = shift
        self._mask = (1 << shift) - 1
        """A key is sampled when its low ``shift`` bits are zero (the tree's keys are Python
        tuple hashes, whose low bits are well mixed)."""
        self.rate = 1.0 / (1 << shift)
        self._scale = float(1 << shift)
        self._limit = int(span * self.rate) + 1
        """Most keys tracked: the ones within the covered range of distances."""
        self._size = 2 * self._limit + 16
        self._tree = [0] * (self._size + 1)
        self._key_at: list[int | None] = [None] * (self._size + 1)
        self._last: dict[int, int] = {}
        self._now = 0
        self._counts = [0] * (len(BOUNDS) + 1)
        self._seen = 0
        """Every access, sampled or not (for SHARDS-adj's correction)."""
        self._distance_sum = 0.0

    # ------------------------------------------------------------------ engine hooks

    def access_nodes(self, nodes: Sequence[TreeNode]) -> None:
        """Record an access to each node's ``key`` (the radix tree's block keys)."""
        self._seen += len(nodes)
        mask = self._mask
        if mask:
            for node in nodes:
                if not node.key & mask:
                    self._sampled(node.key)
        else:
            for node in nodes:
                self._sampled(node.key)

    @property
    def mask(self) -> int:
        """A key is sampled when ``key & mask == 0``."""
        return self._mask

    def access_sampled(self, count: int, keys: Sequence[int]) -> None:
        """``count`` accesses, of which ``keys`` (in order) are the sampled ones: what
        ``access_nodes`` records, for an engine that sampled the keys itself (``native.py``)."""
        self._seen += count
        for key in keys:
            self._sampled(key)

    def access(self, key: int) -> None:
        self._seen += 1
        if not key & self._mask:
            self._sampled(key)

    # ------------------------------------------------------------------ reading

    def snapshot(self, *, adjusted: bool = True) -> CurveSnapshot:
        """The estimated histogram. ``adjusted`` (SHARDS-adj): the sample has ``seen x rate``
        accesses in expectation; the difference (a hot key that happened to be in or out of
        the sample) goes to the first bucket, the distances hot keys have, so the total is
        exact. That difference can shrink as well as grow, so the Prometheus histogram, whose
        buckets are counters and must never go down, exports the unadjusted counts."""
        cumulative = []
        scale = self._scale
        run = self._seen - sum(self._counts) * scale if self.shift and adjusted else 0.0
        for count in self._counts:
            run += count * scale
            cumulative.append(max(run, 0.0))
        return CurveSnapshot(
            capacity=self.capacity,
            rate=self.rate,
            cumulative=tuple(cumulative),
            distance_sum=self._distance_sum * self._scale,
        )

    def __len__(self) -> int:
        """Keys tracked now."""
        return len(self._last)

    # ------------------------------------------------------------------ internals

    def _sampled(self, key: int) -> None:
        last = self._last
        tree, size = self._tree, self._size
        before = last.pop(key, None)
        if before is None:
            self._counts[-1] += 1
        else:
            # Distinct keys touched since this one: the live marks after its own.
            i, seen = before, 0
            while i > 0:
                seen += tree[i]
                i &= i - 1
            newer = len(last) + 1 - seen
            self._bucket((newer * self._scale + 1) / self.capacity)
            i = before
            while i <= size:
                tree[i] -= 1
                i += i & -i
            self._key_at[before] = None
        if self._now >= size:
            self._compact()
            tree = self._tree
        self._now += 1
        t = self._now
        last[key] = t
        self._key_at[t] = key
        while t <= size:
            tree[t] += 1
            t += t & -t
        if len(last) > self._limit:
            self._forget_oldest()

    def _bucket(self, ratio: float) -> None:
        if ratio > MAX_RATIO:
            self._counts[-1] += 1
            return
        lo, hi = 0, len(BOUNDS) - 1
        while lo < hi:  # first bound >= ratio
            mid = (lo + hi) // 2
            if BOUNDS[mid] >= ratio:
                hi = mid
            else:
                lo = mid + 1
        self._counts[lo] += 1
        self._distance_sum += ratio

    def _add(self, i: int, delta: int) -> None:
        tree, size = self._tree, self._size
        while i <= size:
            tree[i] += delta
            i += i & -i

    def _prefix(self, i: int) -> int:
        tree = self._tree
        total = 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    def _forget_oldest(self) -> None:
        # The first time with a live mark: descend the Fenwick tree for prefix sum 1.
        pos, step, tree = 0, 1 << self._size.bit_length(), self._tree
        remaining = 1
        while step:
            nxt = pos + step
            if nxt <= self._size and tree[nxt] < remaining:
                pos = nxt
                remaining -= tree[nxt]
            step >>= 1
        oldest = pos + 1
        key = self._key_at[oldest]
        assert key is not None
        self._add(oldest, -1)
        self._key_at[oldest] = None
        del self._last[key]

    def _compact(self) -> None:
        """Renumber the live access times 1..n in order (times ran out)."""
        order = sorted(self._last.items(), key=lambda kv: kv[1])
        self._tree = [0] * (self._size + 1)
        self._key_at = [None] * (self._size + 1)
        for t, (key, _) in enumerate(order, start=1):
            self._last[key] = t
            self._key_at[t] = key
            self._add(t, 1)
        self._now = len(order)
