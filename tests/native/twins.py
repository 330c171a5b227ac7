"""The Python originals the compiled twins are compared with, built the same way, and the
request streams both are fed."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvpool_agent.cache.eviction.arc import ARCQueue
from kvpool_agent.cache.eviction.base import LevelQueue, SharedPolicy
from kvpool_agent.cache.eviction.guarded import GuardedPolicy
from kvpool_agent.cache.eviction.lrfu import LRFUQueue
from kvpool_agent.cache.eviction.lru import LRUQueue
from kvpool_agent.cache.eviction.mixture import ExpertFactory, MixturePolicy
from kvpool_agent.cache.eviction.queue import EvictionQueue
from kvpool_agent.cache.eviction.reuse_gap import ReuseGapQueue
from kvpool_agent.cache.eviction.shadow import ShadowCache
from kvpool_agent.cache.eviction.vote import VotePolicy
from kvpool_agent.replay.runner import block_tokens
from kvpool_agent.traces import Trace, load_trace

ROOT = Path(__file__).resolve().parents[2]
TRACE_FILES = [
    *sorted((ROOT / "bench" / "traces").glob("*.jsonl")),
    *sorted((ROOT / "examples" / "traces").glob("*.jsonl")),
]
EXPERTS = ("lru", "reuse-gap", "lrfu", "arc")
GUARDED = ("lru", "reuse-gap", "lrfu", "arc")
V1 = ("reuse-gap", "lrfu", "arc")


def bits(values: Sequence[float]) -> list[int]:
    """Floats as their IEEE bits: equal lists are equal to the last bit (and sign of zero)."""
    return [struct.unpack("<q", struct.pack("<d", v))[0] for v in values]


def expert_factory(name: str, history_floor: int | None = None) -> ExpertFactory:
    """The Python expert ``name``, with its history floor lowered when one is given."""
    if name == "lru":
        return lambda capacity: LRUQueue()
    if name == "arc":
        return ARCQueue
    if name == "reuse-gap":
        if history_floor is None:
            return lambda capacity: ReuseGapQueue()
        gap = type("SmallReuseGap", (ReuseGapQueue,), {"history_floor": history_floor})
        return lambda capacity: gap()
    if name == "lrfu":
        if history_floor is None:
            return LRFUQueue
        return type("SmallLRFU", (LRFUQueue,), {"history_floor": history_floor})
    raise ValueError(name)


def shadow(name: str, capacity: int, history_floor: int | None = None) -> ShadowCache:
    return ShadowCache(capacity, expert_factory(name, history_floor)(capacity))


def mixture(
    variant: str,
    capacity: int,
    experts: Sequence[str] | None = None,
    history_floor: int | None = None,
) -> MixturePolicy:
    """``VotePolicy`` ("mixture", the default), the base ``MixturePolicy`` ("mixture-v1") or
    ``GuardedPolicy`` ("guarded")."""
    names = experts or (V1 if variant == "mixture-v1" else GUARDED)
    factories = [(n, expert_factory(n, history_floor)) for n in names]
    cls = {"mixture": VotePolicy, "mixture-v1": MixturePolicy, "guarded": GuardedPolicy}[variant]
    return cls(capacity, factories)


def eviction_queue(
    policy: str,
    capacity: int,
    experts: Sequence[str] | None = None,
    history_floor: int | None = None,
) -> EvictionQueue:
    """``new_eviction_queue(policy, capacity)``, with the same options as the twin."""
    if policy in ("mixture", "mixture-v1", "guarded"):
        shared = mixture(policy, capacity, experts, history_floor)
        return EvictionQueue(shared.new_level, shared)
    if policy == "lru":
        return EvictionQueue(LRUQueue)
    if policy == "reuse-gap":
        return EvictionQueue(lambda: expert_factory("reuse-gap", history_floor)(capacity))
    raise ValueError(policy)


class Mini:
    """The miniature's ``_Mini`` for any policy of the twin's registry: the policy observes
    each request, then a shadow over its level queue serves it."""

    def __init__(self, policy: str, capacity: int) -> None:
        queue = eviction_queue(policy, capacity)
        self.shared: SharedPolicy | None = queue.shared
        level: LevelQueue = self.shared.new_level() if self.shared is not None else queue._factory()
        self.cache = ShadowCache(capacity, level)
        self.changed: list[int] = []
        self.cache.on_change = self.changed.append

    def step(self, keys: Sequence[int]) -> int:
        self.changed.clear()
        if self.shared is not None:
            self.shared.observe(keys)
        return self.cache.step(keys)


def trace_paths(trace: Trace) -> list[list[int]]:
    """Each request's blocks by the trace's ids (an id names its whole prefix)."""
    return [list(r.hash_ids) for r in trace.requests]


def chained_paths(trace: Trace) -> list[list[int]]:
    """Each request's blocks by the keys the engine gives them: ``hash((parent_key,
    tokens))`` chained from 0 over the replay's tokens (large, signed keys)."""
    size = trace.block_size
    key_of: dict[int, int] = {}
    out = []
    for request in trace.requests:
        parent = 0
        keys = []
        for h in request.hash_ids:
            key = key_of.get(h)
            if key is None:
                key = key_of[h] = hash((parent, tuple(block_tokens(h, size))))
            keys.append(key)
            parent = key
        out.append(keys)
    return out


def traces() -> Iterator[tuple[str, Trace]]:
    for path in TRACE_FILES:
        yield path.stem, load_trace(path)


Stepper = Callable[[Sequence[int]], int]
