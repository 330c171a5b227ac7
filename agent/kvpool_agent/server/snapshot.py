"""Warm handoff: export the hottest reusable blocks, import them into an agent of the same geometry.

Built only on the engine's public API. Export walks the radix tree hottest first (highest
priority, then most recently used), closes the selection under ancestors (a block is only
reusable after its whole prefix) and records, parents first, each node's tokens, namespace
(cache salt), priority and KV of every pool. Import opens the token chain ending at each
selected leaf with ``recompute_last_token=False``, writes the KV of the blocks the cache did
not already hold, and releases: the blocks enter the tree exactly as if computed here.

File / HTTP body format (version 1):

    b"KVPS" | version u16 | CRC-32 u32 of body | body length u64 | body

``body`` is msgpack ``{"geometry": {...}, "records": [[salt, extra_keys, parent_index,
[tokens], priority, [frame | None per pool]], ...]}`` where each frame is a
``payload.encode_tensor`` of the node's block in that pool (``[layers, 2, tpb, heads, dim]``).
A snapshot is loaded only by an agent whose ``geometry`` (pools, tokens per block, dtype) is
equal. Retention durations are not carried over: imported blocks keep their priority for good.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

import msgpack
import torch

from kvpool_agent.cache import (
    KVCacheManager,
    KvCacheRetentionConfig,
    OutOfBlocksError,
    TokenRangeRetentionConfig,
)
from kvpool_agent.cache.block import TreeNode
from kvpool_agent.config import DEFAULT_PRIORITY
from kvpool_agent.server.payload import PayloadError, decode_tensor, encode_tensor

MAGIC = b"KVPS"
VERSION = 1
_HEADER = struct.Struct("<4sHIQ")

Namespace = tuple[str | None, tuple[int | str, ...]]
"""The (cache salt, extra keys) a tree root stands for."""


class SnapshotError(ValueError):
    """A snapshot that cannot be loaded here (format, checksum or geometry)."""


@dataclass
class ImportResult:
    chains: int = 0
    blocks_written: int = 0
    skipped: int = 0
    namespaces: set[Namespace] = field(default_factory=set)
    """Salted namespaces imported (so that a later handoff can carry them on)."""


def geometry(engine: KVCacheManager) -> dict[str, Any]:
    """What must be equal for blocks to be interchangeable between two agents."""
    plan = engine.plan
    return {
        "tokens_per_block": plan.tokens_per_block,
        "kv_dtype": plan.kv_dtype,
        "pools": [[p.window, p.kv_heads, p.head_dim, list(p.layers), p.dtype] for p in plan.pools],
    }


def hotness(node: TreeNode) -> tuple[int, int]:
    return (node.priority, node.last_used)


def select_hottest(nodes: Iterable[TreeNode], max_blocks: int | None) -> list[TreeNode]:
    """The hottest nodes, closed under ancestors, parents first; at most ``max_blocks``."""
    chosen: set[int] = set()
    order: list[TreeNode] = []
    for node in sorted(nodes, key=hotness, reverse=True):
        chain = []
        walk: TreeNode | None = node
        while walk is not None and walk.parent is not None and id(walk) not in chosen:
            chain.append(walk)
            walk = walk.parent
        if max_blocks is not None and len(order) + len(chain) > max_blocks:
            continue
        for member in reversed(chain):
            chosen.add(id(member))
            order.append(member)
    order.sort(key=lambda n: n.depth)
    return order


def export_snapshot(
    engine: KVCacheManager,
    namespaces: dict[int, Namespace],
    max_blocks: int | None = None,
) -> bytes:
    """Encode the hottest blocks of ``engine``; roots whose salt is unknown are left out."""
    root_key: dict[int, int] = {}  # node id -> namespace (iter_nodes yields parents first)
    known = []
    for node in engine.iter_nodes():
        parent = node.parent
        assert parent is not None
        key = parent.key if parent.parent is None else root_key[id(parent)]
        root_key[id(node)] = key
        if key == 0 or key in namespaces:
            known.append(node)
    nodes = select_hottest(known, max_blocks)
    index = {id(n): i for i, n in enumerate(nodes)}
    records = []
    for node in nodes:
        salt, extra = namespaces.get(root_key[id(node)], (None, ()))
        frames: list[bytes | None] = []
        for pool in engine.plan.pools:
            block = node.blocks[pool.group]
            if block is None:
                frames.append(None)
            else:
                frames.append(
                    encode_tensor(engine.read_block(pool.index, block.block_id, block.tier))
                )
        parent = index.get(id(node.parent), -1) if node.parent is not None else -1
        records.append([salt, list(extra), parent, list(node.tokens), node.priority, frames])
    body = msgpack.packb({"geometry": geometry(engine), "records": records}, use_bin_type=True)
    return _HEADER.pack(MAGIC, VERSION, zlib.crc32(body), len(body)) + body


def read_snapshot(blob: bytes) -> tuple[dict[str, Any], list[list[Any]]]:
    """The geometry and records of a snapshot; raises SnapshotError on any damage."""
    if len(blob) < _HEADER.size:
        raise SnapshotError("snapshot: shorter than its header")
    magic, version, crc, length = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise SnapshotError(f"snapshot: bad magic {magic!r}")
    if version != VERSION:
        raise SnapshotError(f"snapshot: version {version}, this agent reads {VERSION}")
    body = blob[_HEADER.size :]
    if len(body) != length:
        raise SnapshotError(f"snapshot: body is {len(body)} bytes, header says {length}")
    if zlib.crc32(body) != crc:
        raise SnapshotError("snapshot: checksum mismatch")
    try:
        doc = msgpack.unpackb(body, raw=False, strict_map_key=False)
        return doc["geometry"], doc["records"]
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as err:
        raise SnapshotError(f"snapshot: undecodable body ({err})") from None


def import_snapshot(engine: KVCacheManager, blob: bytes) -> ImportResult:
    """Load a snapshot into ``engine``; stops early (keeping what fit) when the cache is full.

    The engine's query/hit counters are restored afterwards: importing is not client traffic.
    """
    geo, records = read_snapshot(blob)
    if geo != geometry(engine):
        raise SnapshotError(
            f"snapshot: geometry {geo} differs from this agent's {geometry(engine)}"
        )
    saved = {f.name: _copy(getattr(engine.stats, f.name)) for f in fields(engine.stats)}
    result = ImportResult()
    try:
        has_child = {r[2] for r in records if r[2] >= 0}
        for i, _ in enumerate(records):
            if i in has_child:
                continue
            chain = _chain(records, i)
            try:
                result.blocks_written += _import_chain(engine, chain)
                result.chains += 1
                if chain[0][0] is not None or chain[0][1]:
                    result.namespaces.add((chain[0][0], tuple(chain[0][1])))
            except OutOfBlocksError:
                break
            except (SnapshotError, PayloadError):
                result.skipped += 1
    finally:
        stats = engine.stats
        for name in (
            "queries_tokens",
            "queries_blocks",
            "hits_tokens",
            "hits_blocks",
            "partial_hit_tokens",
            "capacity_miss_tokens",
            "capacity_miss_blocks",
            "sequences_opened",
        ):
            setattr(stats, name, saved[name])
    return result


def _import_chain(engine: KVCacheManager, chain: list[list[Any]]) -> int:
    tpb = engine.plan.tokens_per_block
    salt, extra = chain[0][0], tuple(chain[0][1])
    tokens = [t for rec in chain for t in rec[3]]
    ranges = [
        TokenRangeRetentionConfig(token_start=j * tpb, token_end=(j + 1) * tpb, priority=rec[4])
        for j, rec in enumerate(chain)
        if rec[4] != DEFAULT_PRIORITY
    ]
    retention = KvCacheRetentionConfig(token_range_retention_configs=ranges) if ranges else None
    handle = engine.open_sequence(
        tokens, cache_salt=salt, extra_keys=extra, retention=retention, recompute_last_token=False
    )
    written = 0
    try:
        reused_blocks = handle.num_reused_tokens // tpb
        writes: list[tuple[int, int, torch.Tensor]] = []
        for pool in engine.plan.pools:
            first_block = handle.first_token[pool.index] // tpb
            table = handle.block_tables[pool.index]
            for j in range(max(reused_blocks, first_block), len(chain)):
                frame = chain[j][5][pool.index]
                if frame is None:
                    raise SnapshotError(f"snapshot: block {j} of pool {pool.index} has no KV")
                writes.append((pool.index, table[j - first_block], decode_tensor(frame)))
        for pool_index, _, kv in writes:
            view = engine.pool_view(pool_index)
            if tuple(kv.shape) != tuple(view.shape[:1] + view.shape[2:]) or kv.dtype != view.dtype:
                raise SnapshotError(f"snapshot: block of pool {pool_index} has the wrong shape")
        for pool_index, block_id, kv in writes:
            engine.pool_view(pool_index)[:, block_id] = kv.to(engine.device)
            written += 1
    except BaseException:
        engine.release(handle.seq_id, discard=True)
        raise
    engine.release(handle.seq_id)
    return written


def _chain(records: list[list[Any]], i: int) -> list[list[Any]]:
    chain = []
    while i >= 0:
        chain.append(records[i])
        i = records[i][2]
    chain.reverse()
    return chain


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value
