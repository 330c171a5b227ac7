"""The same-node client: KV moves by memory copies through the agent's arena, not a socket.

An engine on the agent's node connects to the agent's Unix socket (``transfer.unix_socket``),
authenticates as over TCP, and gets the primary arena mapped into its own address space (a
memfd handed over with SCM_RIGHTS; on a CUDA agent, the device arena through a CUDA IPC
handle). Requests then carry block ids only:

    client = ShmClient("/run/kvpool/transfer.sock", token=token)
    lease = client.lease(ns, keys, ttl_s=10)
    if lease is not None:
        kv = client.empty_kv(lease.count)
        client.get_into(lease, kv)        # GET_SHM names the lease's blocks; we copy them
        client.get_into(lease, kv_part, start=2, count=1, layers=(0, 8))  # the same ids
        client.release(lease)             # ends the read: the blocks may move again
    client.put(ns, keys, new_kv, first=n)  # PUT_SHM reserves, we copy in, COMMIT
    client.put_many(ns, [(keys_a, kv_a), (keys_b, kv_b)])  # the same, pipelined

Block ids arrive as packed int32. On a CPU agent (a memfd) a read or a write is one compiled
scatter/gather copy (``kvpool_native.copy_spans``: one piece per layer per block, between the
mapping at the agent's paged layout and the caller's contiguous tensor, streaming stores past
1 MiB, no GIL held); without the compiled core, and for a CUDA arena, torch copies do it (an
``index_select`` per layer for a read, a slice copy per block for a write). The agent's blocks
are only guaranteed for as long as the read or reservation is held: a read must be done
before RELEASE on this connection (the agent ends a connection's reads when it closes it,
which each copy from held ids checks for afterwards), a write before COMMIT (or the
reservation's expiry, after which the blocks may belong to someone else). A client is one
connection; its calls are serialized (make one per thread for parallel copies).
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvpool_agent.dataplane.client import (
    TORCH_DTYPES,
    Geometry,
    Lease,
    PutResult,
    TransferConnectionError,
    TransferError,
    _check,
    _Connection,
    _per_pool,
)
from kvpool_agent.dataplane.cuda_ipc import CudaArenaHandle, open_arena
from kvpool_agent.dataplane.first_blocks import FirstBlockView
from kvpool_agent.dataplane.keys import KeyNamespace, chain_tokens
from kvpool_agent.dataplane.protocol import (
    INVALID,
    NOT_FOUND,
    Op,
    PoolLayout,
    lease_range_error,
    pack_meta,
    unpack_meta,
)
from kvpool_agent.hugepages import MADV_POPULATE_WRITE, advise_huge_pages

try:
    from kvpool_native import copy_spans as _copy_spans
    from kvpool_native import shm_put as _shm_put
except ImportError:  # the compiled core is optional: torch copies then
    _copy_spans = None
    _shm_put = None

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reservation:
    """New blocks of a chain reserved by PUT_SHM: the caller writes them, then commits."""

    store_id: int
    """0 when the agent held the whole chain already (nothing to write or commit)."""
    first: int
    """The chain block the caller's data starts at."""
    resident: int
    """Leading blocks the agent holds already: the reserved blocks are ``resident..``."""
    blocks: list[torch.Tensor]
    """Per pool, the agent's block ids of chain blocks ``resident..`` (int64)."""
    ttl_s: float


def _ids(raw: bytes) -> torch.Tensor:
    """Block ids off the wire (little-endian int32) as an int64 index tensor."""
    return torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int64))


def pool_views(
    arena: torch.Tensor, pools: Sequence[PoolLayout], memory: list[dict[str, Any]]
) -> list[torch.Tensor]:
    """Per pool, the paged view ``[layers, blocks, 2, tokens_per_block, kv_heads, head_dim]``
    of a mapped arena, from the MAP reply's bases and strides (the agent's own layout)."""
    out: list[torch.Tensor] = []
    for p, m in zip(pools, memory, strict=True):
        dtype = TORCH_DTYPES[p.dtype]
        elem = torch.empty((), dtype=dtype).element_size()
        t, h, d = p.tokens_per_block, p.kv_heads, p.head_dim
        out.append(
            torch.as_strided(
                arena.view(dtype),
                size=(len(p.layers), int(m["blocks"]), 2, t, h, d),
                stride=(
                    int(m["layer_stride"]) // elem,
                    int(m["block_stride"]) // elem,
                    t * h * d,
                    h * d,
                    d,
                    1,
                ),
                storage_offset=int(m["base"]) // elem,
            )
        )
    return out


