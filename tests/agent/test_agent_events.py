"""KV events: vLLM's wire format over ZMQ, sequence numbers, replay, last-copy removal."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from kvpool_agent.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, BlockUpdated
from kvpool_agent.server import AgentService, create_app
from kvpool_agent.server.events import END_OF_REPLAY, WireEncoder, decode_batch

from .conftest import TPB, small_config

pytestmark = pytest.mark.asyncio


async def test_wire_encoding_follows_vllm_and_removes_only_the_last_copy() -> None:
    enc = WireEncoder(block_size=4, primary_medium="GPU")
    assert enc.encode(AllBlocksCleared()) == ["AllBlocksCleared"]
    stored = enc.encode(BlockStored(11, None, (1, 2, 3, 4), "primary", 35))
    assert stored == ["BlockStored", [11], None, [1, 2, 3, 4], 4, None, "GPU"]
    assert enc.encode(BlockUpdated(11, "primary", 80)) is None  # priority only
    moved = enc.encode(BlockUpdated(11, "secondary", 80))  # offloaded: a new copy on CPU
    assert moved == ["BlockStored", [11], None, [1, 2, 3, 4], 4, None, "CPU"]
    removed = enc.encode(BlockRemoved(11, "secondary", "evicted"))
    assert removed == ["BlockRemoved", [11], "CPU", "evicted"]


async def test_events_are_published_numbered_and_replayed() -> None:
    cfg = small_config(
        events={"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"},
        kv_cache_config={"tokens_per_block": TPB, "host_cache_size": 8 * 1024},
    )
    svc = AgentService(cfg)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    replay = ctx.socket(zmq.DEALER)
    try:
        await svc.start()
        assert svc.publisher.endpoint and svc.publisher.replay_endpoint
        sub.connect(svc.publisher.endpoint)
        replay.connect(svc.publisher.replay_endpoint)
        await asyncio.sleep(0.3)  # PUB/SUB joins late: the start-up batch is only in replay
        app = create_app(svc)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://a"
        ) as c:
            seq = (await c.post("/v1/sequences", json={"tokens": list(range(9))})).json()
            await c.delete(f"/v1/sequences/{seq['seq_id']}")
            topic, seq_bytes, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            assert topic == b"kv-events"
            number = int.from_bytes(seq_bytes, "big")
            assert number == 1
            _, events = decode_batch(payload)
            assert [e[0] for e in events] == ["BlockStored", "BlockStored"]
            assert events[1][2] == events[0][1][0]  # chained to its parent
            assert events[0][6] == "CPU"  # a CPU agent's primary tier

            await replay.send_multipart([b"", (0).to_bytes(8, "big")])
            got: list[tuple[int, Any]] = []
            while True:
                empty, seq_b, body = await asyncio.wait_for(replay.recv_multipart(), 5)
                assert empty == b""
                if seq_b == END_OF_REPLAY:
                    break
                got.append((int.from_bytes(seq_b, "big"), msgpack.unpackb(body)))
            assert [n for n, _ in got] == [0, 1]
            assert got[0][1][1] == [["AllBlocksCleared"]]
            assert got[1][1] == msgpack.unpackb(payload)

            http = (await c.get("/v1/events", params={"start_seq": 1})).json()
            assert [b["seq"] for b in http] == [1]
            assert http[0]["events"][0][0] == "BlockStored"
    finally:
        sub.close(0)
        replay.close(0)
        ctx.term()
        await svc.stop()


async def test_evictions_remove_blocks_with_a_reason(
    client: httpx.AsyncClient, service: AgentService
) -> None:
    for base in range(0, 20 * 64 * TPB, 64 * TPB):  # more distinct prefixes than the pool holds
        seq = (
            await client.post("/v1/sequences", json={"tokens": list(range(base, base + 32 * TPB))})
        ).json()
        await client.delete(f"/v1/sequences/{seq['seq_id']}")
    batches = (await client.get("/v1/events")).json()
    seqs = [b["seq"] for b in batches]
    assert seqs == list(range(len(seqs)))
    removed = [e for b in batches for e in b["events"] if e[0] == "BlockRemoved"]
    stored = {e[1][0] for b in batches for e in b["events"] if e[0] == "BlockStored"}
    assert removed and all(e[3] == "evicted" for e in removed)
    assert {e[1][0] for e in removed} <= stored
    live = stored - {e[1][0] for e in removed}
    assert len(live) == service.engine.num_nodes
