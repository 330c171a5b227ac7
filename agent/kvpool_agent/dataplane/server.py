"""The transfer protocol's server: engine keys, leases and KV bytes on their own TCP port.

One asyncio task per connection reads frames in order (``protocol``); one writer task per
connection sends the replies in the same order, so a connection can have GETs streaming out
while the next requests (a PUT's bytes, say) come in. Engine work goes through
``AgentService`` (its lock, its ownership checks, its limits), and only the byte copies into
and out of pinned blocks happen outside the lock:

- GET: the block ids are looked up, and the lease's read count taken, in the same lock hold as
  the ownership check; the bytes are then sent straight from the pool memory (each
  ``view[layer, block]`` slice is contiguous) and only when the last byte is in the kernel
  does the read end. A lease released or expired meanwhile keeps its blocks pinned until
  then. The send is the compiled core's ``kvpool_native.Sender`` (the header and the slices'
  offsets, ``sendmsg`` of them without the GIL), or, with a checksum to take or without the
  compiled core, ``sendmsg`` of a memoryview per slice.
- PUT: ``begin_store`` opens the chain's synthetic sequence under the lock (its new blocks are
  private and pinned: nobody else reads or writes them); the bytes are received straight into
  those blocks; ``finish_store`` commits and releases under the lock again. Bytes of blocks
  the cache already holds are drained, not written. The receive is the compiled core's
  ``kvpool_native.Receiver`` (the slices' offsets as one array, ``readv`` into them, waiting on
  the socket without the GIL), or, with a checksum to take or without the compiled core,
  ``recvmsg_into`` of a memoryview per slice. A connection that fails or times out mid-PUT
  aborts the store (released with discard: nothing half-written enters the tree, nothing
  stays pinned).

The sockets are used directly (non-blocking, woken by the loop's reader/writer callbacks)
rather than through asyncio transports: a transport may keep a memoryview of the pool after
``write`` returns, and a GET must know when the bytes have left the pinned blocks. A pool
that is not in CPU memory (a CUDA primary tier) is staged through a host buffer.

Same node (``transfer.unix_socket``): the same protocol on a Unix socket, plus ops that move
no KV bytes (docs/dataplane.md "Same node"). After AUTH, MAP hands the arena's memfd over
(SCM_RIGHTS; a CUDA arena's IPC handle instead), GET_SHM takes a read of a lease's blocks
and names them by id, PUT_SHM reserves a chain's new blocks (``begin_store`` with a TTL), the
engine copies into or out of its mapping itself, and COMMIT finishes the store as a TCP PUT
does. Reads end on RELEASE of their lease; reservations expire like leases; both end when
their connection closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import stat
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvpool_agent.cache import CacheError
from kvpool_agent.credentials import AuthError, Principal
from kvpool_agent.dataplane.cuda_ipc import export_arena
from kvpool_agent.dataplane.keys import KeyNamespace
from kvpool_agent.dataplane.protocol import (
    BAD_FRAME,
    CONFLICT,
    F_CRC,
    F_ERROR,
    F_RESPONSE,
    FORBIDDEN,
    HEADER_SIZE,
    INVALID,
    NOT_FOUND,
    OPS_WITH_DATA,
    SHM_OPS,
    TOO_LARGE,
    UNAUTHENTICATED,
    UNAVAILABLE,
    VERSION,
    Header,
    Op,
    PoolLayout,
    ProtocolError,
    frame,
    unpack_header,
    unpack_meta,
)
from kvpool_agent.hugepages import shmem_setting
from kvpool_agent.server.service import (
    AgentService,
    Lease,
    RequestError,
    Store,
    engine_status,
)

try:
    from kvpool_native import Receiver, Sender
except ImportError:  # the compiled core is optional: the Python receive and send paths then
    Receiver = Sender = None

log = logging.getLogger("kvpool.agent.transfer")

READ_BUFFER = 64 << 10
"""Bytes read ahead for headers and metadata (a PUT's data is received in place)."""
SCRATCH_BYTES = 1 << 20
"""Buffer that drained bytes (blocks the cache already holds) are received into."""
IOV_MAX = 1024
"""Most buffers per ``sendmsg``/``recvmsg_into`` (Linux's ``IOV_MAX``)."""
BATCH_BYTES = 4 << 20
"""Most bytes one ``sendmsg``/``recvmsg_into`` is offered (more than a socket buffer holds)."""
MIN_BATCH_BYTES = 256 << 10
THREAD_BYTES = 1 << 20
"""Data at least this large is moved by a worker thread (the kernel copies then run beside
the event loop, on other cores, and the loop keeps serving); smaller data by the loop."""
POLL_SLICE_S = 0.1
"""How often a worker thread waiting on a socket checks that its connection is still open."""
CLOSE_FLUSH_S = 2.0
"""Time the last replies (an error frame) get to leave before a connection is closed."""
CLOSE_LINGER_S = 0.5
"""Time a closing connection keeps reading (and dropping) what the peer still sends."""


_OPS = frozenset(int(op) for op in Op)


class ConnectionClosed(Exception):
    """The peer closed the connection (or it broke)."""


@dataclass
class _PoolMemory:
    """Where the bytes of one pool's ``view[layer, block]`` slices are in the arena."""

    layout: PoolLayout
    base: int
    block_stride: int
    layer_stride: int

    def to_meta(self, num_blocks: int) -> dict[str, Any]:
        """Where a same-node peer finds the pool in its mapping of the arena (MAP reply)."""
        return {
            "index": self.layout.index,
            "base": self.base,
            "layer_stride": self.layer_stride,
            "block_stride": self.block_stride,
            "blocks": num_blocks,
        }

    def offsets(self, layers: list[int], blocks: list[int]) -> np.ndarray:
        """Arena offsets of ``view[layer, block]`` for each layer, then block: ``[L, B]``."""
        rows = np.asarray(layers, dtype=np.int64)[:, None] * self.layer_stride
        cols = np.asarray(blocks, dtype=np.int64)[None, :] * self.block_stride
        return self.base + rows + cols


def pool_layouts(service: AgentService) -> tuple[PoolLayout, ...]:
    plan = service.engine.plan
    return tuple(
        PoolLayout(
            index=p.index,
            layers=p.layers,
            kv_heads=p.kv_heads,
            head_dim=p.head_dim,
            dtype=p.dtype,
            tokens_per_block=p.tokens_per_block,
            window=None if p.is_full_attention else p.window,
        )
        for p in plan.pools
    )


class TransferServer:
    """The transfer port of one agent (``transfer.port`` on the server host) and its
    same-node Unix socket (``transfer.unix_socket``), either or both."""

    def __init__(
        self,
        service: AgentService,
        *,
        host: str | None = None,
        port: int | None = None,
        unix_socket: str | None = None,
    ) -> None:
        self.service = service
        self.config = service.config.transfer
        self.host = service.config.server.host if host is None else host
        requested = self.config.port if port is None else port
        self.unix_path = self.config.unix_socket if unix_socket is None else unix_socket
        if requested is None and self.unix_path is None:
            raise ValueError(
                "transfer.port and transfer.unix_socket are unset: the transfer port is disabled"
            )
        self.requested_port = requested
        self.layouts = pool_layouts(service)
        engine = service.engine
        self.shared_fd: int | None = None
        """The primary arena's memfd (same node on a CPU agent). Moved there before any
        view or pointer into the arena is taken below."""
        if self.unix_path is not None and engine.device.type == "cpu":
            self.shared_fd = engine.storage[0].share()
            _log_pages(engine.storage[0].nbytes, engine.storage[0].huge_page_bytes)
        self.direct = engine.device.type == "cpu"
        """Pools in CPU memory are read and written in place; else staged (tests may turn
        this off on a CPU agent to exercise the staged path)."""
        self.memory: list[_PoolMemory] = []
        for layout in self.layouts:
            view = engine.pool_view(layout.index)
            elem = view.element_size()
            self.memory.append(
                _PoolMemory(
                    layout,
                    view.storage_offset() * elem,
                    view.stride(1) * elem,
                    view.stride(0) * elem,
                )
            )
        self.arena: memoryview | None = None
        if self.direct:
            self.arena = tensor_bytes(engine.storage[0].arena)
        self._sock: socket.socket | None = None
        self._unix: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._accept_unix: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.port = 0

    def pool_memory(self) -> list[dict[str, Any]]:
        """Each pool's place in the primary arena (MAP reply)."""
        engine = self.service.engine
        return [
            m.to_meta(engine.storage[0].num_blocks(engine.plan.pools[m.layout.index].group))
            for m in self.memory
        ]

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Bind and listen (``port`` is then the bound port; the Unix socket, if any, gets
        ``transfer.unix_socket_mode``) and accept connections."""
        loop = asyncio.get_running_loop()
        if self.unix_path is not None:
            self._unix = _bind_unix(self.unix_path, self.config.unix_socket_mode)
            self._accept_unix = loop.create_task(self._accept(self._unix, local=True))
            log.info("transfer socket listening on %s", self.unix_path)
        if self.requested_port is None:
            return
        infos = socket.getaddrinfo(
            self.host, self.requested_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(512)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.port = int(sock.getsockname()[1])
        self._accept_task = loop.create_task(self._accept(sock, local=False))
        log.info("transfer port listening on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        """Stop accepting, close every connection (aborting in-flight stores and
        reservations, ending same-node reads)."""
        for task in (self._accept_task, self._accept_unix):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._accept_task = self._accept_unix = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._unix is not None:
            self._unix.close()
            self._unix = None
            assert self.unix_path is not None
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _accept(self, listener: socket.socket, *, local: bool) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as err:
                log.warning("transfer port: accept failed: %s", err)
                await asyncio.sleep(0.05)
                continue
            conn.setblocking(False)
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if len(self._connections) >= self.config.max_connections:
                self.service.refusals["transfer_connections"] += 1
                refusal = frame(
                    0,
                    0,
                    {
                        "status": UNAVAILABLE,
                        "reason": "limits: too many transfer connections "
                        f"({self.config.max_connections}, transfer.max_connections)",
                        "closing": True,
                    },
                    flags=F_RESPONSE | F_ERROR,
                )
                refused = loop.create_task(_refuse(conn, refusal))
                self._connections.add(refused)
                refused.add_done_callback(self._connections.discard)
                continue
            task = loop.create_task(Connection(self, conn, local=local).serve())
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)


class _SendCursor:
    """How far the sending of a list of buffers has got."""

    def __init__(self, buffers: list[Any]) -> None:
        self.buffers = buffers
        self.total = sum(len(b) for b in buffers)
        self.i = 0
        self.off = 0
        self.budget = BATCH_BYTES
        """Bytes to offer the next call: twice what the last one took (a call never takes
        more than the socket buffer has room for, so offering more only costs list work)."""
        self._skip()

    def _skip(self) -> None:
        while self.i < len(self.buffers) and len(self.buffers[self.i]) == 0:
            self.i += 1

    def done(self) -> bool:
        return self.i >= len(self.buffers)

    def batch(self) -> list[Any]:
        i = self.i
        first = self.buffers[i]
        more = min(
            IOV_MAX - 1, self.budget // max(1, len(self.buffers[min(i + 1, len(self.buffers) - 1)]))
        )
        return [first[self.off :] if self.off else first, *self.buffers[i + 1 : i + 1 + more]]

    def advance(self, n: int) -> None:
        self.budget = min(BATCH_BYTES, max(MIN_BATCH_BYTES, 2 * n))
        while n > 0:
            left = len(self.buffers[self.i]) - self.off
            if n >= left:
                n -= left
                self.i, self.off = self.i + 1, 0
            else:
                self.off += n
                n = 0
        self._skip()


class _RecvCursor:
    """How far receiving into a plan (buffers to fill, byte counts to drain) has got."""

    def __init__(self, plan: list[memoryview | int], checksum: bool, scratch: memoryview) -> None:
        self.plan = plan
        self.checksum = checksum
        self.scratch = scratch
        self.crc = 0
        self.drains = any(isinstance(x, int) for x in plan)
        self.total = sum(x if isinstance(x, int) else len(x) for x in plan)
        self.i = 0
        self.off = 0
        self.budget = BATCH_BYTES
        """Bytes to offer the next receive: twice what the last one got."""
        self._skip()

    def _size(self, k: int) -> int:
        seg = self.plan[k]
        return seg if isinstance(seg, int) else len(seg)

    def _skip(self) -> None:
        while self.i < len(self.plan) and self._size(self.i) == 0:
            self.i += 1

    def done(self) -> bool:
        return self.i >= len(self.plan)

    def take(self, src: memoryview) -> int:
        """Consume read-ahead bytes; returns how many were used."""
        used = 0
        while used < len(src) and not self.done():
            seg = self.plan[self.i]
            take = min(len(src) - used, self._size(self.i) - self.off)
            piece = src[used : used + take]
            if not isinstance(seg, int):
                seg[self.off : self.off + take] = piece
            if self.checksum:
                self.crc = zlib.crc32(piece, self.crc)
            used += take
            self._forward(take)
        return used

    def batch(self) -> list[memoryview]:
        """Buffers for the next receive: the plan's, drains mapped onto distinct parts of the
        scratch buffer (so that a checksum sees every byte before it is overwritten)."""
        if not self.drains:  # buffers only: a slice of the plan
            i = self.i
            first = self.plan[i]
            assert not isinstance(first, int)
            following = self.plan[min(i + 1, len(self.plan) - 1)]
            assert not isinstance(following, int)
            more = min(IOV_MAX - 1, self.budget // max(1, len(following)))
            rest: list[Any] = self.plan[i + 1 : i + 1 + more]
            return [first[self.off :] if self.off else first, *rest]
        out: list[memoryview] = []
        size = 0
        used = 0
        k = self.i
        while k < len(self.plan) and size < self.budget and len(out) < IOV_MAX:
            seg = self.plan[k]
            start = self.off if k == self.i else 0
            if isinstance(seg, int):
                room = len(self.scratch) - used
                if room <= 0:
                    break
                take = min(room, seg - start)
                out.append(self.scratch[used : used + take])
                used += take
                size += take
                if take < seg - start:
                    break
            else:
                out.append(seg[start:] if start else seg)
                size += len(seg) - start
            k += 1
        return out

    def advance(self, n: int, batch: list[memoryview]) -> None:
        self.budget = min(BATCH_BYTES, max(MIN_BATCH_BYTES, 2 * n))
        if self.checksum:
            left = n
            for piece in batch:
                if left <= 0:
                    break
                self.crc = zlib.crc32(piece[: min(left, len(piece))], self.crc)
                left -= len(piece)
        self._forward(n)

    def _forward(self, n: int) -> None:
        while n > 0:
            left = self._size(self.i) - self.off
            if n >= left:
                n -= left
                self.i, self.off = self.i + 1, 0
            else:
                self.off += n
                n = 0
        self._skip()


def _wait_fd(fd: int, write: bool, deadline: float, abort: threading.Event) -> None:
    """Block a worker thread until ``fd`` is ready (TimeoutError past ``deadline``)."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT if write else select.POLLIN)
    while True:
        if abort.is_set():
            raise ConnectionClosed("the connection is closing")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if poller.poll(min(left, POLL_SLICE_S) * 1000):
            return


def _send_blocking(
    sock: socket.socket, cursor: _SendCursor, deadline: float, abort: threading.Event
) -> None:
    while not cursor.done():
        try:
            n = sock.sendmsg(cursor.batch())
        except (BlockingIOError, InterruptedError):
            _wait_fd(sock.fileno(), True, deadline, abort)
            continue
        except OSError as err:
            raise ConnectionClosed(str(err)) from None
        cursor.advance(n)


def _recv_blocking(
    sock: socket.socket, cursor: _RecvCursor, deadline: float, abort: threading.Event
) -> None:
    while not cursor.done():
        batch = cursor.batch()
        try:
            n = sock.recvmsg_into(batch)[0]
        except (BlockingIOError, InterruptedError):
            _wait_fd(sock.fileno(), False, deadline, abort)
            continue
        except OSError as err:
            raise ConnectionClosed(str(err)) from None
        if n == 0:
            raise ConnectionClosed("peer closed the connection")
        cursor.advance(n, batch)


def _log_pages(nbytes: int, huge: int) -> None:
    """Say what pages back the shared arena: 4 KiB pages make scattered same-node copies
    slower, and it takes a node setting to change (docs/dataplane.md, "Huge pages")."""
    if huge >= nbytes // 2:
        log.info("same-node arena: %d MiB, %d MiB of it in 2 MiB pages", nbytes >> 20, huge >> 20)
        return
    setting = shmem_setting()
    log.info(
        "same-node arena: %d MiB in 4 KiB pages (transparent_hugepage/shmem_enabled: %s); "
        "scattered copies into it are slower than into 2 MiB pages, see docs/dataplane.md",
        nbytes >> 20,
        setting or "unknown",
    )


def _pump_blocking(
    move: Callable[[int, float], int],
    stream: Any,
    fd: int,
    deadline: float,
    abort: threading.Event,
) -> None:
    """Run a compiled ``Receiver``'s ``recv`` or ``Sender``'s ``send`` (``move``) from a worker
    thread until ``stream`` is done: it waits for the socket itself (without the GIL), coming
    back every ``POLL_SLICE_S`` to see that the connection is still open and the deadline not
    past."""
    while not stream.done:
        if abort.is_set():
            raise ConnectionClosed("the connection is closing")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        try:
            move(fd, min(left, POLL_SLICE_S))
        except OSError as err:
            raise ConnectionClosed(str(err)) from None


def _spans(offsets: np.ndarray, size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` runs of equal-size pieces at ``offsets`` (in order), adjacent
    pieces merged."""
    flat = offsets.ravel()
    if not len(flat):
        return []
    breaks = np.flatnonzero(np.diff(flat) != size) + 1
    starts = flat[np.concatenate(([0], breaks))]
    ends = flat[np.concatenate((breaks - 1, [len(flat) - 1]))] + size
    return list(zip(starts.tolist(), (ends - starts).tolist(), strict=True))


async def _linger_close(sock: socket.socket) -> None:
    """Close after the last reply: stop sending, then read and drop what the peer still sends
    for a moment, so that unread bytes do not make the kernel reset the connection (which
    would discard the error reply before the peer reads it)."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
    sink = bytearray(READ_BUFFER)
    try:
        async with asyncio.timeout(CLOSE_LINGER_S):
            while await loop.sock_recv_into(sock, sink):
                pass
    except (TimeoutError, OSError):
        pass
    finally:
        sock.close()


def _bind_unix(path: str, mode: int) -> socket.socket:
    """A listening Unix socket at ``path`` with permission bits ``mode``. A stale socket
    there (an agent that died) is replaced; any other file is left alone (an error). The
    socket is created with no permissions (umask-proof) and opened up to ``mode`` only after
    bind, so no other user can connect in between."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"transfer.unix_socket: {path} exists and is not a socket")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.fchmod(sock.fileno(), 0)  # Linux: the bound inode takes the socket's mode
        sock.bind(path)
        os.chmod(path, mode)
        sock.listen(512)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def _refuse(sock: socket.socket, refusal: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.send(refusal)
    await _linger_close(sock)


# --------------------------------------------------------------------- replies


@dataclass
class _Reply:
    """One queued reply: header and metadata, then data buffers (a GET), then ``finish``."""

    head: bytes
    data: list[memoryview] = field(default_factory=list)
    prepare: Callable[[], Awaitable[tuple[bytes, list[memoryview] | Any]]] | None = None
    """Builds ``head`` and ``data`` just before sending (GET: checksum, staging); ``data``
    may be a compiled ``Sender`` of the head and the data instead."""
    finish: Callable[[], Awaitable[None]] | None = None
    """Runs once the reply is sent, or dropped (a GET ends its read)."""
    fds: list[int] = field(default_factory=list)
    """File descriptors sent with the header (SCM_RIGHTS: MAP over the Unix socket)."""


def _reply(request: Header, meta: dict[str, Any] | None = None) -> bytes:
    return frame(request.op, request.request_id, meta, flags=F_RESPONSE)


def _error(op: int, request_id: int, status: int, reason: str, **extra: Any) -> bytes:
    meta = {"status": status, "reason": reason, **extra}
    return frame(op, request_id, meta, flags=F_RESPONSE | F_ERROR)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


# --------------------------------------------------------------------- one connection


class Connection:
    """One client connection: AUTH first, then requests in order."""

    def __init__(self, server: TransferServer, sock: socket.socket, *, local: bool = False) -> None:
        self.server = server
        self.local = local
        """A Unix socket connection: the same-node ops are allowed."""
        self.reads: dict[int, list[Lease]] = {}
        """Same-node reads (GET_SHM) taken by this connection, by lease id: they end on
        RELEASE of the lease or when the connection closes."""
        self.reservations: dict[int, Store] = {}
        """Same-node reservations (PUT_SHM) of this connection awaiting COMMIT or ABORT."""
        self.service = server.service
        self.config = server.config
        self.sock = sock
        self.fd = sock.fileno()
        self.loop = asyncio.get_running_loop()
        self.principal: Principal | None = None
        self.checksums = False
        self._buf = bytearray(READ_BUFFER)
        self._view = memoryview(self._buf)
        self._r0 = 0
        self._r1 = 0
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        self._queue: asyncio.Queue[_Reply | None] = asyncio.Queue(self.config.max_inflight)
        self._pending = 0
        """Replies queued or being sent (the idle timer waits while there are any)."""
        self._writer: asyncio.Task[None] | None = None
        self._main: asyncio.Task[Any] | None = None
        self._abort = threading.Event()
        """Set when the connection goes away: worker threads on its socket stop."""
        self._reading: asyncio.Future[None] | None = None
        """The connection's wait for its socket to become readable, while there is one."""
        self._watching = False
        """The loop watches the socket for reads (``_readable``)."""

    # ------------------------------------------------------------- socket primitives

    async def _wait(self, write: bool, deadline: float | None = None) -> None:
        """Until the socket is readable (writable), or TimeoutError at ``deadline`` (the
        loop's clock). The timer exists only while the wait does: a frame whose bytes are
        already there costs none (two ``asyncio.timeout`` contexts per frame were about a
        tenth of the agent's py-spy samples of same-node saves, docs/dataplane.md)."""
        fut: asyncio.Future[None] = self.loop.create_future()
        if write:
            self.loop.add_writer(self.fd, _wake, fut)
        else:
            self._reading = fut
            if not self._watching:
                self.loop.add_reader(self.fd, self._readable)
                self._watching = True
        timer = None if deadline is None else self.loop.call_at(deadline, _expire, fut)
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()
            if write:
                self.loop.remove_writer(self.fd)
            else:
                self._reading = None

    def _readable(self) -> None:
        """The socket has bytes: wake the wait for them. The loop keeps watching between one
        request's frames and the next (a reader added and removed per frame cost two system
        calls and a handle each time); with no wait to wake it stops, since it would be
        called on every turn of the loop until the bytes are read (a worker thread's)."""
        fut = self._reading
        if fut is None or fut.done():
            self._unwatch()
            return
        fut.set_result(None)

    def _unwatch(self) -> None:
        if self._watching:
            self.loop.remove_reader(self.fd)
            self._watching = False

    async def _recv_into(self, buffers: list[memoryview], deadline: float | None = None) -> int:
        """Receive into ``buffers`` (scatter): at least one byte, or ConnectionClosed (or
        TimeoutError once the loop's clock passes ``deadline``)."""
        while True:
            try:
                if len(buffers) == 1:
                    n = self.sock.recv_into(buffers[0])
                else:
                    n = self.sock.recvmsg_into(buffers)[0]
            except (BlockingIOError, InterruptedError):
                await self._wait(False, deadline)
                continue
            except OSError as err:
                raise ConnectionClosed(str(err)) from None
            if n == 0:
                raise ConnectionClosed("peer closed the connection")
            return n

    async def send_all(self, buffers: list[Any]) -> int:
        """Send every buffer (gather), returning when the last byte is in the kernel."""
        cursor = _SendCursor(buffers)
        if cursor.total >= THREAD_BYTES:
            deadline = time.monotonic() + self.config.body_timeout_s
            await self._in_thread(_send_blocking, self.sock, cursor, deadline, self._abort)
            return cursor.total
        while not cursor.done():
            batch = cursor.batch()
            try:
                n = self.sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                await self._wait(write=True)
                continue
            except OSError as err:
                raise ConnectionClosed(str(err)) from None
            cursor.advance(n)
        return cursor.total

    async def send_pieces(self, sender: Any) -> int:
        """Send a compiled ``Sender`` (a reply's head and data) and let go of it: from a worker
        thread for ``THREAD_BYTES`` or more, else from the loop, waiting for room."""
        try:
            if sender.total >= THREAD_BYTES:
                deadline = time.monotonic() + self.config.body_timeout_s
                await self._in_thread(
                    _pump_blocking, sender.send, sender, self.fd, deadline, self._abort
                )
                return int(sender.total)
            while True:
                try:
                    sender.send(self.fd)
                except OSError as err:
                    raise ConnectionClosed(str(err)) from None
                if sender.done:
                    return int(sender.total)
                await self._wait(write=True)
        finally:
            sender.close()

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a worker thread; if this task is cancelled, the thread is told
        to stop (``_abort``) and waited for: it may be touching pinned blocks."""
        fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self._abort.set()
            with contextlib.suppress(BaseException):
                await fut
            raise

    async def _fill(self, n: int, deadline: float | None = None) -> None:
        """At least ``n`` (<= READ_BUFFER) bytes read ahead (by ``deadline``, as
        ``_recv_into``)."""
        if self._r1 - self._r0 >= n:
            return
        if self._r0 == self._r1:
            self._r0 = self._r1 = 0
        elif self._r0 + n > READ_BUFFER:
            size = self._r1 - self._r0
            self._buf[:size] = self._buf[self._r0 : self._r1]
            self._r0, self._r1 = 0, size
        while self._r1 - self._r0 < n:
            self._r1 += await self._recv_into([self._view[self._r1 :]], deadline)

    async def _take(self, n: int, deadline: float | None = None) -> bytes:
        if n <= READ_BUFFER:
            await self._fill(n, deadline)
            out = bytes(self._view[self._r0 : self._r0 + n])
            self._r0 += n
            return out
        big = bytearray(n)
        await self.read_plan([memoryview(big)], checksum=False, deadline=deadline)
        return bytes(big)

    async def read_plan(
        self, plan: list[memoryview | int], *, checksum: bool, deadline: float | None = None
    ) -> int:
        """Receive the next bytes of the stream into ``plan`` in order: a memoryview is
        filled, an int is that many bytes drained. Returns the CRC-32 of all of them (0
        unless ``checksum``). ``deadline``: as ``_recv_into``'s (a worker thread's read, of
        ``THREAD_BYTES`` or more, ends by then too, and always within ``body_timeout_s``)."""
        cursor = _RecvCursor(plan, checksum, self._scratch)
        if self._r1 > self._r0 and not cursor.done():  # read ahead with the header
            self._r0 += cursor.take(self._view[self._r0 : self._r1])
        if cursor.done():
            return cursor.crc
        if cursor.total >= THREAD_BYTES:
            now = time.monotonic()
            until = now + self.config.body_timeout_s
            if deadline is not None:  # the loop's clock to the thread's
                until = min(until, now + deadline - self.loop.time())
            await self._in_thread(_recv_blocking, self.sock, cursor, until, self._abort)
            return cursor.crc
        while not cursor.done():
            batch = cursor.batch()
            cursor.advance(await self._recv_into(batch, deadline), batch)
        return cursor.crc

    async def receive(self, receiver: Any) -> None:
        """Receive the next bytes of the stream into a compiled ``Receiver`` (its pieces in
        order, drains dropped): what was read ahead first, then straight from the socket
        (from a worker thread for ``THREAD_BYTES`` or more)."""
        if self._r1 > self._r0 and not receiver.done:  # read ahead with the header
            self._r0 += receiver.take(self._view[self._r0 : self._r1])
        if receiver.done:
            return
        if receiver.total - receiver.received >= THREAD_BYTES:
            deadline = time.monotonic() + self.config.body_timeout_s
            await self._in_thread(
                _pump_blocking, receiver.recv, receiver, self.fd, deadline, self._abort
            )
            return
        while True:
            try:
                receiver.recv(self.fd)
            except OSError as err:
                raise ConnectionClosed(str(err)) from None
            if receiver.done:
                return
            await self._wait(write=False)

    # ------------------------------------------------------------- the connection

    async def serve(self) -> None:
        svc = self.service
        svc.transfer.connections += 1
        svc.transfer.accepted += 1
        self._main = asyncio.current_task()
        self._writer = self.loop.create_task(self._write_loop())
        closing: _Reply | None = None
        try:
            while True:
                header, meta = await self._next_frame()
                if self.principal is None and header.op != Op.AUTH:
                    svc.refusals["unauthenticated"] += 1
                    raise ProtocolError(UNAUTHENTICATED, "auth: the first frame must be AUTH")
                await self._dispatch(header, meta)
        except ProtocolError as err:
            if err.status == BAD_FRAME:
                svc.refusals["malformed"] += 1
            closing = _Reply(
                _error(self._last_op, self._last_id, err.status, err.reason, closing=True)
            )
        except (ConnectionClosed, TimeoutError):
            pass
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("transfer connection failed")
        finally:
            await self._shutdown(closing)
            await asyncio.shield(self._end_same_node())
            svc.transfer.connections -= 1

    async def _end_same_node(self) -> None:
        """A closed connection's same-node reads end and its reservations are aborted (a
        client that died mid-transfer leaks nothing; the bytes it was writing are lost)."""
        svc = self.service
        reads, self.reads = self.reads, {}
        for leases in reads.values():
            for lease in leases:
                await svc.end_read(lease)
        stores, self.reservations = self.reservations, {}
        for store in stores.values():
            if store.store_id in svc.stores:
                await svc.abort_store(store)
                svc.transfer.reservations_expired += 1

    _last_op = 0
    _last_id = 0

    async def _shutdown(self, last: _Reply | None) -> None:
        self._unwatch()  # nothing reads the socket any more (the linger close reads itself)
        writer = self._writer
        if writer is not None and not writer.done():
            if last is not None:
                with contextlib.suppress(Exception):
                    self._queue.put_nowait(last)
            with contextlib.suppress(Exception):
                self._queue.put_nowait(None)
            try:
                async with asyncio.timeout(CLOSE_FLUSH_S):
                    await asyncio.shield(writer)
            except (TimeoutError, asyncio.CancelledError, Exception):
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await writer
        # Replies that never left (a broken connection): end their reads.
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is not None and item.finish is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(item.finish())
        if last is not None:
            await _linger_close(self.sock)
        else:
            with contextlib.suppress(OSError):
                self.sock.close()

    async def _write_loop(self) -> None:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            try:
                async with asyncio.timeout(self.config.body_timeout_s):
                    head, data = item.head, item.data
                    if item.prepare is not None:
                        head, data = await item.prepare()
                    if not isinstance(data, list):
                        sent = await self.send_pieces(data)
                    elif item.fds:
                        await self._send_fds(head, item.fds)
                        sent = len(head) + await self.send_all(data)
                    else:
                        sent = await self.send_all([head, *data])
                self.service.transfer.bytes_sent += sent - len(head)
            except asyncio.CancelledError:
                raise
            except BaseException:
                # A reply that cannot be sent (peer gone, too slow): close the connection.
                if self._main is not None and not self._main.done():
                    self._main.cancel()
                raise
            finally:
                self._pending -= 1
                if item.finish is not None:
                    await asyncio.shield(item.finish())

    async def _send(self, item: _Reply) -> None:
        """Queue a reply (waits while ``max_inflight`` replies are queued: backpressure).
        A small reply with nothing queued before it is sent at once when the socket takes
        it (no hop through the writer task)."""
        if (
            not self._pending
            and item.prepare is None
            and item.finish is None
            and not item.data
            and not item.fds
        ):
            try:
                sent = self.sock.send(item.head)
            except (BlockingIOError, InterruptedError, OSError):
                sent = 0  # the writer waits for room, or meets the error and closes
            if sent == len(item.head):
                return
            item = _Reply(item.head[sent:])
        self._pending += 1
        try:
            await self._queue.put(item)
        except BaseException:
            self._pending -= 1
            if item.finish is not None:
                await asyncio.shield(item.finish())
            raise

    async def _send_fds(self, head: bytes, fds: list[int]) -> None:
        """Send ``head`` with ``fds`` attached to its first byte (SCM_RIGHTS)."""
        while True:
            try:
                n = socket.send_fds(self.sock, [head], fds)
                break
            except (BlockingIOError, InterruptedError):
                await self._wait(write=True)
            except OSError as err:
                raise ConnectionClosed(str(err)) from None
        if n < len(head):
            await self.send_all([head[n:]])

    async def _next_frame(self) -> tuple[Header, dict[str, Any]]:
        cfg = self.config
        while True:
            try:
                await self._fill(1, self.loop.time() + cfg.idle_timeout_s)
                break
            except TimeoutError:
                if self._pending:
                    continue  # the client is busy reading a long reply
                raise
        self._last_op, self._last_id = 0, 0
        deadline = self.loop.time() + cfg.header_timeout_s
        raw = await self._take(HEADER_SIZE, deadline)
        header = unpack_header(raw)
        self._last_op, self._last_id = header.op, header.request_id
        if header.op not in _OPS:
            raise ProtocolError(BAD_FRAME, f"frame: unknown opcode {header.op}")
        if header.flags & (F_RESPONSE | F_ERROR):
            raise ProtocolError(BAD_FRAME, "frame: a request may not set RESPONSE or ERROR")
        if header.meta_len > cfg.max_meta_bytes:
            raise ProtocolError(
                TOO_LARGE,
                f"frame: {header.meta_len} bytes of metadata, more than "
                f"{cfg.max_meta_bytes} (transfer.max_meta_bytes)",
            )
        if header.data_len > cfg.max_frame_bytes:
            raise ProtocolError(
                TOO_LARGE,
                f"frame: {header.data_len} bytes of data, more than {cfg.max_frame_bytes} "
                "(transfer.max_frame_bytes)",
            )
        if header.data_len and header.op not in OPS_WITH_DATA:
            raise ProtocolError(BAD_FRAME, f"frame: {Op(header.op).name} carries no data")
        if header.flags & F_CRC and header.op not in OPS_WITH_DATA:
            raise ProtocolError(BAD_FRAME, f"frame: {Op(header.op).name} has no checksum")
        meta = unpack_meta(await self._take(header.meta_len, deadline))
        return header, meta

    # ------------------------------------------------------------- requests

    async def _dispatch(self, header: Header, meta: dict[str, Any]) -> None:
        op = header.op
        if op == Op.AUTH:
            await self._auth(header, meta)
            return
        if op == Op.PUT:
            await self._put(header, meta)
            return
        handler = _HANDLERS[op]
        try:
            if op in SHM_OPS and not self.local:
                raise RequestError(
                    FORBIDDEN,
                    f"{Op(op).name}: a same-node op, only over the agent's Unix socket "
                    "(transfer.unix_socket)",
                )
            await handler(self, header, meta)
        except RequestError as err:
            await self._send(_Reply(_error(op, header.request_id, err.status, err.reason)))
        except CacheError as err:
            await self._send(_Reply(_error(op, header.request_id, engine_status(err), str(err))))

    async def _auth(self, header: Header, meta: dict[str, Any]) -> None:
        if self.principal is not None:
            raise ProtocolError(BAD_FRAME, "auth: this connection is authenticated already")
        _fields(meta, "AUTH", optional={"token", "crc"})
        token = meta.get("token")
        if token is not None and not isinstance(token, str):
            raise ProtocolError(BAD_FRAME, "meta.token: a string")
        crc = meta.get("crc", False)
        if not isinstance(crc, bool):
            raise ProtocolError(BAD_FRAME, "meta.crc: a boolean")
        try:
            principal = self.service.credentials.authenticate(f"Bearer {token}" if token else None)
        except AuthError as err:
            self.service.refusals["unauthenticated"] += 1
            raise ProtocolError(UNAUTHENTICATED, err.reason) from None
        self.principal = principal
        self.checksums = crc
        cfg = self.config
        await self._send(
            _Reply(
                _reply(
                    header,
                    {
                        "version": VERSION,
                        "tenant": principal.tenant,
                        "tokens_per_block": self.service.engine.tpb,
                        "pools": [layout.to_meta() for layout in self.server.layouts],
                        "max_keys": cfg.max_keys,
                        "max_frame_bytes": cfg.max_frame_bytes,
                        "max_inflight": cfg.max_inflight,
                        "max_lease_ttl_s": cfg.max_lease_ttl_s,
                        "crc": crc,
                        "same_node": self.local,
                        # MAP_INDEX is served (an older agent does not know the op, and
                        # would close the connection on it).
                        "first_blocks": self.local and self.service.engine.events.enabled,
                        # Which pod of its pool this agent is (a client on its node matches
                        # it to its name in the ring: dataplane/routed.py).
                        "pod": os.environ.get("POD_NAME") or None,
                    },
                )
            )
        )

    async def _ping(self, header: Header, meta: dict[str, Any]) -> None:
        _fields(meta, "PING")
        await self._send(_Reply(_reply(header)))

    async def _lookup(self, header: Header, meta: dict[str, Any]) -> None:
        _fields(meta, "LOOKUP", required={"ns", "keys"})
        assert self.principal is not None
        tiers = await self.service.lookup_keys(self.principal, _ns(meta), _keys(meta))
        await self._send(_Reply(_reply(header, {"count": len(tiers), "tiers": tiers})))

    async def _lease(self, header: Header, meta: dict[str, Any]) -> None:
        _fields(meta, "LEASE", required={"ns", "keys"}, optional={"ttl"})
        ttl = meta.get("ttl")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))):
            raise ProtocolError(BAD_FRAME, "meta.ttl: a number of seconds")
        assert self.principal is not None
        lease, tiers = await self.service.lease_keys(self.principal, _ns(meta), _keys(meta), ttl)
        out: dict[str, Any] = {"lease": 0, "count": 0, "tiers": [], "first_block": []}
        if lease is not None:
            out = {
                "lease": lease.public_id,
                "count": lease.blocks,
                "tiers": tiers,
                "first_block": lease.first_blocks,
                "ttl": lease.ttl_s,
            }
        await self._send(_Reply(_reply(header, out)))

    async def _release(self, header: Header, meta: dict[str, Any]) -> None:
        _fields(meta, "RELEASE", required={"lease"})
        assert self.principal is not None
        lease_id = _uint(meta, "lease")
        for lease in self.reads.pop(lease_id, []):  # this connection's same-node reads
            await self.service.end_read(lease)
        await self.service.release_lease(self.principal, lease_id)
        await self._send(_Reply(_reply(header)))

    # ------------------------------------------------------------- same node

    async def _map(self, header: Header, meta: dict[str, Any]) -> None:
        _fields(meta, "MAP", optional={"cuda"})
        server = self.server
        arena = self.service.engine.storage[0].arena
        # Without ``cuda`` the peer takes the arena as it is (the reply's ``kind`` says which).
        cuda = meta.get("cuda", arena.device.type == "cuda")
        if not isinstance(cuda, bool):
            raise ProtocolError(BAD_FRAME, "meta.cuda: a boolean")
        out: dict[str, Any] = {"pools": server.pool_memory(), "size": arena.numel()}
        if cuda:
            if arena.device.type != "cuda":
                raise RequestError(
                    CONFLICT,
                    "map: the primary tier is in CPU memory, there is no CUDA arena to export; "
                    "map its memfd instead (cuda false)",
                )
            out.update(export_arena(arena).to_meta())
            await self._send(_Reply(_reply(header, out)))
            return
        if server.shared_fd is None:
            raise RequestError(
                CONFLICT,
                f"map: the primary tier is in {arena.device.type} memory, not a memfd; "
                "map it through CUDA IPC (cuda true)",
            )
        out["kind"] = "memfd"
        await self._send(_Reply(_reply(header, out), fds=[server.shared_fd]))

    async def _map_index(self, header: Header, meta: dict[str, Any]) -> None:
        _fields(meta, "MAP_INDEX")
        assert self.principal is not None
        service = self.service
        table = await service.open_first_blocks(service.tenant_of(self.principal))
        fd = table.reader_fd()

        async def close() -> None:
            os.close(fd)

        out = {"kind": "memfd", "size": table.size, "buckets": table.buckets}
        await self._send(_Reply(_reply(header, out), fds=[fd], finish=close))

    async def _get_shm(self, header: Header, meta: dict[str, Any]) -> None:
        _fields(meta, "GET_SHM", required={"lease"}, optional={"start", "count", "layers"})
        lease_id = _uint(meta, "lease")
        # Without a range the read names every block the lease holds, in every pool: a
        # client keeps those ids for as long as its read lasts (until it releases) and asks
        # nothing more for the lease's other ranges and layers.
        whole = "start" not in meta and "count" not in meta and "layers" not in meta
        if not whole and ("start" not in meta or "count" not in meta):
            raise ProtocolError(
                BAD_FRAME,
                "GET_SHM: meta.start and meta.count go together (neither, and no layers: "
                "the whole lease)",
            )
        start = None if whole else _uint(meta, "start")
        count = 0 if whole else _uint(meta, "count")
        layers = _layer_range(meta, len(self.service.engine.plan.layer_pool))
        memory = self.server.memory
        chosen = [m.layout.index for m in memory if m.layout.selected(layers)]
        assert self.principal is not None
        lease, ids = await self.service.begin_read(self.principal, lease_id, start, count, chosen)
        self.reads.setdefault(lease_id, []).append(lease)
        blocks = [_id_bytes(ids.get(m.layout.index, [])) for m in memory]
        out: dict[str, Any] = {"count": lease.blocks if whole else count, "blocks": blocks}
        if whole:
            out["first_block"] = lease.first_blocks
        await self._send(_Reply(_reply(header, out)))

    async def _put_shm(self, header: Header, meta: dict[str, Any]) -> None:
        ns, keys, first, priority = _store_fields(meta, "PUT_SHM", {"ttl"})
        svc = self.service
        assert self.principal is not None
        ttl = meta.get("ttl", self.config.lease_ttl_s)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
            raise ProtocolError(BAD_FRAME, "meta.ttl: a number of seconds")
        start = await svc.begin_store(self.principal, ns, keys, first, priority, ttl_s=ttl)
        if start.store is None:
            if start.gap:
                reason = (
                    f"put: the cache holds only the first {start.resident} blocks of the chain, "
                    f"but the data starts at block {first}; send from block {start.resident}"
                )
                await self._send(
                    _Reply(
                        _error(
                            header.op, header.request_id, CONFLICT, reason, resident=start.resident
                        )
                    )
                )
            else:
                await self._send(
                    _Reply(_reply(header, {"store": 0, "resident": start.resident, "blocks": []}))
                )
            return
        store = start.store
        self.reservations[store.store_id] = store
        blocks = [_id_bytes(store.block_ids.get(m.layout.index, [])) for m in self.server.memory]
        out = {
            "store": store.store_id,
            "resident": store.resident,
            "blocks": blocks,
            "ttl": min(float(ttl), self.config.max_lease_ttl_s),
        }
        await self._send(_Reply(_reply(header, out)))

    def _reservation(self, meta: dict[str, Any], op: str) -> Store:
        _fields(meta, op, required={"store"})
        store_id = _uint(meta, "store")
        store = self.reservations.pop(store_id, None)
        if store is None:
            raise RequestError(
                NOT_FOUND,
                f"reservation {store_id} is not held by this connection (unknown, committed, "
                "aborted or expired)",
            )
        return store

    async def _commit_reservation(self, header: Header, meta: dict[str, Any]) -> None:
        store = self._reservation(meta, "COMMIT")
        await self.service.commit_store(store)
        stored = store.total - store.resident
        await self._send(_Reply(_reply(header, {"stored": stored, "resident": store.resident})))

    async def _abort_reservation(self, header: Header, meta: dict[str, Any]) -> None:
        store = self._reservation(meta, "ABORT")
        await self.service.abort_store(store)
        await self._send(_Reply(_reply(header)))

    async def _get(self, header: Header, meta: dict[str, Any]) -> None:
        _fields(meta, "GET", required={"lease", "start", "count"}, optional={"layers"})
        lease_id, start, count = _uint(meta, "lease"), _uint(meta, "start"), _uint(meta, "count")
        layers = _layer_range(meta, len(self.service.engine.plan.layer_pool))
        server = self.server
        chosen = [(m, m.layout.selected(layers)) for m in server.memory]
        chosen = [(m, sel) for m, sel in chosen if sel]
        total = sum(len(sel) * m.layout.layer_bytes for m, sel in chosen) * count
        if total > self.config.max_frame_bytes:
            raise RequestError(
                TOO_LARGE,
                f"get: {total} bytes is more than one frame may carry "
                f"({self.config.max_frame_bytes}, transfer.max_frame_bytes); ask for fewer blocks",
            )
        assert self.principal is not None
        lease, ids = await self.service.begin_read(
            self.principal, lease_id, start, count, [m.layout.index for m, _ in chosen]
        )
        checksum = self.checksums

        async def prepare() -> tuple[bytes, list[memoryview] | Any]:
            if server.direct and Sender is not None and not checksum:
                head = frame(
                    header.op, header.request_id, {"count": count}, flags=F_RESPONSE, data_len=total
                )
                return head, _direct_sender(server, chosen, ids, head)
            if server.direct:
                data = _direct_buffers(server, chosen, ids)
            else:
                data = await asyncio.to_thread(_staged_read, self.service, chosen, ids)
            crc = None
            if checksum:
                crc = (
                    await asyncio.to_thread(_crc32, data) if total >= THREAD_BYTES else _crc32(data)
                )
            head = frame(
                header.op,
                header.request_id,
                {"count": count},
                flags=F_RESPONSE,
                data_len=total,
                crc=crc,
            )
            return head, data

        async def finish() -> None:
            await self.service.end_read(lease)

        await self._send(_Reply(b"", prepare=prepare, finish=finish))

    async def _put(self, header: Header, meta: dict[str, Any]) -> None:
        ns, keys, first, priority = _store_fields(meta, "PUT")
        svc = self.service
        assert self.principal is not None
        per_block = sum(m.layout.block_bytes for m in self.server.memory)
        want = (len(keys) - first) * per_block
        if header.data_len != want:
            raise ProtocolError(
                BAD_FRAME,
                f"put: {header.data_len} bytes of data for blocks {first}..{len(keys) - 1}, "
                f"expected {want} ({per_block} per block, every layer of every pool)",
            )
        if self.checksums and not header.flags & F_CRC:
            raise ProtocolError(BAD_FRAME, "put: this connection sends checksums (F_CRC)")
        checksum = bool(header.flags & F_CRC)
        op, rid = header.op, header.request_id
        try:
            start = await svc.begin_store(self.principal, ns, keys, first, priority)
        except (RequestError, CacheError) as err:
            await self._drain(header)
            status = err.status if isinstance(err, RequestError) else engine_status(err)
            reason = err.reason if isinstance(err, RequestError) else str(err)
            await self._send(_Reply(_error(op, rid, status, reason)))
            return
        if start.store is None:
            await self._drain(header)
            if start.gap:
                reason = (
                    f"put: the cache holds only the first {start.resident} blocks of the chain, "
                    f"but the data starts at block {first}; send from block {start.resident}"
                )
                await self._send(_Reply(_error(op, rid, CONFLICT, reason, resident=start.resident)))
            else:
                await self._send(_Reply(_reply(header, {"stored": 0, "resident": start.resident})))
            return
        store = start.store
        try:
            crc = await self._receive_store(store, first, checksum, header.data_len)
            if checksum and crc != header.crc:
                await asyncio.shield(svc.abort_store(store))
                await self._send(
                    _Reply(_error(op, rid, BAD_FRAME, "put: the data's CRC-32 does not match"))
                )
                return
        except BaseException:
            await asyncio.shield(svc.abort_store(store))
            raise
        await svc.finish_store(store)
        stored = store.total - store.resident
        await self._send(_Reply(_reply(header, {"stored": stored, "resident": store.resident})))

    async def _drain(self, header: Header) -> None:
        """Read and drop a refused request's data, keeping the stream in step."""
        if header.data_len:
            async with asyncio.timeout(self.config.body_timeout_s):
                await self.read_plan([header.data_len], checksum=False)
            self.service.transfer.bytes_received += header.data_len

    async def _receive_store(self, store: Store, first: int, checksum: bool, nbytes: int) -> int:
        """Receive a PUT's data: blocks the store writes go to their blocks, the rest is
        drained. Returns the CRC-32 of the data (0 unless ``checksum``)."""
        server = self.server
        svc = self.service
        n = store.total
        ids = store.block_ids
        plan: list[memoryview | int] = []
        receiver = Receiver() if Receiver is not None and not checksum else None
        """The compiled receive (no checksum to take): the pieces' offsets as arrays, filled by
        ``readv`` without a Python object per piece; else ``plan``, memoryviews and drains."""
        staged: list[tuple[int, torch.Tensor]] = []
        skip = store.resident - first
        """Leading blocks of the data the cache held already: drained, not written."""
        for m in server.memory:
            layout = m.layout
            size = layout.layer_bytes
            if server.direct:
                arena = server.arena
                assert arena is not None
                offsets = m.offsets(list(range(len(layout.layers))), ids[layout.index])
                if receiver is not None:
                    if not skip:
                        receiver.add(arena, offsets.ravel(), size)
                    for row in offsets if skip else ():
                        receiver.drain(skip * size)
                        receiver.add(arena, row, size)
                    continue
                rows = [offsets] if not skip else [row[None, :] for row in offsets]
                for row in rows:
                    if skip:
                        plan.append(skip * size)
                    plan.extend(arena[at : at + k] for at, k in _spans(row, size))
            else:
                view = svc.engine.pool_view(layout.index)
                host = torch.empty(
                    (view.shape[0], n - first, *view.shape[2:]),
                    dtype=view.dtype,
                    pin_memory=view.device.type == "cuda",
                )
                data = tensor_bytes(host)
                if receiver is not None:
                    receiver.add(data, np.zeros(1, dtype=np.int64), len(data))
                else:
                    plan.append(data)
                staged.append((layout.index, host))
        crc = 0
        async with asyncio.timeout(self.config.body_timeout_s):
            if receiver is not None:
                try:
                    await self.receive(receiver)
                finally:
                    receiver.close()
            else:
                crc = await self.read_plan(plan, checksum=checksum)
        svc.transfer.bytes_received += nbytes
        if staged:
            task = asyncio.ensure_future(asyncio.to_thread(_staged_write, svc, staged, ids, skip))
            # Never let the copy outlive the store: wait for it even when cancelled.
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await task
                raise
        return crc


_HANDLERS: dict[int, Callable[[Connection, Header, dict[str, Any]], Awaitable[None]]] = {
    Op.PING: Connection._ping,
    Op.LOOKUP: Connection._lookup,
    Op.LEASE: Connection._lease,
    Op.RELEASE: Connection._release,
    Op.GET: Connection._get,
    Op.MAP: Connection._map,
    Op.MAP_INDEX: Connection._map_index,
    Op.GET_SHM: Connection._get_shm,
    Op.PUT_SHM: Connection._put_shm,
    Op.COMMIT: Connection._commit_reservation,
    Op.ABORT: Connection._abort_reservation,
}
"""What serves each request after AUTH (AUTH and PUT are dispatched before the table)."""


# --------------------------------------------------------------------- data buffers


def _id_bytes(ids: list[int]) -> bytes:
    """Block ids on the wire of the same-node ops: little-endian int32, so a peer turns them
    into an index tensor without a Python object per block."""
    return np.asarray(ids, dtype="<i4").tobytes()


def _crc32(buffers: list[memoryview]) -> int:
    crc = 0
    for buf in buffers:
        crc = zlib.crc32(buf, crc)
    return crc


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (no copy)."""
    array: Any = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def _direct_buffers(
    server: TransferServer, chosen: list[tuple[_PoolMemory, list[int]]], ids: dict[int, list[int]]
) -> list[memoryview]:
    """Memoryviews of the pool slices of a GET, in wire order, adjacent slices merged."""
    arena = server.arena
    assert arena is not None
    out: list[memoryview] = []
    for m, layers in chosen:
        offsets = m.offsets(layers, ids[m.layout.index])
        out.extend(arena[at : at + n] for at, n in _spans(offsets, m.layout.layer_bytes))
    return out


def _direct_sender(
    server: TransferServer,
    chosen: list[tuple[_PoolMemory, list[int]]],
    ids: dict[int, list[int]],
    head: bytes,
) -> Any:
    """A compiled ``Sender`` of ``head`` and then the pool slices of a GET, in wire order."""
    arena = server.arena
    assert arena is not None and Sender is not None
    sender = Sender()
    sender.add(head)
    for m, layers in chosen:
        offsets = m.offsets(layers, ids[m.layout.index])
        sender.add(arena, offsets.ravel(), m.layout.layer_bytes)
    return sender


def _staged_read(
    service: AgentService, chosen: list[tuple[_PoolMemory, list[int]]], ids: dict[int, list[int]]
) -> list[memoryview]:
    """A GET's bytes gathered from a device pool into host memory (wire order)."""
    out = []
    for m, layers in chosen:
        view = service.engine.pool_view(m.layout.index)
        index = torch.tensor(ids[m.layout.index], dtype=torch.long, device=view.device)
        rows = torch.tensor(layers, dtype=torch.long, device=view.device)
        host = view[rows[:, None], index[None, :]].contiguous().cpu()
        out.append(tensor_bytes(host))
    return out


def _staged_write(
    service: AgentService,
    staged: list[tuple[int, torch.Tensor]],
    ids: dict[int, list[int]],
    skip: int,
) -> None:
    """Copy a PUT's staged bytes into its private blocks of device pools."""
    for pool, host in staged:
        view = service.engine.pool_view(pool)
        index = torch.tensor(ids[pool], dtype=torch.long, device=view.device)
        view.index_copy_(1, index, host[:, skip:].to(view.device))
    if service.engine.device.type == "cuda":
        torch.cuda.synchronize(service.engine.device)


# --------------------------------------------------------------------- metadata fields


def _fields(
    meta: dict[str, Any],
    op: str,
    *,
    required: set[str] | frozenset[str] = frozenset(),
    optional: set[str] | frozenset[str] = frozenset(),
) -> None:
    missing = required - meta.keys()
    if missing:
        raise ProtocolError(BAD_FRAME, f"{op}: missing meta fields {sorted(missing)}")
    unknown = meta.keys() - required - optional
    if unknown:
        raise ProtocolError(BAD_FRAME, f"{op}: unknown meta fields {sorted(unknown)}")


def _store_fields(
    meta: dict[str, Any], op: str, extra: set[str] | frozenset[str] = frozenset()
) -> tuple[KeyNamespace, list[bytes], int, int | None]:
    """The chain a PUT or PUT_SHM stores: namespace, keys, the first block whose data comes,
    and the priority (None: the default); ``extra`` names the op's other optional fields."""
    _fields(meta, op, required={"ns", "keys", "first"}, optional={"priority", *extra})
    ns, keys = _ns(meta), _keys(meta)
    first = _uint(meta, "first")
    priority = meta.get("priority")
    if priority is not None and type(priority) is not int:
        raise ProtocolError(BAD_FRAME, "meta.priority: an integer")
    if first > len(keys):
        raise ProtocolError(BAD_FRAME, f"meta.first: {first} is past the {len(keys)} keys")
    return ns, keys, first, priority


def _ns(meta: dict[str, Any]) -> KeyNamespace:
    ns = meta["ns"]
    if (
        not isinstance(ns, list)
        or len(ns) != 3
        or not isinstance(ns[0], str)
        or type(ns[1]) is not int
        or type(ns[2]) is not int
    ):
        raise ProtocolError(BAD_FRAME, "meta.ns: [model (str), rank (int), layer_group (int)]")
    return KeyNamespace(ns[0], ns[1], ns[2])


def _keys(meta: dict[str, Any]) -> list[bytes]:
    keys = meta["keys"]
    if not isinstance(keys, list) or not set(map(type, keys)) <= {bytes}:  # (at C speed)
        raise ProtocolError(BAD_FRAME, "meta.keys: a list of byte strings")
    return keys


def _uint(meta: dict[str, Any], name: str) -> int:
    value = meta[name]
    if type(value) is not int or value < 0:
        raise ProtocolError(BAD_FRAME, f"meta.{name}: a non-negative integer")
    return value


def _layer_range(meta: dict[str, Any], num_layers: int) -> tuple[int, int] | None:
    layers = meta.get("layers")
    if layers is None:
        return None
    if (
        not isinstance(layers, list)
        or len(layers) != 2
        or type(layers[0]) is not int
        or type(layers[1]) is not int
    ):
        raise ProtocolError(BAD_FRAME, "meta.layers: [first, end) model layers")
    lo, hi = layers
    if not 0 <= lo < hi <= num_layers:
        raise RequestError(INVALID, f"layers: [{lo}, {hi}) is not inside [0, {num_layers})")
    return lo, hi