@dataclass(frozen=True)
class _Read:
    """What a whole-lease GET_SHM named: per pool, the primary ids of the blocks the lease
    holds from the pool's first block (sliding-window pools start past 0)."""

    count: int
    first_block: list[int]
    ids: list[np.ndarray]

    def range(self, pool: int, start: int, count: int) -> np.ndarray:
        """Ids of blocks ``[start, start + count)`` of ``pool``, checked as the agent checks
        a ranged GET_SHM (422 outside the lease or before the pool's window)."""
        reason = lease_range_error(start, count, self.count, self.first_block, [pool])
        if reason is not None:
            raise TransferError(INVALID, reason)
        at = start - self.first_block[pool]
        return self.ids[pool][at : at + count]


@dataclass(frozen=True)
class _Placement:
    """Where one pool's ``[layer, block]`` pieces are in the mapping (bytes)."""

    base: int
    layer_stride: int
    block_stride: int
    piece: int
    """Bytes of one ``[layer, block]`` piece: ``2 * tokens_per_block * kv_heads * head_dim``
    elements."""

    def offsets(self, layers: Sequence[int], ids: np.ndarray) -> np.ndarray:
        """Mapping offsets of the pieces of ``ids`` in each of ``layers``, layer-major."""
        rows = np.asarray(layers, dtype=np.int64)[:, None] * self.layer_stride
        return (self.base + rows + ids[None, :] * self.block_stride).ravel()


def _contiguous(count: int, piece: int, rows: int, start: int = 0, total: int = 0) -> np.ndarray:
    """Offsets of pieces ``start..start + count`` of each of ``rows`` rows of ``total`` pieces
    (``count`` when 0) in a contiguous ``[rows, total, piece]`` buffer, row-major."""
    total = total or count
    cols = np.arange(start, start + count, dtype=np.int64)
    return ((np.arange(rows, dtype=np.int64)[:, None] * total + cols[None, :]) * piece).ravel()


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes (writable, no copy)."""
    array: Any = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def _map_shared(fd: int, size: int) -> mmap.mmap:
    """The agent's memfd, mapped shared, advised for huge pages where the agent's are
    (``advise_huge_pages``: a scattered copy with 4 KiB pages pays a TLB miss every few
    KiB), and populated up front: a first write to each page of a shared mapping faults,
    which made puts into fresh blocks several times slower than memcpy."""
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    advise_huge_pages(mapping)
    try:
        mapping.madvise(MADV_POPULATE_WRITE)
    except OSError:  # before Linux 5.14: map it again, populated by mmap itself
        mapping.close()
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        advise_huge_pages(mapping)
    return mapping


def _arena_identity(reply: dict[str, Any], fds: list[int]) -> tuple[object, ...]:
    """What names the arena a MAP reply hands over: its memfd's inode, or its IPC handle."""
    if reply.get("kind") == "cuda":
        return ("cuda", bytes(reply["handle"]), int(reply.get("offset", 0)))
    if len(fds) != 1:
        raise TransferError(502, "map: the agent sent no memfd")
    st = os.fstat(fds[0])
    return ("memfd", st.st_dev, st.st_ino)


