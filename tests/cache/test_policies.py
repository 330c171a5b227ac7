"""The reuse-gap eviction policy: its ordering, and the priority/expiry rules around it."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_agent.cache.eviction import POLICIES
from kvpool_agent.cache.eviction.queue import EvictionQueue
from kvpool_agent.cache.eviction.reuse_gap import ReuseGapQueue
from kvpool_agent.config import DEFAULT_PRIORITY, EVICTION_POLICIES, KvCacheConfig


@dataclass(eq=False)
class FakeNode:
    key: int
    parent: FakeNode | None
    last_used: int = 0
    hits: int = 0
    children: dict[tuple[int, ...], FakeNode] = field(default_factory=dict)
    priority: int = DEFAULT_PRIORITY
    expires_at: float | None = None

    def child(self, key: int) -> FakeNode:
        node = FakeNode(key, self)
        self.children[(key,)] = node
        return node


class FakeBlock:
    """A queued block as the eviction queues see it (like ``cache.block.Block``)."""

    def __init__(self, node: FakeNode) -> None:
        self.node = node
        self.block_id = node.key
        self.queue_level = -1
        self.queue_stamp = 0

    @property
    def priority(self) -> int:
        return self.node.priority

    @property
    def expires_at(self) -> float | None:
        return self.node.expires_at

    @property
    def last_used(self) -> int:
        return self.node.last_used

    @property
    def hits(self) -> int:
        return self.node.hits


def test_policy_is_registered_and_configurable() -> None:
    assert POLICIES["reuse-gap"] is ReuseGapQueue
    assert "reuse-gap" in EVICTION_POLICIES
    assert KvCacheConfig(eviction_policy="reuse-gap").eviction_policy == "reuse-gap"


def test_importing_the_engine_alone_registers_every_policy_the_config_accepts() -> None:
    """In a fresh interpreter (no test module has imported a policy module): the agent's
    default policy must be there without anything else imported."""
    code = (
        "from kvpool_agent.cache.eviction import POLICIES; "
        "from kvpool_agent.config import EVICTION_POLICIES; "
        "print(sorted(POLICIES) == sorted(EVICTION_POLICIES), sorted(POLICIES))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("True"), out


def use(queue: EvictionQueue, block: FakeBlock, tick: int) -> None:
    """A request used ``block``: it is pinned, touched and released again."""
    queue.discard(block)
    block.node.last_used = tick
    block.node.hits += 1
    queue.push(block, 0.0)


def test_rarely_reused_chain_goes_before_frequently_reused_one() -> None:
    root = FakeNode(0, None)
    hot = FakeBlock(root.child(1))
    cold = FakeBlock(root.child(2))
    queue = EvictionQueue(ReuseGapQueue)
    queue.push(hot, 0.0)
    queue.push(cold, 0.0)
    for tick in range(10, 200, 10):
        use(queue, hot, tick)
    use(queue, cold, 100)
    use(queue, cold, 190)  # gap 90 against hot's 10, both just used
    use(queue, hot, 200)
    assert queue.pop(0.0) is cold


def test_long_unused_chain_ages_out() -> None:
    """A chain reused often but not for a long time goes before one in regular use."""
    root = FakeNode(0, None)
    finished = FakeBlock(root.child(1))
    active = FakeBlock(root.child(2))
    queue = EvictionQueue(ReuseGapQueue)
    queue.push(finished, 0.0)
    queue.push(active, 0.0)
    for tick in range(1, 20):
        use(queue, finished, tick)
    for tick in range(20, 400, 20):
        use(queue, active, tick)
    assert queue.pop(0.0) is finished


def test_one_quick_reuse_does_not_outrank_a_steady_chain() -> None:
    """A single short gap says little: the chain is judged close to the population's
    first-reuse gap until more uses confirm its rate (``prior_weight``)."""
    root = FakeNode(0, None)
    slow = FakeBlock(root.child(1))  # first reuse after 100: sets the population's prior
    steady = FakeBlock(root.child(2))
    lucky = FakeBlock(root.child(3))
    queue = EvictionQueue(ReuseGapQueue)
    queue.push(slow, 0.0)
    use(queue, slow, 100)
    steady.node.last_used = 100
    queue.push(steady, 0.0)
    for tick in range(106, 220, 6):  # nineteen reuses, every 6 ticks
        use(queue, steady, tick)
    lucky.node.last_used = 215
    queue.push(lucky, 0.0)
    use(queue, lucky, 218)  # one reuse, 3 ticks after its first use
    use(queue, steady, 220)
    assert [queue.pop(0.0) for _ in range(3)] == [slow, lucky, steady]


def test_parent_exposed_by_an_eviction_is_evictable_in_turn() -> None:
    """Leaf-only eviction: once its child is gone the parent is queued and can go too."""
    root = FakeNode(0, None)
    parent = root.child(1)
    other = FakeBlock(root.child(2))
    leaf = FakeBlock(parent.child(3))
    parent_block = FakeBlock(parent)
    queue = EvictionQueue(ReuseGapQueue)
    queue.push(leaf, 0.0)
    queue.push(other, 0.0)
    for tick in range(5, 100, 5):
        use(queue, other, tick)
    assert queue.pop(0.0) is leaf  # never reused: the fresh chain goes first
    del parent.children[(3,)]
    queue.push(parent_block, 0.0)
    assert len(queue) == 2
    assert queue.pop(0.0) is parent_block


def test_priority_levels_come_before_the_policy() -> None:
    root = FakeNode(0, None)
    low = FakeBlock(root.child(1))
    high = FakeBlock(root.child(2))
    low.node.priority = 10
    high.node.priority = 90
    queue = EvictionQueue(ReuseGapQueue)
    queue.push(high, 0.0)
    queue.push(low, 0.0)
    for tick in range(1, 50):  # the low block is the hot one
        use(queue, low, tick)
    assert queue.pop(0.0) is low
    assert queue.pop(0.0) is high


def test_expired_priority_falls_back_to_the_default_level() -> None:
    root = FakeNode(0, None)
    kept = FakeBlock(root.child(1))
    plain = FakeBlock(root.child(2))
    kept.node.priority = 90
    kept.node.expires_at = 5.0
    queue = EvictionQueue(ReuseGapQueue)
    queue.push(kept, 0.0)
    queue.push(plain, 0.0)
    assert queue.pop(1.0) is plain  # priority 90 still holds
    queue.push(plain, 1.0)
    for tick in range(1, 30):
        use(queue, plain, tick)
    # After the duration the kept block competes at the default level, where it is the
    # fresh, never reused chain: it goes first.
    assert queue.pop(10.0) is kept


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "use", "pop", "discard"]), st.integers(0, 7))))
def test_queue_bookkeeping_under_random_operations(ops: list[tuple[str, int]]) -> None:
    """Pop returns only queued blocks, each once; len tracks the queued count."""
    root = FakeNode(0, None)
    blocks = [FakeBlock(root.child(i + 1)) for i in range(8)]
    queue = EvictionQueue(ReuseGapQueue)
    queued: set[int] = set()
    for tick, (op, i) in enumerate(ops, start=1):
        block = blocks[i]
        if op == "push" and i not in queued:
            block.node.last_used = tick
            queue.push(block, 0.0)
            queued.add(i)
        elif op == "use" and i in queued:
            use(queue, block, tick)
        elif op == "discard":
            queue.discard(block)
            queued.discard(i)
        elif op == "pop":
            victim = queue.pop(0.0)
            if queued:
                assert isinstance(victim, FakeBlock)
                assert victim.block_id - 1 in queued
                queued.discard(victim.block_id - 1)
            else:
                assert victim is None
        assert len(queue) == len(queued)
