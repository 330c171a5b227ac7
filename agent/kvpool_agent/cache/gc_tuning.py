"""Garbage-collector settings for processes that hold a large cache.

The tree holds one node (a few small containers) per cached block, so a cache of a million
blocks means millions of tracked objects, and CPython's default thresholds run a full
collection over all of them every few thousand allocations: on the request path this cost
more than the engine itself (``bench/cache_ops.py``). Long-running entry points (the agent,
``kvpool replay``, the benchmarks) call ``tune_gc`` once at start; a library import never does.
"""

from __future__ import annotations

import gc

THRESHOLDS = (100_000, 50, 1000)


def tune_gc() -> None:
    """Collect young objects rarely and old ones almost never; freeze what start-up made."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
