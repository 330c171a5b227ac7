"""KV events: vLLM's wire format over ZMQ, sequence numbers, replay, tier moves, removals.

The byte-for-byte checks against vLLM's own classes and llm-d's decoder are in tests/events.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from kvpool_agent.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, BlockUpdated
from kvpool_agent.credentials import Principal
from kvpool_agent.dataplane.keys import KeyNamespace
from kvpool_agent.server import AgentService, create_app
from kvpool_agent.server.events import (
    END_OF_REPLAY,
    EventPublisher,
    WireEncoder,
    decode_batch,
    positional,
    resolve_topic,
    wire_hash,
)

from .conftest import TPB, small_config

pytestmark = pytest.mark.asyncio


def stored(key: int, parent: int | None, tokens: list[int], medium: str) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": [key],
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def removed(key: int, medium: str) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [key], "medium": medium}


async def test_wire_encoding_follows_vllm_and_moves_blocks_between_mediums() -> None:
    enc = WireEncoder(block_size=4, primary_medium="GPU")
    assert enc.encode(AllBlocksCleared()) == [{"type": "AllBlocksCleared"}]
    assert enc.encode(BlockStored(11, None, (1, 2, 3, 4), "primary", 35)) == [
        stored(11, None, [1, 2, 3, 4], "GPU")
    ]
    assert enc.encode(BlockStored(12, 11, (5, 6, 7, 8), "primary", 35)) == [
        stored(12, 11, [5, 6, 7, 8], "GPU")
    ]
    assert enc.encode(BlockUpdated(11, "primary", 80)) == []  # priority only
    # Offloaded: the GPU copy is gone, a CPU copy exists (the move brings the tokens: the
    # encoder keeps none).
    assert enc.encode(BlockUpdated(11, "secondary", 80, (1, 2, 3, 4))) == [
        removed(11, "GPU"),
        stored(11, None, [1, 2, 3, 4], "CPU"),
    ]
    # Onboarded back: the reverse.
    assert enc.encode(BlockUpdated(11, "primary", 80, (1, 2, 3, 4))) == [
        removed(11, "CPU"),
        stored(11, None, [1, 2, 3, 4], "GPU"),
    ]
    moved = BlockUpdated(12, "secondary", 35, (5, 6, 7, 8))
    assert enc.encode(moved)[1] == stored(12, 11, [5, 6, 7, 8], "CPU")
    # The reason stays off the wire (vLLM has no field for it) and is counted.
    assert enc.encode(BlockRemoved(12, "secondary", "evicted")) == [removed(12, "CPU")]
    assert enc.encode(BlockRemoved(11, "primary", "replaced")) == [removed(11, "GPU")]
    assert enc.removed == {"evicted": 1, "replaced": 1}
    assert enc.encode(BlockUpdated(11, "secondary", 35)) == []  # no longer known


async def test_a_move_without_its_tokens_withdraws_the_block() -> None:
    """A move that does not bring the tokens cannot be stored again under the new medium:
    the old copy is withdrawn and the block forgotten (a consumer misses it, never routes to
    a copy that is gone)."""
    enc = WireEncoder(block_size=4, primary_medium="GPU")
    enc.encode(BlockStored(11, None, (1, 2, 3, 4), "primary", 35))
    assert enc.encode(BlockUpdated(11, "secondary", 35)) == [removed(11, "GPU")]
    assert enc.encode(BlockUpdated(11, "primary", 35, (1, 2, 3, 4))) == []  # no longer known


async def test_a_cpu_agents_tier_moves_publish_nothing() -> None:
    """Its primary and host tiers are both CPU memory: a consumer cannot tell them apart."""
    enc = WireEncoder(block_size=4, primary_medium="CPU")
    enc.encode(BlockStored(11, None, (1, 2, 3, 4), "primary", 35))
    assert enc.encode(BlockUpdated(11, "secondary", 35)) == []
    assert enc.encode(BlockRemoved(11, "secondary", "evicted")) == [removed(11, "CPU")]


async def test_positional_form_is_vllms_field_order() -> None:
    assert positional(stored(1, None, [1, 2, 3, 4], "GPU")) == [
        "BlockStored", [1], None, [1, 2, 3, 4], 4, None, "GPU", None
    ]  # fmt: skip
    assert positional(removed(1, "CPU")) == ["BlockRemoved", [1], "CPU"]
    assert positional({"type": "BlockRemoved", "block_hashes": [1], "group_idx": 0}) == [
        "BlockRemoved", [1], None, 0
    ]  # fmt: skip
    assert positional({"type": "AllBlocksCleared"}) == ["AllBlocksCleared"]


async def test_topic_names_the_pod_and_the_model() -> None:
    env = {"POD_IP": "10.1.2.3", "POD_NAME": "pool-0", "HOSTNAME": "h"}
    assert resolve_topic("kv@{pod}@{model}", "Qwen/Qwen3-8B", env) == "kv@10.1.2.3@Qwen/Qwen3-8B"
    assert resolve_topic("kv@{pod}@{model}", "m", {"POD_NAME": "pool-0"}) == "kv@pool-0@m"
    assert resolve_topic("kv@{pod}@{model}", "m", {"HOSTNAME": "h"}) == "kv@h@m"
    assert resolve_topic("my-topic", "m", env) == "my-topic"
    pub = EventPublisher(
        WireEncoder(4, "CPU"),
        endpoint=None,
        replay_endpoint=None,
        topic="kv@x@{model}",
        replay_buffer=4,
        model="llama",
    )
    assert pub.topic == b"kv@x@llama"


async def test_events_are_published_numbered_and_replayed() -> None:
    cfg = small_config(
        events={
            "endpoint": "tcp://127.0.0.1:*",
            "replay_endpoint": "tcp://127.0.0.1:*",
            "topic": "kv@pod-a@model-a",
        },
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
            assert topic == b"kv@pod-a@model-a"
            number = int.from_bytes(seq_bytes, "big")
            assert number == 1
            raw = msgpack.unpackb(payload)
            assert len(raw) == 3 and raw[2] == 0  # [ts, events, data_parallel_rank]
            assert [e["type"] for e in raw[1]] == ["BlockStored", "BlockStored"]
            _, events = decode_batch(payload)
            assert [e[0] for e in events] == ["BlockStored", "BlockStored"]
            assert events[1][2] == events[0][1][0]  # chained to its parent
            assert events[0][6] == "CPU"  # a CPU agent's primary tier

            # vLLM's replay: [b"", start] in; [b"", topic, seq, payload] per batch, then
            # [b"", b"", -1, b""].
            await replay.send_multipart([b"", (0).to_bytes(8, "big")])
            got: list[tuple[int, Any]] = []
            while True:
                frames = await asyncio.wait_for(replay.recv_multipart(), 5)
                assert len(frames) == 4 and frames[0] == b""
                if frames[2] == END_OF_REPLAY:
                    assert frames[1] == b"" and frames[3] == b""
                    break
                assert frames[1] == b"kv@pod-a@model-a"
                got.append((int.from_bytes(frames[2], "big"), msgpack.unpackb(frames[3])))
            assert [n for n, _ in got] == [0, 1]
            assert got[0][1][1] == [{"type": "AllBlocksCleared"}]
            assert got[1][1] == msgpack.unpackb(payload)

            # A request of another shape gets no answer (as from vLLM); the socket still
            # serves the next one.
            await replay.send_multipart([b"", b"", (1).to_bytes(8, "big")])
            await replay.send_multipart([b"", (1).to_bytes(8, "big")])
            frames = await asyncio.wait_for(replay.recv_multipart(), 5)
            assert int.from_bytes(frames[2], "big") == 1

            http = (await c.get("/v1/events", params={"start_seq": 1})).json()
            assert [b["seq"] for b in http] == [1]
            assert http[0]["events"][0][0] == "BlockStored"
    finally:
        sub.close(0)
        replay.close(0)
        ctx.term()
        await svc.stop()


async def test_evictions_remove_blocks_and_count_the_reason(
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
    gone = [e for b in batches for e in b["events"] if e[0] == "BlockRemoved"]
    stored_keys = {e[1][0] for b in batches for e in b["events"] if e[0] == "BlockStored"}
    assert gone and all(e == ["BlockRemoved", e[1], "CPU"] for e in gone)
    assert service.publisher.encoder.removed == {"evicted": len(gone)}
    assert {e[1][0] for e in gone} <= stored_keys
    live = stored_keys - {e[1][0] for e in gone}
    assert len(live) == service.engine.num_nodes
    metrics = (await client.get("/metrics")).text
    assert f'kvpool_kv_events_blocks_removed_total{{reason="evicted"}} {float(len(gone))}' in (
        metrics
    )


@pytest.mark.parametrize("event_buffer", [0, 10_000], ids=["events off", "events on"])
async def test_engine_key_names_wait_only_while_events_are_recorded(event_buffer: int) -> None:
    """A keyed store names its new blocks for their BlockStored events. With events off no
    event takes a name, so none may be left waiting (up to 100,000 blocks' tokens before)."""
    cache = {"tokens_per_block": TPB, "event_buffer_max_size": event_buffer}
    svc = AgentService(small_config(kv_cache_config=cache))
    await svc.start()
    try:
        anyone = Principal(tenant=None, peer=False)
        ns = KeyNamespace("m")
        for chain in range(8):
            keys = [f"{chain}/{i}".encode() for i in range(4)]
            start = await svc.begin_store(anyone, ns, keys, 0)
            assert start.store is not None
            await svc.finish_store(start.store)
        assert svc.engine.events.enabled == bool(event_buffer)
        assert len(await svc.lookup_keys(anyone, ns, keys)) == 4
        assert svc.publisher.encoder.pending_names == 0
        if event_buffer:  # and the blocks went out under the engine's own hashes
            batches = svc.publisher.replay(0)
            events = [e for _, p in batches for e in decode_batch(p)[1]]
            hashes = {e[1][0] for e in events if e[0] == "BlockStored"}
            assert {wire_hash(k) for k in keys} <= hashes
    finally:
        await svc.stop()
