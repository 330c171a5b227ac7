"""Pool groups by attention kind: what a group's window means for reuse, eviction and sliding.

A group with window ``w`` lets a query at position ``p`` see keys ``p - w + 1 .. p``
(flashinfer ``window_left = w - 1``); a full-attention group's window is the longest
sequence (or unbounded). Two strategies follow from it:

- ``FullAttention``: every block of a prefix is needed by every query after it, so a prefix
  is usable only up to its first missing block, only tree leaves are evicted (in the
  primary tier: blocks with no child there), and a sequence keeps all its blocks. The tree
  keeps its leaf counts (``TreeNode.kids_in_tier``) by this group's blocks.
- ``Window``: a query only needs the blocks of the window at its end, so interior blocks
  may be evicted while later blocks of the prefix stay reusable, and blocks that leave a
  sequence's window go back to the tree as the sequence grows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvpool_agent.cache.block import PRIMARY, SECONDARY, Block, TreeNode


class AttentionGroup:
    """One pool group's attention window (``sizing.GroupSpec``), in blocks."""

    __slots__ = ("index", "tpb", "window")

    full_attention: ClassVar[bool]

    def __init__(self, index: int, window: int, tokens_per_block: int) -> None:
        self.index = index
        self.window = window
        self.tpb = tokens_per_block

    def need_from(self, position: int) -> int:
        """First block index a query at ``position`` needs."""
        return max(0, position - self.window + 1) // self.tpb

    def usable_depth(self, path: Sequence[TreeNode], d: int) -> int:
        """The deepest ``e <= d`` such that this group has every block a query at the end
        of ``path[:d]`` needs, if the prefix is cut at the first block found missing."""
        raise NotImplementedError

    def evictable(self, block: Block) -> bool:
        """Whether an unpinned block of this group, attached to a node (the caller checked
        both), may be evicted now."""
        raise NotImplementedError

    def out_of_window(self, position: int) -> int:
        """Blocks before this index are no longer seen by a query from ``position`` on."""
        raise NotImplementedError


class FullAttention(AttentionGroup):
    """Layers that attend to the whole prefix."""

    __slots__ = ()

    full_attention = True

    def usable_depth(self, path: Sequence[TreeNode], d: int) -> int:
        g = self.index
        for j in range(d):
            if path[j].blocks[g] is None:
                return j
        return d

    def evictable(self, block: Block) -> bool:
        node = block.node
        if block.tier == PRIMARY:
            return node.kids_in_tier[PRIMARY] == 0
        return node.kids_in_tier[PRIMARY] + node.kids_in_tier[SECONDARY] == 0

    def out_of_window(self, position: int) -> int:
        return 0


class Window(AttentionGroup):
    """Layers that attend to the last ``window`` tokens only."""

    __slots__ = ()

    full_attention = False

    def usable_depth(self, path: Sequence[TreeNode], d: int) -> int:
        g = self.index
        for j in range(d - 1, self.need_from(d * self.tpb) - 1, -1):
            if path[j].blocks[g] is None:
                return j
        return d

    def evictable(self, block: Block) -> bool:
        return True

    def out_of_window(self, position: int) -> int:
        return self.need_from(position)


def make_groups(
    windows: Sequence[int], full_attention: Sequence[bool], tokens_per_block: int
) -> list[AttentionGroup]:
    """One strategy per group, in group order."""
    return [
        (FullAttention if full else Window)(g, window, tokens_per_block)
        for g, (window, full) in enumerate(zip(windows, full_attention, strict=True))
    ]
