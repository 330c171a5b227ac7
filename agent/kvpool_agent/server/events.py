"""KV events on the wire: byte for byte what vLLM's publisher sends, over ZMQ with sequence
numbers and vLLM's replay protocol.

What consumers (llm-d's KV indexer, Dynamo's KV router, vLLM's own ``KVEventBatch`` decoder)
read, as vLLM 0.32 writes it (``vllm/distributed/kv_events.py``):

* PUB socket, multipart ``[topic, seq (8 bytes, big-endian), payload]``. The topic is
  ``events.topic`` with ``{pod}`` and ``{model}`` filled in; the default ``kv@{pod}@{model}``
  is the ``kv@<pod>@<model>`` llm-d's indexer takes the pod and model of every block from.
* ``payload`` is ``msgspec.msgpack.Encoder().encode(KVEventBatch(...))``: the batch is an
  array ``[ts, [event, ...], data_parallel_rank]`` (``EventBatch`` is ``array_like``; vLLM's
  publisher fills in its rank, 0 without data parallelism, and so does the agent); each event
  is a map tagged by ``type`` (``KVCacheEvent`` is ``tag=True``, not ``array_like``), its
  fields in vLLM's declaration order, those with a default left out when at it
  (``omit_defaults``), those without one always present::

    {"type": "BlockStored", "block_hashes": [hash], "parent_block_hash": hash | None,
     "token_ids": [...], "block_size": n, "lora_id": None, "medium": m, "lora_name": None}
    {"type": "BlockRemoved", "block_hashes": [hash], "medium": m}
    {"type": "AllBlocksCleared"}

  ``medium`` is where the copy lives: ``"GPU"`` (a CUDA primary tier) or ``"CPU"`` (the host
  tier, or the primary tier of a CPU agent). Why a block went (``evicted``, ``replaced``,
  ``cleared``, ``pruned``) has no field in vLLM's events, so it stays off the wire: the agent
  counts removals by reason (``kvpool_kv_events_blocks_removed_total{reason}``).
* ROUTER replay socket, vLLM's protocol: a DEALER sends ``[b"", start_seq (8 bytes,
  big-endian)]`` (the ROUTER sees ``[identity, b"", start_seq]``, nothing else is answered)
  and gets ``[b"", topic, seq, payload]`` per buffered batch from that number on, then the end
  marker ``[b"", b"", -1 (8 bytes, signed), b""]``. Unlike vLLM, one request gets at most
  ``max_replay_batches`` batches (ask again from the next number): a request cannot make the
  agent send its whole buffer.

The engine reports a block changing tier as ``BlockUpdated``. On the wire that is a
``BlockRemoved`` with the medium it left, then a ``BlockStored`` with the medium it entered
(an offload: primary to host; an onboard: the reverse), so an indexer that keys blocks by
medium never keeps routing to a copy that is gone; a move between tiers of the same medium (a
CPU agent's primary and host tiers) publishes nothing. The engine reports a block once its
last copy is gone as ``BlockRemoved``, with the medium of that copy.

``WireEncoder`` is the reference; ``NativeWireEncoder`` (``kvpool_native.WireEncoder``,
``agent/native/src/wire/``) writes the same bytes and is what an agent on the compiled engine
core uses: it encodes the engine's event records where they lie, so storing a chain of
hundreds of blocks costs no Python object per event (``tests/native/test_wire_encoder.py``
compares the two batch by batch).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import zmq
import zmq.asyncio

from kvpool_agent.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockUpdated,
    KVEvent,
)
from kvpool_agent.cache.packed import PackedTokens

log = logging.getLogger("kvpool.agent.events")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
"""vLLM's ``ZmqEventPublisher.END_SEQ``: the sequence frame of the end-of-replay marker."""

DATA_PARALLEL_RANK = 0
"""The batch's ``data_parallel_rank``: vLLM's publisher writes its rank, 0 without data
parallelism; an agent is one cache, rank 0."""

DEFAULT_TOPIC = "kv@{pod}@{model}"
"""llm-d's topic: ``{pod}`` the pod's address, ``{model}`` the served model name."""

POD_ENV = ("POD_IP", "POD_NAME", "HOSTNAME")
"""Where ``{pod}`` comes from, first set wins (the operator sets all three): llm-d's indexer
identifies a pod by its address, as vLLM deployments do with ``kv@${POD_IP}@${MODEL}``."""

WIRE_FIELDS: dict[str, tuple[tuple[str, ...], int]] = {
    "BlockStored": (
        (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window",
            "locality",
            "ownership",
            "session_id",
        ),
        7,
    ),
    "BlockRemoved": (("block_hashes", "medium", "group_idx", "locality", "ownership"), 2),
    "AllBlocksCleared": ((), 0),
}
"""vLLM 0.32's event fields in declaration order, and how many come first without a default
(always encoded); the rest are encoded only when set (the agent sets none of them)."""


