"""The paged KV cache manager: the request-level API over pools, tree, tiers and eviction.

A client opens a sequence with its prompt tokens. The manager walks the radix tree block by
block (full-block matches, then an optional partial match of the next block), pins what it
reuses, onboards reused blocks that sit in the host tier, and allocates blank blocks for the
rest, in every pool group. The client writes KV into the returned block tables; blocks
enter the tree as soon as they are full and their KV is written (``commit``, or implicitly
on the next ``append_tokens`` and on ``release``). Release unpins; blocks stay reusable
until evicted by prioritized LRU, and a block at or above ``secondary_offload_min_priority``
is copied to the host tier instead of dropped.

Windows: a group with window ``w`` lets a query at position ``p`` see keys ``p - w + 1 .. p``
(flashinfer ``window_left = w - 1``). Blocks that fall out of a sequence's window are
released to the tree as the sequence grows, and a sequence reusing a prefix only needs the
blocks of the window at the end of the match, so window groups may evict interior blocks
while the later blocks of the same prefix stay reusable. Full-attention groups evict only
tree leaves (in the primary tier: blocks with no child in the primary tier), because an
interior block is needed by every prefix below it.

Every public method validates its input and checks capacity before changing anything: a
rejected call leaves the cache exactly as it was.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ValidationError

from kvpool_agent.cache.allocator import TierAllocator
from kvpool_agent.cache.block import HEADS_FROM, PRIMARY, SECONDARY, TIER_NAMES, Block, TreeNode
from kvpool_agent.cache.errors import (
    InvalidRetentionError,
    InvalidTokensError,
    OutOfBlocksError,
    RequestTooLargeError,
    UnknownSequenceError,
)
from kvpool_agent.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockUpdated,
    EventQueue,
    RemovalReason,
)
from kvpool_agent.cache.eviction.queue import EvictionQueue, effective_priority, new_eviction_queue
from kvpool_agent.cache.miniature import PolicyMiniature
from kvpool_agent.cache.mrc import MissRatioCurve
from kvpool_agent.cache.packed import (
    Packed,
    block_key,
    confirmed,
    pack,
    pack_all,
    pack_blocks,
    shared_prefix,
    slice_blocks,
)
from kvpool_agent.cache.retention import DEFAULT_RETENTION, KvCacheRetentionConfig
from kvpool_agent.cache.sizing import (
    PoolPlan,
    build_pools,
    free_device_bytes,
    place,
    plan_pools,
    primary_budget,
)
from kvpool_agent.cache.stats import CacheStats, GhostList
from kvpool_agent.cache.storage import TierStorage, copy_group_blocks
from kvpool_agent.config import (
    DEFAULT_PRIORITY,
    LIVE_FIELDS,
    AgentConfig,
    ConfigError,
    KvCacheConfig,
    ModelGeometry,
    format_validation_error,
)


@dataclass(frozen=True)
class SequenceHandle:
    """What a client needs to write KV and run attention for a sequence."""

    seq_id: int
    num_tokens: int
    num_reused_tokens: int
    """Leading tokens whose KV was found in the cache (the client computes the rest)."""
    block_tables: tuple[tuple[int, ...], ...]
    """Primary-tier block ids of each pool, covering tokens from ``first_token[pool]`` on."""
    first_token: tuple[int, ...]
    """Position of the first token of each pool's table (non-zero once a window slid)."""
    tokens_per_block: int

    @property
    def last_page_len(self) -> int:
        """Tokens in the last block (1..tokens_per_block), flashinfer's ``kv_last_page_len``."""
        return (self.num_tokens - 1) % self.tokens_per_block + 1


class _Sequence:
    __slots__ = (
        "committed_blocks",
        "held",
        "namespace",
        "nodes",
        "num_prompt",
        "observed",
        "packed",
        "retention",
        "reused",
        "seq_id",
        "slide_from",
        "tokens",
    )

    def __init__(
        self,
        seq_id: int,
        namespace: int,
        tokens: list[int],
        retention: KvCacheRetentionConfig,
        num_groups: int,
    ) -> None:
        self.seq_id = seq_id
        self.namespace = namespace
        self.tokens = tokens
        self.num_prompt = len(tokens)
        self.retention = retention
        self.nodes: list[TreeNode] = []
        """Tree nodes of the sequence's leading full blocks (matched or stored)."""
        self.held: list[list[Block | None]] = [[] for _ in range(num_groups)]
        """Per group, the block of each block index (None once released from a window)."""
        self.committed_blocks = 0
        self.reused = 0
        self.observed = 0
        """Leading full blocks the eviction policy has been told about."""
        self.slide_from = 0
        """Tokens before the latest appended chunk: windows are kept relative to it."""
        self.packed: bytes | None = None
        """The prompt's tokens packed (``pack_all``; None if some does not fit): ``_commit``
        slices the prompt's blocks from it instead of packing each."""