class ShmClient:
    """One authenticated same-node connection and the agent's arena mapped beside it.

    ``cuda``: None (the default) maps the arena as the agent has it, its memfd on a CPU agent
    and its CUDA IPC handle on a CUDA agent (``device`` then says which GPU); True or False
    asks for that kind and is refused (409) when the agent has the other.
    ``copy_threads``: threads (the caller's included) that share one copy of 4 MiB or more
    on a CPU arena; 1 (the default) copies on the calling thread only, which is the most a
    busy node can count on. ``map_arena=False``: keys and leases only (``lookup``, ``lease``,
    ``release``), no MAP: what a connector's scheduler needs, without mapping (and
    populating) the whole arena in its process. ``map_index=True`` maps the caller's
    tenant's first-block table too (MAP_INDEX, ``dataplane/first_blocks.py``): a ``lookup``
    whose first key it does not list then answers no blocks without asking the agent
    (``local_misses`` counts them); where the agent offers none, every lookup asks."""

    def __init__(
        self,
        path: str,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        connect_timeout: float = 10.0,
        cuda: bool | None = None,
        copy_threads: int = 1,
        map_arena: bool = True,
        map_index: bool = False,
    ) -> None:
        self.path = path
        self.copy_threads = max(1, int(copy_threads))
        self._settings = (token, timeout, connect_timeout)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(connect_timeout)
            sock.connect(path)
        except OSError as err:
            sock.close()
            raise TransferConnectionError(f"{path}: {err}", request_sent=False) from err
        self._conn = _Connection(path, token, timeout, connect_timeout, False, sock=sock)
        self._geometry: Geometry = self._conn.geometry
        self._lock = threading.Lock()
        self._reading: dict[int, _Read] = {}
        """The leases this connection reads (its first GET_SHM of each named every block
        the lease holds), by lease id: pinned for the read until this client releases them,
        so later reads of other ranges and layers need no round trip."""
        self._mapping: mmap.mmap | None = None
        self._arena_id: tuple[object, ...] | None = None
        self.arena: torch.Tensor | None = None
        """The agent's arena as a flat uint8 tensor (None without ``map_arena``)."""
        self.views: list[torch.Tensor] = []
        self._placements: list[_Placement] = []
        self.index: FirstBlockView | None = None
        """The tenant's first-block table (``map_index``), None where the agent has none."""
        self.local_misses = 0
        """Lookups the first-block table answered (no block held) without a round trip."""
        try:
            if map_arena:
                self.arena = self._map(cuda)
            if map_index:
                self.index = self._map_index()
        except BaseException:
            self._conn.close()
            raise

    def _map_index(self) -> FirstBlockView | None:
        """MAP_INDEX: the tenant's first-block table, read-only; None when the agent has
        none to give (no KV events, or it predates the table: its AUTH reply says)."""
        if not self._conn.auth_reply.get("first_blocks"):
            log.info("kvpool: %s offers no first-block table: every lookup asks", self.path)
            return None
        fds: list[int] = []
        try:
            _, reply = self._conn.request(Op.MAP_INDEX, {}, fds=fds)
            if reply.get("kind") != "memfd" or len(fds) != 1:
                raise TransferError(502, "map_index: the agent sent no memfd")
            return FirstBlockView(fds[0], int(reply["size"]))
        except (TransferError, ValueError) as err:
            log.info("kvpool: no first-block table from %s (%s): every lookup asks", self.path, err)
            return None
        finally:
            for fd in fds:
                os.close(fd)

    def _map(self, cuda: bool | None) -> torch.Tensor:
        """MAP: the arena as a flat uint8 tensor of this process, and the pool views."""
        fds: list[int] = []
        try:
            _, reply = self._conn.request(Op.MAP, {} if cuda is None else {"cuda": cuda}, fds=fds)
            size = int(reply["size"])
            self._arena_id = _arena_identity(reply, fds)
            if reply.get("kind") == "cuda":
                arena = open_arena(CudaArenaHandle.from_meta(reply))
            else:
                if reply.get("kind") != "memfd" or len(fds) != 1:
                    raise TransferError(502, "map: the agent sent no memfd")
                self._mapping = _map_shared(fds[0], max(size, 1))
                arena = torch.frombuffer(self._mapping, dtype=torch.uint8, count=size)
        finally:
            for fd in fds:  # the mapping holds its own reference
                os.close(fd)
        self.views = pool_views(arena, self._geometry.pools, reply["pools"])
        self._placements = [
            _Placement(
                int(m["base"]),
                int(m["layer_stride"]),
                int(m["block_stride"]),
                2 * p.tokens_per_block * p.kv_heads * p.head_dim * self.views[i].element_size(),
            )
            for i, (p, m) in enumerate(zip(self._geometry.pools, reply["pools"], strict=True))
        ]
        return arena

    def sibling(self) -> ShmClient:
        """A second connection to the same agent that shares this client's mapping (no
        second MAP): calls on the two run side by side (a connector's loads beside its
        saves), each connection's reads and reservations its own."""
        self._mapped()  # (ValueError without a mapping: there is nothing to share)
        token, timeout, connect_timeout = self._settings
        twin = ShmClient(
            self.path,
            token=token,
            timeout=timeout,
            connect_timeout=connect_timeout,
            copy_threads=self.copy_threads,
            map_arena=False,
        )
        fds: list[int] = []
        try:
            # The agent may have restarted since this client mapped its arena: the new one
            # must be the very memory this mapping shows (the memfd's inode, the IPC handle).
            _, reply = twin._conn.request(Op.MAP, {}, fds=fds)
            same = _arena_identity(reply, fds) == self._arena_id
        except BaseException:
            twin.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        if not same or twin._geometry != self._geometry:
            twin.close()
            raise TransferError(409, "sibling: the agent behind the socket is not the one mapped")
        twin.arena, twin.views, twin._mapping = self.arena, self.views, self._mapping
        twin._placements, twin._arena_id = self._placements, self._arena_id
        return twin

    @property
    def pod(self) -> str | None:
        """The agent's pod name (its ``POD_NAME``), as its AUTH reply gives it."""
        pod = self._conn.auth_reply.get("pod")
        return str(pod) if pod else None

    @property
    def device(self) -> torch.device | None:
        """Where the mapped arena lives (a GPU for a CUDA agent's); None without a mapping.
        Copies between the arena and tensors on the same device stay on that device."""
        return None if self.arena is None else self.arena.device

    @property
    def _compiled(self) -> bool:
        """Copies go through ``copy_spans`` (a memfd mapping, and the compiled core)."""
        return _copy_spans is not None and self._mapping is not None

    def close(self) -> None:
        """Close the connection: the agent ends this client's reads and aborts its
        uncommitted reservations. The mapping goes when the last tensor over it does."""
        self._reading.clear()
        self._conn.close()

    @property
    def broken(self) -> bool:
        """The connection failed or was closed (by this side, or by the agent: its restart,
        its idle timeout, seen without a round trip): open a new client."""
        return self._conn.broken or self._conn.hung_up()

    def _mapped(self) -> torch.Tensor:
        """The arena, for a read or a write (ValueError when this client did not map it)."""
        if self.arena is None:
            raise ValueError("this ShmClient has no arena (map_arena=False): no KV moves")
        return self.arena

    def __enter__(self) -> ShmClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def geometry(self, replica: str | None = None) -> Geometry:
        """The agent's pools (as ``TransferClient.geometry``; there is one agent, so
        ``replica`` is not needed)."""
        return self._geometry

    def _request(self, op: Op, meta: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return self._conn.request(op, meta)[1]

    # ------------------------------------------------------------- keys and leases

    def empty_kv(
        self,
        blocks: int,
        layers: tuple[int, int] | None = None,
        *,
        pin_memory: bool = False,
        device: torch.device | None = None,
    ) -> list[torch.Tensor]:
        """Tensors to ``get_into``: in host memory, or on ``device`` (``self.device``, for
        a CUDA agent's arena: the copies then stay on the GPU)."""
        return self._geometry.empty_kv(blocks, layers, pin_memory=pin_memory, device=device)

    def ping(self) -> None:
        self._request(Op.PING, {})

    def lookup(self, ns: KeyNamespace, keys: Sequence[bytes]) -> list[str]:
        """Tier of each leading resident block of the chain (no side effects). With the
        first-block table, a chain whose first key it does not list holds nothing (the
        agent is asked only while the connection is up: a restarted agent has a new table)."""
        index = self.index
        if index is not None and keys and not self.broken:
            first = chain_tokens([bytes(keys[0])], self._geometry.tokens_per_block)
            if index.holds(ns, first[:2]) is False:
                self.local_misses += 1
                return []
        return list(self._request(Op.LOOKUP, _chain_meta(ns, keys))["tiers"])

    def lease(
        self, ns: KeyNamespace, keys: Sequence[bytes], ttl_s: float | None = None
    ) -> Lease | None:
        """Pin the chain's leading resident blocks; None when none is resident."""
        meta = _chain_meta(ns, keys)
        if ttl_s is not None:
            meta["ttl"] = float(ttl_s)
        reply = self._request(Op.LEASE, meta)
        if not reply["lease"]:
            return None
        return Lease(
            replica=self.path,
            lease_id=int(reply["lease"]),
            count=int(reply["count"]),
            tiers=list(reply["tiers"]),
            first_block=[int(x) for x in reply["first_block"]],
            ttl_s=float(reply["ttl"]),
            expires_at=time.monotonic() + float(reply["ttl"]),
        )

    def release(self, lease: Lease) -> None:
        """Release a lease and end this client's reads of it (one gone counts as done)."""
        self._reading.pop(lease.lease_id, None)
        try:
            self._request(Op.RELEASE, {"lease": lease.lease_id})
        except TransferError as err:
            if err.status != NOT_FOUND:
                raise

    # ------------------------------------------------------------- reads

    def get_into(
        self,
        lease: Lease,
        dst: torch.Tensor | Sequence[torch.Tensor | None],
        *,
        start: int = 0,
        count: int | None = None,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Copy blocks ``[start, start + count)`` of a lease out of the mapping into ``dst``
        (per pool ``[selected layers, count, 2, tokens_per_block, kv_heads, head_dim]``, as
        ``TransferClient.get_into``). The blocks stay pinned until ``release``."""
        arena = self._mapped()
        count = lease.count - start if count is None else count
        geo = self._geometry
        targets = _per_pool(dst, geo)
        for p, target in zip(geo.pools, targets, strict=True):
            shape = geo.kv_shape(p.index, count, layers)
            if shape[0] and target is None:
                raise ValueError(f"dst: pool {p.index} has selected layers but no tensor")
            if shape[0] and target is not None:
                _check(target, shape, TORCH_DTYPES[p.dtype], f"dst[{p.index}]")
        # Under the connection's lock: no other call's reply can arrive while the copy
        # runs, so a readable socket afterwards can only mean the agent closed it.
        with self._lock:
            read = self._read(lease)
            for p, target in zip(geo.pools, targets, strict=True):
                selected = p.selected(layers)
                if selected and target is not None:
                    self._copy_out(p.index, selected, read.range(p.index, start, count), target)
            if arena.device.type == "cuda":
                # The copies were queued on this thread's stream: wait for them, not for the
                # engine's kernels on its other streams.
                torch.cuda.current_stream(arena.device).synchronize()
            if not self._conn.alive():
                # The agent ends a connection's reads only after closing it: open now, the
                # blocks stayed pinned through the copy; closed, they may have moved.
                self._reading.clear()
                self._conn.close()
                raise TransferConnectionError(
                    f"{self.path}: the agent closed the connection, its reads ended; "
                    "what was copied may be stale",
                    request_sent=True,
                )

    def _read(self, lease: Lease) -> _Read:
        """This connection's read of ``lease`` (the lock held): the first call takes it
        (GET_SHM of the whole lease), later ones reuse its block ids."""
        read = self._reading.get(lease.lease_id)
        if read is None:
            reply = self._conn.request(Op.GET_SHM, {"lease": lease.lease_id})[1]
            read = _Read(
                int(reply["count"]),
                [int(x) for x in reply["first_block"]],
                [np.frombuffer(raw, dtype="<i4") for raw in reply["blocks"]],
            )
            self._reading[lease.lease_id] = read
        return read

    def _copy_out(
        self, pool: int, layers: list[int], block_ids: np.ndarray, target: torch.Tensor
    ) -> None:
        """Blocks ``block_ids`` of ``pool``, in ``layers``, out of the mapping into
        ``target``."""
        if self._compiled:
            self._gather(pool, layers, block_ids, target)
            return
        # One gather per layer, of rows that are each one contiguous [layer, block] slice:
        # torch copies those row by row (a gather over the whole strided 6-d view takes an
        # element-wise path, measured ~100x slower).
        view = self.views[pool].flatten(2)
        ids = torch.from_numpy(block_ids.astype(np.int64)).to(view.device)
        direct = target.device == view.device and target.is_contiguous()
        out = target.view(len(layers), len(block_ids), -1) if direct else None
        for i, layer in enumerate(layers):
            if out is not None:
                torch.index_select(view[layer], 0, ids, out=out[i])
            else:
                target[i].copy_(view[layer].index_select(0, ids).view(target.shape[1:]))

    def _gather(self, pool: int, layers: list[int], ids: np.ndarray, target: torch.Tensor) -> None:
        """Blocks ``ids`` of the mapping, in ``layers``, into ``target`` (``[layers, blocks,
        ...]``): one ``copy_spans`` of a piece per layer per block, through a host tensor when
        ``target`` is not a contiguous CPU one. The pieces are copied block by block, the
        order in which they lie in the mapping: with 8 KiB pieces that took about four fifths
        of the time of reading a layer's pieces across blocks (docs/dataplane.md)."""
        assert _copy_spans is not None and self._mapping is not None
        place = self._placements[pool]
        rows = len(layers)
        at = place.offsets(layers, ids.astype(np.int64)).reshape(rows, -1).T.ravel()
        to = _contiguous(len(ids), place.piece, rows).reshape(rows, -1).T.ravel()
        direct = target.device.type == "cpu" and target.is_contiguous()
        host = target if direct else torch.empty(target.shape, dtype=target.dtype)
        _copy_spans(_host_bytes(host), to, self._mapping, at, place.piece, self.copy_threads)
        if not direct:
            target.copy_(host)

    # ------------------------------------------------------------- writes

    def reserve(
        self,
        ns: KeyNamespace,
        keys: Sequence[bytes],
        *,
        first: int = 0,
        priority: int | None = None,
        ttl_s: float | None = None,
    ) -> Reservation:
        """PUT_SHM: reserve the chain's blocks the agent does not hold (from ``first``, whose
        predecessors it must hold: else ``ChainGapError``). They are private until
        ``commit``; uncommitted past ``ttl_s`` (``transfer.lease_ttl_s`` by default) they are
        freed again."""
        self._mapped()  # nothing to reserve blocks for without the arena
        reply = self._request(Op.PUT_SHM, _reserve_meta(ns, keys, first, priority, ttl_s))
        return _reservation(reply, first)

    def write(self, reservation: Reservation, kv: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Copy ``kv`` (blocks ``first..`` of the chain, every layer of every pool, as
        ``TransferClient.put`` takes them) into the reserved blocks; blocks the agent held
        already are skipped."""
        arena = self._mapped()
        if not reservation.store_id:
            return
        geo = self._geometry
        skip = reservation.resident - reservation.first
        for p, tensor, ids in zip(geo.pools, _per_pool(kv, geo), reservation.blocks, strict=True):
            if tensor is None:
                raise ValueError(f"kv: pool {p.index} has no tensor")
            n = skip + len(ids)
            _check(tensor, geo.kv_shape(p.index, n), TORCH_DTYPES[p.dtype], f"kv[{p.index}]")
            if self._compiled:
                self._scatter(p.index, len(p.layers), ids.numpy(), tensor, skip)
                continue
            view = self.views[p.index]
            src = (tensor[:, skip:] if skip else tensor).to(view.device)
            # A copy per block (all its layers at once): measured at memcpy speed, where
            # index_copy_ (whole view or per layer) reaches about half of it.
            for i, block in enumerate(ids.tolist()):
                view[:, block].copy_(src[:, i])
        if arena.device.type == "cuda":
            # The copies were queued on this thread's stream: wait for them, not for the
            # engine's kernels on its other streams.
            torch.cuda.current_stream(arena.device).synchronize()

    def _scatter(
        self, pool: int, layers: int, ids: np.ndarray, tensor: torch.Tensor, skip: int
    ) -> None:
        """``tensor``'s blocks ``skip..`` (every layer) into blocks ``ids`` of the mapping: one
        ``copy_spans`` of a piece per layer per block."""
        assert _copy_spans is not None and self._mapping is not None
        place = self._placements[pool]
        host = tensor.to("cpu", memory_format=torch.contiguous_format)
        to = place.offsets(range(layers), ids.astype(np.int64))
        at = _contiguous(len(ids), place.piece, layers, skip, skip + len(ids))
        _copy_spans(self._mapping, to, _host_bytes(host), at, place.piece, self.copy_threads)

    def commit(self, reservation: Reservation) -> PutResult:
        """COMMIT: the written blocks enter the cache (as a TCP PUT's do)."""
        if not reservation.store_id:
            return PutResult(self.path, 0, reservation.resident)
        reply = self._request(Op.COMMIT, {"store": reservation.store_id})
        return PutResult(self.path, int(reply["stored"]), int(reply["resident"]))

    def abort(self, reservation: Reservation) -> None:
        """ABORT: free the reserved blocks (nothing of them enters the cache)."""
        if reservation.store_id:
            self._request(Op.ABORT, {"store": reservation.store_id})

    def put(
        self,
        ns: KeyNamespace,
        keys: Sequence[bytes],
        kv: torch.Tensor | Sequence[torch.Tensor],
        *,
        first: int = 0,
        priority: int | None = None,
    ) -> PutResult:
        """Store a chain (reserve, copy in, commit); the same contract as
        ``TransferClient.put``. A failed copy aborts the reservation.

        Into a memfd arena, with the compiled core, the whole exchange runs in compiled code
        that holds no GIL (``kvpool_native.shm_put``): a caller's thread holds the
        interpreter lock only around the call, not through the round trips and the copy
        (docs/dataplane.md, "Same node")."""
        if _shm_put is not None and self._mapping is not None:
            sources = self._sources(kv, first, len(keys))
            with self._lock:
                rid = self._conn.hand_over(2)
                if rid is not None:
                    meta = pack_meta(_reserve_meta(ns, keys, first, priority, None))
                    return self._put_compiled(rid, meta, first, sources)
        reservation = self.reserve(ns, keys, first=first, priority=priority)
        try:
            self.write(reservation, kv)
        except BaseException:
            if not self._conn.broken:
                self.abort(reservation)
            raise
        return self.commit(reservation)

    def _sources(
        self, kv: torch.Tensor | Sequence[torch.Tensor], first: int, total: int
    ) -> list[tuple[Any, int, int, int, int, int, int]]:
        """Per pool, what ``shm_put`` copies from (see there), ``kv`` checked as ``write``
        checks it but for its block count, which the reservation decides."""
        geo = self._geometry
        out = []
        for p, tensor in zip(geo.pools, _per_pool(kv, geo), strict=True):
            if tensor is None:
                raise ValueError(f"kv: pool {p.index} has no tensor")
            blocks = int(tensor.shape[1]) if tensor.dim() > 1 else total - first
            _check(tensor, geo.kv_shape(p.index, blocks), TORCH_DTYPES[p.dtype], f"kv[{p.index}]")
            host = tensor.to("cpu", memory_format=torch.contiguous_format)
            place = self._placements[p.index]
            layout = (place.base, place.layer_stride, place.block_stride, place.piece)
            out.append((_host_bytes(host), *layout, len(p.layers), blocks))
        return out

    def _put_compiled(
        self, rid: int, meta: bytes, first: int, sources: list[tuple[Any, ...]]
    ) -> PutResult:
        """Under the lock: ``put``'s exchange as requests ``rid`` and ``rid + 1``, compiled."""
        conn = self._conn
        try:
            outcome = _shm_put(conn.sock.fileno(), rid, meta, first, self._mapping, sources)
        except (OSError, ValueError) as err:  # ConnectionError is an OSError
            raise conn.broke(err) from err
        kind = outcome[0]
        if kind == "stored":
            return PutResult(self.path, int(outcome[1]), int(outcome[2]))
        if kind == "held":
            return PutResult(self.path, 0, int(outcome[1]))
        if kind == "refused":
            raise conn.refusal(unpack_meta(outcome[1]))
        raise ValueError(str(outcome[1]))  # "mismatch": the reservation was aborted

    def put_many(
        self,
        ns: KeyNamespace,
        chains: Iterable[tuple[Sequence[bytes], torch.Tensor | Sequence[torch.Tensor]]],
        *,
        priority: int | None = None,
    ) -> list[PutResult]:
        """Store several chains, each as ``put`` does (from block 0), with the agent's work
        overlapped with the copies: the next chain's reservation is asked for before this
        chain's copy starts, and a commit's reply is read only after the next copy. The agent
        answers a connection in order and works on one request at a time, so while this
        thread copies one chain the agent commits the one before and reserves the one after;
        a stream of PUTs then costs about its copies alone (``bench/transfer.py``: the
        ``put_many`` column).

        Results are in the order of ``chains`` (which is read lazily, one ahead). The first
        failure is raised once nothing is in flight: the chains before it are stored, the
        ones reserved after it are aborted, the rest are not sent."""
        results: list[PutResult] = []
        # Requests sent and not answered yet, oldest first: (what it is, the chain's data for
        # a reservation, request id, the chain's index).
        inflight: deque[tuple[Op, Any, int, int]] = deque()
        todo = enumerate(chains)
        self._mapped()

        def ask() -> None:
            nxt = next(todo, None)
            if nxt is not None:
                i, (keys, kv) = nxt
                meta = _reserve_meta(ns, keys, 0, priority, None)
                inflight.append((Op.PUT_SHM, kv, self._conn.send(Op.PUT_SHM, meta), i))
                results.append(PutResult(self.path, 0, 0))  # its slot, filled below

        with self._lock:
            try:
                ask()
                while inflight:
                    op, kv, rid, i = inflight.popleft()
                    reply = self._conn.receive(rid)[1]
                    if op == Op.COMMIT:
                        stored, resident = int(reply["stored"]), int(reply["resident"])
                        results[i] = PutResult(self.path, stored, resident)
                        continue
                    reservation = _reservation(reply, 0)
                    ask()  # the agent reserves the next chain while this one is copied
                    if not reservation.store_id:
                        results[i] = PutResult(self.path, 0, reservation.resident)
                        continue
                    try:
                        self.write(reservation, kv)
                    except BaseException:
                        abort = self._conn.send(Op.ABORT, {"store": reservation.store_id})
                        inflight.append((Op.ABORT, None, abort, i))  # read in _settle
                        raise
                    commit = self._conn.send(Op.COMMIT, {"store": reservation.store_id})
                    inflight.append((Op.COMMIT, None, commit, i))
            except BaseException:
                self._settle(inflight)
                raise
        return results

    def _settle(self, inflight: deque[tuple[Op, Any, int, int]]) -> None:
        """After a failure in ``put_many``: read what is still in flight (the connection stays
        usable) and abort the reservations among it. A broken connection needs nothing: the
        agent aborts a closed connection's reservations itself."""
        while inflight and not self._conn.broken:
            op, _, rid, _ = inflight.popleft()
            try:
                reply = self._conn.receive(rid)[1]
            except TransferError:
                continue
            except TransferConnectionError:
                return
            if op == Op.PUT_SHM and int(reply.get("store", 0)):  # a reservation: abort it
                try:
                    abort = self._conn.send(Op.ABORT, {"store": int(reply["store"])})
                except TransferConnectionError:
                    return
                inflight.append((Op.ABORT, None, abort, -1))  # read after the earlier ones


def _reserve_meta(
    ns: KeyNamespace,
    keys: Sequence[bytes],
    first: int,
    priority: int | None,
    ttl_s: float | None,
) -> dict[str, Any]:
    meta = _chain_meta(ns, keys)
    meta["first"] = first
    if priority is not None:
        meta["priority"] = priority
    if ttl_s is not None:
        meta["ttl"] = float(ttl_s)
    return meta


def _reservation(reply: dict[str, Any], first: int) -> Reservation:
    return Reservation(
        store_id=int(reply["store"]),
        first=first,
        resident=int(reply["resident"]),
        blocks=[_ids(raw) for raw in reply["blocks"]],
        ttl_s=float(reply.get("ttl", 0.0)),
    )


def _chain_meta(ns: KeyNamespace, keys: Sequence[bytes]) -> dict[str, Any]:
    return {"ns": [ns.model, ns.rank, ns.layer_group], "keys": [bytes(k) for k in keys]}
