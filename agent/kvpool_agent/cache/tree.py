"""The radix tree of reusable blocks: matching, storing, pins, eviction order, dropping.

Each namespace (``cache_salt`` and ``extra_keys``) has a root; a node is one full token
block of a prefix, keyed by ``packed.block_key`` of its parent's key and its tokens, with
one ``Block`` per pool group (None where a window group lost it). The tree owns:

- the match of a prompt (full blocks by key, confirmed by their packed tokens; the usable
  depth the groups allow; an optional partial match of the next block);
- storing a sequence's full blocks, or joining the node another sequence stored first;
- pins (a sequence's reference on a block) and the eviction queues of the unpinned,
  evictable blocks, one per (tier, group), with the priority rule and the policy;
- dropping: a lost full-attention block drops its node and subtree, a lost window block
  leaves a hole that is pruned once no prefix can end below it; events and the ghost list
  record what went.

The full-attention group (if any) gives the tree its leaves: ``TreeNode.kids_in_tier``
counts a node's children by the tier of their full-attention block, and only a block with
no child in its tier (or, in the host tier, in either) may be evicted.

It decides nothing about tiers or storage: ``tiers.py`` moves blocks between tiers and
frees ids; this module only asks the block pool to take back ids of dropped blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvpool_agent.cache.block import HEADS_FROM, PRIMARY, SECONDARY, TIER_NAMES, Block, TreeNode
from kvpool_agent.cache.block_pool import BlockPool, TierLayout
from kvpool_agent.cache.events import (
    BlockRemoved,
    BlockStored,
    BlockUpdated,
    EventQueue,
    RemovalReason,
)
from kvpool_agent.cache.eviction.queue import EvictionQueue, effective_priority, new_eviction_queue
from kvpool_agent.cache.groups import AttentionGroup
from kvpool_agent.cache.packed import Packed, confirmed, pack, shared_prefix
from kvpool_agent.cache.retention import KvCacheRetentionConfig
from kvpool_agent.cache.stats import GhostList


class RadixTree:
    """Roots by namespace, the nodes below them, and the eviction queues of their blocks."""

    def __init__(
        self,
        groups: Sequence[AttentionGroup],
        pool: BlockPool,
        tiers: tuple[TierLayout, TierLayout],
        policy: str,
        *,
        events: EventQueue,
        ghost: GhostList,
    ) -> None:
        self.groups = list(groups)
        self.num_groups = len(self.groups)
        full = [g.index for g in self.groups if g.full_attention]
        assert len(full) <= 1, "layers of full attention form one group"
        self.full: int | None = full[0] if full else None
        """The full-attention group, whose blocks make the tree's leaves (None: none)."""
        self.windows = [g for g in self.groups if not g.full_attention]
        self._evictable = [g.evictable for g in self.groups]
        self.tpb = self.groups[0].tpb
        self.pool = pool
        self._pinned = pool.pinned  # the pool's counts, kept by ``pin`` and ``unpin``
        self._free = pool.tiers  # where dropped and unpinned private blocks' ids go
        self._tiers = tiers
        self.events = events
        self.ghost = ghost
        self.roots: dict[int, TreeNode] = {}
        self.num_nodes = 0
        self.tick = 0
        """Recency clock of the nodes (``TreeNode.last_used``): one tick per touch."""
        self.observers: list[EvictionQueue] = []
        """The queues whose policy watches every request (``SharedPolicy``)."""
        self.queues = self._new_queues(policy)

    def _new_queues(self, policy: str) -> tuple[list[EvictionQueue], list[EvictionQueue]]:
        """One queue per (tier, group), sized for policies that model the tier: the host
        tier's queue gets the device and host capacity together, since a block leaves the
        pair only when it leaves the host tier."""
        device = self._tiers[PRIMARY].group_blocks
        host = self._tiers[SECONDARY].group_blocks
        queues = (
            [new_eviction_queue(policy, device[g]) for g in range(self.num_groups)],
            [
                new_eviction_queue(policy if host[g] else "lru", device[g] + host[g])
                for g in range(self.num_groups)
            ],
        )
        self.observers = [q for tier in queues for q in tier if q.shared is not None]
        return queues

    def switch_policy(self, name: str, now: float) -> None:
        """New queues under policy ``name``, holding the same blocks (popped in the old
        order, pushed in that order)."""
        old = self.queues
        self.queues = self._new_queues(name)
        for tier in (PRIMARY, SECONDARY):
            for g in range(self.num_groups):
                queued = []
                while (block := old[tier][g].pop(now)) is not None:
                    queued.append(block)
                for block in queued:
                    self.queues[tier][g].push(block, now)

    def observe(self, keys: list[int], *, scored: bool = True) -> None:
        """Tell the policies that watch requests about one (``SharedPolicy.observe``)."""
        for queue in self.observers:
            queue.observe(keys, scored=scored)

    # ----------------------------------------------------------------- reading

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node of the tree, parents before children."""
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def root(self, namespace: int) -> TreeNode:
        """The namespace's root, made on first use."""
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = TreeNode(namespace, (), None, self.num_groups)
        return root

    # ----------------------------------------------------------------- matching

    def walk(
        self, namespace: int, toks: list[int], limit: int, packed: bytes | None = None
    ) -> list[TreeNode]:
        """The tree nodes matching the leading full blocks of ``toks[:limit]`` (read-only)."""
        root = self.roots.get(namespace)
        if root is None:
            return []
        tpb = self.tpb
        path: list[TreeNode] = []
        node = root
        for start in range(0, limit - tpb + 1, tpb):
            # ``block_key`` inlined: this loop is the lookup's cost per block
            child = node.children.get(hash((node.key, tuple(toks[start : start + tpb]))))
            if child is None:
                break
            path.append(child)
            node = child
        if path:
            # Keys only pick candidates: a block whose key collided is a miss, and so is
            # everything after it.
            del path[confirmed([n.packed for n in path], toks, tpb, packed) :]
        return path

    def match(
        self,
        namespace: int,
        toks: list[int],
        limit: int,
        packed: bytes | None,
        *,
        partial: bool,
        take_over: bool,
    ) -> tuple[list[TreeNode], TreeNode | None, int]:
        """The usable matched path, and (``partial``) a partially matching next node with
        its token count; ``take_over``: only a node nobody uses qualifies."""
        path = self.walk(namespace, toks, limit, packed)
        if not path and self.roots.get(namespace) is None:
            return [], None, 0
        tpb = self.tpb
        walked = len(path)
        usable = self.usable_depth(path)
        if usable < walked:
            return path[:usable], None, 0
        node, m = None, 0
        if partial and walked * tpb < limit:
            parent = path[-1] if path else self.roots[namespace]
            node, m = self._partial_match(
                parent, toks[walked * tpb : min(limit, (walked + 1) * tpb)], take_over
            )
        return path, node, m

    def usable_depth(self, path: list[TreeNode]) -> int:
        """Deepest prefix whose needed blocks are all present in some tier."""
        d = len(path)
        if self.full is not None:
            d = self.groups[self.full].usable_depth(path, d)
        while d > 0:
            for group in self.windows:
                shorter = group.usable_depth(path, d)
                if shorter < d:
                    d = shorter
                    break
            else:
                return d
        return 0

    def _partial_match(
        self, parent: TreeNode, rest: list[int], take_over: bool
    ) -> tuple[TreeNode | None, int]:
        """The child sharing the longest leading run of ``rest`` (at least one token)."""
        if not parent.may_extend(rest[0]):
            return None, 0  # no child starts with the next token: nothing to scan
        best, best_len = None, 0
        head = pack(rest[:1])
        for child in parent.children.values():
            m = shared_prefix(child.packed, rest, head)
            if m <= best_len or any(b is None for b in child.blocks):
                continue
            if take_over and (child.children or any(b.ref_count for b in child.blocks if b)):
                continue  # taking a block over is only possible while nobody uses it
            best, best_len = child, m
        return best, best_len

    # ----------------------------------------------------------------- storing

    def store(
        self,
        parent: TreeNode,
        key: int,
        tokens: tuple[int, ...],
        packed: Packed,
        held: list[list[Block | None]],
        j: int,
        priority: int,
        expires_at: float | None,
        now: float,
    ) -> TreeNode:
        """A new node under ``parent`` for block ``j`` of a sequence that ``held`` (per
        group) the blocks of; they become the node's."""
        node = TreeNode(key, packed, parent, self.num_groups)
        children = parent.children
        children[key] = node
        if parent.heads is not None or len(children) >= HEADS_FROM:
            parent.head_added(node)
        self.num_nodes += 1
        node.priority = priority
        node.stored_at = now
        node.expires_at = expires_at
        self.tick += 1
        node.last_used = self.tick
        for g in range(self.num_groups):
            block = held[g][j]
            assert block is not None and block.node is None
            block.node = node
            node.blocks[g] = block
        full = self.full
        if full is not None:
            parent.kids_in_tier[PRIMARY] += 1
            # Mostly the parent is the sequence's previous block, pinned: nothing to recheck.
            above = parent.blocks[full]
            if above is not None and not above.ref_count:
                self.recheck(parent, now)
        if self.ghost:
            self.ghost.discard(node.key)
        if self.events.enabled:
            self.events.push(
                BlockStored(
                    node.key,
                    parent.key if parent.parent is not None else None,
                    tokens,
                    TIER_NAMES[PRIMARY],
                    priority,
                )
            )
        return node

    def join(self, node: TreeNode, held: list[list[Block | None]], j: int, now: float) -> None:
        """Another sequence stored this block first. Keep one copy in the tree and make sure
        the sequence that ``held`` block ``j`` pins it (a sequence always pins its whole
        path): take the node over with our copy where theirs is unused or missing, else
        share theirs and give ours back."""
        for g in range(self.num_groups):
            mine = held[g][j]
            theirs = node.blocks[g]
            if mine is None or theirs is mine:
                continue
            if theirs is not None and theirs.ref_count:
                self.pin(theirs)
                held[g][j] = theirs
                self.unpin(mine, now)  # private: its id goes back to the free list
                continue
            if theirs is not None:
                self.queues[theirs.tier][g].discard(theirs)
                self.pool.release(theirs.tier, g, theirs.block_id)
                theirs.node = None
                if g == self.full and node.parent is not None:
                    node.parent.kids_in_tier[theirs.tier] -= 1
            mine.node = node
            node.blocks[g] = mine
            if g == self.full and node.parent is not None:
                node.parent.kids_in_tier[PRIMARY] += 1
                self.recheck(node.parent, now)

    def raise_priorities(
        self,
        nodes: list[TreeNode],
        retention: KvCacheRetentionConfig,
        num_prompt: int,
        now: float,
    ) -> None:
        """Raise the priority of a released sequence's blocks to what its retention policy
        asks, where that is higher than their current effective priority."""
        tpb = self.tpb
        for j, node in enumerate(nodes):
            priority, duration = retention.block_priority(j * tpb, (j + 1) * tpb, num_prompt)
            if priority > effective_priority(node, now):
                node.priority = priority
                node.expires_at = None if duration is None else node.stored_at + duration / 1000.0
                for block in node.blocks:
                    if block is not None:
                        self.queues[block.tier][block.group].requeue(block, now)
                self.events.push(BlockUpdated(node.key, _tier_name(node), priority))

    def touch(self, nodes: list[TreeNode]) -> None:
        for node in nodes:
            self.tick += 1
            node.last_used = self.tick

    # ----------------------------------------------------------------- pins

    def pin(self, block: Block) -> None:
        if block.ref_count == 0:
            self.queues[block.tier][block.group].discard(block)
            self._pinned[block.tier][block.group] += 1
        block.ref_count += 1

    def unpin(self, block: Block, now: float) -> None:
        block.ref_count -= 1
        if block.ref_count:
            return
        self._pinned[block.tier][block.group] -= 1
        if block.node is None:
            self._free[block.tier].release(block.group, block.block_id)
        elif self._evictable[block.group](block):  # ``evictable``, minus the done tests
            self.queues[block.tier][block.group].push(block, now)

    # ----------------------------------------------------------------- eviction order

    def evictable(self, block: Block) -> bool:
        if block.ref_count or block.node is None:
            return False
        return self._evictable[block.group](block)

    def recheck(self, node: TreeNode, now: float) -> None:
        """Re-test whether ``node``'s full-attention block is a leaf it may evict."""
        if self.full is None or node.parent is None:
            return
        block = node.blocks[self.full]
        if block is None or block.ref_count:
            return
        queue = self.queues[block.tier][self.full]
        if self.evictable(block):
            if block not in queue:
                queue.push(block, now)
        else:
            queue.discard(block)

    # ----------------------------------------------------------------- dropping

    def drop_group_block(self, node: TreeNode, g: int, reason: RemovalReason, now: float) -> None:
        """The group's copy of ``node`` is gone (its id was already handed on by the caller)."""
        block = node.blocks[g]
        assert block is not None
        if g == self.full:
            node.blocks[g] = None
            block.node = None
            self.drop_node(node, reason, now, skip=block)
            return
        node.blocks[g] = None
        block.node = None
        self.queues[block.tier][g].discard(block)
        self.prune(node, now)

    def drop_node(
        self, node: TreeNode, reason: RemovalReason, now: float, skip: Block | None = None
    ) -> None:
        """Remove ``node`` and everything below it from the tree, freeing their blocks."""
        for child in list(node.children.values()):
            self.drop_node(child, reason, now)
        tier_of_full = skip.tier if skip is not None else None
        for g, block in enumerate(node.blocks):
            if block is None:
                continue
            if g == self.full:
                tier_of_full = block.tier
            assert block.ref_count == 0, "a block in use is never dropped"
            self.queues[block.tier][g].discard(block)
            self._free[block.tier].release(g, block.block_id)
            block.node = None
            node.blocks[g] = None
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        if parent.heads is not None:
            parent.head_removed(node)
        if tier_of_full is not None and self.full is not None:
            parent.kids_in_tier[tier_of_full] -= 1
            self.recheck(parent, now)
        self.num_nodes -= 1
        if self.events.enabled:
            self.events.push(BlockRemoved(node.key, TIER_NAMES[tier_of_full or 0], reason))
        if reason == "evicted":
            self.ghost.add(node.key)

    def prune(self, node: TreeNode, now: float) -> None:
        """Drop leaves that miss a window block (no prefix can end there) and no one uses."""
        while (
            node.parent is not None
            and not node.children
            and any(b is None for b in node.blocks)
            and not any(b is not None and b.ref_count for b in node.blocks)
        ):
            parent = node.parent
            self.drop_node(node, "pruned", now)
            node = parent

    def unlink_taken(self, node: TreeNode, now: float) -> None:
        """A sequence took ``node``'s blocks over (``Tiers.take_over``): the emptied leaf
        leaves the tree, replaced by the sequence's private copy."""
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        if parent.heads is not None:
            parent.head_removed(node)
        if self.full is not None:
            parent.kids_in_tier[PRIMARY] -= 1
            self.recheck(parent, now)
        self.num_nodes -= 1
        self.events.push(BlockRemoved(node.key, TIER_NAMES[PRIMARY], "replaced"))

    def clear(self, now: float) -> None:
        """Drop every node no open sequence uses (and whatever hangs only from those)."""
        for root in list(self.roots.values()):
            for child in list(root.children.values()):
                self._clear_subtree(child, now)

    def _clear_subtree(self, node: TreeNode, now: float) -> None:
        for child in list(node.children.values()):
            self._clear_subtree(child, now)
        if not node.children and not any(b is not None and b.ref_count for b in node.blocks):
            self.drop_node(node, "cleared", now)


def _tier_name(node: TreeNode) -> str:
    for block in node.blocks:
        if block is not None:
            return TIER_NAMES[block.tier]
    return TIER_NAMES[PRIMARY]
