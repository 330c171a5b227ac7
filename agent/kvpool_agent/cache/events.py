"""KV events the engine records for the agent to publish (bounded; oldest dropped first).

Events are per tree node (one reusable block of a prefix): stored when it enters the tree,
updated when it changes tier or priority, removed (with the reason) when its last copy is
gone. The agent maps them to the vLLM-compatible wire format.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

RemovalReason = Literal["evicted", "replaced", "cleared", "pruned"]


@dataclass(frozen=True, slots=True)
class BlockStored:
    key: int
    parent_key: int | None
    token_ids: tuple[int, ...]
    tier: str
    priority: int


@dataclass(frozen=True, slots=True)
class BlockUpdated:
    key: int
    tier: str
    priority: int
    token_ids: tuple[int, ...] | None = None
    """The block's tokens when it changed tier (a consumer that files blocks by medium
    stores it again under the new one, tokens included), None for a priority change: the
    publisher then keeps no block's tokens."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    key: int
    tier: str
    reason: RemovalReason


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockUpdated | BlockRemoved | AllBlocksCleared


class EventQueue:
    """A bounded FIFO of KV events; ``dropped`` counts what fell off the old end."""

    def __init__(self, max_size: int) -> None:
        self._queue: deque[KVEvent] = deque(maxlen=max_size or None)
        self.enabled = max_size > 0
        self.dropped = 0

    def push(self, event: KVEvent) -> None:
        if not self.enabled:
            return
        queue = self._queue
        if queue.maxlen is not None and len(queue) == queue.maxlen:
            self.dropped += 1
        queue.append(event)

    def drain(self, limit: int | None = None) -> list[KVEvent]:
        """Remove and return up to ``limit`` events, oldest first."""
        queue = self._queue
        n = len(queue) if limit is None else min(limit, len(queue))
        return [queue.popleft() for _ in range(n)]

    def __len__(self) -> int:
        return len(self._queue)

    def resize(self, max_size: int) -> None:
        """Change the bound (a live setting); keeps the newest events."""
        old = list(self._queue)
        self.enabled = max_size > 0
        self._queue = deque(old[-max_size:] if max_size else [], maxlen=max_size or None)
