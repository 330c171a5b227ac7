"""Eviction policies a bench may name beside the config's: the defaults before ``mixture``.

``register`` makes them engine policy names for this process only (the eviction registry and
the config's list of names it checks), so that a bench can run the default and the one
before it side by side. They are never config names of the agent. Both have compiled twins
(``agent/native/src/eviction/registry.rs``), so they run on either core.
"""

from __future__ import annotations

from kvpool_agent import config as config_module
from kvpool_agent.cache.eviction import POLICIES
from kvpool_agent.cache.eviction.guarded import GuardedPolicy
from kvpool_agent.cache.eviction.mixture import MixturePolicy

EXTRA_SERIES: dict[str, type[MixturePolicy]] = {
    "mixture-v1": MixturePolicy,
    "guarded": GuardedPolicy,
}
"""``mixture-v1``: reuse-gap, LRFU and ARC, no LRU expert, no hysteresis; ``guarded``
(``guarded.py``): LRU among those experts, one leader, hysteresis."""


def register(extra: dict[str, type[MixturePolicy]] = EXTRA_SERIES) -> list[str]:
    """Make ``extra`` engine policies for this process; returns their names."""
    POLICIES.update(extra)
    known = config_module.EVICTION_POLICIES
    config_module.EVICTION_POLICIES = (*known, *(name for name in extra if name not in known))
    return list(extra)


def names() -> tuple[str, ...]:
    """Every policy name this process accepts now (the config's and the registered)."""
    return config_module.EVICTION_POLICIES