def resolve_topic(
    template: str, model: str | None, environ: Mapping[str, str] | None = None
) -> str:
    """``template`` with ``{pod}`` (``$POD_IP``, else ``$POD_NAME``, else ``$HOSTNAME``, else
    the host name) and ``{model}`` (``model``, empty when unset) filled in."""
    env = os.environ if environ is None else environ
    pod = next((env[name] for name in POD_ENV if env.get(name)), None) or socket.gethostname()
    return template.replace("{pod}", pod).replace("{model}", model or "")


@dataclass(slots=True)
class _Known:
    """What a later event of a live block needs: not its tokens, which a tier move carries
    (a block's tokens kept here for every live block took more memory than the engine's
    own records of it)."""

    parent: int | None
    """The parent's hash on the wire."""
    medium: str
    wire: int
    """This block's hash on the wire: the engine's own for a block stored by engine key."""


MAX_PENDING_NAMES = 100_000
"""Engine-key names waiting for their block's BlockStored (beyond it the oldest are dropped:
those blocks go out under the agent's own hash)."""


def wire_hash(key: bytes) -> int:
    """An engine key as vLLM's events name the block: the low 64 bits of the hash bytes read
    big-endian (``maybe_convert_block_hash`` with vLLM's default integer block hashes)."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


class WireEncoder:
    """Maps engine events to vLLM wire events, remembering each live block's last medium."""

    def __init__(self, block_size: int, primary_medium: str) -> None:
        self.block_size = block_size
        self.mediums = {"primary": primary_medium, "secondary": "CPU"}
        self._known: dict[int, _Known] = {}
        self.removed: Counter[str] = Counter()
        """Blocks whose last copy went, by reason (the wire has no field for it)."""
        self._names: dict[tuple[int, ...], int] = {}
        self._watched: set[int] = set()
        self._gone: list[int] = []

    def watch(self, key: int) -> None:
        """Report the block whose key (the engine's) is ``key`` through ``take_gone`` once an
        encoded event says its last copy went (BlockRemoved, AllBlocksCleared)."""
        self._watched.add(key)

    def take_gone(self) -> list[int]:
        """The watched keys whose blocks went since the last call (no longer watched)."""
        gone, self._gone = self._gone, []
        return gone

    @property
    def watched(self) -> int:
        return len(self._watched)

    def name(self, tokens: Sequence[int], key: bytes) -> None:
        """The block whose tokens are ``tokens`` (an engine key's synthetic tokens) is about to
        be stored: publish it under the engine's hash of ``key``, as the engine's own events
        name it, instead of the agent's hash of the tokens."""
        if len(self._names) >= MAX_PENDING_NAMES:
            self._names.pop(next(iter(self._names)))
        self._names[tuple(tokens)] = wire_hash(key)

    @property
    def pending_names(self) -> int:
        """Names given that no BlockStored has taken yet."""
        return len(self._names)

    def name_chain(self, tokens: Sequence[int] | PackedTokens, keys: Sequence[bytes]) -> None:
        """``name`` each block of a chain: block ``i`` is ``tokens[i*bs:(i+1)*bs]``."""
        if isinstance(tokens, PackedTokens):
            tokens = tokens.tolist()
        bs = self.block_size
        if len(tokens) != len(keys) * bs:
            raise ValueError(f"name_chain: {len(tokens)} tokens for {len(keys)} keys of {bs}")
        for i, key in enumerate(keys):
            self.name(tokens[i * bs : (i + 1) * bs], key)

    def encode_batch(
        self, events: Sequence[KVEvent], ts: float, rank: int
    ) -> tuple[bytes, int] | None:
        """The batch of ``events`` as published, and how many wire events it holds; None
        when they make none."""
        wire = [w for e in events for w in self.encode(e)]
        if not wire:
            return None
        return encode_batch(ts, wire, rank), len(wire)

    def drain_batch(self, queue: EventSource, ts: float, rank: int) -> tuple[bytes, int] | None:
        """``encode_batch`` of everything ``queue`` holds (drained)."""
        return self.encode_batch(queue.drain(), ts, rank)

    def encode(self, event: KVEvent) -> list[dict[str, Any]]:
        """The wire events of one engine event (none, one, or two for a tier move)."""
        if isinstance(event, BlockStored):
            medium = self.mediums[event.tier]
            tokens = list(event.token_ids)
            wire = self._names.pop(tuple(tokens), event.key) if self._names else event.key
            parent = event.parent_key
            if parent is not None and (up := self._known.get(parent)) is not None:
                parent = up.wire
            self._known[event.key] = _Known(parent, medium, wire)
            return [self._stored(wire, parent, tokens, medium)]
        if isinstance(event, BlockUpdated):
            known = self._known.get(event.key)
            medium = self.mediums[event.tier]
            if known is None or known.medium == medium:
                return []  # a priority change, or a move a consumer cannot see
            left = known.medium
            if event.token_ids is None:  # a move without its tokens: only the copy that went
                del self._known[event.key]
                return [self._removed(known.wire, left)]
            known.medium = medium
            return [
                self._removed(known.wire, left),
                self._stored(known.wire, known.parent, list(event.token_ids), medium),
            ]
        if isinstance(event, BlockRemoved):
            gone = self._known.pop(event.key, None)
            self.removed[event.reason] += 1
            if event.key in self._watched:
                self._watched.discard(event.key)
                self._gone.append(event.key)
            if gone is None:
                return [self._removed(event.key, self.mediums[event.tier])]
            return [self._removed(gone.wire, gone.medium)]
        if isinstance(event, AllBlocksCleared):
            self._known.clear()
            self._gone.extend(self._watched)
            self._watched.clear()
            return [{"type": "AllBlocksCleared"}]
        raise TypeError(f"unknown KV event {event!r}")

    def _stored(
        self, key: int, parent: int | None, tokens: list[int], medium: str
    ) -> dict[str, Any]:
        return {
            "type": "BlockStored",
            "block_hashes": [key],
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": self.block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
        }

    @staticmethod
    def _removed(key: int, medium: str) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": [key], "medium": medium}


