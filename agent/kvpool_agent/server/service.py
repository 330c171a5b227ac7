"""The agent service: the one owner of the engine, between the web layer and the cache.

The engine is single-threaded, so every engine call goes through ``EngineGate``: one asyncio
lock, held for the call (run inline when short, in a worker thread when heavy, such as
attention), after which the KV events it produced are published as one numbered batch.
Validation happens before the engine is touched, and the engine itself rejects a bad call
before changing anything, so a rejected request leaves the cache as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvpool_agent.cache import (
    CacheError,
    InvalidRetentionError,
    InvalidTokensError,
    KVCacheManager,
    KvCacheRetentionConfig,
    OutOfBlocksError,
    RequestTooLargeError,
    SequenceHandle,
    UnknownSequenceError,
)
from kvpool_agent.cache.miniature import PolicyCurveSnapshot
from kvpool_agent.cache.mrc import BOUNDS, CurveSnapshot
from kvpool_agent.cache.native_curves import NativePolicyMiniature
from kvpool_agent.cache.packed import PackedTokens, unpack
from kvpool_agent.cache.sequences import namespace_of as _namespace
from kvpool_agent.config import (
    DEFAULT_PRIORITY,
    AgentConfig,
    ConfigError,
    changed_fields,
    restart_fields,
)
from kvpool_agent.credentials import Credentials, Principal
from kvpool_agent.dataplane.first_blocks import FirstBlockIndex, FirstBlockTable, buckets_for
from kvpool_agent.dataplane.keys import (
    KEYS_SALT_PREFIX,
    KeyFormatError,
    KeyNamespace,
    check_keys,
    packed_chain_tokens,
)
from kvpool_agent.dataplane.protocol import lease_range_error
from kvpool_agent.server.attention import AttentionBatch, run_attention
from kvpool_agent.server.events import EventPublisher, make_encoder
from kvpool_agent.server.snapshot import ImportResult, Namespace, export_snapshot, import_snapshot
from kvpool_kernels import PagedAttention

log = logging.getLogger("kvpool.agent")

T = TypeVar("T")

RANDOM_IDS = 64
"""Ids a read of the OS's random bytes makes (``AgentService._new_id``)."""

ENGINE_STATUS: dict[type[CacheError], int] = {
    UnknownSequenceError: 404,
    RequestTooLargeError: 413,
    OutOfBlocksError: 503,
    InvalidTokensError: 422,
    InvalidRetentionError: 422,
}
"""The status of each engine refusal (HTTP, and the transfer protocol's error replies)."""


def engine_status(err: CacheError) -> int:
    return next((s for t, s in ENGINE_STATUS.items() if isinstance(err, t)), 400)


