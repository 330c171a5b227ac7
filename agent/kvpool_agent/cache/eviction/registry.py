"""Every eviction policy, by the name ``KvCacheConfig.eviction_policy`` takes.

The one place policies are registered: nothing adds to ``POLICIES`` when a module is
imported. ``kvpool_agent.config.EVICTION_POLICIES`` (the names the config and the CRD
accept) is made from it, so a policy added here is configurable everywhere.
"""

from __future__ import annotations

from kvpool_agent.cache.eviction.base import Policy
from kvpool_agent.cache.eviction.lru import LRUQueue
from kvpool_agent.cache.eviction.mixture import MixturePolicy
from kvpool_agent.cache.eviction.reuse_gap import ReuseGapQueue

POLICIES: dict[str, Policy] = {
    "lru": LRUQueue,
    "reuse-gap": ReuseGapQueue,
    "mixture": MixturePolicy,
}
"""Policy name -> its level-queue factory, or its ``SharedPolicy`` class."""
