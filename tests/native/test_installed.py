"""The compiled core is part of what the test command builds (``hack/lib.sh``): if it is
missing, the suite fails here instead of quietly testing the Python core alone."""

from __future__ import annotations

import os

from kvpool_agent.cache.native import native_available, native_policies
from kvpool_agent.config import EVICTION_POLICIES


def test_the_compiled_core_is_installed_and_runs_every_configurable_policy() -> None:
    if os.environ.get("KVPOOL_CORE") == "python":
        return  # asked for the Python core alone
    assert native_available(), "kvpool_native is missing: pip install ./agent/native"
    assert set(EVICTION_POLICIES) <= native_policies()
