"""The engine's bookkeeping at request level: the seam between the façade and its parts.

``CacheCore`` is everything ``KVCacheManager`` (``manager.py``) does except input
validation, sizing, the clock and storage. It never touches a tensor, and it is what a
compiled twin of the engine implements: the twin is swapped in behind this class, so the
methods and types below are a specification. Everything observable must match this
implementation exactly (results, errors and their messages, sequence ids, counters,
events, nodes, curves, block ids and copies): the differential harness
(``tests/cache/differential.py``) compares two engines built on either, op by op.

Parts (one job each; none imports this module or the façade):

- ``block_pool.BlockPool``: free ids per tier and group, chunk ownership, pin counts;
  never evicts.
- ``tree.RadixTree``: namespaces' roots and nodes, matching, storing, joining, pins, the
  eviction queues, dropping and pruning; events and the ghost list of what it drops.
- ``tiers.Tiers``: allocation that evicts, offload, onboard, partial copy and take-over;
  records storage copies as ``CopyOp``.
- ``groups``: ``FullAttention`` and ``Window`` strategies (window arithmetic, usable depth,
  what may be evicted, what leaves a sequence's window).
- ``sequences.SequenceRecord``: what is kept of an open sequence.

The seam
--------

Construction: ``CacheCore(layout: CoreLayout, settings: CoreSettings)``. The core pushes
``AllBlocksCleared`` on its event queue and starts a policy curve (``policy_curve(True)``).

Arguments are plain data, already validated by the caller:

- ``tokens: list[int]``: non-negative ints (``sequences.check_and_pack``), non-empty for
  ``open`` and ``append``; ``packed: bytes | None``: ``packed.pack_all(tokens)`` (None
  when some token does not fit 32 bits), which confirms matches and gives stored blocks
  their packed tokens without packing each again;
- ``namespace: int``: the root key (``sequences.namespace_of``);
- ``retention: KvCacheRetentionConfig``: validated (``DEFAULT_RETENTION`` when none); the
  core reads ``block_priority`` only;
- ``seq_id: int``: an int (``is_open`` tells whether it is open);
- ``now: float``: the caller's clock, read once per public call; every priority expiry,
  queue push and stored time of the call uses it.

Mutating methods. Each checks what it can before changing anything (a request that
cannot fit raises with the cache as it was); only an allocation can still fail after it
began evicting (``OutOfBlocksError`` with those evictions, and their copies, done):

- ``open(tokens, packed, namespace, retention, recompute_last_token, now) ->
  SequenceView``: match (``recompute_last_token`` keeps the last token out of it), pin,
  check capacity (``OutOfBlocksError``), allocate, onboard, partial reuse, count the
  query. The caller checks the request's size against ``group_capacity`` first
  (``RequestTooLargeError``). Sequence ids are 1, 2, ... in the order of successful opens.
- ``append(seq_id, tokens, now) -> SequenceView``: ``tokens`` non-empty;
  ``RequestTooLargeError``, ``OutOfBlocksError``; commits the written blocks, then slides
  the windows.
- ``commit(seq_id, now) -> None``; ``release(seq_id, discard, now) -> None`` (``discard``:
  drop the blocks not committed yet).
- ``clear(now) -> int``: nodes dropped.
- ``save_counters() -> object`` and ``restore_counters(saved) -> None``: put the client
  query counters (``stats.QUERY_COUNTERS``) back to what they were at ``save_counters``,
  the rest left as they are now (work that is not client traffic); what is saved is the
  core's own.
- ``count_missed(blocks) -> None``: blocks a client asked for that no open matched (a
  lease past what the pool holds), counted as queried and missed.
- ``configure(settings, now) -> None``: new live settings; a new ``eviction_policy``
  rebuilds the queues (and the policy curve, if on), a new ``event_buffer_max_size``
  resizes the event queue.
- ``policy_curve(on: bool) -> None``: a new miniature of the current policy, or none.
- ``mute_curve(muted: bool) -> None``: while muted, an ``open`` is no query of the policy
  curve; ``query_curve(tokens, namespace) -> None`` makes one of every full block of
  ``tokens`` without opening anything (muted or not).

Storage copies: ``take_copies() -> list[CopyOp]`` returns (and forgets) the copies the
core recorded since the last call, oldest first. The caller takes and executes them, in
order, after every mutating call, whether it returned or raised: an eviction may offload
blocks (recorded) before the request fails with ``OutOfBlocksError``. ``CopyOp(group,
src_tier, dst_tier, src_ids, dst_ids)`` copies block ``src_ids[i]`` of every pool of
``group`` in tier ``src_tier`` to ``dst_ids[i]`` in ``dst_tier`` (tiers: 0 primary, 1 host;
ids distinct within an op); ops must run in order, since an id one op reads may be
written by a later one.

Errors: the typed errors of ``cache/errors.py`` named above, and ``UnknownSequenceError``
for a ``seq_id`` that is not open.

Read side: ``sequence(seq_id) -> SequenceView``, ``is_open(seq_id) -> bool``,
``lookup(tokens, namespace) -> list[int]`` (the tier of each leading full block an
``open`` would reuse; no side effect), ``num_nodes``, ``num_open_sequences``,
``group_capacity -> list[int]``, ``usage(tier, group) -> (total, free, pinned, evictable)``,
``iter_nodes()`` (``block.TreeNode`` records, parents first: key, parent, depth, tokens,
priority, expires_at, stored_at, last_used, hits, and per group a ``Block`` or None with
tier, block_id, ref_count), and the objects ``stats`` (``CacheStats``), ``events``
(``EventQueue``), ``ghost`` (``GhostList``), ``mrc`` and ``miniature`` (replaceable: the
core calls ``mrc.access_nodes`` with the nodes a request hit, then with those it stored,
reading only ``key``, and ``miniature.access_chain`` at each open with the keys of the
prompt's full blocks, root first; the compiled core feeds compiled curves of the same
interface inside the engine, ``native_curves.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvpool_agent.cache.block import PRIMARY, SECONDARY, Block, TreeNode
from kvpool_agent.cache.block_pool import BlockPool, TierLayout
from kvpool_agent.cache.errors import OutOfBlocksError, RequestTooLargeError
from kvpool_agent.cache.events import AllBlocksCleared, EventQueue
from kvpool_agent.cache.groups import make_groups
from kvpool_agent.cache.miniature import PolicyMiniature
from kvpool_agent.cache.mrc import MissRatioCurve
from kvpool_agent.cache.native_curves import AnyMissRatioCurve, AnyPolicyMiniature
from kvpool_agent.cache.packed import block_key, pack_blocks, slice_blocks
from kvpool_agent.cache.retention import DEFAULT_RETENTION, KvCacheRetentionConfig
from kvpool_agent.cache.sequences import SequenceRecord, not_open
from kvpool_agent.cache.stats import QUERY_COUNTERS, CacheStats, GhostList
from kvpool_agent.cache.tiers import CopyOp, Tiers
from kvpool_agent.cache.tree import RadixTree
from kvpool_agent.config import DEFAULT_PRIORITY

__all__ = ["CacheCore", "CopyOp", "CoreLayout", "CoreSettings", "SequenceView", "TierLayout"]


@dataclass(frozen=True)
class CoreLayout:
    """The pool groups and tiers the core keeps books for (from ``sizing.PoolPlan``)."""

    tokens_per_block: int
    windows: tuple[int, ...]
    """Attention window of each group, in tokens (a full-attention group's too)."""
    full_attention: tuple[bool, ...]
    """Whether each group is the full-attention one (at most one is)."""
    block_bytes: tuple[int, ...]
    """Bytes of one block of each group: how many of its ids a chunk holds."""
    tiers: tuple[TierLayout, TierLayout]
    """The primary tier, then the host tier (no chunk: no host tier)."""


@dataclass(frozen=True)
class CoreSettings:
    """The ``KvCacheConfig`` fields the core reads; all of them may change at run time."""

    enable_block_reuse: bool
    enable_partial_reuse: bool
    copy_on_partial_reuse: bool
    secondary_offload_min_priority: int
    eviction_policy: str
    event_buffer_max_size: int


@dataclass(frozen=True, slots=True)
class SequenceView:
    """An open sequence as a client sees it, per pool group."""

    seq_id: int
    num_tokens: int
    num_reused_tokens: int
    tables: tuple[tuple[int, ...], ...]
    """Each group's primary block ids, from block ``first_block[group]`` on."""
    first_block: tuple[int, ...]
    """Each group's first block still held (non-zero once a window slid)."""


_DEFAULT_BLOCK_PRIORITY = (DEFAULT_PRIORITY, DEFAULT_RETENTION.decode_duration_ms)
"""What ``DEFAULT_RETENTION.block_priority`` gives every block, prompt or decode."""
assert DEFAULT_RETENTION.decode_retention_priority == DEFAULT_PRIORITY
assert not DEFAULT_RETENTION.token_range_retention_configs


class CacheCore:
    """Sequences, tree, tiers and pool of one engine, at request level."""

    def __init__(self, layout: CoreLayout, settings: CoreSettings) -> None:
        self.layout = layout
        self.settings = settings
        self.tpb = tpb = layout.tokens_per_block
        self.groups = make_groups(layout.windows, layout.full_attention, tpb)
        self.num_groups = len(self.groups)
        self._windowed = not all(layout.full_attention)
        """Whether some group releases blocks that leave a sequence's window."""
        self.stats = CacheStats()
        self.events = EventQueue(settings.event_buffer_max_size)
        self.ghost = GhostList(sum(layout.tiers[PRIMARY].group_blocks))
        self.pool = BlockPool(layout.block_bytes, layout.tiers, self.stats)
        self.tree = RadixTree(
            self.groups,
            self.pool,
            layout.tiers,
            settings.eviction_policy,
            events=self.events,
            ghost=self.ghost,
        )
        self.tiers = Tiers(
            self.pool, self.tree, self.stats, settings.secondary_offload_min_priority
        )
        self.sequences: dict[int, SequenceRecord] = {}
        self._next_seq = 1
        self.mrc: AnyMissRatioCurve = MissRatioCurve(self._curve_capacity())
        """Reuse distances of the accessed blocks (``cache/mrc.py``): hits and stores."""
        self.miniature: AnyPolicyMiniature | None = None
        """The policy's own curve (``cache/miniature.py``), fed each query's chain of block
        keys; the agent drains it between requests. None: off (``policy_curve``)."""
        self._curve_muted = False
        self.policy_curve(True)
        self.events.push(AllBlocksCleared())

    def _curve_capacity(self) -> int:
        """Blocks of the reference group (full attention, else the first) over both tiers:
        the capacity the miss-ratio curve is a fraction of."""
        g = self.tree.full if self.tree.full is not None else 0
        tiers = self.layout.tiers
        return tiers[PRIMARY].group_blocks[g] + tiers[SECONDARY].group_blocks[g]

    # ----------------------------------------------------------------- requests

    def open(
        self,
        tokens: list[int],
        packed: bytes | None,
        namespace: int,
        retention: KvCacheRetentionConfig,
        recompute_last_token: bool,
        now: float,
    ) -> SequenceView:
        """Open a sequence: reuse what the tree holds, allocate the rest."""
        tree, pool, settings = self.tree, self.pool, self.settings
        tpb = self.tpb
        n = len(tokens)
        nblocks = -(-n // tpb)
        limit = n - 1 if recompute_last_token else n
        if settings.enable_block_reuse:
            path, partial, partial_len = tree.match(
                namespace,
                tokens,
                limit,
                packed,
                partial=settings.enable_partial_reuse,
                take_over=not settings.copy_on_partial_reuse,
            )
        else:
            path, partial, partial_len = [], None, 0
        d = len(path)
        ghost_blocks = self._ghost_hits(namespace, tokens, path)
        need_from = [group.need_from(d * tpb) for group in self.groups]

        # Pin what is reused, so that making room below cannot evict it.
        pinned: list[Block] = []
        for j, node in enumerate(path):
            for g in range(self.num_groups):
                if j >= need_from[g]:
                    block = node.blocks[g]
                    assert block is not None
                    tree.pin(block)
                    pinned.append(block)
        partial_blocks: list[Block] = []
        if partial is not None:
            for block in partial.blocks:
                assert block is not None
                tree.pin(block)
                partial_blocks.append(block)
        take_over = partial is not None and not settings.copy_on_partial_reuse
        # Without a host tier no block sits there: skip the per-block tier checks.
        has_host = pool.has_host()
        # Capacity check before anything irreversible.
        needed = []
        for g in range(self.num_groups):
            onboard = (
                sum(1 for b in pinned if b.group == g and b.tier == SECONDARY) if has_host else 0
            )
            fresh = nblocks - d - (1 if take_over else 0)
            if take_over and partial_blocks[g].tier == SECONDARY:
                onboard += 1
            needed.append(onboard + fresh)
        short = pool.shortfall(needed)
        if short is not None:
            for block in pinned + partial_blocks:
                tree.unpin(block, now)
            raise OutOfBlocksError(short)

        seq = SequenceRecord(self._next_seq, namespace, tokens, retention, self.num_groups)
        seq.packed = packed
        self._next_seq += 1
        seq.nodes = path
        mini = None if self._curve_muted else self.miniature
        if settings.enable_block_reuse and (tree.observers or mini is not None):
            keys = self._block_keys(namespace, tokens, path)
            if tree.observers:
                tree.observe(keys)
                seq.observed = len(keys)
            if mini is not None:
                mini.access_chain(keys)
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
        fresh_ids = [
            self.tiers.allocate(PRIMARY, g, needed[g], now) for g in range(self.num_groups)
        ]
        if has_host:
            self.tiers.onboard_path(path, need_from, fresh_ids, now)
        for g in range(self.num_groups):
            seq.held[g] = [None] * need_from[g] + [p.blocks[g] for p in path[need_from[g] :]]
        if partial is not None:
            if take_over:
                self.tiers.take_over(partial, seq.held, fresh_ids, now)
            else:
                self.tiers.copy_partial(partial, seq.held, fresh_ids)
                for block in partial_blocks:
                    tree.unpin(block, now)
        for g in range(self.num_groups):
            missing = nblocks - len(seq.held[g])
            seq.held[g].extend(pool.new_private(g, missing, fresh_ids[g]))
            assert not fresh_ids[g]

        seq.reused = d * tpb + partial_len
        seq.committed_blocks = d
        seq.slide_from = seq.reused
        tree.touch(path)
        self.sequences[seq.seq_id] = seq
        self._count_query(tokens, path, from_host, partial_len, ghost_blocks)
        return self._view(seq)

    def append(self, seq_id: int, tokens: list[int], now: float) -> SequenceView:
        """Add tokens to an open sequence: what it held counts as written (its full blocks
        are committed), and window groups release the blocks the new tokens cannot see."""
        seq = self._get(seq_id)
        old = len(seq.tokens)
        new_total = old + len(tokens)
        nblocks = -(-new_total // self.tpb)
        have = len(seq.held[0])
        extra = nblocks - have
        max_blocks = self.pool.max_blocks
        for group in self.groups:
            g = group.index
            if nblocks - group.need_from(old) > max_blocks[g]:
                raise RequestTooLargeError(
                    f"tokens: the sequence would need more than the pool's {max_blocks[g]} blocks"
                )
        fresh: list[list[int]] = []
        if extra > 0:
            short = self.pool.shortfall([extra] * self.num_groups)
            if short is not None:
                raise OutOfBlocksError(short)
            try:
                for g in range(self.num_groups):
                    fresh.append(self.tiers.allocate(PRIMARY, g, extra, now))
            except OutOfBlocksError:
                for g, ids in enumerate(fresh):
                    for block_id in ids:
                        self.pool.release(PRIMARY, g, block_id)
                raise
        self._commit(seq, now)
        seq.tokens.extend(tokens)
        self._slide(seq, old, now)
        for g, ids in enumerate(fresh):
            seq.held[g].extend(self.pool.new_private(g, extra, ids))
        return self._view(seq)

    def commit(self, seq_id: int, now: float) -> None:
        """The KV of every token of the sequence is written: full blocks become reusable."""
        self._commit(self._get(seq_id), now)

    def release(self, seq_id: int, discard: bool, now: float) -> None:
        """Close a sequence; ``discard`` drops the blocks not yet committed."""
        seq = self._get(seq_id)
        if not discard:
            self._commit(seq, now)
        if seq.retention is not DEFAULT_RETENTION:
            self.tree.raise_priorities(seq.nodes, seq.retention, seq.num_prompt, now)
        del self.sequences[seq_id]
        self.tree.touch(seq.nodes)
        unpin = self.tree.unpin
        for g in range(self.num_groups):
            for block in seq.held[g]:
                if block is not None:
                    unpin(block, now)
            seq.held[g] = []

    def count_missed(self, blocks: int) -> None:
        """Blocks a client asked for that no open matched (a lease past what the pool
        holds): counted as queried and missed."""
        self.stats.queries_tokens += blocks * self.tpb
        self.stats.queries_blocks += blocks

    def save_counters(self) -> dict[str, Any]:
        """The client query counters as they are (``KVCacheManager.uncounted``)."""
        stats = self.stats
        return {name: copy.copy(getattr(stats, name)) for name in QUERY_COUNTERS}

    def restore_counters(self, saved: dict[str, Any]) -> None:
        """Put the query counters back to ``saved`` (``save_counters``)."""
        for name, value in saved.items():
            setattr(self.stats, name, copy.copy(value))

    def clear(self, now: float) -> int:
        """Drop every reusable block not used by an open sequence; returns how many nodes went."""
        before = self.tree.num_nodes
        self.tree.clear(now)
        if self.tree.num_nodes == 0:
            self.events.push(AllBlocksCleared())
        return before - self.tree.num_nodes

    def configure(self, settings: CoreSettings, now: float) -> None:
        """Apply new live settings."""
        old = self.settings
        new_policy = settings.eviction_policy != old.eviction_policy
        if new_policy:
            self.tree.switch_policy(settings.eviction_policy, now)
        if settings.event_buffer_max_size != old.event_buffer_max_size:
            self.events.resize(settings.event_buffer_max_size)
        self.settings = settings
        self.tiers.offload_min_priority = settings.secondary_offload_min_priority
        if new_policy and self.miniature is not None:
            self.policy_curve(True)  # the curve of the new policy, from scratch

    def policy_curve(self, on: bool) -> None:
        """Run the policy curve's miniatures (a new one, of the current policy) or none."""
        self.miniature = (
            PolicyMiniature(self.settings.eviction_policy, self._curve_capacity()) if on else None
        )

    def mute_curve(self, muted: bool) -> None:
        self._curve_muted = muted

    def query_curve(self, tokens: list[int], namespace: int) -> None:
        if self.miniature is not None and self.settings.enable_block_reuse:
            self.miniature.access_chain(self._block_keys(namespace, tokens, []))

    def take_copies(self) -> list[CopyOp]:
        """The storage copies recorded since the last call, oldest first (see the module)."""
        copies = self.tiers.copies
        if not copies:
            return []
        self.tiers.copies = []
        return copies

    # ----------------------------------------------------------------- read side

    def is_open(self, seq_id: int) -> bool:
        return seq_id in self.sequences

    def sequence(self, seq_id: int) -> SequenceView:
        return self._view(self._get(seq_id))

    def lookup(self, tokens: list[int], namespace: int) -> list[int]:
        """The tier of each leading full block of ``tokens`` an ``open`` would reuse now:
        the usable prefix, full blocks only; a block is in the host tier when one of the
        group blocks the prefix needs sits there. No side effect."""
        path = []
        if self.settings.enable_block_reuse:
            path = self.tree.walk(namespace, tokens, len(tokens))
        d = self.tree.usable_depth(path)
        if d == 0:
            return []
        out = [PRIMARY] * d
        if not self.pool.has_host():
            return out  # no host tier: every block is in the primary one
        for group in self.groups:
            g = group.index
            for j in range(group.need_from(d * self.tpb), d):
                block = path[j].blocks[g]
                if block is not None and block.tier == SECONDARY:
                    out[j] = SECONDARY
        return out

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes

    @property
    def num_open_sequences(self) -> int:
        return len(self.sequences)

    @property
    def group_capacity(self) -> list[int]:
        """Most primary blocks each pool group can hold (every chunk of the tier)."""
        return list(self.pool.max_blocks)

    def usage(self, tier: int, group: int) -> tuple[int, int, int, int]:
        """Blocks total, free, pinned and evictable (queued for eviction now) of ``group``
        in ``tier``."""
        total, free, pinned = self.pool.usage(tier, group)
        return total, free, pinned, len(self.tree.queues[tier][group])

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node of the tree, parents before children."""
        return self.tree.iter_nodes()

    # ----------------------------------------------------------------- sequences

    def _get(self, seq_id: int) -> SequenceRecord:
        seq = self.sequences.get(seq_id)
        if seq is None:
            raise not_open(seq_id)
        return seq

    def _view(self, seq: SequenceRecord) -> SequenceView:
        tables = []
        firsts = []
        for held in seq.held:
            first = 0
            while first < len(held) and held[first] is None:
                first += 1
            tables.append(tuple(b.block_id for b in held[first:] if b is not None))
            firsts.append(first)
        return SequenceView(seq.seq_id, len(seq.tokens), seq.reused, tuple(tables), tuple(firsts))

    def _commit(self, seq: SequenceRecord, now: float) -> None:
        """Store every full, written block of ``seq`` that is not in the tree yet."""
        if not self.settings.enable_block_reuse:
            return
        tpb = self.tpb
        full = len(seq.tokens) // tpb
        first = len(seq.nodes)
        if first >= full:
            return
        tree = self.tree
        root = tree.root(seq.namespace)
        parent = seq.nodes[-1] if seq.nodes else root
        if (
            seq.nodes
            and parent.parent is not None
            and parent.parent.children.get(parent.key) is not parent
        ):
            # The sequence's last stored block left the tree (with window groups only, its
            # window blocks were released and then evicted): nothing to hang the rest under,
            # so it stays private to the sequence, as after a key collision.
            stop = first
        else:
            stop = full
        slid = seq.slide_from > 0 and self._windowed
        prompt = seq.packed
        if prompt is not None and full * tpb * 4 <= len(prompt):
            packs = slice_blocks(prompt, first, full, tpb)
        else:
            packs = pack_blocks(seq.tokens[first * tpb : full * tpb], tpb)
        retention = seq.retention
        for j in range(first, stop):
            if slid and any(held[j] is None for held in seq.held):
                # A window released this block before it was stored (block reuse was off
                # then): its KV is gone there, so it and the rest stay private.
                break
            tokens = tuple(seq.tokens[j * tpb : (j + 1) * tpb])
            key = hash((parent.key, tokens))  # ``block_key``, inlined (once per block)
            packed = packs[j - first]
            node = parent.children.get(key)
            if node is None:
                if retention is DEFAULT_RETENTION:
                    priority, duration = _DEFAULT_BLOCK_PRIORITY
                else:
                    priority, duration = retention.block_priority(
                        j * tpb, (j + 1) * tpb, seq.num_prompt
                    )
                expires_at = None if duration is None else now + duration / 1000.0
                node = tree.store(
                    parent, key, tokens, packed, seq.held, j, priority, expires_at, now
                )
            elif node.packed == packed:
                tree.join(node, seq.held, j, now)
            else:
                # Another block has this key: this one and those after it stay private to
                # the sequence (freed on release), as if they were never reusable.
                break
            seq.nodes.append(node)
            parent = node
        seq.committed_blocks = len(seq.nodes)
        stored = seq.nodes[first:]
        self.mrc.access_nodes(stored)
        if tree.observers and full > seq.observed:
            tree.observe([node.key for node in seq.nodes], scored=False)
            seq.observed = full

    def _slide(self, seq: SequenceRecord, old_len: int, now: float) -> None:
        """Release the window blocks that no query from ``old_len`` on can see."""
        seq.slide_from = old_len
        tree = self.tree
        for group in self.groups:
            held = seq.held[group.index]
            for j in range(min(group.out_of_window(old_len), len(held))):
                block = held[j]
                if block is not None:
                    held[j] = None
                    tree.unpin(block, now)
                    if block.node is not None:
                        tree.prune(block.node, now)

    # ----------------------------------------------------------------- accounting

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
        if not len(self.ghost) or not self.settings.enable_block_reuse:
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
        if self.settings.enable_block_reuse:
            self.mrc.access_nodes(path)
