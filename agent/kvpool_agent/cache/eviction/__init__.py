"""Which unpinned block goes first when a tier needs room.

- ``queue.py``: ``EvictionQueue``, the evictable blocks of one (pool group, tier) by
  effective priority (``effective_priority``), then by the policy within a level;
  ``new_eviction_queue`` makes one for a policy name.
- ``registry.py``: ``POLICIES``, every policy by its config name, registered in that one
  place; ``kvpool_agent.config.EVICTION_POLICIES`` is made from it.
- ``base.py``: the record the queues order (``Evictable``) and the two kinds of policy: a
  ``LevelQueue`` per priority level, or a ``SharedPolicy`` that watches every request.
- ``heap.py``: heaps with lazy removal, as every order keeps its entries: ``LazyHeap`` and
  the one ``compact``.
- One file per policy: ``lru.py`` (the reference's), ``reuse_gap.py``, ``mixture.py`` (follows
  the best of its experts, each run in a ``shadow.py`` cache: ``reuse-gap``, ``lrfu.py``,
  ``arc.py``).

The package and everything the registry imports stay below ``kvpool_agent.config`` (they
never import it), so the config can read the names without an import cycle; only
``queue.py`` reads the priority constants from the config.
"""

from kvpool_agent.cache.eviction.registry import POLICIES

__all__ = ["POLICIES"]
