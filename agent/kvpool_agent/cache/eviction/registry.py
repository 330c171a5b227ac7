"""Every eviction policy, by the name ``KvCacheConfig.eviction_policy`` takes.

The one place policies are registered: nothing adds to ``POLICIES`` when a module is
imported. ``kvpool_agent.config.EVICTION_POLICIES`` (the names the config and the CRD
accept) is made from it, so a policy added here is configurable everywhere.
"""

from __future__ import annotations

from kvpool_agent.cache.eviction.base import Policy
from kvpool_agent.cache.eviction.lru import LRUQueue
from kvpool_agent.cache.eviction.reuse_gap import ReuseGapQueue
from kvpool_agent.cache.eviction.vote import VotePolicy

POLICIES: dict[str, Policy] = {
    "lru": LRUQueue,
    "reuse-gap": ReuseGapQueue,
    "mixture": VotePolicy,
}
"""Policy name -> its level-queue factory, or its ``SharedPolicy`` class.

``mixture`` (the default) is ``VotePolicy`` (``vote.py``): plain LRU, reuse-gap, LRFU and
ARC in shadow caches, voting with weights that follow their hit scores. Its predecessors are
kept as classes it builds on and as bench series (``bench/series.py``), not as config names:
``GuardedPolicy`` (``guarded.py``, the default before it: the same experts, following one
leader with hysteresis) as ``guarded``, and the original ``MixturePolicy`` (reuse-gap,
LRFU, ARC; no LRU, no hysteresis) as ``mixture-v1``.
"""
