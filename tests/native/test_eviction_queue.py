"""``EvictionQueue`` compiled and in Python, driven by the same operation scripts: blocks
pushed, discarded, popped and requeued; priorities with durations that expire; tree nodes
touched (with ties in ``last_used``), dropped while a policy still remembers them, and
stored again under their old key; requests observed, with changes of leader. Every victim,
every level and every mixture score must be the same."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_agent.cache.block import Block, TreeNode
from kvpool_agent.config import DEFAULT_PRIORITY

from .twins import bits, eviction_queue

kvpool_native = pytest.importorskip("kvpool_native")

POLICIES = ("lru", "reuse-gap", "mixture", "mixture-v1", "guarded")
OPS = (
    "node",
    "node",
    "touch",
    "touch",
    "priority",
    "item",
    "item",
    "push",
    "push",
    "push",
    "discard",
    "pop",
    "pop",
    "requeue",
    "free",
    "drop",
    "observe",
    "observe",
    "time",
)


class Script:
    """One queue of each kind and a tree of nodes and blocks mirrored on both sides.

    Node and block ids are the twin's (its slots, reused as the engine reuses them); a
    block id keeps its Python ``Block`` across reuse, as an engine slot keeps its record, so
    the stamps agree.
    """

    def __init__(
        self,
        policy: str,
        capacity: int,
        experts: Sequence[str] | None = None,
        history_floor: int | None = None,
        ties: bool = False,
    ) -> None:
        self.ties = ties
        """Every node at one of three ticks: the blocks' order within a tick is then the
        order their queues took them in."""
        self.py = eviction_queue(policy, capacity, experts, history_floor)
        self.twin = kvpool_native.EvictionQueueTwin(
            policy, capacity, None if experts is None else list(experts), history_floor
        )
        self.policy = policy
        self.nodes: dict[int, TreeNode] = {}
        self.roots: list[int] = []
        self.blocks: dict[int, Block] = {}
        self.items: dict[int, int] = {}  # live block -> its node
        self.node_items: dict[int, set[int]] = {}
        self.dropped: list[tuple[int, int]] = []  # (key, parent key) of dropped nodes
        self.keys: set[int] = set()
        self.now = 0.0
        self.tick = 0
        self.pops = 0
        for _ in range(2):
            self.new_node(random.Random(0), None, None)

    # -- the tree

    def new_node(self, rng: random.Random, parent: int | None, key: int | None) -> None:
        if key is None:
            key = rng.getrandbits(64) - 2**63
            while key in self.keys:
                key += 1
        self.keys.add(key)
        priority, expires = self.retention(rng)
        self.tick += 1
        tick = rng.randrange(3) if self.ties else self.tick
        nid = self.twin.add_node(key, parent, tick, priority, expires)
        node = TreeNode(key, b"", None if parent is None else self.nodes[parent], 1)
        if parent is not None:
            self.nodes[parent].children[key] = node
        node.priority, node.expires_at, node.last_used = priority, expires, tick
        self.nodes[nid] = node
        self.node_items[nid] = set()
        if parent is None:
            self.roots.append(nid)

    def retention(self, rng: random.Random) -> tuple[int, float | None]:
        if rng.random() < 0.7:
            return DEFAULT_PRIORITY, None
        priority = rng.choice([0, 10, 35, 60, 100])
        expires = None if rng.random() < 0.3 else self.now + rng.choice([0.0, 0.5, 2.0, 8.0])
        return priority, expires

    def path_keys(self, nid: int) -> list[int]:
        keys = []
        node: TreeNode | None = self.nodes[nid]
        while node is not None and node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return keys[::-1]

    # -- one random operation

    def step(self, op: str, rng: random.Random) -> None:
        py, twin = self.py, self.twin
        inner = [n for n in self.nodes if n not in self.roots]
        live = list(self.items)
        if op == "node":
            if self.dropped and rng.random() < 0.4:  # a block stored again under its key
                at = rng.randrange(len(self.dropped))
                key, parent_key = self.dropped[at]
                parent = next((i for i, n in self.nodes.items() if n.key == parent_key), None)
                if parent is not None and key not in self.keys:
                    self.dropped.pop(at)
                    self.new_node(rng, parent, key)
                    return
            leaves = [n for n, node in self.nodes.items() if not node.children]
            r = rng.random()
            if r < 0.5 and leaves:  # chains of single children, as conversations grow
                parent = rng.choice(leaves)
            elif r < 0.8:
                parent = rng.choice(list(self.nodes))
            else:
                parent = rng.choice(self.roots)
            self.new_node(rng, parent, None)
        elif op == "touch" and inner:
            nid = rng.choice(inner)
            r = 1.0 if self.ties else rng.random()
            if r < 0.6:
                self.tick += 1
                tick = self.tick
            elif r < 0.8:  # ties in last_used
                tick = max(0, self.tick - rng.randrange(4))
            else:  # many blocks at a few ticks: their order is their queues' sequence
                tick = rng.randrange(3)
            twin.set_last_used(nid, tick)
            self.nodes[nid].last_used = tick
        elif op == "priority" and inner:
            nid = rng.choice(inner)
            priority, expires = self.retention(rng)
            twin.set_priority(nid, priority, expires)
            node = self.nodes[nid]
            node.priority, node.expires_at = priority, expires
            if rng.random() < 0.8:  # the engine requeues; the queues must cope if not
                for iid in self.node_items[nid]:
                    py.requeue(self.blocks[iid], self.now)
                    twin.requeue(iid, self.now)
        elif op == "item" and inner:
            nid = rng.choice(inner)
            iid = twin.add_item(nid)
            block = self.blocks.setdefault(iid, Block(0, 0, iid))
            assert block.queue_level == -1 and block.node is None
            block.node = self.nodes[nid]
            self.items[iid] = nid
            self.node_items[nid].add(iid)
        elif op == "push" and live:
            iid = rng.choice(live)
            block = self.blocks[iid]
            if block.queue_level < 0:
                py.push(block, self.now)
                twin.push(iid, self.now)
        elif op in ("discard", "requeue") and live:
            iid = rng.choice(live)
            if op == "discard":
                py.discard(self.blocks[iid])
                twin.discard(iid)
            else:
                py.requeue(self.blocks[iid], self.now)
                twin.requeue(iid, self.now)
        elif op == "pop":
            victim = py.pop(self.now)
            got = twin.pop(self.now)
            assert got == (None if victim is None else victim.block_id)
            if victim is not None:
                self.pops += 1
                if rng.random() < 0.8:  # the engine frees the victim, and a node left empty
                    nid = self.items[victim.block_id]
                    self.free(victim.block_id)
                    self.drop(nid)
        elif op == "free" and live:
            iid = rng.choice(live)
            if self.blocks[iid].queue_level < 0:
                self.free(iid)
        elif op == "drop" and inner:
            self.drop(rng.choice(inner))
        elif op == "observe" and inner:
            keys = self.path_keys(rng.choice(inner))
            scored = rng.random() < 0.8
            py.observe(keys, scored=scored)
            twin.observe(keys, scored)
        elif op == "time":
            self.now += rng.choice([0.0, 0.25, 1.0, 3.0])
        self.check(rng)

    def free(self, iid: int) -> None:
        self.twin.free_item(iid)
        self.blocks[iid].node = None
        self.node_items[self.items.pop(iid)].discard(iid)

    def drop(self, nid: int) -> None:
        """Drop ``nid`` from the tree if it is a leaf without blocks."""
        node = self.nodes[nid]
        if node.children or self.node_items[nid] or nid in self.roots:
            return
        self.twin.drop_node(nid)
        assert node.parent is not None
        del node.parent.children[node.key]
        del self.nodes[nid], self.node_items[nid]
        self.keys.discard(node.key)
        self.dropped.append((node.key, node.parent.key))

    def check(self, rng: random.Random) -> None:
        py, twin = self.py, self.twin
        assert len(twin) == len(py)
        for iid in rng.sample(list(self.items), min(4, len(self.items))):
            assert twin.queue_level(iid) == self.blocks[iid].queue_level
        shared = py.shared
        if shared is not None:
            assert (twin.leader, twin.switches) == (shared.leader, shared.switches)  # type: ignore[attr-defined]
            assert bits(twin.scores) == bits(shared.scores)  # type: ignore[attr-defined]
        if self.policy == "reuse-gap":  # every remembered chain head is held, no more
            heads = sum(len(q._head_of) for q in py._levels if q is not None)  # type: ignore[attr-defined]
            assert twin.holds()[1] == heads

    def drain(self) -> None:
        """Pop everything: the rest of the order must agree too."""
        self.now += 100.0
        while (victim := self.py.pop(self.now)) is not None:
            assert self.twin.pop(self.now) == victim.block_id
        assert self.twin.pop(self.now) is None and len(self.twin) == 0


def run(
    policy: str,
    seed: int,
    steps: int,
    capacity: int,
    history_floor: int | None,
    ties: bool = False,
) -> Script:
    rng = random.Random(seed)
    script = Script(policy, capacity, history_floor=history_floor, ties=ties)
    for _ in range(steps):
        script.step(rng.choice(OPS), rng)
    script.drain()
    return script


@pytest.mark.parametrize("policy", POLICIES)
def test_seeded_scripts_evict_the_same_blocks(policy: str) -> None:
    pops = switches = 0
    for seed in range(40):
        floor = 6 if seed % 3 == 0 else None  # reuse-gap and LRFU forget their history
        script = run(policy, seed, steps=1500, capacity=4 + seed % 9, history_floor=floor)
        pops += script.pops
        switches += script.twin.switches or 0
    assert pops > 3000
    if policy in ("guarded", "mixture-v1"):
        assert switches > 0  # leader changes re-bucketed queued blocks (the vote has none)


@pytest.mark.parametrize("policy", ["mixture", "mixture-v1", "guarded"])
def test_seeded_scripts_with_recency_ties_evict_the_same_blocks(policy: str) -> None:
    """Among them, changes of leader that move tied blocks, and tied blocks that enter the
    leader's shadow together: each keeps its place among its tick's blocks."""
    for seed in range(30):
        for capacity in (4, 8, 12, 16):
            run(policy, 100 + seed, 1500, capacity, history_floor=None, ties=True)


@pytest.mark.parametrize("variant", ["mixture", "mixture-v1", "guarded"])
def test_blocks_tied_in_recency_leave_in_the_order_they_were_queued(variant: str) -> None:
    """Eight queued blocks at one tick enter the leader's shadow in one request: they change
    bucket together (in no order that matters), and are evicted in the order they were
    queued."""
    py, twin = eviction_queue(variant, 16), kvpool_native.EvictionQueueTwin(variant, 16)
    rng = random.Random(3)
    parent_py, parent = TreeNode(0, b"", None, 1), twin.add_node(0)
    keys = []
    for _ in range(8):
        key = rng.getrandbits(63)
        nid = twin.add_node(key, parent, 7)
        node = TreeNode(key, b"", parent_py, 1)
        node.last_used = 7
        parent_py.children[key] = node
        block = Block(0, 0, twin.add_item(nid))
        block.node = node
        py.push(block, 0.0)
        twin.push(block.block_id, 0.0)
        parent_py, parent = node, nid
        keys.append(key)
    py.observe(keys)
    twin.observe(keys)
    victims = [py.pop(0.0).block_id for _ in keys]  # type: ignore[union-attr]
    assert [twin.pop(0.0) for _ in keys] == victims
    assert victims == sorted(victims)  # the blocks' ids grow in the order they came


@settings(max_examples=300, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    capacity=st.integers(1, 12),
    floor=st.sampled_from([None, 3]),
    ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 2**32)), max_size=150),
)
def test_generated_scripts_evict_the_same_blocks(
    policy: str, capacity: int, floor: int | None, ops: list[tuple[str, int]]
) -> None:
    script = Script(policy, capacity, history_floor=floor)
    for op, seed in ops:
        script.step(op, random.Random(seed))
    script.drain()


@pytest.mark.parametrize("experts", [["lru"], ["arc", "lrfu"], ["reuse-gap", "lru", "arc"]])
@pytest.mark.parametrize("variant", ["mixture", "mixture-v1", "guarded"])
def test_a_mixture_of_other_experts_evicts_the_same_blocks(
    variant: str, experts: list[str]
) -> None:
    rng = random.Random(len(experts))
    script = Script(variant, 6, experts=experts)
    for _ in range(600):
        script.step(rng.choice(OPS), rng)
    script.drain()


def test_unknown_policies_are_refused_with_the_names_allowed() -> None:
    with pytest.raises(ValueError, match="guarded, lru, mixture, mixture-v1, reuse-gap"):
        kvpool_native.EvictionQueueTwin("fifo", 8)
    assert kvpool_native.EvictionQueueTwin("mixture", 8).watches_requests()
    assert not kvpool_native.EvictionQueueTwin("reuse-gap", 8).watches_requests()


def test_a_block_cannot_be_pushed_twice() -> None:
    twin = kvpool_native.EvictionQueueTwin("lru", 8)
    root = twin.add_node(0)
    item = twin.add_item(twin.add_node(1, root))
    twin.push(item, 0.0)
    with pytest.raises(RuntimeError, match="already evictable"):
        twin.push(item, 0.0)
    twin.discard(item)
    twin.discard(item)  # not queued: a no-op
    assert twin.pop(0.0) is None
