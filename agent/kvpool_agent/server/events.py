"""KV events on the wire: vLLM's format, published over ZMQ with sequence numbers and replay.

What consumers (llm-d's KV indexer, Dynamo's KV router, AIBrix's gateway) decode:

* PUB socket, multipart ``[topic, seq (8 bytes, big-endian), payload]``;
* ``payload`` = msgpack ``[ts, [event, ...]]`` (vLLM's ``EventBatch``, array-like);
* events are tagged arrays:
  ``["BlockStored", [hash], parent_hash | None, [token ids], block_size, lora_id, medium]``,
  ``["BlockRemoved", [hash], medium, reason]``, ``["AllBlocksCleared"]``;
  ``medium`` is ``"GPU"`` or ``"CPU"`` (where the copy lives). ``reason`` (``evicted``,
  ``replaced``, ``cleared``, ``pruned``) is a kvpool extension in the trailing position, which
  array-like decoders that do not know it ignore.
* ROUTER replay socket: a DEALER client sends ``[b"", start_seq (8 bytes, big-endian)]`` and
  gets one ``[b"", seq, payload]`` message per buffered batch from that number on (at most
  ``max_replay_batches`` per request: ask again from the next number), then
  ``[b"", -1 (8 bytes, signed), b""]`` (without the empty frame in, none comes back).

The engine reports per-node tier moves as ``BlockUpdated``; on the wire a move publishes
``BlockStored`` with the new medium, and ``BlockRemoved`` is only sent once the last copy of
the block is gone, so a consumer never forgets a block the agent still holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

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

log = logging.getLogger("kvpool.agent.events")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


@dataclass
class _Known:
    parent: int | None
    tokens: list[int]
    medium: str


class WireEncoder:
    """Maps engine events to vLLM wire events, remembering each live block's last medium."""

    def __init__(self, block_size: int, primary_medium: str) -> None:
        self.block_size = block_size
        self.mediums = {"primary": primary_medium, "secondary": "CPU"}
        self._known: dict[int, _Known] = {}

    def encode(self, event: KVEvent) -> list[Any] | None:
        if isinstance(event, BlockStored):
            medium = self.mediums[event.tier]
            tokens = list(event.token_ids)
            self._known[event.key] = _Known(event.parent_key, tokens, medium)
            return self._stored(event.key, event.parent_key, tokens, medium)
        if isinstance(event, BlockUpdated):
            known = self._known.get(event.key)
            medium = self.mediums[event.tier]
            if known is None or known.medium == medium:
                return None  # a priority change: the wire format has no event for it
            known.medium = medium
            return self._stored(event.key, known.parent, known.tokens, medium)
        if isinstance(event, BlockRemoved):
            gone = self._known.pop(event.key, None)
            medium = gone.medium if gone is not None else self.mediums[event.tier]
            return ["BlockRemoved", [event.key], medium, event.reason]
        if isinstance(event, AllBlocksCleared):
            self._known.clear()
            return ["AllBlocksCleared"]
        raise TypeError(f"unknown KV event {event!r}")

    def _stored(self, key: int, parent: int | None, tokens: list[int], medium: str) -> list[Any]:
        return ["BlockStored", [key], parent, tokens, self.block_size, None, medium]


class EventPublisher:
    """Numbers batches, keeps the last ones for replay and publishes them on ZMQ when bound."""

    def __init__(
        self,
        encoder: WireEncoder,
        *,
        endpoint: str | None,
        replay_endpoint: str | None,
        topic: str,
        replay_buffer: int,
        max_replay_batches: int = 1000,
    ) -> None:
        self.encoder = encoder
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
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
        wire = [w for e in events if (w := self.encoder.encode(e)) is not None]
        if not wire:
            return None
        seq = self.next_seq
        self.next_seq += 1
        payload = msgpack.packb([time.time(), wire], use_bin_type=True)
        self.buffer.append((seq, payload))
        self.published_events += len(wire)
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
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            identity, rest = frames[0], frames[1:]
            envelope = [identity]
            if rest and rest[0] == b"":
                envelope.append(b"")
                rest = rest[1:]
            if not rest or len(rest[0]) != 8:
                log.warning("replay: malformed request (expected an 8-byte start sequence)")
                await router.send_multipart([*envelope, END_OF_REPLAY, b""])
                continue
            start = int.from_bytes(rest[0], "big")
            for seq, payload in self.replay(start):
                await router.send_multipart([*envelope, seq.to_bytes(8, "big"), payload])
            await router.send_multipart([*envelope, END_OF_REPLAY, b""])


def decode_batch(payload: bytes) -> tuple[float, list[list[Any]]]:
    """The ``(ts, events)`` of a published payload (what a consumer does; used in tests/docs)."""
    ts, events, *_ = msgpack.unpackb(payload, raw=False)
    return ts, events
