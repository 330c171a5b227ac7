"""The engine's own policy at other sizes: miniature simulations on a sample of the keys.

``mrc.py`` answers "what would a cache of ``x`` times this size hit" for LRU. The engine's
policy is not LRU (the default ``mixture`` resists scans and keeps a hot set LRU would lose),
and the autoscaler's error comes from the gap: offline, anchoring the prediction on the
policy's own curve put every step up within 5 points of the measured pool, where the LRU
curve missed by up to 14 (``bench/autoscale_predict.py``, ``docs/operations.md``).

A miniature simulation (Waldspurger et al., "Cache Modeling and Optimization using Miniature
Simulations", ATC '17) runs the policy itself on the spatially sampled keys (rate
``R = 2**-shift``) in a cache ``R`` times the size: a few caches, one per ratio of the
capacity, each a metadata-only ``ShadowCache`` of the configured policy fed one sampled
block at a time. Their hit ratios are the policy's curve at those ratios.

Fed flat, a miniature does not keep what the real tree keeps: the tree evicts only leaves,
so a block whose continuations are cached is never a victim, while a flat miniature can lose
a shared prefix. On the end-to-end trace slice that puts the curve's gain from a second
replica 3 points low on average; a prototype fed each request's sampled keys as one chain
(root first, which ``ShadowCache.step`` already takes) removes most of it
(``bench/autoscale_sampling.py``, ``docs/operations.md``). The engines would first have to
hand the curves a request's whole chain in one call.

Cost. The engine's request path only appends the sampled keys to a list (a mask and a
compare per block); ``drain`` replays them, a few tens of microseconds per sampled key and
miniature for ``mixture``, off the request path: the agent drains between requests within a
CPU budget (``limits.policy_curve_cpu_share``). The rate is the lowest that keeps
``min_blocks`` in the smallest miniature, so the cost per engine block falls as the cache
grows (at 10,000 blocks one key in 32 is sampled, at 100,000 one in 256). When the budget
cannot keep up and more than ``max_pending`` keys wait, the oldest half is dropped (counted):
the curve then misses some reuses, it never stalls the engine.

The compiled core runs a compiled twin of this class (``agent/native/src/curves/
miniature.rs``, wrapped by ``native_curves.NativePolicyMiniature``): the engine queues the
sampled keys itself and ``drain`` replays them through compiled miniatures, 20 to 30 times
faster per key, with the same counts to the access (``tests/native/test_curves.py``). This
class is its specification, and the policy curve of the Python core.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvpool_agent.cache.block import TreeNode
from kvpool_agent.cache.eviction.base import SharedPolicy
from kvpool_agent.cache.eviction.registry import POLICIES
from kvpool_agent.cache.eviction.shadow import ShadowCache

RATIOS: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
"""Sizes simulated, as multiples of the capacity: ``K/N`` for the steps the autoscaler asks
about (1 -> 2 is 2, 2 -> 1 is 0.5, 3 -> 2 is 0.67, 4 -> 1 is 0.25)."""
MIN_BLOCKS = 64
"""Fewest blocks the smallest miniature keeps: a cache of a few blocks says little."""
MAX_PENDING = 16384
"""Sampled keys waiting for ``drain`` beyond which the oldest are dropped (half of them)."""


@dataclass(frozen=True)
class PolicyCurveSnapshot:
    """Counted sampled accesses and, per ratio, the hits a cache of the policy at that
    ratio of the capacity had on them."""

    policy: str
    capacity: int
    rate: float
    ratios: tuple[float, ...]
    hits: tuple[int, ...]
    accesses: int
    dropped: int

    def hit_ratio(self, ratio: float) -> float | None:
        """Hit ratio at one of ``ratios``; None before any counted access."""
        if not self.accesses:
            return None
        return self.hits[self.ratios.index(ratio)] / self.accesses


class _Mini:
    """One miniature: a shadow cache of the policy, and the policy's shared state."""

    __slots__ = ("cache", "shared")

    def __init__(self, policy: str, capacity: int) -> None:
        entry = POLICIES[policy]
        if isinstance(entry, type) and issubclass(entry, SharedPolicy):
            self.shared: SharedPolicy | None = entry(capacity)
            self.cache = ShadowCache(capacity, self.shared.new_level())
        else:
            self.shared = None
            self.cache = ShadowCache(capacity, entry())

    def step(self, key: int) -> int:
        keys = (key,)
        if self.shared is not None:
            self.shared.observe(keys)
        return self.cache.step(keys)


