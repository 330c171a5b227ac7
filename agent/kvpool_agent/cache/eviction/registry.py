"""Every eviction policy, by the name ``KvCacheConfig.eviction_policy`` takes.

The one place policies are registered: nothing adds to ``POLICIES`` when a module is
imported. ``kvpool_agent.config.EVICTION_POLICIES`` (the names the config and the CRD
accept) is made from it, so a policy added here is configurable everywhere.
"""

from __future__ import annotations

from kvpool_agent.cache.eviction.base import Policy
from kvpool_agent.cache.eviction.guarded import GuardedPolicy
from kvpool_agent.cache.eviction.lru import LRUQueue
from kvpool_agent.cache.eviction.reuse_gap import ReuseGapQueue

POLICIES: dict[str, Policy] = {
    "lru": LRUQueue,
    "reuse-gap": ReuseGapQueue,
    "mixture": GuardedPolicy,
}
"""Policy name -> its level-queue factory, or its ``SharedPolicy`` class.

``mixture`` (the default) is ``GuardedPolicy`` (``guarded.py``): the mixture of
``mixture.py`` with plain LRU among its experts and a selector with hysteresis. The
original ``MixturePolicy`` (reuse-gap, LRFU, ARC; no LRU, no hysteresis) is kept as the
base class and as ``bench/replay_sweep.py``'s ``mixture-v1`` series, not as a config name;
so is the candidate ``VotePolicy`` (``vote.py``), the ``vote`` series.
"""
