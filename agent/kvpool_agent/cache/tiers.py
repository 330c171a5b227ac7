"""Where blocks live: allocation that evicts, offload to and onboard from the host tier.

When the block pool has no free id, ``allocate`` evicts: the tree names the victims in its
priority-then-policy order; a primary-tier victim at or above
``secondary_offload_min_priority`` is offloaded (its node now points at a host block,
taken from the host pool, evicting there if need be) when the group has host capacity,
else dropped. A reused block found in the host tier is copied back (``onboard_path``); a
partial match is copied into a new block (``copy_partial``) or taken over, leaving the
tree (``take_over``).

Storage is never touched here: every copy is recorded as a ``CopyOp`` in ``copies``, in
the order the engine did them, for the caller to execute in that order (an id freed by one
copy's source may be the destination of a later one).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool_agent.cache.block import PRIMARY, SECONDARY, TIER_NAMES, Block, TreeNode
from kvpool_agent.cache.block_pool import BlockPool
from kvpool_agent.cache.errors import OutOfBlocksError
from kvpool_agent.cache.events import BlockUpdated
from kvpool_agent.cache.eviction.queue import effective_priority
from kvpool_agent.cache.stats import CacheStats
from kvpool_agent.cache.tree import RadixTree


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy blocks of one pool group (every pool of it) between or within tiers."""

    group: int
    src_tier: int
    dst_tier: int
    src_ids: tuple[int, ...]
    dst_ids: tuple[int, ...]


