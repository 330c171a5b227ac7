"""Block records and radix tree nodes: the engine's two kinds of bookkeeping record.

A ``TreeNode`` is one reusable token block of a prefix: its chained key, its tokens packed
(``cache/packed.py``: 4 B a token, not a tuple of ints) and, for each pool group, the
``Block`` (storage slot) holding its KV in some tier, or None where a window group evicted
it. Priority, expiry and recency live on the node, so every group's copy of a node ages
together. A ``Block`` not attached to a node is private to the one sequence that writes it
(its last, still filling block, or a duplicate of a node that another sequence stored
first).
"""

from __future__ import annotations

from kvpool_agent.cache.packed import Packed, first_token, unpack
from kvpool_agent.config import DEFAULT_PRIORITY

HEADS_FROM = 16
"""Children from which a node indexes its children's first tokens (``TreeNode.heads``)."""

PRIMARY = 0
SECONDARY = 1
TIER_NAMES = ("primary", "secondary")


class TreeNode:
    """One full block of tokens in the radix tree."""

    __slots__ = (
        "blocks",
        "children",
        "depth",
        "expires_at",
        "heads",
        "hits",
        "key",
        "kids_in_tier",
        "last_used",
        "packed",
        "parent",
        "priority",
        "stored_at",
    )

    def __init__(
        self,
        key: int,
        packed: Packed,
        parent: TreeNode | None,
        num_groups: int,
    ) -> None:
        self.key = key
        self.packed = packed
        """The block's tokens, packed: what confirms a match found by key."""
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        """Child nodes by their key (``packed.block_key``)."""
        self.blocks: list[Block | None] = [None] * num_groups
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.priority = DEFAULT_PRIORITY
        self.expires_at: float | None = None
        self.stored_at = 0.0
        self.last_used = 0
        self.hits = 0
        self.kids_in_tier = [0, 0]
        """Children whose full-attention block sits in each tier (leaf test for eviction)."""
        self.heads: dict[int, int] | None = None
        """First token -> children starting with it, once the node had ``HEADS_FROM``
        children: a partial match looks there instead of scanning every child."""

    @property
    def tokens(self) -> tuple[int, ...]:
        """The block's tokens (unpacked on each call: snapshots, tests and tools read it)."""
        return unpack(self.packed)

    # The tree calls these two only where ``heads`` is (or is due to be) kept, so that a
    # node with few children costs nothing per stored block.

    def head_added(self, child: TreeNode) -> None:
        """``child`` was just added to ``children``: count it (building ``heads`` if due)."""
        heads = self.heads
        if heads is None:
            heads = self.heads = {}
            for node in self.children.values():
                first = first_token(node.packed)
                heads[first] = heads.get(first, 0) + 1
            return
        first = first_token(child.packed)
        heads[first] = heads.get(first, 0) + 1

    def head_removed(self, child: TreeNode) -> None:
        """``child`` was just deleted from ``children``: count it out of ``heads``."""
        heads = self.heads
        assert heads is not None
        first = first_token(child.packed)
        left = heads[first] - 1
        if left:
            heads[first] = left
        else:
            del heads[first]

    def may_extend(self, token: int) -> bool:
        """Whether some child's tokens start with ``token`` (False: no partial match here)."""
        heads = self.heads
        if heads is not None:
            return token in heads
        return bool(self.children)

    def __repr__(self) -> str:
        return f"TreeNode(key={self.key:#x}, depth={self.depth}, children={len(self.children)})"


class Block:
    """One slot of one group in one tier."""

    __slots__ = ("block_id", "group", "node", "queue_level", "queue_stamp", "ref_count", "tier")

    def __init__(self, group: int, tier: int, block_id: int) -> None:
        self.group = group
        self.tier = tier
        self.block_id = block_id
        self.ref_count = 0
        self.node: TreeNode | None = None
        self.queue_level = -1
        self.queue_stamp = 0

    # The eviction queues read these; only blocks attached to a node are ever queued.
    @property
    def priority(self) -> int:
        return self.node.priority if self.node is not None else DEFAULT_PRIORITY

    @property
    def expires_at(self) -> float | None:
        return self.node.expires_at if self.node is not None else None

    @property
    def last_used(self) -> int:
        return self.node.last_used if self.node is not None else 0

    @property
    def hits(self) -> int:
        return self.node.hits if self.node is not None else 0

    def __repr__(self) -> str:
        return (
            f"Block(group={self.group}, tier={TIER_NAMES[self.tier]}, id={self.block_id}, "
            f"refs={self.ref_count})"
        )
