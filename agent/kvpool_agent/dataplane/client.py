"""A Python client of the transfer protocol: what an inference-engine connector calls.

``TransferClient(["10.0.0.5:8100", ...], token=...)`` keeps a small pool of authenticated
connections per replica and routes each chain of engine keys by rendezvous hashing of its
namespace and leading ``affinity_blocks`` keys (``kvpool_agent.client.rendezvous_rank``): chains
that share a prefix go to the replica that caches it. Calls are blocking and thread-safe (each
call takes a pooled connection of its own).

    client = TransferClient(replicas, token=token)
    ns = KeyNamespace("llama-3-8b", rank=0)
    count = len(client.lookup(ns, keys))           # no side effects
    lease = client.lease(ns, keys, ttl_s=10)      # pins the resident prefix
    if lease is not None:
        kv = client.empty_kv(lease.count)           # per pool [layers, n, 2, tpb, heads, dim]
        client.get_into(lease, kv)
        client.release(lease)
    client.put(ns, keys, new_kv, first=count)       # new_kv holds blocks count.. only

Retries: a connection that cannot be opened, or that breaks, is retried with exponential
backoff (``retries`` times), then the next-ranked replica is tried for lookups, leases and
stores. LOOKUP, GET and RELEASE are retried even when the request was already sent (they are
idempotent: a repeated RELEASE that finds the lease gone counts as done); LEASE and PUT only
when nothing of the request was sent. A PUT whose connection broke mid-stream raises
``TransferConnectionError`` (``request_sent`` true): the agent discarded that store, so calling
``put`` again is safe, but the client does not do it blindly.
"""

from __future__ import annotations

import contextlib
import hashlib
import select
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvpool_agent.client import DEFAULT_AFFINITY_BLOCKS, rendezvous_rank
from kvpool_agent.dataplane.keys import KeyNamespace
from kvpool_agent.dataplane.protocol import (
    CONFLICT,
    F_CRC,
    F_ERROR,
    HEADER_SIZE,
    NOT_FOUND,
    Header,
    Op,
    PoolLayout,
    frame,
    unpack_header,
    unpack_meta,
)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
}
IOV_MAX = 1024
READ_AHEAD = 64 << 10
FRESH_S = 1.0
"""A pooled connection used this recently is taken without checking that it is still open
(for idempotent requests: a stale one is retried anyway)."""


class TransferError(Exception):
    """The agent refused a request (``status`` as on the HTTP API, ``reason`` why)."""

    def __init__(self, status: int, reason: str, meta: dict[str, Any] | None = None) -> None:
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason
        self.meta = meta or {}


class ChainGapError(TransferError):
    """A PUT's data started past what the agent holds: nothing was stored; ``resident``
    is where the data must start."""

    @property
    def resident(self) -> int:
        return int(self.meta.get("resident", 0))


class TransferConnectionError(ConnectionError):
    """A connection failed; ``request_sent`` says whether the request may have reached the
    agent (then a non-idempotent request was not retried)."""

    def __init__(self, message: str, *, request_sent: bool) -> None:
        super().__init__(message)
        self.request_sent = request_sent


