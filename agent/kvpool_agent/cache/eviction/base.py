"""What every eviction order is made of: the record it orders and the two kinds of policy.

A ``LevelQueue`` orders the evictable blocks of one priority level (``EvictionQueue`` in
``queue.py`` owns the levels). A policy that must see every request, not only the blocks
that become evictable, is a ``SharedPolicy``: one per (group, tier), told each request's
block keys through ``EvictionQueue.observe`` and making the level queues of that (group,
tier). ``registry.POLICIES`` names one or the other for each policy.

Nothing here imports the configuration: ``kvpool_agent.config`` reads the policy names from
the registry, so the registry and the policies it names stay below it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Prioritized(Protocol):
    """What the priority rule reads: a ``TreeNode``, or a ``Block`` through its node."""

    @property
    def priority(self) -> int: ...

    @property
    def expires_at(self) -> float | None: ...


class Evictable(Prioritized, Protocol):
    """What the queues need of a block (``kvpool_agent.cache.block.Block`` provides it)."""

    block_id: int
    queue_level: int
    """Priority level the block sits in while queued, -1 while not queued."""
    queue_stamp: int
    """Bumped on every enqueue and dequeue; heap entries with an older stamp are stale."""

    @property
    def last_used(self) -> int: ...

    @property
    def hits(self) -> int: ...


class LevelQueue(ABC):
    """Orders the evictable blocks of one priority level."""

    @abstractmethod
    def push(self, block: Evictable) -> None:
        """The block became evictable (it was released, or its priority changed)."""

    @abstractmethod
    def discard(self, block: Evictable) -> None:
        """The block stopped being evictable (pinned again, or dropped). Called before the
        block's ``queue_stamp`` is bumped."""

    @abstractmethod
    def pop(self) -> Evictable | None:
        """Remove and return the victim, or None when empty."""

    @abstractmethod
    def __len__(self) -> int: ...


LevelQueueFactory = Callable[[], LevelQueue]
"""Makes the queue of one priority level (a policy with no state across levels)."""


class SharedPolicy(ABC):
    """Policy state shared by every priority level of one (group, tier).

    Made with the tier's capacity in blocks of the group. ``observe`` gets the keys of each
    request's full blocks, root first, before the engine makes room for the request.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def new_level(self) -> LevelQueue:
        """A queue for one priority level, drawing on the shared state."""

    @abstractmethod
    def observe(self, keys: Sequence[int], *, scored: bool = True) -> None:
        """A request for the blocks ``keys``. ``scored`` is False when a sequence only grew
        (decode, a further chunk): the keys extend a request already observed."""


Policy = LevelQueueFactory | type[SharedPolicy]
"""A registry entry: a level-queue factory, or a shared policy's class."""


def tree_node(block: Evictable) -> Any:
    """The tree node of a queued block (a shadow node is its own); the policies that rank
    chains or follow a shadow read its key and links. Only stored blocks are ever queued."""
    node = getattr(block, "node", None)
    if node is None:
        raise TypeError(f"block {block.block_id} has no tree node; only stored blocks are queued")
    return node
