"""The engine's own policy at other sizes: miniature simulations on a sample of the keys.

``mrc.py`` answers "what would a cache of ``x`` times this size hit" for LRU. The engine's
policy is not LRU (the default ``mixture`` resists scans and keeps a hot set LRU would lose),
and the autoscaler's error comes from the gap: offline, anchoring the prediction on the
policy's own curve put every step up within 5 points of the measured pool, where the LRU
curve missed by up to 14 (``bench/autoscale_predict.py``, ``docs/operations.md``).

A miniature simulation (Waldspurger et al., "Cache Modeling and Optimization using Miniature
Simulations", ATC '17) runs the policy itself on the spatially sampled keys (rate
``R = 2**-shift``) in a cache ``R`` times the size: a few caches, one per ratio of the
capacity, each a metadata-only ``ShadowCache`` of the configured policy.

Each is fed a request's sampled keys as one chain, root first (``access_chain``, at open,
with every full block of the prompt), as the tree sees the request: the sampled keys of a
prefix are a prefix of the sampled keys, so a miniature holds prefixes and, like the tree,
evicts only leaves, never a shared prefix whose continuations it keeps. Fed one key at a
time, it lost such prefixes and put the gain from a second replica 3 points low on the
end-to-end trace slice; fed chains, with every key simulated, it is the exact curve there
(``bench/autoscale_sampling.py``, ``docs/operations.md``). A request counts its chain's
keys as accesses and the chain's cached prefix as hits, as the tree counts a query's blocks
and its matched prefix (blocks a sequence's decode adds are part of no query). The data
plane asks once per lease, with the whole chain it was asked for; its stores ask nothing
(``KVCacheManager.curve_muted``).

Cost. The engine's request path only appends the sampled keys to a list (a mask and a
compare per block, once the keys of the missed blocks are hashed at open, which
``mixture``'s own observers need anyway); ``drain`` replays them, a few tens
of microseconds per sampled key and miniature for ``mixture``, off the request path: the
agent drains between requests within a CPU budget (``limits.policy_curve_cpu_share``). The
rate is the lowest that keeps ``min_blocks`` in the smallest miniature, so the cost per
engine block falls as the cache grows (at 10,000 blocks one key in 32 is sampled, at
100,000 one in 256). When the budget cannot keep up and more than ``max_pending`` keys
wait, the oldest chains are dropped (counted) until at most half of that waits: the curve
then misses some reuses, it never stalls the engine.

The compiled core runs a compiled twin of this class (``agent/native/src/curves/
miniature.rs``, wrapped by ``native_curves.NativePolicyMiniature``): the engine queues the
sampled keys itself and ``drain`` replays them through compiled miniatures, 20 to 30 times
faster per key, with the same counts to the access (``tests/native/test_curves.py``). This
class is its specification, and the policy curve of the Python core.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvpool_agent.cache.eviction.base import SharedPolicy
from kvpool_agent.cache.eviction.registry import POLICIES
from kvpool_agent.cache.eviction.shadow import ShadowCache

RATIOS: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
"""Sizes simulated, as multiples of the capacity: ``K/N`` for the steps the autoscaler asks
about (1 -> 2 is 2, 2 -> 1 is 0.5, 3 -> 2 is 0.67, 4 -> 1 is 0.25)."""
MIN_BLOCKS = 64
"""Fewest blocks the smallest miniature keeps: a cache of a few blocks says little."""
MAX_PENDING = 16384
"""Sampled keys waiting for ``drain`` beyond which the oldest chains are dropped (until half
that many wait)."""


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

    def step(self, chain: Sequence[int]) -> int:
        """One request's sampled keys, root first; returns its cached prefix's length."""
        if self.shared is not None:
            self.shared.observe(chain)
        return self.cache.step(chain)


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
        """Sampled keys waiting for ``drain``, oldest first: the chains end to end."""
        self._chains: deque[int] = deque()
        """Length of each chain in ``pending``, oldest first."""

    @property
    def rate(self) -> float:
        return 1.0 / (1 << self.shift)

    def sizes(self) -> list[int]:
        """Blocks in each miniature at the current rate."""
        return [max(int(self.capacity * r) >> self.shift, 1) for r in self.ratios]

    # ------------------------------------------------------------------ engine hooks

    @property
    def mask(self) -> int:
        """A key is sampled when ``key & mask == 0``."""
        return self._mask

    def access_chain(self, keys: Iterable[int]) -> None:
        """One request: the keys of its prompt's full blocks, root first (keys must be
        well-mixed hashes); the sampled ones are queued as one chain."""
        mask = self._mask
        self.queue_chain([key for key in keys if not key & mask])

    def access(self, key: int) -> None:
        """A request of one block: ``access_chain((key,))``."""
        if not key & self._mask:
            self.queue_chain((key,))

    def queue_chain(self, sampled: Sequence[int]) -> None:
        """One request's sampled keys, root first: what ``access_chain`` queues, for an
        engine that sampled them itself (``native.py``)."""
        if not sampled:
            return
        self.pending.extend(sampled)
        self._chains.append(len(sampled))
        if len(self.pending) > self.max_pending:
            self._overflow()

    # ------------------------------------------------------------------ simulation

    def drain(self, limit: int | None = None) -> int:
        """Replay pending chains, oldest first, through every miniature: all when ``limit``
        is None, else until ``limit`` keys were (the last chain whole, so a few more).
        Returns how many keys were replayed."""
        pending, chains = self.pending, self._chains
        want = len(pending) if limit is None else min(limit, len(pending))
        minis, hits = self._minis, self.hits
        warm = self._warm_after
        done = 0
        while done < want:
            n = chains.popleft()
            chain = pending[done : done + n]
            done += n
            got = [mini.step(chain) for mini in minis]
            self._seen += n
            if self._seen > warm:
                self.accesses += n
                for i, hit in enumerate(got):
                    hits[i] += hit
        del pending[:done]
        return done

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
        """Too many keys wait for ``drain``: drop the oldest chains until at most
        ``max_pending // 2`` keys wait."""
        keep = self.max_pending // 2
        chains = self._chains
        cut = 0
        while chains and len(self.pending) - cut > keep:
            cut += chains.popleft()
        self.dropped += cut
        del self.pending[:cut]