class NativeWireEncoder:
    """``WireEncoder`` compiled (``kvpool_native.WireEncoder``): the same state and the same
    bytes, without a dict per event. With the compiled engine core it encodes the engine's
    event records where they are (``NativeEvents.drain_wire``), so a chain of hundreds of
    blocks costs no Python object per event."""

    def __init__(self, block_size: int, primary_medium: str) -> None:
        import kvpool_native

        self.block_size = block_size
        self._inner = kvpool_native.WireEncoder(block_size, primary_medium)

    @property
    def removed(self) -> dict[str, int]:
        """Blocks whose last copy went, by reason."""
        return dict(self._inner.removed)

    @property
    def pending_names(self) -> int:
        """Names given that no BlockStored has taken yet."""
        return int(self._inner.pending_names)

    def watch(self, key: int) -> None:
        self._inner.watch(key)

    def take_gone(self) -> list[int]:
        return list(self._inner.take_gone())

    @property
    def watched(self) -> int:
        return int(self._inner.watched)

    def name_chain(self, tokens: Sequence[int] | PackedTokens, keys: Sequence[bytes]) -> None:
        if type(keys) is not list or not set(map(type, keys)) <= {bytes}:
            keys = [bytes(k) for k in keys]  # (the data plane's are checked bytes already)
        # Packed tokens go over as their bytes: no int object per token either way.
        self._inner.name_chain(tokens.data if isinstance(tokens, PackedTokens) else tokens, keys)

    def encode_batch(
        self, events: Sequence[KVEvent], ts: float, rank: int
    ) -> tuple[bytes, int] | None:
        return self._inner.encode_batch(list(events), ts, rank)

    def drain_batch(self, queue: EventSource, ts: float, rank: int) -> tuple[bytes, int] | None:
        drain_wire = getattr(queue, "drain_wire", None)
        if drain_wire is None:  # the Python engine's queue
            return self.encode_batch(queue.drain(), ts, rank)
        return drain_wire(self._inner, ts, rank)


class EventSource(Protocol):
    """What the publisher drains: the engine's event queue (``EventQueue``, or the compiled
    core's ``NativeEvents``, which also has ``drain_wire``)."""

    def drain(self, limit: int | None = None) -> list[KVEvent]: ...


class Encoder(Protocol):
    """``WireEncoder`` or ``NativeWireEncoder``."""

    block_size: int

    @property
    def removed(self) -> Mapping[str, int]: ...

    @property
    def pending_names(self) -> int: ...

    def watch(self, key: int) -> None: ...

    def take_gone(self) -> list[int]: ...

    @property
    def watched(self) -> int: ...

    def name_chain(self, tokens: Sequence[int] | PackedTokens, keys: Sequence[bytes]) -> None: ...

    def encode_batch(
        self, events: Sequence[KVEvent], ts: float, rank: int
    ) -> tuple[bytes, int] | None: ...

    def drain_batch(self, queue: EventSource, ts: float, rank: int) -> tuple[bytes, int] | None: ...


def make_encoder(block_size: int, primary_medium: str, *, native: bool) -> Encoder:
    """The compiled encoder where ``native`` (the engine runs the compiled core), else the
    Python one."""
    if native:
        return NativeWireEncoder(block_size, primary_medium)
    return WireEncoder(block_size, primary_medium)


