"""Warm handoff: export the hottest reusable blocks, import them into an agent of the same geometry.

Built only on the engine's public API. Export walks the radix tree hottest first (highest
priority, then most recently used), closes the selection under ancestors (a block is only
reusable after its whole prefix) and records, parents first, each node's tokens, namespace
(cache salt), priority and KV of every pool. Import opens the token chain ending at each
selected leaf with ``recompute_last_token=False``, writes the KV of the blocks the cache did
not already hold, and releases: the blocks enter the tree exactly as if computed here.
``export_by_owner`` splits the same selection by the replica that owns each chain (the
ring-aware handoff, ``server/rebalance.py``): one snapshot per owner, each closed under
ancestors, so a prefix shared by chains of two owners goes to both.

File / HTTP body format (version 1):

    b"KVPS" | version u16 | CRC-32 u32 of body | body length u64 | body

``body`` is msgpack ``{"geometry": {...}, "records": [[salt, extra_keys, parent_index,
[tokens], priority, [frame | None per pool]], ...]}`` where each frame is a
``payload.encode_tensor`` of the node's block in that pool (``[layers, 2, tpb, heads, dim]``).
A snapshot is loaded only by an agent whose ``geometry`` (pools, tokens per block, dtype) is
equal. Retention durations are not carried over: imported blocks keep their priority for good.

A snapshot comes from a peer or a file, so it is untrusted: ``read_snapshot`` checks the whole
document (every record and field, see ``check_document``) and ``import_snapshot`` checks every
frame against this agent's pools before the first engine call, so a damaged or hostile
snapshot is refused with a ``SnapshotError`` naming the record and field and changes nothing.
Parents come strictly before their children, which rules out cycles and bounds every chain by
the number of records; the work of an import (blocks walked over all chains) is bounded too.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from kvpool_agent.cache import (
    KVCacheManager,
    KvCacheRetentionConfig,
    OutOfBlocksError,
    RequestTooLargeError,
    TokenRangeRetentionConfig,
)
from kvpool_agent.cache.block import TreeNode
from kvpool_agent.config import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY
from kvpool_agent.server import payload
from kvpool_agent.server.payload import PayloadError, decode_tensor, encode_tensor

MAGIC = b"KVPS"
VERSION = 1
_HEADER = struct.Struct("<4sHIQ")

MAX_RECORDS = 1 << 22
"""Most records (blocks) one snapshot may hold (4,194,304)."""
MAX_SALT_CHARS = 256
"""Longest cache salt (as on the HTTP API)."""
MAX_EXTRA_KEYS = 16
"""Most extra namespace keys (as on the HTTP API)."""
MAX_EXTRA_KEY_CHARS = 256
"""Longest string extra key."""
TOKEN_LIMIT = 1 << 63
"""Token ids are in ``[0, TOKEN_LIMIT)`` (as on the HTTP API)."""
MAX_TOKENS_PER_BLOCK = 1 << 16
MAX_POOLS = 1024
RECORD_FIELDS = ("salt", "extra_keys", "parent", "tokens", "priority", "frames")
"""The fields of a record, in order."""
IMPORT_WORK_BASE = 1 << 22
"""Blocks an import may walk (summed over the chains it opens) beyond ``IMPORT_WORK_PER_RECORD``
per record; chains past that budget are skipped (a comb-shaped tree would otherwise cost the
square of its size)."""
IMPORT_WORK_PER_RECORD = 8
MAX_RANGES_PER_OPEN = 32
"""Priority ranges in one retention policy; a chain with more priority changes is opened in
segments (well below the policy model's own limit)."""


Namespace = tuple[str | None, tuple[int | str, ...]]
"""The (cache salt, extra keys) a tree root stands for."""


class SnapshotError(ValueError):
    """A snapshot that cannot be loaded here (format, checksum, content or geometry)."""


class SnapshotGeometryError(SnapshotError):
    """A well-formed snapshot of another geometry (pools, tokens per block, dtype)."""


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


def _known_nodes(
    engine: KVCacheManager, namespaces: dict[int, Namespace]
) -> tuple[list[TreeNode], dict[int, int]]:
    """The nodes of the namespaces whose salt is known (parents first), and the namespace
    key of every node by ``id``."""
    root_key: dict[int, int] = {}  # node id -> namespace (iter_nodes yields parents first)
    known = []
    for node in engine.iter_nodes():
        parent = node.parent
        assert parent is not None
        key = parent.key if parent.parent is None else root_key[id(parent)]
        root_key[id(node)] = key
        if key == 0 or key in namespaces:
            known.append(node)
    return known, root_key


def _encode(
    engine: KVCacheManager,
    nodes: list[TreeNode],
    root_key: dict[int, int],
    namespaces: dict[int, Namespace],
) -> bytes:
    """A snapshot of ``nodes`` (closed under ancestors, parents first)."""
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


def export_snapshot(
    engine: KVCacheManager,
    namespaces: dict[int, Namespace],
    max_blocks: int | None = None,
) -> bytes:
    """Encode the hottest blocks of ``engine``; roots whose salt is unknown are left out."""
    known, root_key = _known_nodes(engine, namespaces)
    return _encode(engine, select_hottest(known, max_blocks), root_key, namespaces)


OwnerOf = Callable[[Namespace, list[int]], "str | None"]
"""``owner(namespace, tokens)``: the replica that owns the chains starting with ``tokens``
(the leading ``affinity_blocks`` blocks of a chain, or all of a shorter one), None when the
chain cannot be routed from its tokens (engine-keyed chains)."""


def owners(
    nodes: list[TreeNode],
    root_key: dict[int, int],
    namespaces: dict[int, Namespace],
    owner: OwnerOf,
    affinity_blocks: int,
) -> dict[int, str | None]:
    """The owner of every node (by ``id``; ``nodes`` parents first). A node at depth
    ``affinity_blocks`` or deeper belongs to the owner of its ancestor at that depth, as the
    clients route every sequence through it there; a shallower node to the owner of a
    sequence that ends with it."""
    out: dict[int, str | None] = {}
    prefix: dict[int, list[int]] = {}
    for node in nodes:
        parent = node.parent
        if node.depth > affinity_blocks and parent is not None and id(parent) in out:
            out[id(node)] = out[id(parent)]
            continue
        above = prefix.get(id(parent), []) if parent is not None else []
        tokens = above + list(node.tokens)
        if node.depth < affinity_blocks:
            prefix[id(node)] = tokens
        ns = namespaces.get(root_key[id(node)], (None, ()))
        out[id(node)] = owner(ns, tokens)
    return out


def export_by_owner(
    engine: KVCacheManager,
    namespaces: dict[int, Namespace],
    owner: OwnerOf,
    affinity_blocks: int,
    max_blocks: int | None = None,
    only: str | None = None,
) -> dict[str | None, bytes]:
    """The hottest blocks split by owner: one snapshot per owner (None: chains without one),
    each closed under ancestors (a shared ancestor goes to every owner below it).

    ``only``: just the chains that replica owns (the hottest of them, up to ``max_blocks``);
    without it the hottest of all chains, up to ``max_blocks`` in all, every one to its owner.
    """
    known, root_key = _known_nodes(engine, namespaces)
    owner_of = owners(known, root_key, namespaces, owner, affinity_blocks)
    if only is not None:
        picked = select_hottest([n for n in known if owner_of[id(n)] == only], max_blocks)
        return {only: _encode(engine, picked, root_key, namespaces)} if picked else {}
    picked = select_hottest(known, max_blocks)
    groups: dict[str | None, dict[int, TreeNode]] = {}
    for node in picked:
        group = groups.setdefault(owner_of[id(node)], {})
        walk: TreeNode | None = node
        while walk is not None and walk.parent is not None and id(walk) not in group:
            group[id(walk)] = walk
            walk = walk.parent
    return {
        who: _encode(engine, sorted(group.values(), key=lambda n: n.depth), root_key, namespaces)
        for who, group in groups.items()
    }


def read_snapshot(blob: bytes) -> tuple[dict[str, Any], list[list[Any]]]:
    """The geometry and records of a snapshot; raises SnapshotError on any damage.

    The whole document is checked (``check_document``): what this returns is well formed.
    """
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
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as err:
        reason = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        raise SnapshotError(f"snapshot: undecodable body ({_short(reason)})") from None
    return check_document(doc, len(body))


def check_document(doc: Any, body_bytes: int) -> tuple[dict[str, Any], list[list[Any]]]:
    """Check a decoded snapshot body; returns its geometry and records.

    The geometry must be a map with ``tokens_per_block`` and ``pools``; ``records`` a list of
    at most ``MAX_RECORDS`` records (and no more than ``body_bytes`` can hold), each exactly
    ``[salt, extra_keys, parent, tokens, priority, frames]``:

    - ``salt``: a string of at most ``MAX_SALT_CHARS`` characters, or None;
    - ``extra_keys``: a list of at most ``MAX_EXTRA_KEYS`` ints or strings;
    - ``parent``: -1 (a first block) or the index of an earlier record (parents come first:
      no cycles), whose salt and extra keys are the same;
    - ``tokens``: a list of exactly ``tokens_per_block`` ints in ``[0, 2**63)``;
    - ``priority``: an int in 0..100;
    - ``frames``: a list with one bytes-or-None entry per pool (their content is checked
      against the agent's pools by ``import_snapshot``).
    """
    if not isinstance(doc, dict):
        raise SnapshotError(f"snapshot: the body must be a map, got {_kind(doc)}")
    keys = set(doc)
    if keys != {"geometry", "records"}:
        missing = sorted(map(repr, {"geometry", "records"} - keys))
        unknown = sorted(map(repr, keys - {"geometry", "records"}))
        raise SnapshotError(
            "snapshot: the body must be a map of exactly 'geometry' and 'records'"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; unknown {_short(', '.join(unknown))}" if unknown else "")
        )
    geo = doc["geometry"]
    if not isinstance(geo, dict):
        raise SnapshotError(f"snapshot: geometry must be a map, got {_kind(geo)}")
    tpb = geo.get("tokens_per_block")
    if type(tpb) is not int or not 1 <= tpb <= MAX_TOKENS_PER_BLOCK:
        raise SnapshotError(
            f"snapshot: geometry.tokens_per_block must be an int in 1..{MAX_TOKENS_PER_BLOCK}, "
            f"got {_short(repr(tpb))}"
        )
    pools = geo.get("pools")
    if type(pools) is not list or not 1 <= len(pools) <= MAX_POOLS:
        raise SnapshotError(
            f"snapshot: geometry.pools must be a list of 1..{MAX_POOLS} pools, got {_kind(pools)}"
        )
    records = doc["records"]
    if type(records) is not list:
        raise SnapshotError(f"snapshot: records must be a list, got {_kind(records)}")
    # The smallest encoded record: array header, nil salt, empty extra keys, parent, tokens
    # (header and a byte per token), priority, frames (header and a nil per pool).
    smallest = 7 + tpb + len(pools)
    if len(records) > MAX_RECORDS or len(records) * smallest > body_bytes:
        raise SnapshotError(
            f"snapshot: records: {len(records)} records, at most {MAX_RECORDS} and at most "
            f"{body_bytes // smallest} in a body of {body_bytes} bytes"
        )
    for i, rec in enumerate(records):
        _check_record(records, i, rec, tpb, len(pools))
    return geo, records


def _check_record(records: list[Any], i: int, rec: Any, tpb: int, num_pools: int) -> None:
    where = f"snapshot: record {i}"
    if type(rec) is not list or len(rec) != len(RECORD_FIELDS):
        got = f"{len(rec)} fields" if type(rec) is list else _kind(rec)
        raise SnapshotError(f"{where}: must be a list [{', '.join(RECORD_FIELDS)}], got {got}")
    salt, extra, parent, tokens, priority, frames = rec
    if salt is not None and (type(salt) is not str or len(salt) > MAX_SALT_CHARS):
        raise SnapshotError(
            f"{where}: salt must be a string of at most {MAX_SALT_CHARS} characters or null, "
            f"got {_kind(salt)}"
        )
    if type(extra) is not list or len(extra) > MAX_EXTRA_KEYS:
        raise SnapshotError(
            f"{where}: extra_keys must be a list of at most {MAX_EXTRA_KEYS} keys, "
            f"got {_kind(extra)}"
        )
    for k, key in enumerate(extra):
        if not (type(key) is int or (type(key) is str and len(key) <= MAX_EXTRA_KEY_CHARS)):
            raise SnapshotError(
                f"{where}: extra_keys[{k}] must be an int or a string of at most "
                f"{MAX_EXTRA_KEY_CHARS} characters, got {_kind(key)}"
            )
    if type(parent) is not int or not -1 <= parent < i:
        allowed = (
            f"-1 (a first block) or the index of an earlier record (0..{i - 1})"
            if i
            else "-1 (the first record has no earlier record to hang from)"
        )
        raise SnapshotError(f"{where}: parent must be {allowed}, got {_short(repr(parent))}")
    if parent >= 0:
        up = records[parent]
        if up[0] != salt or up[1] != extra:
            raise SnapshotError(
                f"{where}: salt and extra_keys must be those of its parent (record {parent})"
            )
    if type(tokens) is not list or len(tokens) != tpb:
        raise SnapshotError(
            f"{where}: tokens must be a list of exactly {tpb} token ids (tokens_per_block), "
            f"got {_kind(tokens)}"
        )
    for k, token in enumerate(tokens):
        if type(token) is not int or not 0 <= token < TOKEN_LIMIT:
            raise SnapshotError(
                f"{where}: tokens[{k}] must be an int in [0, 2**63), got {_short(repr(token))}"
            )
    if type(priority) is not int or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise SnapshotError(
            f"{where}: priority must be an int in {MIN_PRIORITY}..{MAX_PRIORITY}, "
            f"got {_short(repr(priority))}"
        )
    if type(frames) is not list or len(frames) != num_pools:
        raise SnapshotError(
            f"{where}: frames must be a list with one entry per pool ({num_pools}), "
            f"got {_kind(frames)}"
        )
    for p, frame in enumerate(frames):
        if frame is not None and type(frame) is not bytes:
            raise SnapshotError(f"{where}: frames[{p}] must be bytes or null, got {_kind(frame)}")


def check_frames(engine: KVCacheManager, records: list[list[Any]]) -> None:
    """Every frame must be the KV of one block of its pool here: dtype, shape, length and
    checksum (without copying the data)."""
    expected = []
    for pool in engine.plan.pools:
        view = engine.pool_view(pool.index)
        shape = (view.shape[0], *view.shape[2:])
        code = payload.DTYPE_CODES.get(view.dtype)
        nbytes = math.prod(shape) * view.element_size()
        offset = payload._HEADER.size + 8 * len(shape)
        expected.append((shape, code, nbytes, offset, view.dtype))
    for i, rec in enumerate(records):
        for p, frame in enumerate(rec[5]):
            if frame is None:
                continue
            shape, code, nbytes, offset, dtype = expected[p]
            where = f"snapshot: record {i}: frames[{p}]"
            if len(frame) != offset + nbytes:
                raise SnapshotError(
                    f"{where} is {len(frame)} bytes, a block of pool {p} "
                    f"({dtype} {list(shape)}) is a frame of {offset + nbytes}"
                )
            magic, version, got_code, ndim, crc, got_bytes = payload._HEADER.unpack_from(frame)
            if (magic, version, got_code, ndim, got_bytes) != (
                payload.MAGIC,
                payload.VERSION,
                code,
                len(shape),
                nbytes,
            ) or struct.unpack_from(f"<{ndim}Q", frame, payload._HEADER.size) != shape:
                raise SnapshotError(
                    f"{where} is not a version {payload.VERSION} frame of a {dtype} "
                    f"{list(shape)} block of pool {p}"
                )
            if zlib.crc32(memoryview(frame)[offset:]) != crc:
                raise SnapshotError(f"{where}: checksum mismatch")


def import_snapshot(engine: KVCacheManager, blob: bytes) -> ImportResult:
    """Load a snapshot into ``engine``; stops early (keeping what fit) when the cache is full.

    Everything is checked before the first engine call: a refused snapshot (SnapshotError)
    changes nothing. The engine's query/hit counters are restored afterwards: importing is
    not client traffic.
    """
    geo, records = read_snapshot(blob)
    here = geometry(engine)
    if geo != here:
        raise SnapshotGeometryError(
            f"snapshot: geometry {_short(repr(geo))} differs from this agent's {here}"
        )
    check_frames(engine, records)
    depth: list[int] = []
    has_child: set[int] = set()
    for rec in records:
        parent = rec[2]
        depth.append(1 if parent < 0 else depth[parent] + 1)
        if parent >= 0:
            has_child.add(parent)
    budget = IMPORT_WORK_BASE + IMPORT_WORK_PER_RECORD * len(records)
    result = ImportResult()
    with engine.uncounted():  # importing is not client traffic
        for i in range(len(records)):
            if i in has_child:
                continue
            if depth[i] > budget:
                result.skipped += 1
                continue
            budget -= depth[i]
            chain = _chain(records, i)
            segments = _segments(chain)
            cost = sum(end for _, end, _ in segments)
            if cost > budget:
                result.skipped += 1
                continue
            budget -= cost
            try:
                for start, end, runs in segments:
                    result.blocks_written += _import_segment(engine, chain, start, end, runs)
                result.chains += 1
                if chain[0][0] is not None or chain[0][1]:
                    result.namespaces.add((chain[0][0], tuple(chain[0][1])))
            except OutOfBlocksError:
                break
            except (SnapshotError, PayloadError, RequestTooLargeError):
                result.skipped += 1
    return result


def _priority_runs(chain: list[list[Any]]) -> list[tuple[int, int, int]]:
    """``(first block, end block, priority)`` of each run of equal non-default priority."""
    runs: list[tuple[int, int, int]] = []
    for j, rec in enumerate(chain):
        priority = rec[4]
        if priority == DEFAULT_PRIORITY:
            continue
        if runs and runs[-1][1] == j and runs[-1][2] == priority:
            runs[-1] = (runs[-1][0], j + 1, priority)
        else:
            runs.append((j, j + 1, priority))
    return runs


def _segments(chain: list[list[Any]]) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """``(start, end, priority runs)`` of the opens that import ``chain``: one, unless it
    changes priority more often than a retention policy may say. A later segment reuses the
    blocks of the earlier ones; its policy gives them the lowest priority, which never lowers
    what they already have."""
    runs = _priority_runs(chain)
    per_open = MAX_RANGES_PER_OPEN - 1  # one range is kept for the prefix of a later segment
    out = []
    start = 0
    for k in range(0, max(len(runs), 1), per_open):
        group = runs[k : k + per_open]
        end = len(chain) if k + per_open >= len(runs) else group[-1][1]
        out.append((start, end, group))
        start = end
    return out


def _import_segment(
    engine: KVCacheManager,
    chain: list[list[Any]],
    start: int,
    end: int,
    runs: list[tuple[int, int, int]],
) -> int:
    """Open the first ``end`` blocks of ``chain``, write the KV of those the cache did not
    hold, release; returns the blocks written."""
    tpb = engine.plan.tokens_per_block
    salt, extra = chain[0][0], tuple(chain[0][1])
    tokens = [t for rec in chain[:end] for t in rec[3]]
    ranges = [
        TokenRangeRetentionConfig(token_start=a * tpb, token_end=b * tpb, priority=priority)
        for a, b, priority in runs
    ]
    if ranges and start:
        ranges.insert(
            0,
            TokenRangeRetentionConfig(token_start=0, token_end=start * tpb, priority=MIN_PRIORITY),
        )
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
            for j in range(max(reused_blocks, first_block), end):
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
    """The records from the first block to record ``i`` (parents come first, so it ends)."""
    chain = []
    while i >= 0:
        chain.append(records[i])
        i = records[i][2]
    chain.reverse()
    return chain


def _kind(value: Any) -> str:
    """A short description of a value of the wrong kind (type, and length when it has one)."""
    if isinstance(value, (list, dict, str, bytes)):
        return f"{type(value).__name__} of length {len(value)}"
    if value is None or isinstance(value, (bool, int, float)):
        return f"{type(value).__name__} {value!r}"
    return type(value).__name__


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