class Tiers:
    """Block moves between the primary and the host tier, and allocation with eviction."""

    def __init__(
        self,
        pool: BlockPool,
        tree: RadixTree,
        stats: CacheStats,
        offload_min_priority: int,
    ) -> None:
        self.pool = pool
        self.tree = tree
        self.stats = stats
        self.offload_min_priority = offload_min_priority
        """``secondary_offload_min_priority``: lower-priority victims are dropped."""
        self.copies: list[CopyOp] = []
        """Storage copies not yet taken by the caller, oldest first."""

    def _copy(self, g: int, src_tier: int, dst_tier: int, src: list[int], dst: list[int]) -> None:
        if src:
            self.copies.append(CopyOp(g, src_tier, dst_tier, tuple(src), tuple(dst)))

    # ----------------------------------------------------------------- allocation

    def allocate(self, tier: int, g: int, count: int, now: float) -> list[int]:
        """``count`` free ids of group ``g`` in ``tier``: free ids, then free chunks of other
        groups, then evictions (offloading what qualifies, in one batched copy)."""
        if count <= 0:
            return []
        pool = self.pool
        ids = pool.take_many(tier, g, count)
        while len(ids) < count:
            victims = self.evict(tier, g, count - len(ids), now)
            if not victims and not pool.num_free(tier, g):
                break
            ids.extend(victims)  # still counted as in use: they pass straight to the caller
            ids += pool.take_many(tier, g, count - len(ids))  # pruning may have freed ids
        if len(ids) < count:
            for block_id in ids:
                pool.release(tier, g, block_id)
            raise OutOfBlocksError(f"tier {TIER_NAMES[tier]}: no block left for pool group {g}")
        return ids

    def evict(self, tier: int, g: int, count: int, now: float) -> list[int]:
        """Evict up to ``count`` blocks of group ``g`` from ``tier``; returns their ids.

        Victims from the primary tier that qualify are offloaded: host slots are taken one
        by one (dropping host victims needs no copy) and the data moves in one batch.
        """
        tree = self.tree
        queue = tree.queues[tier][g]  # the tree's order: priority, then the policy
        freed: list[int] = []
        moves: list[tuple[int, Block]] = []  # (primary id, its new host block)
        threshold = self.offload_min_priority
        has_host = tier == PRIMARY and self.pool.tiers[SECONDARY].capacity[g] > 0
        while len(freed) < count:
            victim = queue.pop(now)
            if victim is None:
                break
            assert isinstance(victim, Block)
            node = victim.node
            assert node is not None and victim.ref_count == 0
            self.stats.evictions[tier] += 1
            host_id = None
            if has_host and effective_priority(victim, now) >= threshold:
                host_id = self._take_host_slot(g, now)
                if victim.node is None:
                    # Making room in the host tier pruned this node: its id is free again.
                    if host_id is not None:
                        self.pool.release(SECONDARY, g, host_id)
                    continue
            freed.append(victim.block_id)
            if host_id is not None:
                # Not evictable from the host tier until its data is there (after the batch).
                moved = Block(g, SECONDARY, host_id)
                moves.append((victim.block_id, moved))
                self.move(node, g, moved, now, enqueue=False)
            else:
                tree.drop_group_block(node, g, "evicted", now)
        # A pending move whose node was pruned meanwhile gave its host slot back: skip it.
        moves = [(src, b) for src, b in moves if b.node is not None]
        if moves:
            src_ids = [src for src, _ in moves]
            self._copy(g, PRIMARY, SECONDARY, src_ids, [b.block_id for _, b in moves])
            self.stats.offloads += len(moves)
            queue = tree.queues[SECONDARY][g]
            for _, moved in moves:
                if tree.evictable(moved) and moved not in queue:
                    queue.push(moved, now)
        return freed

    def _take_host_slot(self, g: int, now: float) -> int | None:
        block_id = self.pool.take(SECONDARY, g)
        if block_id is None:
            victims = self.evict(SECONDARY, g, 1, now)
            block_id = victims[0] if victims else self.pool.allocate(SECONDARY, g)
        return block_id

    # ----------------------------------------------------------------- moves

    def move(self, node: TreeNode, g: int, new: Block, now: float, *, enqueue: bool = True) -> None:
        """Point ``node``'s group-``g`` block at ``new`` (another tier), keeping the pins."""
        tree = self.tree
        old = node.blocks[g]
        assert old is not None
        new.node = node
        new.ref_count = old.ref_count
        if old.ref_count:
            pinned = self.pool.pinned
            pinned[old.tier][g] -= 1
            pinned[new.tier][g] += 1
        tree.queues[old.tier][g].discard(old)
        old.node = None
        node.blocks[g] = new
        full = tree.full
        if g == full and node.parent is not None:
            node.parent.kids_in_tier[old.tier] -= 1
            node.parent.kids_in_tier[new.tier] += 1
            tree.recheck(node.parent, now)
        if enqueue and new.ref_count == 0 and tree.evictable(new):
            tree.queues[new.tier][g].push(new, now)
        if (g == full or full is None) and tree.events.enabled:
            tree.events.push(
                BlockUpdated(node.key, TIER_NAMES[new.tier], node.priority, node.tokens)
            )

    def onboard_path(
        self, path: list[TreeNode], need_from: list[int], fresh_ids: list[list[int]], now: float
    ) -> None:
        """Copy the pinned host-tier blocks of a matched path back to the primary tier, into
        ids taken from the front of ``fresh_ids`` (per group)."""
        for g in range(self.tree.num_groups):
            nodes = [
                node
                for j, node in enumerate(path)
                if j >= need_from[g] and (b := node.blocks[g]) is not None and b.tier == SECONDARY
            ]
            if not nodes:
                continue
            ids, fresh_ids[g][:] = fresh_ids[g][: len(nodes)], fresh_ids[g][len(nodes) :]
            src = []
            for node in nodes:
                block = node.blocks[g]
                assert block is not None
                src.append(block.block_id)
            self._copy(g, SECONDARY, PRIMARY, src, ids)
            for node, block_id, host_id in zip(nodes, ids, src, strict=True):
                self.move(node, g, Block(g, PRIMARY, block_id), now)
                self.pool.release(SECONDARY, g, host_id)
            self.stats.onboards += len(nodes)

    def copy_partial(
        self, partial: TreeNode, held: list[list[Block | None]], fresh_ids: list[list[int]]
    ) -> None:
        """Copy-on-partial-reuse: a new private block starts as a copy of the matched one."""
        for g in range(self.tree.num_groups):
            src = partial.blocks[g]
            assert src is not None
            (block,) = self.pool.new_private(g, 1, fresh_ids[g])
            assert block is not None
            self._copy(g, src.tier, PRIMARY, [src.block_id], [block.block_id])
            held[g].append(block)

    def take_over(
        self,
        partial: TreeNode,
        held: list[list[Block | None]],
        fresh_ids: list[list[int]],
        now: float,
    ) -> None:
        """Partial reuse without copy: the unused leaf leaves the tree and becomes ours
        (its pinned blocks, onboarded first where they sit in the host tier)."""
        tree = self.tree
        for g in range(tree.num_groups):
            block = partial.blocks[g]
            assert block is not None
            if block.tier == SECONDARY:
                new_id = fresh_ids[g].pop(0)
                self._copy(g, SECONDARY, PRIMARY, [block.block_id], [new_id])
                self.move(partial, g, Block(g, PRIMARY, new_id), now)
                self.pool.release(SECONDARY, g, block.block_id)
                self.stats.onboards += 1
                block = partial.blocks[g]
                assert block is not None
            block.node = None
            partial.blocks[g] = None
            held[g].append(block)
        tree.unlink_taken(partial, now)