class KVCacheManager:
    """Paged KV cache over one or more pool groups, a primary and an optional host tier."""

    def __init__(
        self,
        model: ModelGeometry,
        config: KvCacheConfig,
        *,
        primary_bytes: int | None = None,
        device: str | torch.device = "cpu",
        reserved_bytes: int = 0,
        max_seq_len: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.config = config.model_copy()
        self.device = torch.device(device)
        self.clock = clock
        if primary_bytes is None:
            if self.device.type != "cuda":
                raise ConfigError(
                    "a CPU primary tier needs an explicit byte budget (cpu_budget_bytes)"
                )
            primary_bytes = primary_budget(
                config, free_device_bytes(str(self.device)), reserved_bytes
            )
        self.plan: PoolPlan = plan_pools(
            model, config, primary_bytes=primary_bytes, max_seq_len=max_seq_len
        )
        self.tpb = config.tokens_per_block
        groups = self.plan.groups
        self._num_groups = len(groups)
        self._window = [g.window for g in groups]
        self._full = next((g.index for g in groups if g.full_attention), None)
        on_cuda = self.device.type == "cuda"
        self.storage = (
            TierStorage(self.plan, self.plan.primary, self.device, pin=False),
            TierStorage(self.plan, self.plan.secondary, torch.device("cpu"), pin=on_cuda),
        )
        self._alloc = (
            TierAllocator(self.plan, self.plan.primary),
            TierAllocator(self.plan, self.plan.secondary),
        )
        self._max_blocks = [
            sum(len(a.ids_in_chunk(g, c)) for c in range(a.num_chunks))
            for g in range(self._num_groups)
            for a in (self._alloc[PRIMARY],)
        ]
        self._observers: list[EvictionQueue] = []
        """The queues whose policy watches every request (``SharedPolicy``)."""
        self._queues = self._new_queues(config.eviction_policy)
        self._pinned = [[0] * self._num_groups, [0] * self._num_groups]
        self._roots: dict[int, TreeNode] = {}
        self._sequences: dict[int, _Sequence] = {}
        self._next_seq = 1
        self._tick = 0
        self.num_nodes = 0
        self.stats = CacheStats()
        self.events = EventQueue(config.event_buffer_max_size)
        self.ghost = GhostList(sum(self.plan.primary.group_blocks))
        self.mrc = MissRatioCurve(self._curve_capacity())
        """Reuse distances of the accessed blocks (``cache/mrc.py``): hits and stores."""
        self.miniature: PolicyMiniature | None = None
        """The policy's own curve (``cache/miniature.py``), fed the same accesses; the agent
        drains it between requests. None: off (``policy_curve``)."""
        self.policy_curve(True)
        self.events.push(AllBlocksCleared())

    # ----------------------------------------------------------------- construction

    @classmethod
    def with_capacity(
        cls, model: ModelGeometry, config: KvCacheConfig, num_blocks: int, **kwargs: Any
    ) -> KVCacheManager:
        """A manager whose primary tier holds ``num_blocks`` blocks of every group."""
        _, groups, _ = build_pools(model, config, kwargs.get("max_seq_len"))
        total = sum(g.block_bytes for g in groups)
        if len(groups) == 1:
            return cls(model, config, primary_bytes=num_blocks * total, **kwargs)
        # Several groups lose a little to chunk edges: size up until each has its share.
        budget = num_blocks * total
        while True:
            mgr = cls(model, config, primary_bytes=budget, **kwargs)
            if min(mgr.plan.primary.group_blocks) >= num_blocks:
                return mgr
            budget = budget * 9 // 8

    @classmethod
    def from_agent_config(cls, cfg: AgentConfig, **kwargs: Any) -> KVCacheManager:
        """Size from the agent config: CUDA memory when present, else the CPU budget
        (``sizing.place``)."""
        placement = place(cfg)
        return cls(
            cfg.model,
            cfg.kv_cache_config,
            primary_bytes=placement.primary_bytes,
            device=placement.device,
            reserved_bytes=cfg.reserved_device_bytes,
            max_seq_len=cfg.max_seq_len,
            **kwargs,
        )

    def _new_queues(self, policy: str) -> tuple[list[EvictionQueue], list[EvictionQueue]]:
        """One queue per (tier, group), sized for policies that model the tier: the host
        tier's queue gets the device and host capacity together, since a block leaves the
        pair only when it leaves the host tier."""
        device = self.plan.primary.group_blocks
        host = self.plan.secondary.group_blocks
        queues = (
            [new_eviction_queue(policy, device[g]) for g in range(self._num_groups)],
            [
                new_eviction_queue(policy if host[g] else "lru", device[g] + host[g])
                for g in range(self._num_groups)
            ],
        )
        self._observers = [q for tier in queues for q in tier if q.shared is not None]
        return queues

    # ----------------------------------------------------------------- public API

    def open_sequence(
        self,
        tokens: Sequence[int],
        *,
        cache_salt: str | None = None,
        extra_keys: Sequence[int | str] = (),
        retention: KvCacheRetentionConfig | dict[str, Any] | None = None,
        recompute_last_token: bool = True,
    ) -> SequenceHandle:
        """Open a sequence for ``tokens``: reuse what the cache holds, allocate the rest.

        ``cache_salt`` and ``extra_keys`` (an adapter id, say) put the sequence in its own
        namespace: it only reuses blocks stored under the same salt and keys.
        ``recompute_last_token`` keeps the last prompt token out of the match, so the client
        always has a token to run and get logits from.
        """
        toks, packed = _check_and_pack(tokens)
        if not toks:
            raise InvalidTokensError("tokens: a sequence needs at least one token")
        policy = _check_retention(retention)
        tpb = self.tpb
        n = len(toks)
        nblocks = -(-n // tpb)
        for g in range(self._num_groups):
            if nblocks > self._max_blocks[g]:
                raise RequestTooLargeError(
                    f"tokens: {n} tokens need {nblocks} blocks but the pool holds "
                    f"{self._max_blocks[g]} ({self._max_blocks[g] * tpb} tokens)"
                )
        namespace = _namespace(cache_salt, extra_keys)
        now = self.clock()
        limit = n - 1 if recompute_last_token else n
        path, partial, partial_len = self._match(namespace, toks, limit, packed)
        d = len(path)
        ghost_blocks = self._ghost_hits(namespace, toks, path)
        need_from = [self._need_from(g, d * tpb) for g in range(self._num_groups)]

        # Pin what is reused, so that making room below cannot evict it.
        pinned: list[Block] = []
        for j, node in enumerate(path):
            for g in range(self._num_groups):
                if j >= need_from[g]:
                    block = node.blocks[g]
                    assert block is not None
                    self._pin(block)
                    pinned.append(block)
        partial_blocks: list[Block] = []
        if partial is not None:
            for block in partial.blocks:
                assert block is not None
                self._pin(block)
                partial_blocks.append(block)
        take_over = partial is not None and not self.config.copy_on_partial_reuse
        # Without a host tier no block sits there: skip the per-block tier checks.
        has_host = any(self._alloc[SECONDARY].capacity)
        # Capacity check before anything irreversible.
        needed = []
        for g in range(self._num_groups):
            onboard = (
                sum(1 for b in pinned if b.group == g and b.tier == SECONDARY) if has_host else 0
            )
            fresh = nblocks - d - (1 if take_over else 0)
            if take_over and partial_blocks[g].tier == SECONDARY:
                onboard += 1
            needed.append(onboard + fresh)
        short = self._shortfall(needed)
        if short is not None:
            for block in pinned + partial_blocks:
                self._unpin(block, now)
            raise OutOfBlocksError(short)

        seq = _Sequence(self._next_seq, namespace, toks, policy, self._num_groups)
        seq.packed = packed
        self._next_seq += 1
        seq.nodes = path
        if self._observers and self.config.enable_block_reuse:
            keys = self._block_keys(namespace, toks, path)
            for queue in self._observers:
                queue.observe(keys)
            seq.observed = len(keys)
        from_host = (
            sum(
                1
                for node in path
                if any(b is not None and b.tier == SECONDARY for b in node.blocks)
            )
            if has_host
            else 0
        )
        # One allocation per group for everything this request needs in the primary tier,
        # so that what it evicts is offloaded in one batched copy.
        fresh_ids = [self._allocate(PRIMARY, g, needed[g]) for g in range(self._num_groups)]
        if has_host:
            self._onboard_path(path, need_from, fresh_ids)
        for g in range(self._num_groups):
            seq.held[g] = [None] * need_from[g] + [p.blocks[g] for p in path[need_from[g] :]]
        if partial is not None:
            if take_over:
                self._take_over(partial, seq, fresh_ids)
            else:
                self._copy_partial(partial, seq, fresh_ids)
                for block in partial_blocks:
                    self._unpin(block, now)
        for g in range(self._num_groups):
            missing = nblocks - len(seq.held[g])
            seq.held[g].extend(self._new_private(g, missing, fresh_ids[g]))
            assert not fresh_ids[g]

        seq.reused = d * tpb + partial_len
        seq.committed_blocks = d
        seq.slide_from = seq.reused
        self._touch(path)
        self._sequences[seq.seq_id] = seq
        self._count_query(toks, path, from_host, partial_len, ghost_blocks)
        return self._handle(seq)

    def append_tokens(self, seq_id: int, tokens: Sequence[int]) -> SequenceHandle:
        """Add tokens (decode steps or a further chunk) to an open sequence.

        The KV of every token already in the sequence counts as written: its full blocks
        enter the tree now, and window groups release the blocks that the new tokens can no
        longer see.
        """
        seq = self._get(seq_id)
        toks = _check_tokens(tokens)
        if not toks:
            return self._handle(seq)
        old = len(seq.tokens)
        new_total = old + len(toks)
        nblocks = -(-new_total // self.tpb)
        have = len(seq.held[0])
        extra = nblocks - have
        for g in range(self._num_groups):
            if nblocks - self._need_from(g, old) > self._max_blocks[g]:
                raise RequestTooLargeError(
                    f"tokens: the sequence would need more than the pool's "
                    f"{self._max_blocks[g]} blocks"
                )
        fresh: list[list[int]] = []
        if extra > 0:
            short = self._shortfall([extra] * self._num_groups)
            if short is not None:
                raise OutOfBlocksError(short)
            try:
                for g in range(self._num_groups):
                    fresh.append(self._allocate(PRIMARY, g, extra))
            except OutOfBlocksError:
                for g, ids in enumerate(fresh):
                    for block_id in ids:
                        self._alloc[PRIMARY].release(g, block_id)
                raise
        self._commit(seq)
        seq.tokens.extend(toks)
        self._slide(seq, old)
        for g, ids in enumerate(fresh):
            seq.held[g].extend(self._new_private(g, extra, ids))
        return self._handle(seq)

    def commit(self, seq_id: int) -> None:
        """Declare the KV of every token of the sequence written: full blocks become reusable."""
        self._commit(self._get(seq_id))

    def release(self, seq_id: int, *, discard: bool = False) -> None:
        """Close a sequence. Its written blocks stay reusable; ``discard`` drops the
        blocks not yet committed (an aborted request whose KV was never written)."""
        seq = self._get(seq_id)
        if not discard:
            self._commit(seq)
        now = self.clock()
        self._apply_priorities(seq, now)
        del self._sequences[seq_id]
        self._touch(seq.nodes)
        for g in range(self._num_groups):
            for block in seq.held[g]:
                if block is not None:
                    self._unpin(block, now)
            seq.held[g] = []

    def sequence(self, seq_id: int) -> SequenceHandle:
        """The current handle of an open sequence."""
        return self._handle(self._get(seq_id))

    def apply_live_config(self, new: KvCacheConfig) -> list[str]:
        """Apply the fields of ``new`` that can change at run time; returns those that changed.

        Raises ConfigError, changing nothing, if a restart-only field differs.
        """
        changed = [
            name
            for name in KvCacheConfig.model_fields
            if getattr(new, name) != getattr(self.config, name)
        ]
        restart = [f for f in changed if f"kv_cache_config.{f}" not in LIVE_FIELDS]
        if restart:
            raise ConfigError(
                "these fields need a restart: " + ", ".join(f"kv_cache_config.{f}" for f in restart)
            )
        if "eviction_policy" in changed:
            self._switch_policy(new.eviction_policy)
        if "event_buffer_max_size" in changed:
            self.events.resize(new.event_buffer_max_size)
        self.config = new.model_copy()
        if "eviction_policy" in changed and self.miniature is not None:
            self.policy_curve(True)  # the curve of the new policy, from scratch
        return changed

    def policy_curve(self, on: bool) -> None:
        """Run the policy curve's miniatures (a new one, of the current policy) or none."""
        self.miniature = (
            PolicyMiniature(self.config.eviction_policy, self._curve_capacity()) if on else None
        )

    def clear(self) -> int:
        """Drop every reusable block not used by an open sequence; returns how many nodes went."""
        before = self.num_nodes
        for root in list(self._roots.values()):
            for child in list(root.children.values()):
                self._clear_subtree(child)
        if self.num_nodes == 0:
            self.events.push(AllBlocksCleared())
        return before - self.num_nodes

    # ----------------------------------------------------------------- read side

    @property
    def num_open_sequences(self) -> int:
        return len(self._sequences)

    @property
    def group_capacity(self) -> list[int]:
        """Most primary blocks each pool group can hold (every chunk of the tier)."""
        return list(self._max_blocks)

    def usage(self) -> list[dict[str, int | str]]:
        """Blocks used, free and total of every pool in every tier."""
        out: list[dict[str, int | str]] = []
        for pool in self.plan.pools:
            for tier, alloc in enumerate(self._alloc):
                total = alloc.capacity[pool.group]
                free = alloc.num_free(pool.group)
                out.append(
                    {
                        "pool": pool.index,
                        "tier": TIER_NAMES[tier],
                        "blocks_total": total,
                        "blocks_free": free,
                        "blocks_used": total - free,
                        "blocks_pinned": self._pinned[tier][pool.group],
                    }
                )
        return out

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node of the tree, parents before children."""
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def read_block(self, pool: int, block_id: int, tier: int = PRIMARY) -> torch.Tensor:
        """A copy of one block's KV in a pool: ``[layers, 2, tpb, heads, dim]``."""
        return self.storage[tier].views[pool][:, block_id].clone()

    def pool_view(self, pool: int, tier: int = PRIMARY) -> torch.Tensor:
        """The paged KV tensor of a pool (``[layers, blocks, 2, tpb, heads, dim]``)."""
        return self.storage[tier].views[pool]

    # ----------------------------------------------------------------- matching

    def lookup(
        self,
        tokens: Sequence[int],
        *,
        cache_salt: str | None = None,
        extra_keys: Sequence[int | str] = (),
    ) -> list[str]:
        """The tier (``"primary"`` or ``"secondary"``) of each leading full block of
        ``tokens`` that an ``open_sequence`` would reuse now, without opening anything.

        Full blocks only (no partial match), and only the usable prefix (every block a query
        after it needs is present, see ``_usable_depth``). A block counts as ``secondary``
        when one of the group blocks the prefix needs sits in the host tier (an open would
        copy it back first). No side effects: nothing is pinned, no recency is touched, no
        counter moves and no event is queued.
        """
        toks = _check_tokens(tokens)
        namespace = _namespace(cache_salt, extra_keys)
        path = self._walk(namespace, toks, len(toks))
        d = self._usable_depth(path)
        if d == 0:
            return []
        out = [TIER_NAMES[PRIMARY]] * d
        if not any(self._alloc[SECONDARY].capacity):
            return out  # no host tier: every block is in the primary one
        for g in range(self._num_groups):
            for j in range(self._need_from(g, d * self.tpb), d):
                block = path[j].blocks[g]
                if block is not None and block.tier == SECONDARY:
                    out[j] = TIER_NAMES[SECONDARY]
        return out

    def _walk(
        self, namespace: int, toks: list[int], limit: int, packed: bytes | None = None
    ) -> list[TreeNode]:
        """The tree nodes matching the leading full blocks of ``toks[:limit]`` (read-only)."""
        root = self._roots.get(namespace)
        if not self.config.enable_block_reuse or root is None:
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

    def _match(
        self, namespace: int, toks: list[int], limit: int, packed: bytes | None
    ) -> tuple[list[TreeNode], TreeNode | None, int]:
        """The usable matched path, and a partially matching next node with its token count."""
        path = self._walk(namespace, toks, limit, packed)
        if not path and self._roots.get(namespace) is None:
            return [], None, 0
        if not self.config.enable_block_reuse:
            return [], None, 0
        tpb = self.tpb
        walked = len(path)
        usable = self._usable_depth(path)
        if usable < walked:
            return path[:usable], None, 0
        partial, m = None, 0
        if self.config.enable_partial_reuse and walked * tpb < limit:
            node = path[-1] if path else self._roots[namespace]
            partial, m = self._partial_match(
                node, toks[walked * tpb : min(limit, (walked + 1) * tpb)]
            )
        return path, partial, m

    def _usable_depth(self, path: list[TreeNode]) -> int:
        """Deepest prefix whose needed blocks are all present in some tier."""
        d = len(path)
        if self._full is not None:
            g = self._full
            for j, node in enumerate(path):
                if node.blocks[g] is None:
                    d = j
                    break
        while d > 0:
            ok = True
            for g in range(self._num_groups):
                if g == self._full:
                    continue
                lo = self._need_from(g, d * self.tpb)
                for j in range(d - 1, lo - 1, -1):
                    if path[j].blocks[g] is None:
                        d, ok = j, False
                        break
                if not ok:
                    break
            if ok:
                return d
        return 0

    def _partial_match(self, parent: TreeNode, rest: list[int]) -> tuple[TreeNode | None, int]:
        """The child sharing the longest leading run of ``rest`` (at least one token)."""
        if not parent.may_extend(rest[0]):
            return None, 0  # no child starts with the next token: nothing to scan
        best, best_len = None, 0
        take_over = not self.config.copy_on_partial_reuse
        head = pack(rest[:1])
        for child in parent.children.values():
            m = shared_prefix(child.packed, rest, head)
            if m <= best_len or any(b is None for b in child.blocks):
                continue
            if take_over and (child.children or any(b.ref_count for b in child.blocks if b)):
                continue  # taking a block over is only possible while nobody uses it
            best, best_len = child, m
        return best, best_len

    def _need_from(self, g: int, position: int) -> int:
        """First block index a query at ``position`` needs in group ``g``."""
        return max(0, position - self._window[g] + 1) // self.tpb

    # ----------------------------------------------------------------- capacity

    def _shortfall(self, needed: list[int]) -> str | None:
        """Why ``needed`` primary blocks per group cannot be had now, or None if they can."""
        alloc = self._alloc[PRIMARY]
        spare_chunks = {g: alloc.free_chunks(g) for g in range(self._num_groups)}
        for g, want in enumerate(needed):
            if want <= 0:
                continue
            have = alloc.capacity[g] - self._pinned[PRIMARY][g]  # free or evictable
            if have >= want:
                continue
            for h, chunks in spare_chunks.items():
                if h != g:
                    have += sum(len(alloc.ids_in_chunk(g, c)) for c in chunks)
            if have < want:
                return (
                    f"need {want} blocks in pool group {g} but only {have} are free or evictable; "
                    "the rest are pinned by open sequences"
                )
        return None

    def _new_private(self, g: int, count: int, ids: list[int] | None = None) -> list[Block | None]:
        """``count`` pinned private blocks, from ``ids`` (consumed) or newly allocated."""
        if ids is None:
            ids = self._allocate(PRIMARY, g, count)
        taken, ids[:] = ids[:count], ids[count:]
        out: list[Block | None] = []
        for block_id in taken:
            block = Block(g, PRIMARY, block_id)
            block.ref_count = 1
            out.append(block)
        self._pinned[PRIMARY][g] += len(taken)
        return out

    def _allocate(self, tier: int, g: int, count: int) -> list[int]:
        """``count`` free ids of group ``g`` in ``tier``: free ids, then free chunks of other
        groups, then evictions (offloading what qualifies, in one batched copy)."""
        if count <= 0:
            return []
        alloc = self._alloc[tier]
        ids: list[int] = []
        while len(ids) < count:
            block_id = alloc.allocate(g)
            if block_id is not None:
                ids.append(block_id)
                continue
            if self._steal_chunk(tier, g):
                continue
            victims = self._evict(tier, g, count - len(ids))
            if not victims and not alloc.num_free(g):
                break
            ids.extend(victims)  # still counted as in use: they pass straight to the caller
        if len(ids) < count:
            for block_id in ids:
                alloc.release(g, block_id)
            raise OutOfBlocksError(f"tier {TIER_NAMES[tier]}: no block left for pool group {g}")
        return ids

    def _steal_chunk(self, tier: int, g: int) -> bool:
        """Move a wholly free chunk from the group with the most free chunks to ``g``."""
        alloc = self._alloc[tier]
        best: list[int] = []
        for h in range(self._num_groups):
            if h != g:
                chunks = alloc.free_chunks(h)
                if len(chunks) > len(best):
                    best = chunks
        for chunk in best:
            if alloc.ids_in_chunk(g, chunk):
                alloc.move_free_chunk(chunk, g)
                self.stats.chunk_moves += 1
                return True
        return False

    # ----------------------------------------------------------------- eviction

    def _evict(self, tier: int, g: int, count: int) -> list[int]:
        """Evict up to ``count`` blocks of group ``g`` from ``tier``; returns their ids.

        Victims from the primary tier that qualify are offloaded: host slots are taken one
        by one (dropping host victims needs no copy) and the data moves in one batch.
        """
        queue = self._queues[tier][g]
        now = self.clock()
        freed: list[int] = []
        moves: list[tuple[int, Block]] = []  # (primary id, its new host block)
        threshold = self.config.secondary_offload_min_priority
        has_host = tier == PRIMARY and self._alloc[SECONDARY].capacity[g] > 0
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
                host_id = self._take_host_slot(g)
                if victim.node is None:
                    # Making room in the host tier pruned this node: its id is free again.
                    if host_id is not None:
                        self._alloc[SECONDARY].release(g, host_id)
                    continue
            freed.append(victim.block_id)
            if host_id is not None:
                # Not evictable from the host tier until its data is there (after the batch).
                moved = Block(g, SECONDARY, host_id)
                moves.append((victim.block_id, moved))
                self._move_tier(node, g, moved, now, enqueue=False)
            else:
                self._drop_group_block(node, g, "evicted")
        # A pending move whose node was pruned meanwhile gave its host slot back: skip it.
        moves = [(src, b) for src, b in moves if b.node is not None]
        if moves:
            copy_group_blocks(
                self.plan,
                g,
                self.storage[PRIMARY],
                self.storage[SECONDARY],
                [src for src, _ in moves],
                [b.block_id for _, b in moves],
            )
            self.stats.offloads += len(moves)
            for _, moved in moves:
                if self._evictable(moved) and moved not in self._queues[SECONDARY][g]:
                    self._queues[SECONDARY][g].push(moved, now)
        return freed

    def _take_host_slot(self, g: int) -> int | None:
        alloc = self._alloc[SECONDARY]
        block_id = alloc.allocate(g)
        if block_id is None and self._steal_chunk(SECONDARY, g):
            block_id = alloc.allocate(g)
        if block_id is None:
            victims = self._evict(SECONDARY, g, 1)
            block_id = victims[0] if victims else alloc.allocate(g)
        return block_id

    def _move_tier(
        self, node: TreeNode, g: int, new: Block, now: float, *, enqueue: bool = True
    ) -> None:
        """Point ``node``'s group-``g`` block at ``new`` (another tier), keeping the pins."""
        old = node.blocks[g]
        assert old is not None
        new.node = node
        new.ref_count = old.ref_count
        if old.ref_count:
            self._pinned[old.tier][g] -= 1
            self._pinned[new.tier][g] += 1
        self._queues[old.tier][g].discard(old)
        old.node = None
        node.blocks[g] = new
        if g == self._full and node.parent is not None:
            node.parent.kids_in_tier[old.tier] -= 1
            node.parent.kids_in_tier[new.tier] += 1
            self._recheck(node.parent, now)
        if enqueue and new.ref_count == 0 and self._evictable(new):
            self._queues[new.tier][g].push(new, now)
        if g == self._full or self._full is None:
            self.events.push(BlockUpdated(node.key, TIER_NAMES[new.tier], node.priority))

    def _drop_group_block(self, node: TreeNode, g: int, reason: RemovalReason) -> None:
        """The group's copy of ``node`` is gone (its id was already handed on by the caller)."""
        block = node.blocks[g]
        assert block is not None
        if g == self._full:
            node.blocks[g] = None
            block.node = None
            self._drop_node(node, reason, skip=block)
            return
        node.blocks[g] = None
        block.node = None
        self._queues[block.tier][g].discard(block)
        self._prune(node)

    def _drop_node(self, node: TreeNode, reason: RemovalReason, skip: Block | None = None) -> None:
        """Remove ``node`` and everything below it from the tree, freeing their blocks."""
        for child in list(node.children.values()):
            self._drop_node(child, reason)
        now = self.clock()
        tier_of_full = skip.tier if skip is not None else None
        for g, block in enumerate(node.blocks):
            if block is None:
                continue
            if g == self._full:
                tier_of_full = block.tier
            assert block.ref_count == 0, "a block in use is never dropped"
            self._queues[block.tier][g].discard(block)
            self._alloc[block.tier].release(g, block.block_id)
            block.node = None
            node.blocks[g] = None
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        if parent.heads is not None:
            parent.head_removed(node)
        if tier_of_full is not None and self._full is not None:
            parent.kids_in_tier[tier_of_full] -= 1
            self._recheck(parent, now)
        self.num_nodes -= 1
        if self.events.enabled:
            self.events.push(BlockRemoved(node.key, TIER_NAMES[tier_of_full or 0], reason))
        if reason == "evicted":
            self.ghost.add(node.key)

    def _prune(self, node: TreeNode) -> None:
        """Drop leaves that miss a window block (no prefix can end there) and no one uses."""
        while (
            node.parent is not None
            and not node.children
            and any(b is None for b in node.blocks)
            and not any(b is not None and b.ref_count for b in node.blocks)
        ):
            parent = node.parent
            self._drop_node(node, "pruned")
            node = parent

    def _clear_subtree(self, node: TreeNode) -> None:
        for child in list(node.children.values()):
            self._clear_subtree(child)
        if not node.children and not any(b is not None and b.ref_count for b in node.blocks):
            self._drop_node(node, "cleared")

    def _evictable(self, block: Block) -> bool:
        node = block.node
        if block.ref_count or node is None:
            return False
        if block.group != self._full:
            return True
        if block.tier == PRIMARY:
            return node.kids_in_tier[PRIMARY] == 0
        return node.kids_in_tier[PRIMARY] + node.kids_in_tier[SECONDARY] == 0

    def _recheck(self, node: TreeNode, now: float) -> None:
        """Re-test whether ``node``'s full-attention block is a leaf it may evict."""
        if self._full is None or node.parent is None:
            return
        block = node.blocks[self._full]
        if block is None or block.ref_count:
            return
        queue = self._queues[block.tier][self._full]
        if self._evictable(block):
            if block not in queue:
                queue.push(block, now)
        else:
            queue.discard(block)

    # ----------------------------------------------------------------- pin / unpin

    def _pin(self, block: Block) -> None:
        if block.ref_count == 0:
            self._queues[block.tier][block.group].discard(block)
            self._pinned[block.tier][block.group] += 1
        block.ref_count += 1

    def _unpin(self, block: Block, now: float) -> None:
        block.ref_count -= 1
        if block.ref_count:
            return
        self._pinned[block.tier][block.group] -= 1
        if block.node is None:
            self._alloc[block.tier].release(block.group, block.block_id)
        elif self._evictable(block):
            self._queues[block.tier][block.group].push(block, now)

    # ----------------------------------------------------------------- tiers

    def _onboard_path(
        self, path: list[TreeNode], need_from: list[int], fresh_ids: list[list[int]]
    ) -> None:
        """Copy the pinned host-tier blocks of a matched path back to the primary tier."""
        now = self.clock()
        for g in range(self._num_groups):
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
            copy_group_blocks(
                self.plan, g, self.storage[SECONDARY], self.storage[PRIMARY], src, ids
            )
            for node, block_id, host_id in zip(nodes, ids, src, strict=True):
                self._move_tier(node, g, Block(g, PRIMARY, block_id), now)
                self._alloc[SECONDARY].release(g, host_id)
            self.stats.onboards += len(nodes)

    def _copy_partial(self, partial: TreeNode, seq: _Sequence, fresh_ids: list[list[int]]) -> None:
        """Copy-on-partial-reuse: a new private block starts as a copy of the matched one."""
        for g in range(self._num_groups):
            src = partial.blocks[g]
            assert src is not None
            (block,) = self._new_private(g, 1, fresh_ids[g])
            assert block is not None
            copy_group_blocks(
                self.plan,
                g,
                self.storage[src.tier],
                self.storage[PRIMARY],
                [src.block_id],
                [block.block_id],
            )
            seq.held[g].append(block)

    def _take_over(self, partial: TreeNode, seq: _Sequence, fresh_ids: list[list[int]]) -> None:
        """Partial reuse without copy: the unused leaf leaves the tree and becomes ours."""
        now = self.clock()
        parent = partial.parent
        assert parent is not None
        for g in range(self._num_groups):
            block = partial.blocks[g]
            assert block is not None
            if block.tier == SECONDARY:
                new_id = fresh_ids[g].pop(0)
                copy_group_blocks(
                    self.plan,
                    g,
                    self.storage[SECONDARY],
                    self.storage[PRIMARY],
                    [block.block_id],
                    [new_id],
                )
                self._move_tier(partial, g, Block(g, PRIMARY, new_id), now)
                self._alloc[SECONDARY].release(g, block.block_id)
                self.stats.onboards += 1
                block = partial.blocks[g]
                assert block is not None
            block.node = None
            partial.blocks[g] = None
            seq.held[g].append(block)
        del parent.children[partial.key]
        if parent.heads is not None:
            parent.head_removed(partial)
        if self._full is not None:
            parent.kids_in_tier[PRIMARY] -= 1
            self._recheck(parent, now)
        self.num_nodes -= 1
        self.events.push(BlockRemoved(partial.key, TIER_NAMES[PRIMARY], "replaced"))

    # ----------------------------------------------------------------- tree updates

    def _commit(self, seq: _Sequence) -> None:
        """Store every full, written block of ``seq`` that is not in the tree yet."""
        if not self.config.enable_block_reuse:
            return
        full = len(seq.tokens) // self.tpb
        j = len(seq.nodes)
        if j >= full:
            return
        now = self.clock()
        root = self._roots.get(seq.namespace)
        if root is None:
            root = self._roots[seq.namespace] = TreeNode(seq.namespace, (), None, self._num_groups)
        parent = seq.nodes[-1] if seq.nodes else root
        tpb = self.tpb
        first = len(seq.nodes)
        prompt = seq.packed
        if prompt is not None and full * tpb * 4 <= len(prompt):
            packs = slice_blocks(prompt, first, full, tpb)
        else:
            packs = pack_blocks(seq.tokens[first * tpb : full * tpb], tpb)
        for j in range(first, full):
            tokens = tuple(seq.tokens[j * tpb : (j + 1) * tpb])
            key = hash((parent.key, tokens))  # ``block_key``, inlined (once per block)
            packed = packs[j - first]
            node = parent.children.get(key)
            if node is None:
                node = self._store(parent, key, tokens, packed, seq, j, now)
            elif node.packed == packed:
                self._join_existing(node, seq, j, now)
            else:
                # Another block has this key: this one and those after it stay private to
                # the sequence (freed on release), as if they were never reusable.
                break
            seq.nodes.append(node)
            parent = node
        seq.committed_blocks = len(seq.nodes)
        stored = seq.nodes[first:]
        self.mrc.access_nodes(stored)
        if self.miniature is not None:
            self.miniature.access_nodes(stored)
        if self._observers and full > seq.observed:
            keys = [node.key for node in seq.nodes]
            for queue in self._observers:
                queue.observe(keys, scored=False)
            seq.observed = full

    def _store(
        self,
        parent: TreeNode,
        key: int,
        tokens: tuple[int, ...],
        packed: Packed,
        seq: _Sequence,
        j: int,
        now: float,
    ) -> TreeNode:
        node = TreeNode(key, packed, parent, self._num_groups)
        children = parent.children
        children[key] = node
        if parent.heads is not None or len(children) >= HEADS_FROM:
            parent.head_added(node)
        self.num_nodes += 1
        retention = seq.retention
        if retention is DEFAULT_RETENTION:
            priority, duration = _DEFAULT_BLOCK_PRIORITY
        else:
            priority, duration = retention.block_priority(
                j * self.tpb, (j + 1) * self.tpb, seq.num_prompt
            )
        node.priority = priority
        node.stored_at = now
        node.expires_at = None if duration is None else now + duration / 1000.0
        self._tick += 1
        node.last_used = self._tick
        for g in range(self._num_groups):
            block = seq.held[g][j]
            assert block is not None and block.node is None
            block.node = node
            node.blocks[g] = block
        full = self._full
        if full is not None:
            parent.kids_in_tier[PRIMARY] += 1
            # Mostly the parent is the sequence's previous block, pinned: nothing to recheck.
            above = parent.blocks[full]
            if above is not None and not above.ref_count:
                self._recheck(parent, now)
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

    def _join_existing(self, node: TreeNode, seq: _Sequence, j: int, now: float) -> None:
        """Another sequence stored this block first. Keep one copy in the tree and make sure
        ``seq`` pins it (a sequence always pins its whole path): take the node over with our
        copy where theirs is unused or missing, else share theirs and give ours back."""
        for g in range(self._num_groups):
            mine = seq.held[g][j]
            theirs = node.blocks[g]
            if mine is None or theirs is mine:
                continue
            if theirs is not None and theirs.ref_count:
                self._pin(theirs)
                seq.held[g][j] = theirs
                self._unpin(mine, now)  # private: its id goes back to the free list
                continue
            if theirs is not None:
                self._queues[theirs.tier][g].discard(theirs)
                self._alloc[theirs.tier].release(g, theirs.block_id)
                theirs.node = None
                if g == self._full and node.parent is not None:
                    node.parent.kids_in_tier[theirs.tier] -= 1
            mine.node = node
            node.blocks[g] = mine
            if g == self._full and node.parent is not None:
                node.parent.kids_in_tier[PRIMARY] += 1
                self._recheck(node.parent, now)

    def _apply_priorities(self, seq: _Sequence, now: float) -> None:
        """A released sequence raises the priority of the blocks it stored or reused to what
        its retention policy asks, if that is higher than their current effective priority."""
        policy = seq.retention
        if policy is DEFAULT_RETENTION:
            return
        tpb = self.tpb
        for j, node in enumerate(seq.nodes):
            priority, duration = policy.block_priority(j * tpb, (j + 1) * tpb, seq.num_prompt)
            if priority > effective_priority(node, now):
                node.priority = priority
                node.expires_at = None if duration is None else node.stored_at + duration / 1000.0
                for block in node.blocks:
                    if block is not None:
                        self._queues[block.tier][block.group].requeue(block, now)
                self.events.push(BlockUpdated(node.key, _tier_name(node), priority))

    def _slide(self, seq: _Sequence, old_len: int) -> None:
        """Release the blocks of window groups that no query from ``old_len`` on can see."""
        now = self.clock()
        seq.slide_from = old_len
        for g in range(self._num_groups):
            if g == self._full:
                continue
            held = seq.held[g]
            for j in range(min(self._need_from(g, old_len), len(held))):
                block = held[j]
                if block is not None:
                    held[j] = None
                    self._unpin(block, now)
                    if block.node is not None:
                        self._prune(block.node)

    def _touch(self, nodes: list[TreeNode]) -> None:
        for node in nodes:
            self._tick += 1
            node.last_used = self._tick

    def _switch_policy(self, name: str) -> None:
        now = self.clock()
        old = self._queues
        self._queues = self._new_queues(name)
        for tier in (PRIMARY, SECONDARY):
            for g in range(self._num_groups):
                queued = []
                while (block := old[tier][g].pop(now)) is not None:
                    queued.append(block)
                for block in queued:
                    self._queues[tier][g].push(block, now)

    # ----------------------------------------------------------------- bookkeeping

    def _curve_capacity(self) -> int:
        """Blocks of the reference group (full attention, else the first) over both tiers:
        the capacity the miss-ratio curve is a fraction of."""
        g = self._full if self._full is not None else 0
        return self.plan.primary.group_blocks[g] + self.plan.secondary.group_blocks[g]

    def _block_keys(self, namespace: int, toks: list[int], path: list[TreeNode]) -> list[int]:
        """The node keys of every full block of ``toks``: the matched ones, then the keys the
        rest will be stored under."""
        keys = [node.key for node in path]
        key = keys[-1] if keys else namespace
        tpb = self.tpb
        for j in range(len(path), len(toks) // tpb):
            key = block_key(key, tuple(toks[j * tpb : (j + 1) * tpb]))
            keys.append(key)
        return keys

    def _ghost_hits(self, namespace: int, toks: list[int], path: list[TreeNode]) -> int:
        """Missed blocks right after the match whose keys the ghost list remembers: a bigger
        cache would still have held them (capacity misses, not compulsory ones)."""
        if not len(self.ghost) or not self.config.enable_block_reuse:
            return 0
        tpb = self.tpb
        key = path[-1].key if path else namespace
        j = len(path)
        while (j + 1) * tpb <= len(toks):
            key = block_key(key, tuple(toks[j * tpb : (j + 1) * tpb]))
            if key not in self.ghost:
                break
            j += 1
        return j - len(path)

    def _count_query(
        self,
        toks: list[int],
        path: list[TreeNode],
        from_host: int,
        partial_len: int,
        ghost_blocks: int,
    ) -> None:
        stats = self.stats
        tpb = self.tpb
        stats.sequences_opened += 1
        stats.queries_tokens += len(toks)
        stats.queries_blocks += -(-len(toks) // tpb)
        stats.hits_blocks[SECONDARY] += from_host
        stats.hits_blocks[PRIMARY] += len(path) - from_host
        stats.hits_tokens[SECONDARY] += from_host * tpb
        stats.hits_tokens[PRIMARY] += (len(path) - from_host) * tpb + partial_len
        stats.partial_hit_tokens += partial_len
        stats.capacity_miss_blocks += ghost_blocks
        stats.capacity_miss_tokens += ghost_blocks * tpb
        for node in path:
            node.hits += 1
        if self.config.enable_block_reuse:
            self.mrc.access_nodes(path)
            if self.miniature is not None:
                self.miniature.access_nodes(path)

    def _handle(self, seq: _Sequence) -> SequenceHandle:
        tables = []
        firsts = []
        for pool in self.plan.pools:
            held = seq.held[pool.group]
            first = 0
            while first < len(held) and held[first] is None:
                first += 1
            tables.append(tuple(b.block_id for b in held[first:] if b is not None))
            firsts.append(first * self.tpb)
        return SequenceHandle(
            seq_id=seq.seq_id,
            num_tokens=len(seq.tokens),
            num_reused_tokens=seq.reused,
            block_tables=tuple(tables),
            first_token=tuple(firsts),
            tokens_per_block=self.tpb,
        )

    def _get(self, seq_id: int) -> _Sequence:
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            raise UnknownSequenceError(f"seq_id must be an int, got {seq_id!r}")
        seq = self._sequences.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"sequence {seq_id} is not open (unknown or released)")
        return seq


# --------------------------------------------------------------------- helpers

_DEFAULT_BLOCK_PRIORITY = (DEFAULT_PRIORITY, DEFAULT_RETENTION.decode_duration_ms)
"""What ``DEFAULT_RETENTION.block_priority`` gives every block, prompt or decode."""
assert DEFAULT_RETENTION.decode_retention_priority == DEFAULT_PRIORITY
assert not DEFAULT_RETENTION.token_range_retention_configs


def _tier_name(node: TreeNode) -> str:
    for block in node.blocks:
        if block is not None:
            return TIER_NAMES[block.tier]
    return TIER_NAMES[PRIMARY]


def _check_tokens(tokens: Sequence[int]) -> list[int]:
    return _check_and_pack(tokens)[0]


def _check_and_pack(tokens: Sequence[int]) -> tuple[list[int], bytes | None]:
    """The validated tokens, and them packed (``pack_all``) when every one fits."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (list, tuple, range)):
        raise InvalidTokensError(f"tokens must be a list of ints, got {type(tokens).__name__}")
    toks = list(tokens)
    if toks and set(map(type, toks)) == {int}:
        # the common case, checked at C speed: packing fails for a negative token
        packed = pack_all(toks)
        if packed is not None or min(toks) >= 0:
            return toks, packed
    for t in toks:
        if type(t) is not int:
            raise InvalidTokensError(f"tokens must be ints, got {type(t).__name__} ({t!r})")
        if t < 0:
            raise InvalidTokensError(f"tokens must be non-negative, got {t}")
    return toks, pack_all(toks)


def _check_retention(
    retention: KvCacheRetentionConfig | dict[str, Any] | None,
) -> KvCacheRetentionConfig:
    if retention is None:
        return DEFAULT_RETENTION
    if isinstance(retention, KvCacheRetentionConfig):
        return retention
    try:
        return KvCacheRetentionConfig.model_validate(retention)
    except ValidationError as err:
        raise InvalidRetentionError(format_validation_error(err, "retention policy")) from None


def _namespace(cache_salt: str | None, extra_keys: Sequence[int | str]) -> int:
    """Root key of a tenant's tree: 0 without salt or keys, else a stable 63-bit digest."""
    if cache_salt is None and not extra_keys:
        return 0
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidTokensError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    text = repr((cache_salt, tuple(extra_keys))).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1