@dataclass(frozen=True)
class Geometry:
    """The agent's pools, as its AUTH reply describes them."""

    tokens_per_block: int
    pools: tuple[PoolLayout, ...]
    tenant: str | None
    max_keys: int
    max_frame_bytes: int
    max_lease_ttl_s: float

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer of every pool (a PUT carries this per block)."""
        return sum(p.block_bytes for p in self.pools)

    def kv_shape(
        self, pool: int, blocks: int, layers: tuple[int, int] | None = None
    ) -> tuple[int, ...]:
        """``[layers, blocks, 2, tokens_per_block, kv_heads, head_dim]`` of one pool."""
        p = self.pools[pool]
        return (len(p.selected(layers)), blocks, 2, p.tokens_per_block, p.kv_heads, p.head_dim)

    def empty_kv(
        self,
        blocks: int,
        layers: tuple[int, int] | None = None,
        *,
        pin_memory: bool = False,
        device: torch.device | None = None,
    ) -> list[torch.Tensor]:
        """Tensors to ``get_into`` (one per pool; pools without a selected layer get an
        empty one), in host memory unless ``device`` names another (a same-node client's
        CUDA arena reads into its own GPU)."""
        on_host = device is None or device.type == "cpu"
        return [
            torch.empty(
                self.kv_shape(p.index, blocks, layers),
                dtype=TORCH_DTYPES[p.dtype],
                device=device,
                pin_memory=pin_memory and on_host,
            )
            for p in self.pools
        ]


@dataclass(frozen=True)
class Lease:
    """Leading resident blocks of a chain, pinned on ``replica`` until released or expired."""

    replica: str
    lease_id: int
    count: int
    tiers: list[str]
    first_block: list[int]
    """Per pool, the first block a GET may start at (sliding-window pools hold only the
    blocks the window at the end of the prefix needs)."""
    ttl_s: float
    expires_at: float = field(compare=False)
    """``time.monotonic()`` when the agent drops it."""


@dataclass(frozen=True)
class PutResult:
    replica: str
    stored: int
    """Blocks written by this PUT."""
    resident: int
    """Leading blocks the agent held already (their bytes were not written)."""


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    array: Any = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def _parse_replica(replica: str) -> tuple[str, int]:
    text = replica.removeprefix("kvpx://")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"replica {replica!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


_HUNG_UP = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL
"""What ``poll`` reports for a peer that closed its end (``POLLRDHUP``: even with data left)."""


class _Connection:
    """One authenticated blocking connection to one replica."""

    def __init__(
        self,
        replica: str,
        token: str | None,
        timeout: float,
        connect_timeout: float,
        checksums: bool,
        sock: socket.socket | None = None,
    ) -> None:
        self.replica = replica
        self.checksums = checksums
        self.timeout = timeout
        if sock is None:
            host, port = _parse_replica(replica)
            sock = socket.create_connection((host, port), timeout=connect_timeout)
        self.sock = sock
        """Connected: TCP to ``replica``, or a Unix socket the same-node client opened."""
        # A blocking socket whose kernel timeouts bound each call: one system call per
        # receive (a Python socket timeout adds a poll before each).
        self.sock.settimeout(None)
        timeval = struct.pack("ll", int(timeout), int(timeout % 1 * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        if self.sock.family != socket.AF_UNIX:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.next_id = 1
        self._hang_up = select.poll()
        self._hang_up.register(self.sock.fileno(), _HUNG_UP)
        self.broken = False
        self.sent_any = False
        self.last_used = time.monotonic()
        self._buf = bytearray(READ_AHEAD)
        self._view = memoryview(self._buf)
        self._r0 = self._r1 = 0
        try:
            _, meta = self.request(Op.AUTH, {"token": token, "crc": checksums})
        except BaseException:
            self.close()
            raise
        self.auth_reply = meta
        self.geometry = Geometry(
            tokens_per_block=int(meta["tokens_per_block"]),
            pools=tuple(PoolLayout.from_meta(p) for p in meta["pools"]),
            tenant=meta.get("tenant"),
            max_keys=int(meta["max_keys"]),
            max_frame_bytes=int(meta["max_frame_bytes"]),
            max_lease_ttl_s=float(meta["max_lease_ttl_s"]),
        )

    def close(self) -> None:
        self.broken = True
        with contextlib.suppress(OSError):
            self.sock.close()

    def alive(self) -> bool:
        """False when the agent closed this (idle) connection meanwhile."""
        if self.broken:
            return False
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable  # an idle connection has nothing to read unless it was closed

    def hung_up(self) -> bool:
        """The agent closed its end (or the socket failed), known without a round trip and
        whether or not a reply is waiting to be read: unlike ``alive``, safe to ask from
        another thread while a request is in flight."""
        return bool(self._hang_up.poll(0))

    def _send(self, buffers: list[Any]) -> None:
        i, off = 0, 0
        while i < len(buffers):
            batch = [buffers[i][off:] if off else buffers[i], *buffers[i + 1 : i + IOV_MAX]]
            n = self.sock.sendmsg(batch)
            self.sent_any = True
            while n > 0:
                left = len(buffers[i]) - off
                if n >= left:
                    n -= left
                    i, off = i + 1, 0
                else:
                    off += n
                    n = 0
            while i < len(buffers) and len(buffers[i]) == 0:
                i += 1

    def _recv_exact(self, buf: memoryview) -> None:
        """Fill ``buf``: first from what was read ahead, then straight from the socket."""
        got = min(len(buf), self._r1 - self._r0)
        if got:
            buf[:got] = self._view[self._r0 : self._r0 + got]
            self._r0 += got
        while got < len(buf):
            n = self.sock.recv_into(buf[got:])
            if n == 0:
                raise ConnectionError("the agent closed the connection")
            got += n

    def _recv_bytes(self, n: int) -> bytes:
        """``n`` bytes of a header or metadata (read ahead in one call when they fit)."""
        if self._r1 - self._r0 < n <= len(self._buf):
            if self._r0 == self._r1 or self._r0 + n > len(self._buf):
                rest = self._view[self._r0 : self._r1].tobytes()
                self._buf[: len(rest)] = rest
                self._r0, self._r1 = 0, len(rest)
            while self._r1 - self._r0 < n:
                got = self.sock.recv_into(self._view[self._r1 :])
                if got == 0:
                    raise ConnectionError("the agent closed the connection")
                self._r1 += got
        if self._r1 - self._r0 >= n:
            out = self._view[self._r0 : self._r0 + n].tobytes()
            self._r0 += n
            return out
        big = bytearray(n)
        self._recv_exact(memoryview(big))
        return bytes(big)

    def _recv_fds(self, fds: list[int]) -> None:
        """Read the start of a reply with the file descriptors attached to it (the reply is
        the next thing on the connection: nothing may be read ahead)."""
        if self._r1 != self._r0:
            raise ConnectionError("a reply carrying descriptors was read ahead of")
        msg, got, _, _ = socket.recv_fds(self.sock, len(self._buf), 4)
        fds.extend(got)
        if not msg:
            raise ConnectionError("the agent closed the connection")
        self._buf[: len(msg)] = msg
        self._r0, self._r1 = 0, len(msg)

    def request(
        self,
        op: Op,
        meta: dict[str, Any],
        data: list[memoryview] | None = None,
        into: list[memoryview] | None = None,
        fds: list[int] | None = None,
    ) -> tuple[Header, dict[str, Any]]:
        """Send one request and read its reply (its data into ``into``; file descriptors
        sent with it, over a Unix socket, appended to ``fds``)."""
        self.sent_any = False
        rid = self.send(op, meta, data)
        return self.receive(rid, into, fds)

    def send(self, op: Op, meta: dict[str, Any], data: list[memoryview] | None = None) -> int:
        """Send one request without reading its reply; returns its id. The agent answers a
        connection's requests in order, so several may be in flight (``receive`` each, in
        the order sent)."""
        rid = self.next_id
        self.next_id += 1
        data = data or []
        nbytes = sum(len(b) for b in data)
        crc = None
        if data and self.checksums:
            crc = 0
            for buf in data:
                crc = zlib.crc32(buf, crc)
        try:
            self._send([frame(op, rid, meta, data_len=nbytes, crc=crc), *data])
        except (OSError, ValueError) as err:
            raise self.broke(err) from err
        return rid

    def receive(
        self, rid: int, into: list[memoryview] | None = None, fds: list[int] | None = None
    ) -> tuple[Header, dict[str, Any]]:
        """Read the reply to request ``rid`` (the oldest one not read yet); an error reply
        is raised as ``TransferError`` (``ChainGapError`` for a gap)."""
        try:
            if fds is not None:
                self._recv_fds(fds)
            head = unpack_header(self._recv_bytes(HEADER_SIZE))
            reply = unpack_meta(self._recv_bytes(head.meta_len))
            if head.request_id != rid and head.request_id != 0:
                raise ConnectionError(f"reply to request {head.request_id}, expected {rid}")
            if head.flags & F_ERROR:
                if head.data_len:
                    self._recv_bytes(head.data_len)
                raise self.refusal(reply)
            if into is not None:
                want = sum(len(b) for b in into)
                if head.data_len != want:
                    raise ConnectionError(f"reply carries {head.data_len} bytes, expected {want}")
                check = 0
                for buf in into:
                    self._recv_exact(buf)
                    if head.flags & F_CRC:
                        check = zlib.crc32(buf, check)
                if head.flags & F_CRC and check != head.crc:
                    raise TransferError(400, "get: the data's CRC-32 does not match")
            elif head.data_len:
                self._recv_bytes(head.data_len)
            return head, reply
        except TransferError:
            raise
        except (OSError, ConnectionError, ValueError, struct.error) as err:
            raise self.broke(err) from err

    def refusal(self, reply: dict[str, Any]) -> TransferError:
        """The error an error reply's metadata stands for (``ChainGapError`` for a gap); the
        connection is closed when the agent said it closes it after this reply."""
        status, reason = int(reply.get("status", 0)), str(reply.get("reason", ""))
        if reply.get("closing"):
            self.close()
        cls = ChainGapError if status == CONFLICT and "resident" in reply else TransferError
        return cls(status, reason, reply)

    def hand_over(self, ids: int) -> int | None:
        """The first of ``ids`` request ids taken for an exchange that compiled code runs on
        this socket (``ShmClient.put``), which then counts as sent; None when bytes were
        read ahead (the exchange would miss them: ``send`` and ``receive`` must run it)."""
        if self.broken or self._r0 != self._r1:
            return None
        rid = self.next_id
        self.next_id += ids
        self.sent_any = True
        return rid

    def broke(self, err: BaseException) -> TransferConnectionError:
        """Close the connection (its state is unknown) and say why."""
        self.close()
        why = f"timed out ({self.timeout:g}s)" if isinstance(err, BlockingIOError) else err
        return TransferConnectionError(f"{self.replica}: {why}", request_sent=self.sent_any)


class TransferClient:
    """Engine-key lookups, leases, gets and puts against a pool's agents."""

    def __init__(
        self,
        replicas: Iterable[str],
        *,
        token: str | None = None,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
        retries: int = 2,
        backoff_s: float = 0.05,
        max_idle_connections: int = 4,
        checksums: bool = False,
        affinity_blocks: int = DEFAULT_AFFINITY_BLOCKS,
    ) -> None:
        self.replicas = sorted(set(replicas))
        if not self.replicas:
            raise ValueError("replicas: a transfer client needs at least one HOST:PORT")
        for replica in self.replicas:
            _parse_replica(replica)
        self.token = token
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_idle = max_idle_connections
        self.checksums = checksums
        self.affinity_blocks = affinity_blocks
        self._idle: dict[str, list[_Connection]] = {}
        self._geometry: dict[str, Geometry] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ connections

    def close(self) -> None:
        with self._lock:
            conns = [c for pool in self._idle.values() for c in pool]
            self._idle.clear()
        for conn in conns:
            conn.close()

    def __enter__(self) -> TransferClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _acquire(self, replica: str, *, check: bool = True) -> _Connection:
        while True:
            with self._lock:
                pool = self._idle.get(replica)
                conn = pool.pop() if pool else None
            if conn is None:
                conn = _Connection(
                    replica, self.token, self.timeout, self.connect_timeout, self.checksums
                )
                self._geometry[replica] = conn.geometry
                return conn
            if (not check and time.monotonic() - conn.last_used < FRESH_S) or conn.alive():
                return conn
            conn.close()

    def _put_back(self, conn: _Connection) -> None:
        if conn.broken:
            return
        conn.last_used = time.monotonic()
        with self._lock:
            pool = self._idle.setdefault(conn.replica, [])
            if len(pool) < self.max_idle:
                pool.append(conn)
                return
        conn.close()

    def _on(self, replica: str, op: Op, fn: Any, *, idempotent: bool) -> Any:
        """Run ``fn(conn)`` on a connection to ``replica``, retrying broken connections."""
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * (2 ** (attempt - 1)))
            try:
                conn = self._acquire(replica, check=not idempotent)
            except (OSError, TransferConnectionError) as err:
                last = err
                continue
            try:
                out = fn(conn)
            except TransferConnectionError as err:
                if err.request_sent and not idempotent:
                    raise
                last = err
                continue
            except TransferError:
                self._put_back(conn)
                raise
            except BaseException:
                conn.close()
                raise
            self._put_back(conn)
            return out
        raise TransferConnectionError(
            f"{replica}: {op.name} failed after {self.retries + 1} attempts: {last}",
            request_sent=False,
        )

    def _ranked(self, op: Op, ns: KeyNamespace, keys: Sequence[bytes], fn: Any, **kw: Any) -> Any:
        """``fn`` on the replica the chain maps to, else the next-ranked ones."""
        last: Exception | None = None
        for replica in self.ranking(ns, keys):
            try:
                return self._on(replica, op, lambda c, r=replica: fn(c, r), **kw)
            except TransferConnectionError as err:
                if err.request_sent:
                    raise
                last = err
        raise TransferConnectionError(f"no replica answered {op.name}: {last}", request_sent=False)

    # ------------------------------------------------------------------ routing

    def route_key(self, ns: KeyNamespace, keys: Sequence[bytes]) -> bytes:
        """The digest a chain is routed by: its namespace and leading ``affinity_blocks`` keys."""
        h = hashlib.blake2b(digest_size=16)
        h.update(ns.salt().encode())
        for key in keys[: self.affinity_blocks]:
            h.update(len(key).to_bytes(1, "little") + bytes(key))
        return h.digest()

    def ranking(self, ns: KeyNamespace, keys: Sequence[bytes]) -> list[str]:
        return rendezvous_rank(self.route_key(ns, keys), self.replicas)

    def replica_for(self, ns: KeyNamespace, keys: Sequence[bytes]) -> str:
        return self.ranking(ns, keys)[0]

    def geometry(self, replica: str | None = None) -> Geometry:
        """The pools of ``replica`` (default: the first), from its AUTH reply."""
        replica = replica or self.replicas[0]
        if replica not in self._geometry:
            self._on(replica, Op.AUTH, lambda c: None, idempotent=True)
        return self._geometry[replica]

    def empty_kv(
        self, blocks: int, layers: tuple[int, int] | None = None, *, pin_memory: bool = False
    ) -> list[torch.Tensor]:
        return self.geometry().empty_kv(blocks, layers, pin_memory=pin_memory)

    # ------------------------------------------------------------------ operations

    def ping(self, replica: str | None = None) -> None:
        replica = replica or self.replicas[0]
        self._on(replica, Op.PING, lambda c: c.request(Op.PING, {}), idempotent=True)

    def lookup(self, ns: KeyNamespace, keys: Sequence[bytes]) -> list[str]:
        """The tier of each leading block of the chain the agent holds (no side effects)."""
        meta = _chain_meta(ns, keys)

        def run(conn: _Connection, _: str) -> list[str]:
            return list(conn.request(Op.LOOKUP, meta)[1]["tiers"])

        out: list[str] = self._ranked(Op.LOOKUP, ns, keys, run, idempotent=True)
        return out

    def lease(
        self, ns: KeyNamespace, keys: Sequence[bytes], ttl_s: float | None = None
    ) -> Lease | None:
        """Pin the chain's leading resident blocks; None when none is resident."""
        meta = _chain_meta(ns, keys)
        if ttl_s is not None:
            meta["ttl"] = float(ttl_s)

        def run(conn: _Connection, replica: str) -> Lease | None:
            reply = conn.request(Op.LEASE, meta)[1]
            if not reply["lease"]:
                return None
            return Lease(
                replica=replica,
                lease_id=int(reply["lease"]),
                count=int(reply["count"]),
                tiers=list(reply["tiers"]),
                first_block=[int(x) for x in reply["first_block"]],
                ttl_s=float(reply["ttl"]),
                expires_at=time.monotonic() + float(reply["ttl"]),
            )

        out: Lease | None = self._ranked(Op.LEASE, ns, keys, run, idempotent=False)
        return out

    def release(self, lease: Lease) -> None:
        """Release a lease (one already gone, released or expired, counts as released)."""

        def run(conn: _Connection) -> None:
            try:
                conn.request(Op.RELEASE, {"lease": lease.lease_id})
            except TransferError as err:
                if err.status != NOT_FOUND:
                    raise

        self._on(lease.replica, Op.RELEASE, run, idempotent=True)

    def get_into(
        self,
        lease: Lease,
        dst: torch.Tensor | Sequence[torch.Tensor | None],
        *,
        start: int = 0,
        count: int | None = None,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Read blocks ``[start, start + count)`` of a lease into ``dst``: per pool a tensor
        ``[selected layers, count, 2, tokens_per_block, kv_heads, head_dim]`` of the pool's
        dtype (a single tensor for a single pool; None for pools without a selected layer).
        Contiguous CPU tensors are filled in place; others through a host copy."""
        count = lease.count - start if count is None else count
        geo = self.geometry(lease.replica)
        targets = _per_pool(dst, geo)
        into: list[memoryview] = []
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p, target in zip(geo.pools, targets, strict=True):
            shape = geo.kv_shape(p.index, count, layers)
            if shape[0] == 0:
                continue
            if target is None:
                raise ValueError(f"dst: pool {p.index} has selected layers but no tensor")
            _check(target, shape, TORCH_DTYPES[p.dtype], f"dst[{p.index}]")
            if target.device.type == "cpu" and target.is_contiguous():
                into.append(_tensor_bytes(target))
            else:
                host = torch.empty(shape, dtype=target.dtype)
                staged.append((target, host))
                into.append(_tensor_bytes(host))
        meta: dict[str, Any] = {"lease": lease.lease_id, "start": start, "count": count}
        if layers is not None:
            meta["layers"] = [layers[0], layers[1]]
        self._on(
            lease.replica,
            Op.GET,
            lambda c: c.request(Op.GET, meta, into=into),
            idempotent=True,
        )
        for target, host in staged:
            target.copy_(host)

    def put(
        self,
        ns: KeyNamespace,
        keys: Sequence[bytes],
        kv: torch.Tensor | Sequence[torch.Tensor],
        *,
        first: int = 0,
        priority: int | None = None,
    ) -> PutResult:
        """Store a chain: ``kv`` holds blocks ``first..`` of ``keys`` (per pool
        ``[layers, len(keys) - first, 2, tokens_per_block, kv_heads, head_dim]``). The agent
        must already hold blocks ``0..first - 1`` (else ``ChainGapError`` names where to
        start); blocks it already holds from ``first`` on are not written again."""
        meta = _chain_meta(ns, keys)
        meta["first"] = first
        if priority is not None:
            meta["priority"] = priority

        def run(conn: _Connection, replica: str) -> PutResult:
            geo = conn.geometry
            blocks = len(keys) - first
            data: list[memoryview] = []
            for p, tensor in zip(geo.pools, _per_pool(kv, geo), strict=True):
                if tensor is None:
                    raise ValueError(f"kv: pool {p.index} has no tensor")
                shape = geo.kv_shape(p.index, blocks)
                _check(tensor, shape, TORCH_DTYPES[p.dtype], f"kv[{p.index}]")
                if tensor.device.type != "cpu" or not tensor.is_contiguous():
                    tensor = tensor.contiguous().cpu()
                data.append(_tensor_bytes(tensor))
            reply = conn.request(Op.PUT, meta, data=data)[1]
            return PutResult(replica, int(reply["stored"]), int(reply["resident"]))

        out: PutResult = self._ranked(Op.PUT, ns, keys, run, idempotent=False)
        return out


class KVClient(Protocol):
    """What a connector needs of a pool: ``TransferClient`` (the transfer port, any node) and
    ``ShmClient`` (the same node's agent, through its arena) both are one."""

    def geometry(self, replica: str | None = None) -> Geometry: ...

    def lookup(self, ns: KeyNamespace, keys: Sequence[bytes]) -> list[str]: ...

    def lease(
        self, ns: KeyNamespace, keys: Sequence[bytes], ttl_s: float | None = None
    ) -> Lease | None: ...

    def release(self, lease: Lease) -> None: ...

    def get_into(
        self,
        lease: Lease,
        dst: torch.Tensor | Sequence[torch.Tensor | None],
        *,
        start: int = 0,
        count: int | None = None,
        layers: tuple[int, int] | None = None,
    ) -> None: ...

    def put(
        self,
        ns: KeyNamespace,
        keys: Sequence[bytes],
        kv: torch.Tensor | Sequence[torch.Tensor],
        *,
        first: int = 0,
        priority: int | None = None,
    ) -> PutResult: ...

    def close(self) -> None: ...


def _chain_meta(ns: KeyNamespace, keys: Sequence[bytes]) -> dict[str, Any]:
    return {"ns": [ns.model, ns.rank, ns.layer_group], "keys": [bytes(k) for k in keys]}


def _per_pool(
    tensors: torch.Tensor | Sequence[torch.Tensor | None], geo: Geometry
) -> list[torch.Tensor | None]:
    if isinstance(tensors, torch.Tensor):
        if len(geo.pools) != 1:
            raise ValueError(f"the agent has {len(geo.pools)} pools: pass one tensor per pool")
        return [tensors]
    out = list(tensors)
    if len(out) != len(geo.pools):
        raise ValueError(f"{len(out)} tensors for the agent's {len(geo.pools)} pools")
    return out


def _check(tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> None:
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise ValueError(
            f"{name}: expected a {dtype} tensor of shape {list(shape)} "
            "([layers, blocks, 2, tokens_per_block, kv_heads, head_dim]), "
            f"got {tensor.dtype} {list(tensor.shape)}"
        )