def encode_batch(ts: float, events: list[dict[str, Any]], rank: int = DATA_PARALLEL_RANK) -> bytes:
    """What ``msgspec.msgpack.Encoder().encode(KVEventBatch(ts, events, rank))`` writes (the
    maps' keys in vLLM's field order, floats as float64, ints in their shortest form)."""
    return msgpack.packb([float(ts), events, rank], use_bin_type=True)


class EventPublisher:
    """Numbers batches, keeps the last ones for replay and publishes them on ZMQ when bound."""

    def __init__(
        self,
        encoder: Encoder,
        *,
        endpoint: str | None,
        replay_endpoint: str | None,
        topic: str,
        replay_buffer: int,
        max_replay_batches: int = 1000,
        model: str | None = None,
        data_parallel_rank: int = DATA_PARALLEL_RANK,
    ) -> None:
        self.encoder = encoder
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        if "{model}" in topic and not model:
            log.warning(
                "events: model.name is unset, so the topic %r names no model: llm-d's indexer "
                "files this agent's blocks under an empty model name",
                topic,
            )
        self.topic = resolve_topic(topic, model).encode()
        self.data_parallel_rank = data_parallel_rank
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=replay_buffer)
        self.max_replay_batches = max_replay_batches
        self.next_seq = 0
        self.published_events = 0
        self.bound = False
        self._ctx: zmq.asyncio.Context | None = None
        self._pub_ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    def bind(self) -> None:
        """Bind the sockets (raises zmq.ZMQError if an endpoint is taken)."""
        if self.endpoint is None and self.replay_endpoint is None:
            self.bound = True
            return
        if self.endpoint is not None:
            # A plain socket: publishing is a non-blocking send from the engine's critical
            # section; only the replay socket needs the event loop.
            self._pub_ctx = zmq.Context()
            self._pub = self._pub_ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(self.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.replay_endpoint is not None:
            self._ctx = zmq.asyncio.Context()
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(self.replay_endpoint)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())
        self.bound = True

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        for ctx in (self._ctx, self._pub_ctx):
            if ctx is not None:
                ctx.term()
        self._pub = self._router = self._ctx = self._pub_ctx = None
        self.bound = False

    def publish(self, events: list[KVEvent]) -> int | None:
        """Encode and publish one batch; returns its sequence number (None if nothing to send)."""
        return self._send(self.encoder.encode_batch(events, time.time(), self.data_parallel_rank))

    def flush(self, queue: EventSource) -> int | None:
        """Drain ``queue`` and publish what it held as one batch (``publish``)."""
        return self._send(self.encoder.drain_batch(queue, time.time(), self.data_parallel_rank))

    def _send(self, batch: tuple[bytes, int] | None) -> int | None:
        if batch is None:
            return None
        payload, count = batch
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append((seq, payload))
        self.published_events += count
        if self._pub is not None:
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart(
                    [self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
                )
        return seq

    def replay(self, start_seq: int, limit: int | None = None) -> list[tuple[int, bytes]]:
        """Buffered batches numbered ``start_seq`` or later, oldest first, at most ``limit``
        (default ``max_replay_batches``): one request cannot ask for the whole buffer."""
        count = self.max_replay_batches if limit is None else min(limit, self.max_replay_batches)
        if not self.buffer or start_seq > self.buffer[-1][0]:
            return []
        first = self.buffer[0][0]
        skip = max(0, start_seq - first)
        return list(itertools.islice(self.buffer, skip, skip + count))

    async def _serve_replay(self) -> None:
        """vLLM's ``ZmqEventPublisher._service_replay``: ``[identity, b"", start_seq]`` in,
        ``[identity, b"", topic, seq, payload]`` per batch and the end marker out."""
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                log.warning("replay: ignored a request of %d frames (expected 3)", len(frames))
                continue
            identity, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in self.replay(start):
                await router.send_multipart(
                    [identity, b"", self.topic, seq.to_bytes(8, "big"), payload]
                )
            await router.send_multipart([identity, b"", b"", END_OF_REPLAY, b""])


def positional(event: Any) -> list[Any]:
    """An event as ``[type, field, ...]`` in vLLM's field order (its former ``array_like``
    layout, which llm-d's decoder also normalizes to), trailing unset defaults left out."""
    if isinstance(event, list):
        return event
    tag = event["type"]
    fields, required = WIRE_FIELDS.get(tag, ((), 0))
    values = [event.get(name) for name in fields]
    while len(values) > required and values[-1] is None:
        values.pop()
    return [tag, *values]


def decode_batch(payload: bytes) -> tuple[float, list[list[Any]]]:
    """The ``(ts, events)`` of a published payload, each event ``positional`` (what
    ``GET /v1/events`` serves; the tests' decoder)."""
    ts, events, *_ = msgpack.unpackb(payload, raw=False)
    return ts, [positional(e) for e in events]
