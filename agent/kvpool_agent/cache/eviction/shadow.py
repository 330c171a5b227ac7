"""A metadata-only prefix cache: what a cache of the same capacity would hold under another
eviction policy, fed the same requests.

The mixture policies (``mixture.py``, ``guarded.py``, ``vote.py``) run a few of these beside
the real cache and follow, or weigh, whichever has been hitting most. A shadow keeps only
keys: no KV, no blocks, no priorities, no tiers. Like the real tree it is prefix-closed and
evicts only leaves, so its hit count for a request is the length of the request's cached
prefix, the figure the real cache would have had under that policy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvpool_agent.cache.eviction.base import LevelQueue

SHADOW_LEVEL = 0
"""The one priority level of a shadow's nodes. A shadow has no priorities, and the level
queues it runs only ask whether a node is queued (``queue_level >= 0``)."""


class ShadowNode:
    """One cached key. It is its own queue record (``Evictable``) and its own tree node
    (``ChainNode``), so the engine's level queues order shadow nodes unchanged."""

    __slots__ = (
        "block_id",
        "children",
        "hits",
        "key",
        "last_used",
        "parent",
        "pinned",
        "queue_level",
        "queue_stamp",
    )

    priority = SHADOW_LEVEL
    expires_at: float | None = None

    def __init__(self, key: int, parent: ShadowNode | None) -> None:
        self.key = key
        self.block_id = key
        self.parent = parent
        self.children: dict[int, ShadowNode] = {}
        self.last_used = 0
        self.hits = 0
        self.pinned = False
        self.queue_level = -1
        self.queue_stamp = 0

    @property
    def node(self) -> ShadowNode:
        return self


class AccessObserver(Protocol):
    """A level queue that must see every access, not only the leaves it is given."""

    def on_access(self, node: ShadowNode) -> None: ...


KeyChanged = Callable[[int], None]


class ShadowCache:
    """``capacity`` keys under the policy ``queue``; ``step`` replays one request.

    ``on_change`` is called with every key that enters or leaves the cache.
    """

    __slots__ = ("_observer", "_queue", "_root", "_tick", "cache", "capacity", "on_change")

    def __init__(self, capacity: int, queue: LevelQueue) -> None:
        if capacity < 1:
            raise ValueError(f"a shadow cache needs at least one block, got {capacity}")
        self.capacity = capacity
        self._queue = queue
        observe = getattr(queue, "on_access", None)
        self._observer: Callable[[ShadowNode], None] | None = observe
        self._root = ShadowNode(0, None)
        self._tick = 0
        self.cache: dict[int, ShadowNode] = {}
        """Cached key -> node (keys are path hashes, so one key names one prefix)."""
        self.on_change: KeyChanged | None = None

    def __len__(self) -> int:
        return len(self.cache)

    def __contains__(self, key: int) -> bool:
        return key in self.cache

    def step(self, keys: Sequence[int]) -> int:
        """Serve a request for the blocks ``keys`` (a path from the root); returns how many
        leading blocks were cached. Blocks that do not fit even after evicting every
        unpinned leaf are not cached."""
        cache = self.cache
        queue = self._queue
        path: list[ShadowNode] = []
        for key in keys:
            node = cache.get(key)
            if node is None:
                break
            path.append(node)
        hits = len(path)
        for node in path:
            node.pinned = True
        if path and path[-1].queue_level >= 0:
            self._unqueue(path[-1])
        need = len(keys) - hits
        changed = self.on_change
        while len(cache) + need > self.capacity:
            victim = queue.pop()
            if victim is None:
                need = self.capacity - len(cache)
                break
            assert isinstance(victim, ShadowNode)
            victim.queue_level = -1
            victim.queue_stamp += 1
            del cache[victim.key]
            parent = victim.parent
            assert parent is not None
            del parent.children[victim.key]
            if parent is not self._root and not parent.children and not parent.pinned:
                self._enqueue(parent)
            if changed is not None:
                changed(victim.key)
        observer = self._observer
        tick = self._tick
        for node in path:
            tick += 1
            node.last_used = tick
            node.hits += 1
            if observer is not None:
                observer(node)
        parent = path[-1] if path else self._root
        for key in keys[hits : hits + need]:
            node = ShadowNode(key, parent)
            tick += 1
            node.last_used = tick
            if observer is not None:
                observer(node)
            parent.children[key] = node
            cache[key] = node
            parent = node
            if changed is not None:
                changed(key)
        self._tick = tick
        for node in path:
            node.pinned = False
        if parent is not self._root and not parent.children:
            self._enqueue(parent)
        return hits

    def _enqueue(self, node: ShadowNode) -> None:
        node.queue_stamp += 1
        node.queue_level = SHADOW_LEVEL
        self._queue.push(node)

    def _unqueue(self, node: ShadowNode) -> None:
        self._queue.discard(node)
        node.queue_level = -1
        node.queue_stamp += 1
