"""Eviction policies a bench may name beside the config's: the defaults before ``mixture``.

``register`` makes them engine policy names for this process only (the eviction registry and
the config's list of names it checks), so that a bench can run the default and the one
before it side by side. They are never config names of the agent. Both have compiled twins
(``agent/native/src/eviction/registry.rs``), so they run on either core.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

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


def policies(
    parser: argparse.ArgumentParser, text: str, *, required: Sequence[str] = ()
) -> list[str]:
    """A bench's ``--policies``: registers the series, then returns the comma-separated
    names of ``text``; an unknown name, none at all, or a missing ``required`` one stops the
    bench with the names allowed."""
    register()
    names = [name for name in text.split(",") if name]
    allowed = config_module.EVICTION_POLICIES
    unknown = [name for name in names if name not in allowed]
    missing = [name for name in required if name not in names]
    if unknown or missing or not names:
        parser.error(
            f"--policies: unknown {unknown}, missing {missing}; allowed: {', '.join(allowed)}"
        )
    return names