def checked_ratios(policy: str, ratios: Iterable[float]) -> tuple[float, ...]:
    """``ratios`` sorted, once ``policy`` is a known eviction policy and every ratio is
    positive (else ValueError): the checks both miniatures' constructors make."""
    if policy not in POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}; one of {sorted(POLICIES)}")
    checked = tuple(sorted(ratios))
    if not checked or checked[0] <= 0:
        raise ValueError(f"ratios must be positive, got {checked}")
    return checked


class PolicyMiniature:
    """Miniatures of ``policy`` at ``ratios`` of ``capacity`` blocks, fed a sample of keys."""

    def __init__(
        self,
        policy: str,
        capacity: int,
        *,
        ratios: Iterable[float] = RATIOS,
        min_blocks: int = MIN_BLOCKS,
        max_pending: int = MAX_PENDING,
        shift: int | None = None,
    ) -> None:
        self.ratios = checked_ratios(policy, ratios)
        self.policy = policy
        self.capacity = max(int(capacity), 1)
        self.min_blocks = min_blocks
        self.max_pending = max_pending
        if shift is None:  # the lowest rate that keeps min_blocks in the smallest miniature
            shift = 0
            while self.capacity * self.ratios[0] / (2 << shift) >= min_blocks:
                shift += 1
        self.shift = max(shift, 0)
        self._mask = (1 << self.shift) - 1
        self._minis = [_Mini(policy, size) for size in self.sizes()]
        self._seen = 0
        self._warm_after = self.sizes()[0]
        """Sampled accesses replayed before counting starts: a cold miniature misses what a
        warm cache would hit (the smallest one fills first)."""
        self.hits = [0] * len(self.ratios)
        self.accesses = 0
        self.dropped = 0
        self.pending: list[int] = []

    @property
    def rate(self) -> float:
        return 1.0 / (1 << self.shift)

    def sizes(self) -> list[int]:
        """Blocks in each miniature at the current rate."""
        return [max(int(self.capacity * r) >> self.shift, 1) for r in self.ratios]

    # ------------------------------------------------------------------ engine hooks

    def access_nodes(self, nodes: Iterable[TreeNode]) -> None:
        """Queue the sampled ones among the accessed tree nodes (their ``key``)."""
        mask = self._mask
        pending = self.pending
        for node in nodes:
            if not node.key & mask:
                pending.append(node.key)
        if len(pending) > self.max_pending:
            self._overflow()

    @property
    def mask(self) -> int:
        """A key is sampled when ``key & mask == 0``."""
        return self._mask

    def queue_sampled(self, keys: Sequence[int]) -> None:
        """The sampled keys of one request's accessed nodes, in order: what ``access_nodes``
        queues, for an engine that sampled them itself (``native.py``)."""
        pending = self.pending
        pending.extend(keys)
        if len(pending) > self.max_pending:
            self._overflow()

    def access(self, key: int) -> None:
        """Queue one accessed key if it is sampled (keys must be well-mixed hashes)."""
        if not key & self._mask:
            self.pending.append(key)
            if len(self.pending) > self.max_pending:
                self._overflow()

    # ------------------------------------------------------------------ simulation

    def drain(self, limit: int | None = None) -> int:
        """Replay up to ``limit`` pending keys (all when None) through every miniature;
        returns how many were replayed."""
        pending = self.pending
        n = len(pending) if limit is None else min(limit, len(pending))
        if not n:
            return 0
        batch = pending[:n]
        del pending[:n]
        minis, hits = self._minis, self.hits
        warm = self._warm_after
        for key in batch:
            self._seen += 1
            got = [mini.step(key) for mini in minis]
            if self._seen > warm:
                self.accesses += 1
                for i, hit in enumerate(got):
                    hits[i] += hit
        return n

    def snapshot(self) -> PolicyCurveSnapshot:
        return PolicyCurveSnapshot(
            policy=self.policy,
            capacity=self.capacity,
            rate=self.rate,
            ratios=self.ratios,
            hits=tuple(self.hits),
            accesses=self.accesses,
            dropped=self.dropped,
        )

    # ------------------------------------------------------------------ internals

    def _overflow(self) -> None:
        """Too many keys wait for ``drain``: keep the newest ``max_pending / 2``."""
        cut = len(self.pending) - self.max_pending // 2
        self.dropped += cut
        del self.pending[:cut]