class RequestError(Exception):
    """A request the agent refuses, with the HTTP status and the reason."""

    def __init__(self, status: int, reason: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.headers = headers


@dataclass
class ReloadCounters:
    applied: int = 0
    restart_required: int = 0
    invalid: int = 0
    unchanged: int = 0
    errors: int = 0
    """Checks that failed with an unexpected exception (the watcher keeps polling)."""
    pending_restart: list[str] = field(default_factory=list)


@dataclass
class OpenSequence:
    """A sequence a tenant opened: its public id, its owner and the engine's handle."""

    public_id: int
    tenant: str | None
    handle: SequenceHandle
    last_used: float
    held: tuple[int, ...]
    """Blocks the sequence pins in each pool group (for the per-tenant cap)."""


@dataclass
class Lease:
    """Leading resident blocks of a chain of engine keys, pinned for a while for reads."""

    public_id: int
    tenant: str | None
    handle: SequenceHandle
    """The engine sequence of the leased prefix (opened with nothing to allocate)."""
    blocks: int
    tiers: list[str]
    """Where each leased block was found (``primary``/``secondary``) when the lease began."""
    expires_at: float
    """``time.monotonic()`` after which the lease is gone."""
    ttl_s: float
    held: tuple[int, ...]
    readers: int = 0
    """Reads (GETs) streaming out of the blocks now; the engine release waits for them."""
    closing: bool = False

    @property
    def first_blocks(self) -> list[int]:
        """Per pool, the first leased block readable there (a sliding-window pool holds
        only the blocks its window at the end of the prefix needs)."""
        tpb = self.handle.tokens_per_block
        return [t // tpb for t in self.handle.first_token]


@dataclass
class Store:
    """A chain of engine keys being stored: its new blocks are private until it commits."""

    store_id: int
    tenant: str | None
    handle: SequenceHandle
    resident: int
    """Leading blocks the cache held already (not written by this store)."""
    total: int
    held: tuple[int, ...]
    block_ids: dict[int, list[int]]
    """Per pool, the primary ids of the blocks the store writes (chain blocks resident..)."""
    names: tuple[PackedTokens, list[bytes]] = field(default_factory=lambda: (PackedTokens(b""), []))
    """Synthetic tokens and engine keys of the blocks it writes (block ``i`` is the ``i``-th
    ``tokens_per_block`` run): its KV events name each block by the engine's hash."""
    first: tuple[str, str | None, PackedTokens] | None = None
    """The chain's namespace salt (``KeyNamespace.salt()``), the tenant's salt of it and its
    first block's synthetic tokens, to list it in a first-block table (``_list_first``)."""
    expires_at: float | None = None
    """A same-node reservation (PUT_SHM): ``time.monotonic()`` after which it is aborted
    like an expired lease, its blocks freed. None: the connection receiving its bytes owns
    it (a TCP PUT), and finishes or aborts it itself."""


@dataclass
class StoreStart:
    """What ``begin_store`` decided: a store to fill, or why there is nothing to write."""

    store: Store | None
    resident: int
    """Leading blocks of the chain the cache holds (usable) now."""
    total: int
    gap: bool = False
    """The client skipped blocks the cache does not hold: nothing can be stored."""


@dataclass
class TransferCounters:
    """Transfer port activity (metrics)."""

    connections: int = 0
    accepted: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    reservations_expired: int = 0
    """Same-node reservations (PUT_SHM) aborted because they were not committed in time."""


def keyed_salt(tenant: str | None, salt: str | None) -> str | None:
    """The engine-key namespace's own salt (``KeyNamespace.salt()``) that ``salt`` is
    ``tenant``'s salt of; None when it is another tenant's, or not an engine-key namespace."""
    if salt is None:
        return None
    if tenant is not None:
        prefix = f"{TENANT_SALT_PREFIX}{tenant}{SALT_SEP}"
        if not salt.startswith(prefix):
            return None
        salt = salt[len(prefix) :]
    elif salt.startswith(TENANT_SALT_PREFIX):
        return None
    return salt if salt.startswith(KEYS_SALT_PREFIX) else None


def tenant_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The engine's cache salt for a tenant's request: the tenant decides the namespace,
    the client's salt only subdivides it. Tenant names are DNS labels (no separator inside),
    so two tenants never share a namespace whatever salts their clients send."""
    if tenant is None:
        return cache_salt
    suffix = "" if cache_salt is None else f"{SALT_SEP}{cache_salt}"
    return f"{TENANT_SALT_PREFIX}{tenant}{suffix}"


SALT_SEP = "\x1f"
"""Separates the parts of an engine salt (ASCII unit separator: no tenant name holds it)."""
TENANT_SALT_PREFIX = f"{SALT_SEP}tenant{SALT_SEP}"
"""How ``tenant_salt`` marks a tenant's namespace."""


class AgentService:
    """Engine, config, credentials, event publisher and lifecycle state of one agent."""

    def __init__(self, config: AgentConfig, engine: KVCacheManager | None = None) -> None:
        self.config = config
        self.limits = config.limits
        self.credentials = Credentials(config.auth)
        self.engine = engine if engine is not None else KVCacheManager.from_agent_config(config)
        log.info("cache engine core: %s", self.engine.core_name)
        self.lock = asyncio.Lock()
        primary_medium = "GPU" if self.engine.device.type == "cuda" else "CPU"
        ev = config.events
        host = config.server.host
        self.publisher = EventPublisher(
            make_encoder(self.engine.tpb, primary_medium, native=self.engine.core_name == "native"),
            endpoint=_at_host(ev.endpoint, host),
            replay_endpoint=_at_host(ev.replay_endpoint, host),
            topic=ev.topic,
            model=config.model.name,
            replay_buffer=ev.replay_buffer,
            max_replay_batches=config.limits.max_replay_batches,
        )
        self.sequences: dict[int, OpenSequence] = {}
        self.namespaces: dict[int, Namespace] = {}
        self.reloads = ReloadCounters()
        self.refusals: Counter[str] = Counter()
        """Requests refused by a limit or by authentication, by reason (a metric)."""
        self.expired_sequences = 0
        self.leases: dict[int, Lease] = {}
        self.stores: dict[int, Store] = {}
        self._random_ids: list[int] = []
        """Random ids drawn ahead for ``_new_id``."""
        self.first_blocks: FirstBlockIndex | None = None
        """Tables of the chains whose first blocks the cache holds, per tenant that asked
        (``open_first_blocks``; ``dataplane/first_blocks.py``)."""
        self.expired_leases = 0
        self._lease_added = asyncio.Event()
        """Wakes the housekeeping task to schedule a new lease's expiry (``_deadline_added``)."""
        self._wake_at = -math.inf
        """When the sleeping housekeeper wakes anyway (-inf while it is awake: it reads every
        deadline before it sleeps again)."""
        self.transfer = TransferCounters()
        self.draining = False
        self.serving = False
        self.started_at = time.monotonic()
        self.busy_since: float | None = None
        """When the engine call now running took the engine (None: idle)."""
        self.handoff_result: str | None = None
        self.attention_kernel = PagedAttention()
        self._held_by: dict[str | None, list[int]] = {}
        self._open_by: Counter[str | None] = Counter()
        """Open sequences, leases and in-flight stores per tenant (one cap for all three)."""
        self._housekeeping: asyncio.Task[None] | None = None
        if config.limits.policy_curve_cpu_share == 0:
            self.engine.policy_curve(False)
        self._curve_at = time.monotonic()
        self._curve_credit = 0.0
        """Seconds the policy curve's replay may still take (``simulate_policy_curve``)."""
        groups = self.engine.plan.groups
        self._group_of_pool = [p.group for p in self.engine.plan.pools]
        self._window_blocks = [
            None if g.full_attention else -(-g.window // self.engine.tpb) + 1 for g in groups
        ]

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind the event sockets, publish the start-up events (AllBlocksCleared first) and
        start the housekeeping task (idle sequence expiry, credential reload)."""
        self.publisher.bind()
        self.flush_events()
        self.serving = True
        self._housekeeping = asyncio.get_running_loop().create_task(self._housekeep())

    async def stop(self) -> None:
        self.serving = False
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeping
            self._housekeeping = None
        await self.publisher.close()
        if self.first_blocks is not None:
            self.first_blocks.close()
            self.first_blocks = None

    @property
    def ready(self) -> bool:
        return self.serving and self.publisher.bound and not self.draining and self.stalled_for < 0

    @property
    def stalled_for(self) -> float:
        """Seconds the engine call now running is past ``limits.engine_stall_s`` (< 0: fine)."""
        since = self.busy_since
        if since is None:
            return -1.0
        return time.monotonic() - since - self.limits.engine_stall_s

    async def _housekeep(self) -> None:
        interval = min(1.0, self.limits.sequence_idle_timeout_s / 4)
        while True:
            delay = interval
            deadlines = [lease.expires_at for lease in self.leases.values()]
            deadlines += [s.expires_at for s in self.stores.values() if s.expires_at is not None]
            if deadlines:  # wake at the earliest lease (or reservation) deadline
                delay = max(0.01, min(interval, min(deadlines) - time.monotonic()))
            # Not ``wait_for``: on Python 3.11 a cancel that lands as the event is set can
            # leave it waiting on the finished wait forever, and ``stop`` with it.
            waiter = asyncio.ensure_future(self._lease_added.wait())
            self._wake_at = time.monotonic() + delay
            try:
                await asyncio.wait((waiter,), timeout=delay)
            finally:
                waiter.cancel()
                self._wake_at = -math.inf
            self._lease_added.clear()
            try:
                self.credentials.refresh()
                await self.expire_idle()
                await self.expire_leases()
                await self.simulate_policy_curve()
            except Exception:  # housekeeping must outlive any one failure
                log.exception("housekeeping failed; retrying")

    def _deadline_added(self, at: float) -> None:
        """A lease or reservation that expires at ``at``: wake the housekeeper only if it
        sleeps past that. Most deadlines (``transfer.lease_ttl_s``) lie beyond its next
        regular wake, and a wake per same-node PUT cost the agent a housekeeping pass each."""
        if at < self._wake_at:
            self._lease_added.set()

    async def expire_idle(self, now: float | None = None) -> int:
        """Release (discarding unwritten KV) every sequence idle past the timeout."""
        limit = self.limits.sequence_idle_timeout_s

        def run() -> int:
            t = time.monotonic() if now is None else now
            stale = [s for s in self.sequences.values() if t - s.last_used > limit]
            for seq in stale:
                self._release(seq, discard=True)
            return len(stale)

        if not self.sequences:
            return 0
        expired = await self.call(run)
        if expired:
            self.expired_sequences += expired
            log.warning("released %d sequences idle for more than %.0fs", expired, limit)
        return expired

    async def simulate_policy_curve(self, now: float | None = None) -> int:
        """Replay the policy curve's sampled keys (``cache/miniature.py``) in short slices
        under the engine lock, while the time they took stays within
        ``limits.policy_curve_cpu_share`` of the time since the last call (credit for at most
        one second is kept, so an idle spell buys no burst). Returns the keys replayed."""
        mini = self.engine.miniature
        share = self.limits.policy_curve_cpu_share
        if mini is None or share == 0:  # off (limits are restart-only)
            return 0
        t = time.monotonic() if now is None else now
        self._curve_credit = min(self._curve_credit + share * (t - self._curve_at), share)
        self._curve_at = t
        replayed = 0
        step = NATIVE_CURVE_SLICE if isinstance(mini, NativePolicyMiniature) else CURVE_SLICE
        while mini.pending and self._curve_credit > 0:
            start = time.perf_counter()
            replayed += await self.call(lambda: mini.drain(step))
            self._curve_credit -= time.perf_counter() - start
            await asyncio.sleep(0)  # let a waiting request take the engine between slices
        return replayed

    # ------------------------------------------------------------------ engine calls

    async def call(self, fn: Callable[[], T], *, heavy: bool = False) -> T:
        """Run ``fn`` against the engine alone, then publish the events it produced.

        Everything a request looks up (its sequence, its block ids) is looked up inside
        ``fn``, under the same hold of the lock as the engine work: a request racing a
        release finds the sequence gone, never someone else's blocks.
        """
        async with self.lock:
            self.busy_since = time.monotonic()
            try:
                return await asyncio.to_thread(fn) if heavy else fn()
            finally:
                self.busy_since = None
                self.flush_events()

    def flush_events(self) -> None:
        self.publisher.flush(self.engine.events)
        if self.first_blocks is not None:
            self.first_blocks.forget(self.publisher.encoder.take_gone())

    def default_retention(self) -> KvCacheRetentionConfig | None:
        """The config's default policy as a request policy (None when it is the engine's)."""
        r = self.config.retention
        if r.priority == DEFAULT_PRIORITY and r.duration_ms is None:
            return None
        return KvCacheRetentionConfig.model_validate(
            {
                "token_range_retention_configs": [
                    {"token_start": 0, "priority": r.priority, "duration_ms": r.duration_ms}
                ],
                "decode_retention_priority": r.priority,
                "decode_duration_ms": r.duration_ms,
            }
        )

    # ------------------------------------------------------------------ tenancy

    def tenant_of(self, principal: Principal) -> str | None:
        """The tenant a data request acts for; the peer credential is not a tenant."""
        if self.credentials.enabled and principal.tenant is None:
            raise RequestError(
                403, "authorization: the peer credential cannot use sequences; use a tenant's"
            )
        return principal.tenant

    def _owned(self, principal: Principal, seq_id: int) -> OpenSequence:
        """The caller's open sequence ``seq_id``; another tenant's is as unknown as a closed one."""
        seq = self.sequences.get(seq_id)
        if seq is None or seq.tenant != self.tenant_of(principal):
            raise RequestError(404, f"sequence {seq_id} is not open (unknown or released)")
        seq.last_used = time.monotonic()
        return seq

    def _new_id(self) -> int:
        """A random 62-bit id, unused by any open sequence, lease or store. The OS's random
        bytes are read ``RANDOM_IDS`` ids at a time: a system call per id was 1 to 3% of the
        agent's CPU per same-node save (py-spy, docs/dataplane.md)."""
        while True:
            if not self._random_ids:
                draws = array("Q", os.urandom(8 * RANDOM_IDS))
                self._random_ids = [(draw >> 2) + 1 for draw in draws]
            public_id = self._random_ids.pop()
            if (
                public_id not in self.sequences
                and public_id not in self.leases
                and public_id not in self.stores
            ):
                return public_id

    def _held(self, handle: SequenceHandle) -> tuple[int, ...]:
        held = [0] * len(self._window_blocks)
        for pool, table in enumerate(handle.block_tables):
            held[self._group_of_pool[pool]] = len(table)
        return tuple(held)

    def _admit(self, tenant: str | None, num_tokens: int, held: tuple[int, ...] = ()) -> None:
        """Refuse (429) a request that would take its tenant past the open-sequence or the
        pinned-block cap; ``held`` is what the sequence pins already (appends)."""
        if not held and self._open_by[tenant] >= self.limits.tenant_max_open_sequences:
            self.refusals["open_sequences"] += 1
            raise RequestError(
                429,
                f"limits: tenant has {self.limits.tenant_max_open_sequences} open sequences "
                "(tenant_max_open_sequences); release some first",
                {"retry-after": "1"},
            )
        if len(self.credentials.tenants) < 2:
            return  # a single tenant has nobody to starve
        tpb = self.engine.tpb
        fraction = self.limits.tenant_max_pinned_fraction
        have = self._held_by.get(tenant, [0] * len(self._window_blocks))
        for g, capacity in enumerate(self.engine.group_capacity):
            need = -(-num_tokens // tpb)
            bound = self._window_blocks[g]
            if bound is not None:
                need = min(need, bound)
            grow = need - (held[g] if held else 0)
            cap = int(capacity * fraction)
            if grow > 0 and have[g] + grow > cap:
                self.refusals["pinned_blocks"] += 1
                raise RequestError(
                    429,
                    f"limits: this request would pin {have[g] + grow} blocks of pool group {g} "
                    f"for the tenant, more than {cap} ({fraction:.0%} of {capacity}, "
                    "tenant_max_pinned_fraction); release sequences first",
                    {"retry-after": "1"},
                )

    @property
    def open_handles(self) -> int:
        """Open sequences, leases and in-flight stores (a drain waits for them)."""
        return len(self.sequences) + len(self.leases) + len(self.stores)

    def _account(self, tenant: str | None, old: tuple[int, ...], new: tuple[int, ...]) -> None:
        """A tenant's handle pins ``new`` blocks per group instead of ``old``: ``()`` as
        ``old`` opens a handle (sequence, lease or store), ``()`` as ``new`` closes one."""
        self._open_by[tenant] += (not old) - (not new)
        have = self._held_by.setdefault(tenant, [0] * len(self._window_blocks))
        for g in range(len(have)):
            have[g] += (new[g] if new else 0) - (old[g] if old else 0)

    def _scrub(self, handle: SequenceHandle, fresh_from_block: int) -> None:
        """Zero the blocks a sequence got fresh (from block index ``fresh_from_block`` on):
        a recycled block must never show its previous owner's KV."""
        tpb = handle.tokens_per_block
        for pool, table in enumerate(handle.block_tables):
            skip = max(0, fresh_from_block - handle.first_token[pool] // tpb)
            fresh = table[skip:]
            if fresh:
                view = self.engine.pool_view(pool)
                index = torch.tensor(fresh, dtype=torch.long, device=view.device)
                view.index_fill_(1, index, 0)

    # ------------------------------------------------------------------ sequences

    async def open(
        self,
        principal: Principal,
        tokens: list[int],
        cache_salt: str | None,
        extra_keys: list[int | str],
        retention: KvCacheRetentionConfig | None,
        recompute_last_token: bool,
    ) -> OpenSequence:
        tenant = self.tenant_of(principal)
        if self.draining:
            raise RequestError(503, "draining: this agent admits no new sequences")
        policy = retention if retention is not None else self.default_retention()
        salt = tenant_salt(tenant, cache_salt)

        def run() -> OpenSequence:
            self._admit(tenant, len(tokens))
            handle = self.engine.open_sequence(
                tokens,
                cache_salt=salt,
                extra_keys=tuple(extra_keys),
                retention=policy,
                recompute_last_token=recompute_last_token,
            )
            self._scrub(handle, -(-handle.num_reused_tokens // handle.tokens_per_block))
            seq = OpenSequence(self._new_id(), tenant, handle, time.monotonic(), self._held(handle))
            self.sequences[seq.public_id] = seq
            self._account(tenant, (), seq.held)
            if salt is not None or extra_keys:
                self.namespaces[_namespace(salt, extra_keys)] = (salt, tuple(extra_keys))
            return seq

        return await self.call(run)

    async def get(self, principal: Principal, seq_id: int) -> OpenSequence:
        return await self.call(lambda: self._owned(principal, seq_id))

    async def append(self, principal: Principal, seq_id: int, tokens: list[int]) -> OpenSequence:
        def run() -> OpenSequence:
            seq = self._owned(principal, seq_id)
            old = seq.handle
            self._admit(seq.tenant, old.num_tokens + len(tokens), seq.held)
            handle = self.engine.append_tokens(old.seq_id, tokens)
            self._scrub(handle, -(-old.num_tokens // old.tokens_per_block))
            held = self._held(handle)
            self._account(seq.tenant, seq.held, held)
            seq.handle, seq.held = handle, held
            return seq

        return await self.call(run)

    async def commit(self, principal: Principal, seq_id: int) -> OpenSequence:
        def run() -> OpenSequence:
            seq = self._owned(principal, seq_id)
            self.engine.commit(seq.handle.seq_id)
            return seq

        return await self.call(run)

    async def release(self, principal: Principal, seq_id: int, discard: bool) -> None:
        await self.call(lambda: self._release(self._owned(principal, seq_id), discard))

    def _release(self, seq: OpenSequence, discard: bool) -> None:
        self.engine.release(seq.handle.seq_id, discard=discard)
        del self.sequences[seq.public_id]
        self._account(seq.tenant, seq.held, ())

    def block_ids(
        self, handle: SequenceHandle, pool: int, start: int, count: int, *, write: bool
    ) -> list[int]:
        """Primary block ids ``[start, start + count)`` of a sequence's table in ``pool``.

        Writes may not touch blocks the sequence reused whole: other sequences share them.
        Call it under the engine lock, in the same hold as the access.
        """
        if not 0 <= pool < len(handle.block_tables):
            raise RequestError(
                404, f"pool: {pool} does not exist (0..{len(handle.block_tables) - 1})"
            )
        table = handle.block_tables[pool]
        if count < 1 or start < 0 or start + count > len(table):
            raise RequestError(
                422,
                f"blocks [{start}, {start + count}) are outside the table of {len(table)} blocks",
            )
        if write:
            tpb = handle.tokens_per_block
            first = handle.first_token[pool] // tpb + start
            if first * tpb < handle.num_reused_tokens - handle.num_reused_tokens % tpb:
                raise RequestError(
                    409,
                    f"block {start} of pool {pool} holds reused tokens: shared blocks are "
                    f"read-only (the first {handle.num_reused_tokens} tokens were reused)",
                )
        return list(table[start : start + count])

    async def write_kv(
        self, principal: Principal, seq_id: int, pool: int, start: int, kv: torch.Tensor
    ) -> None:
        if not 0 <= pool < len(self.engine.plan.pools):
            raise RequestError(404, f"pool: {pool} does not exist")
        view = self.engine.pool_view(pool)
        count = kv.shape[1] if kv.dim() == view.dim() else 0
        want_tail = (view.shape[0], count, *view.shape[2:])
        if count < 1 or tuple(kv.shape) != want_tail or kv.dtype != view.dtype:
            want = [view.shape[0], "blocks", *view.shape[2:]]
            raise RequestError(
                422,
                f"payload: expected a {view.dtype} tensor of shape {want} "
                f"([layers, blocks, 2, tokens_per_block, kv_heads, head_dim]), "
                f"got {kv.dtype} {list(kv.shape)}",
            )

        def run() -> None:
            seq = self._owned(principal, seq_id)
            ids = self.block_ids(seq.handle, pool, start, count, write=True)
            index = torch.tensor(ids, dtype=torch.long, device=view.device)
            view.index_copy_(1, index, kv.to(view.device))

        await self.call(run, heavy=kv.nbytes > HEAVY_BYTES)

    async def read_kv(
        self, principal: Principal, seq_id: int, pool: int, start: int, count: int
    ) -> torch.Tensor:
        def run() -> torch.Tensor:
            seq = self._owned(principal, seq_id)
            ids = self.block_ids(seq.handle, pool, start, count, write=False)
            view = self.engine.pool_view(pool)
            return view[:, torch.tensor(ids, dtype=torch.long, device=view.device)].cpu()

        block_bytes = (
            self.engine.plan.pools[pool].block_bytes
            if 0 <= pool < len(self.engine.plan.pools)
            else 0
        )
        return await self.call(run, heavy=count * block_bytes > HEAVY_BYTES)

    async def attention(
        self,
        principal: Principal,
        seq_ids: list[int],
        q_lens: list[int],
        layer: int,
        num_qo_heads: int,
        causal: bool,
        q: torch.Tensor,
    ) -> tuple[torch.Tensor, str]:
        if len(seq_ids) != len(q_lens):
            raise RequestError(422, f"q_lens: {len(q_lens)} entries for {len(seq_ids)} sequences")
        if len(set(seq_ids)) != len(seq_ids):
            raise RequestError(422, "seq_ids: a sequence appears twice in the batch")

        def run() -> tuple[torch.Tensor, str]:
            handles = tuple(self._owned(principal, s).handle for s in seq_ids)
            batch = AttentionBatch(handles, tuple(q_lens), layer, num_qo_heads, causal)
            return run_attention(self.engine, self.attention_kernel, batch, q)

        try:
            return await self.call(run, heavy=True)
        except ValueError as err:  # AttentionRequestError and the kernels' shape checks
            raise RequestError(422, str(err)) from None

    # ------------------------------------------------------------------ engine keys

    def _chain(self, ns: KeyNamespace, keys: list[bytes]) -> list[bytes]:
        """The request's keys, checked against the namespace rules and ``transfer.max_keys``."""
        try:
            ns.check()
            return check_keys(keys, self.config.transfer.max_keys)
        except KeyFormatError as err:
            raise RequestError(422, str(err)) from None

    async def lookup_keys(
        self, principal: Principal, ns: KeyNamespace, keys: list[bytes]
    ) -> list[str]:
        """Tier of each leading resident block of a chain, in the caller's tenant; no side
        effects (``KVCacheManager.lookup``)."""
        tenant = self.tenant_of(principal)
        chain = self._chain(ns, keys)
        salt = tenant_salt(tenant, ns.salt())
        tpb = self.engine.tpb
        tokens = packed_chain_tokens(chain, tpb)

        def run() -> list[str]:
            tiers = self.engine.lookup(tokens, cache_salt=salt)
            if tiers:
                self._list_first(tenant, ns.salt(), salt, tokens[:tpb])
            return tiers

        return await self.call(run)

    async def lease_keys(
        self, principal: Principal, ns: KeyNamespace, keys: list[bytes], ttl_s: float | None
    ) -> tuple[Lease | None, list[str]]:
        """Pin the leading resident blocks of a chain for at most ``ttl_s`` (bounded by
        ``transfer.max_lease_ttl_s``); None when none is resident. A lease is the data
        plane's prefix-cache query: the whole chain counts as queried, the lease as hits,
        and the policy curve is asked with the whole chain (the store that follows a miss
        is none: ``uncounted``)."""
        tenant = self.tenant_of(principal)
        chain = self._chain(ns, keys)
        if self.draining:
            raise RequestError(503, "draining: this agent grants no new leases")
        cfg = self.config.transfer
        ttl = cfg.lease_ttl_s if ttl_s is None else ttl_s
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl):
            raise RequestError(422, "ttl_s: a finite number of seconds")
        if ttl <= 0:
            raise RequestError(422, "ttl_s: must be positive")
        ttl = min(float(ttl), cfg.max_lease_ttl_s)
        salt = tenant_salt(tenant, ns.salt())
        tpb = self.engine.tpb
        tokens = packed_chain_tokens(chain, tpb)

        def run() -> tuple[Lease | None, list[str]]:
            tiers = self.engine.lookup(tokens, cache_salt=salt)
            d = len(tiers)
            if d == 0:
                self._count_unmatched(len(chain))
                self.engine.query_policy_curve(tokens, cache_salt=salt)
                return None, []
            self._admit(tenant, d * tpb)
            with self.engine.curve_muted():  # the curve's query is the whole chain, below
                handle = self.engine.open_sequence(
                    tokens[: d * tpb], cache_salt=salt, recompute_last_token=False
                )
            if handle.num_reused_tokens != d * tpb:  # cannot happen: same hold as the lookup
                self.engine.release(handle.seq_id, discard=True)
                raise RequestError(503, "lease: the cache changed under the request; retry")
            self._count_unmatched(len(chain) - d)
            self.engine.query_policy_curve(tokens, cache_salt=salt)
            self._list_first(tenant, ns.salt(), salt, tokens[:tpb])
            lease = Lease(
                self._new_id(),
                tenant,
                handle,
                d,
                tiers,
                time.monotonic() + ttl,
                ttl,
                self._held(handle),
            )
            self.leases[lease.public_id] = lease
            self._deadline_added(lease.expires_at)
            self._account(tenant, (), lease.held)
            if salt is not None:
                self.namespaces[_namespace(salt, ())] = (salt, ())
            return lease, tiers

        return await self.call(run)

    def _count_unmatched(self, blocks: int) -> None:
        """Count the part of a leased chain past the lease as queried (missed) tokens."""
        self.engine.count_missed(blocks)

    async def release_lease(self, principal: Principal, lease_id: int) -> None:
        await self.call(lambda: self._close_lease(self._owned_lease(principal, lease_id)))

    def _owned_lease(self, principal: Principal, lease_id: int) -> Lease:
        """The caller's live lease; another tenant's, a released or an expired one: 404."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.tenant != self.tenant_of(principal):
            raise RequestError(404, f"lease {lease_id} is not held (unknown, released or expired)")
        if time.monotonic() >= lease.expires_at:
            self._expire(lease)
            raise RequestError(404, f"lease {lease_id} is not held (unknown, released or expired)")
        return lease

    def _close_lease(self, lease: Lease) -> None:
        """Forget a lease; its blocks are unpinned now, or when its last read ends."""
        self.leases.pop(lease.public_id, None)
        if lease.closing:
            return
        lease.closing = True
        if lease.readers == 0:
            self._unpin_lease(lease)

    def _unpin_lease(self, lease: Lease) -> None:
        self.engine.release(lease.handle.seq_id)
        self._account(lease.tenant, lease.held, ())

    def _expire(self, lease: Lease) -> None:
        self.expired_leases += 1
        self._close_lease(lease)

    async def expire_leases(self, now: float | None = None) -> int:
        """Release every lease past its deadline (``kvpool_leases_expired_total``), and abort
        every same-node reservation past its own (``kvpool_reservations_expired_total``):
        its blocks go back to the free lists, nothing of it enters the tree."""

        def run() -> int:
            t = time.monotonic() if now is None else now
            stale = [lease for lease in self.leases.values() if t >= lease.expires_at]
            for lease in stale:
                self._expire(lease)
            late = [
                s for s in self.stores.values() if s.expires_at is not None and t >= s.expires_at
            ]
            for store in late:
                self._drop_store(store)
            self.transfer.reservations_expired += len(late)
            return len(stale) + len(late)

        if not self.leases and not any(s.expires_at is not None for s in self.stores.values()):
            return 0
        return await self.call(run)

    async def begin_read(
        self,
        principal: Principal,
        lease_id: int,
        start: int | None,
        count: int,
        pools: list[int],
    ) -> tuple[Lease, dict[int, list[int]]]:
        """Primary block ids of blocks ``[start, start + count)`` of a lease in each of
        ``pools`` (``start`` None: every block the lease holds in each pool, from the pool's
        first), looked up in the same lock hold as the ownership check; the lease's blocks
        stay pinned until ``end_read``, even if the lease is released or expires meanwhile."""

        def run() -> tuple[Lease, dict[int, list[int]]]:
            lease = self._owned_lease(principal, lease_id)
            firsts = lease.first_blocks
            tables = lease.handle.block_tables
            if start is None:
                held = {pool: list(tables[pool][: lease.blocks - firsts[pool]]) for pool in pools}
                lease.readers += 1
                return lease, held
            reason = lease_range_error(start, count, lease.blocks, firsts, pools)
            if reason is not None:
                raise RequestError(422, reason)
            ids = {}
            for pool in pools:
                at = start - firsts[pool]
                ids[pool] = list(tables[pool][at : at + count])
            lease.readers += 1
            return lease, ids

        return await self.call(run)

    async def end_read(self, lease: Lease) -> None:
        def run() -> None:
            lease.readers -= 1
            if lease.closing and lease.readers == 0:
                self._unpin_lease(lease)

        await self.call(run)

    async def begin_store(
        self,
        principal: Principal,
        ns: KeyNamespace,
        keys: list[bytes],
        first: int,
        priority: int | None = None,
        ttl_s: float | None = None,
    ) -> StoreStart:
        """Open a chain for writing: the blocks from the resident prefix on get fresh private
        blocks, which only the caller writes (outside the lock) before ``finish_store``.
        ``first`` is the first block whose bytes the client sends: the cache must hold every
        block before it, else nothing is stored (``gap``). ``ttl_s`` makes it a same-node
        reservation that expires (bounded by ``transfer.max_lease_ttl_s``) unless committed
        (``commit_store``)."""
        tenant = self.tenant_of(principal)
        chain = self._chain(ns, keys)
        if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first <= len(chain):
            raise RequestError(422, f"first: a block index in [0, {len(chain)}]")
        if self.draining:
            raise RequestError(503, "draining: this agent stores nothing new")
        if priority is None:
            policy = self.default_retention()
        else:
            try:
                policy = KvCacheRetentionConfig.model_validate(
                    {"token_range_retention_configs": [{"token_start": 0, "priority": priority}]}
                )
            except ValueError:
                raise RequestError(422, "priority: an integer in [0, 100]") from None
        salt = tenant_salt(tenant, ns.salt())
        tpb = self.engine.tpb
        tokens = packed_chain_tokens(chain, tpb)
        listing = (ns.salt(), salt, tokens[:tpb])  # the chain in a first-block table
        n = len(chain)
        if ttl_s is not None:
            if isinstance(ttl_s, bool) or not math.isfinite(ttl_s) or ttl_s <= 0:
                raise RequestError(422, "ttl_s: a positive, finite number of seconds")
            ttl_s = min(float(ttl_s), self.config.transfer.max_lease_ttl_s)

        def resident() -> int:
            return len(self.engine.lookup(tokens, cache_salt=salt))

        def run() -> StoreStart:
            # From block 0 no gap is possible, and the open below finds the resident prefix
            # itself: one walk of the tree instead of two (most PUTs of a connector).
            if first:
                d = resident()
                if d:
                    self._list_first(tenant, *listing)
                if first > d:
                    return StoreStart(None, d, n, gap=True)
                if d == n:
                    return StoreStart(None, d, n)
            try:
                self._admit(tenant, n * tpb)
            except RequestError:
                if not first and resident() == n:  # held already: nothing to admit
                    self._list_first(tenant, *listing)
                    return StoreStart(None, n, n)
                raise
            with self.engine.uncounted():  # storing is not a prefix-cache query
                handle = self.engine.open_sequence(
                    tokens, cache_salt=salt, retention=policy, recompute_last_token=False
                )
            held = handle.num_reused_tokens // tpb
            if held == n:  # the whole chain was resident (a PUT from block 0)
                self.engine.release(handle.seq_id)
                self._list_first(tenant, *listing)
                return StoreStart(None, held, n)
            ids = {}
            for pool, table in enumerate(handle.block_tables):
                first_block = handle.first_token[pool] // tpb
                ids[pool] = list(table[held - first_block : n - first_block])
            names = (tokens[held * tpb : n * tpb], chain[held:n])
            store = Store(self._new_id(), tenant, handle, held, n, self._held(handle), ids, names)
            store.first = listing
            if ttl_s is not None:
                store.expires_at = time.monotonic() + ttl_s
                self._deadline_added(store.expires_at)
            self.stores[store.store_id] = store
            self._account(tenant, (), store.held)
            if salt is not None:
                self.namespaces[_namespace(salt, ())] = (salt, ())
            return StoreStart(store, store.resident, n)

        return await self.call(run)

    async def open_first_blocks(self, tenant: str | None) -> FirstBlockTable:
        """The tenant's first-block table for a same-node client to map (MAP_INDEX), made
        on first use and filled with what the cache holds of the tenant's chains then;
        ``RequestError`` 409 while the engine records no KV events, which is how the table
        learns of removals."""
        if not self.engine.events.enabled:
            raise RequestError(
                409,
                "the first-block index needs the engine's KV events "
                "(kv_cache_config.event_buffer_max_size > 0)",
            )

        def run() -> FirstBlockTable:
            if self.first_blocks is None:
                self.first_blocks = FirstBlockIndex(buckets_for(self._blocks()), self.engine.tpb)
            made = tenant not in self.first_blocks.tables
            table = self.first_blocks.table(tenant)
            if made:
                self._list_held(tenant)
            return table

        return await self.call(run, heavy=True)

    def _blocks(self) -> int:
        """Blocks the cache can hold in one pool, every tier (a bound on its chains)."""
        usage = self.engine.usage()
        return max(
            sum(int(u["blocks_total"]) for u in usage if u["pool"] == pool.index)
            for pool in self.engine.plan.pools
        )

    def _list_first(
        self, tenant: str | None, ns_salt: str, salt: str | None, tokens: PackedTokens
    ) -> None:
        """Inside the engine call that found a chain's first block resident: list it in the
        tenant's first-block table, if the tenant has one, and watch the block's removal.
        The events so far are published first: a removal among them is of an earlier copy
        of the block (evicted, then stored again in this call), which must leave the table
        before this one is listed, not after. ``tokens``: the chain's first block's, unpacked
        only when a table takes them."""
        index = self.first_blocks
        if index is None or tenant not in index.tables:
            return
        self.flush_events()
        self._note_first(index, tenant, ns_salt, salt, tokens.tolist())

    def _note_first(
        self,
        index: FirstBlockIndex,
        tenant: str | None,
        ns_salt: str,
        salt: str | None,
        tokens: list[int],
    ) -> None:
        key = index.note(tenant, ns_salt, salt, tokens)
        if key is not None:
            self.publisher.encoder.watch(key)

    def _list_held(self, tenant: str | None) -> None:
        """List every first block of ``tenant``'s keyed chains the cache holds (a new table,
        or after a handoff brought blocks in): one walk of the whole tree."""
        roots: dict[int, tuple[str, str]] = {}
        for root, (salt, extra) in self.namespaces.items():
            ns_salt = keyed_salt(tenant, salt) if not extra else None
            if ns_salt is not None:
                roots[root] = (ns_salt, salt)
        index = self.first_blocks
        if not roots or index is None or tenant not in index.tables:
            return
        self.flush_events()  # (as _list_first does, once for the walk)
        for node in self.engine.iter_nodes():
            parent = node.parent
            if parent is None or parent.parent is not None or parent.key not in roots:
                continue  # a root, or not a first block of the tenant's keyed chains
            ns_salt, salt = roots[parent.key]
            self._note_first(index, tenant, ns_salt, salt, list(unpack(node.packed)))

    def _name_store(self, store: Store) -> None:
        """Have the events of a store's new blocks name them by the engine's keys, while the
        engine records events: else no BlockStored would take the names, and up to
        ``MAX_PENDING_NAMES`` blocks' tokens would sit in the encoder for nothing."""
        if self.engine.events.enabled:
            self.publisher.encoder.name_chain(*store.names)

    async def finish_store(self, store: Store) -> None:
        """Commit a filled store: its blocks enter the tree (BlockStored events)."""
        await self.call(lambda: self._enter_store(store))

    def _enter_store(self, store: Store) -> None:
        """Inside an engine call: a store's written blocks enter the tree, named by the
        engine's keys in their events, and its first block in the tenant's table."""
        self.stores.pop(store.store_id)
        self._name_store(store)
        self.engine.release(store.handle.seq_id)
        self._account(store.tenant, store.held, ())
        if store.first is not None:
            self._list_first(store.tenant, *store.first)

    async def abort_store(self, store: Store) -> None:
        """Drop a store whose bytes did not all arrive: nothing of it enters the tree."""
        await self.call(lambda: self._drop_store(store))

    def _drop_store(self, store: Store) -> None:
        if self.stores.pop(store.store_id, None) is None:
            return
        self.engine.release(store.handle.seq_id, discard=True)
        self._account(store.tenant, store.held, ())

    async def commit_store(self, store: Store) -> None:
        """Commit a same-node reservation whose bytes the engine wrote into the mapping, as
        ``finish_store`` does; 404 when it expired first (its blocks are free again, so what
        was written there is lost, not half-entered)."""

        def run() -> None:
            if self.stores.get(store.store_id) is not store:
                raise RequestError(
                    404, f"reservation {store.store_id} is not held (expired or aborted)"
                )
            if store.expires_at is not None and time.monotonic() >= store.expires_at:
                self._drop_store(store)
                self.transfer.reservations_expired += 1
                raise RequestError(
                    404, f"reservation {store.store_id} is not held (expired or aborted)"
                )
            self._enter_store(store)

        await self.call(run)

    # ------------------------------------------------------------------ config

    async def apply_config(self, new: AgentConfig) -> list[str]:
        """Apply a reloaded config: every live change at once, or nothing if a restart-only
        field changed too (that change waits for the restart the operator rolls)."""
        async with self.lock:
            restart = restart_fields(self.config, new)
            if restart:
                self.reloads.restart_required += 1
                self.reloads.pending_restart = restart
                log.warning("config change needs a restart, not applied: %s", ", ".join(restart))
                raise ConfigError("these fields need a restart: " + ", ".join(restart))
            self.reloads.pending_restart = []
            changed = [
                f"kv_cache_config.{n}" for n in self.engine.apply_live_config(new.kv_cache_config)
            ]
            changed += [f for f in changed_fields(self.config, new) if f not in changed]
            self.config = new
            self.flush_events()
            if changed:
                self.reloads.applied += 1
                log.info("config reloaded, applied live: %s", ", ".join(changed))
            else:
                self.reloads.unchanged += 1
            return changed

    # ------------------------------------------------------------------ handoff

    async def export_hottest(self) -> bytes:
        max_blocks = self.config.lifecycle.handoff_max_blocks
        return await self.call(
            lambda: export_snapshot(self.engine, self.namespaces, max_blocks), heavy=True
        )

    async def import_blocks(self, blob: bytes) -> ImportResult:
        def run() -> ImportResult:
            result = import_snapshot(self.engine, blob)
            for salt, extra in result.namespaces:
                self.namespaces[_namespace(salt, extra)] = (salt, extra)
            for tenant in list(self.first_blocks.tables if self.first_blocks else ()):
                self._list_held(tenant)  # the chains that came in, in their tables
            return result

        return await self.call(run, heavy=True)

    async def release_all(self) -> int:
        """Release every open sequence (dropping uncommitted KV) and every lease (end of a
        drain). In-flight stores finish or abort on their own: only their connection may
        release them, since it may be writing into their blocks."""

        def run() -> int:
            open_now = list(self.sequences.values())
            for seq in open_now:
                self._release(seq, discard=True)
            leases = list(self.leases.values())
            for lease in leases:
                self._close_lease(lease)
            return len(open_now) + len(leases)

        return await self.call(run)

    def stats_document(self) -> dict[str, Any]:
        s = self.engine.stats
        return {
            "queries_tokens": s.queries_tokens,
            "hits_tokens": {"primary": s.hits_tokens[0], "secondary": s.hits_tokens[1]},
            "capacity_miss_tokens": s.capacity_miss_tokens,
            "miss_ratio_curve": curve_document(self.engine.mrc.snapshot()),
            "policy_curve": (
                None
                if self.engine.miniature is None
                else policy_curve_document(self.engine.miniature.snapshot())
            ),
            "evictions": {"primary": s.evictions[0], "secondary": s.evictions[1]},
            "offloads": s.offloads,
            "onboards": s.onboards,
            "sequences_opened": s.sequences_opened,
            "engine_core": self.engine.core_name,
            "open_sequences": self.engine.num_open_sequences,
            "tree_blocks": self.engine.num_nodes,
            "pools": self.engine.usage(),
            "events_next_seq": self.publisher.next_seq,
            "draining": self.draining,
            "pending_restart": self.reloads.pending_restart,
            "expired_sequences": self.expired_sequences,
            "open_leases": len(self.leases),
            "expired_leases": self.expired_leases,
            "stores_in_flight": len(self.stores),
        }


def curve_document(curve: CurveSnapshot) -> dict[str, Any]:
    """The miss-ratio curve in ``/v1/stats``: cumulative estimated block accesses per bound
    (a fraction of ``capacity_blocks``; the last entry is every access) and the hit ratio an
    LRU cache of each size would have had."""
    total = curve.accesses
    return {
        "capacity_blocks": curve.capacity,
        "sample_rate": curve.rate,
        "accesses": total,
        "buckets": [
            {"le": bound, "accesses": value, "hit_ratio": value / total if total else None}
            for bound, value in zip(BOUNDS, curve.cumulative, strict=False)
        ],
    }


def policy_curve_document(mini: PolicyCurveSnapshot) -> dict[str, Any]:
    """The policy's own curve in ``/v1/stats``: per ratio of the capacity, the hit ratio a
    cache of the engine's policy that size had on the sampled accesses."""
    return {
        "policy": mini.policy,
        "capacity_blocks": mini.capacity,
        "sample_rate": mini.rate,
        "accesses": mini.accesses,
        "dropped": mini.dropped,
        "ratios": [
            {"ratio": r, "hits": h, "hit_ratio": mini.hit_ratio(r)}
            for r, h in zip(mini.ratios, mini.hits, strict=True)
        ],
    }


CURVE_SLICE = 16
"""Sampled keys replayed per hold of the engine lock (a few milliseconds for ``mixture``)."""
NATIVE_CURVE_SLICE = 256
"""The same for the compiled miniature (``cache/native_curves.py``), 20 to 30 times faster
per key: about as long a hold, and fewer of them."""

HEAVY_BYTES = 1 << 20
"""Copies larger than this run in a worker thread, so the event loop keeps serving probes."""


def _at_host(endpoint: str | None, host: str) -> str | None:
    """An event endpoint with its ``*`` host replaced by the server host."""
    if endpoint is None or "://*:" not in endpoint:
        return endpoint
    bracketed = f"[{host}]" if ":" in host else host
    return endpoint.replace("://*:", f"://{bracketed}:")
