"""KV events as the ecosystem reads them.

A real ``kvpool agent`` process publishes on loopback while sequences are stored, evicted
through its host tier and evicted for good; a subscriber captures the messages and a DEALER
replays them. Then:

* vLLM's own classes (``.venv-vllm``) decode every batch, and encode it back to the very
  same bytes: the agent writes what vLLM's publisher writes;
* llm-d's own decoder (its vLLM adapter, built from the Go module proxy) decodes every batch
  to the hashes, parents, tokens and mediums that were published;
* the replay socket answers in vLLM's shape, end marker included.

Tier moves show only where the primary tier is not CPU memory, so an in-process agent whose
primary tier is labelled ``GPU`` offloads and onboards a prefix: an index fed by llm-d's
decoding holds exactly the (block, medium) pairs the engine holds.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import msgpack
import pytest
import yaml
import zmq

from kvpool_agent.config import AgentConfig
from kvpool_agent.server import AgentService, create_app
from kvpool_agent.server.events import END_OF_REPLAY, WIRE_FIELDS, make_encoder

from .conftest import Message, decode_with_llmd, decode_with_vllm

if TYPE_CHECKING:  # the shared helper's type, from tests/conftest.py
    from tests.conftest import AgentProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

U64 = (1 << 64) - 1
TPB = 4
BLOCK_BYTES = 2 * 2 * 2 * 8 * TPB * 4
"""K and V x 2 layers x 2 kv heads x head dim 8 x tokens per block x float32."""
MODEL = "kvpool/test-model"
POD_IP = "10.0.0.7"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agent_doc(primary_blocks: int, host_blocks: int) -> dict[str, Any]:
    return {
        "model": {
            "name": MODEL,
            "num_layers": 2,
            "num_kv_heads": 2,
            "head_dim": 8,
            "dtype": "float32",
        },
        "kv_cache_config": {"tokens_per_block": TPB, "host_cache_size": host_blocks * BLOCK_BYTES},
        "device": "cpu",
        "cpu_budget_bytes": primary_blocks * BLOCK_BYTES,
    }


@dataclass
class Capture:
    live: list[Message]
    """What a subscriber got (from its first message on: PUB/SUB joins late)."""
    replay_frames: list[list[bytes]]
    """What a DEALER asking for a replay from 0 got, frame by frame."""
    stats: dict[str, Any]


def chain(first: int, blocks: int) -> list[int]:
    return list(range(first, first + blocks * TPB))


def drive(url: str) -> None:
    """Stores a prefix, a second one sharing two of its blocks, then 160 blocks more through
    a 64-block primary tier and a 32-block host tier (offloads, then evictions for good)."""
    with httpx.Client(base_url=url, timeout=60) as c:

        def store(tokens: list[int]) -> None:
            seq = c.post("/v1/sequences", json={"tokens": tokens})
            seq.raise_for_status()
            c.delete(f"/v1/sequences/{seq.json()['seq_id']}").raise_for_status()

        a = chain(1, 3) + [99]  # three full blocks and a partial one
        store(a)
        store(a[: 2 * TPB] + chain(500, 2))
        for i in range(40):
            store(chain(1000 * (i + 1), 4))


@pytest.fixture(scope="module")
def capture(
    tmp_path_factory: pytest.TempPathFactory, start_agent: Callable[..., AgentProcess]
) -> Iterator[Capture]:
    tmp = tmp_path_factory.mktemp("events-agent")
    port, pub, replay = free_port(), free_port(), free_port()
    doc = agent_doc(primary_blocks=64, host_blocks=32)
    doc["events"] = {
        "endpoint": f"tcp://127.0.0.1:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }
    config = tmp / "agent.yaml"
    config.write_text(yaml.safe_dump(doc))
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 20_000)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("POD_IP", POD_IP)
            agent = start_agent(config, port, "--port", str(port))
        sub.connect(f"tcp://127.0.0.1:{pub}")
        time.sleep(0.5)  # the subscription reaches the publisher
        drive(agent.url)
        stats = httpx.get(f"{agent.url}/v1/stats", timeout=30).json()
        live: list[Message] = []
        while not live or live[-1].seq < stats["events_next_seq"] - 1:
            topic, seq, payload = sub.recv_multipart()
            live.append(Message(topic, int.from_bytes(seq, "big"), payload))
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 20_000)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames: list[list[bytes]] = []
        while not frames or frames[-1][-1]:  # vLLM's clients: an empty payload ends a replay
            frames.append(dealer.recv_multipart())
        yield Capture(live, frames, stats)
        agent.stop()
    finally:
        ctx.destroy(linger=0)


def replayed(cap: Capture) -> list[Message]:
    """The replay as vLLM's replay client reads it: after the empty delimiter frame,
    ``topic, seq, payload`` until a message with an empty payload."""
    out = []
    for frames in cap.replay_frames[:-1]:
        topic, seq, payload = frames[1:]
        out.append(Message(topic, int.from_bytes(seq, "big"), payload))
    return out


def test_replay_answers_in_vllms_shape(capture: Capture) -> None:
    *batches, end = capture.replay_frames
    assert end == [b"", b"", END_OF_REPLAY, b""]
    assert int.from_bytes(end[2], "big", signed=True) == -1
    assert batches and all(len(f) == 4 and f[0] == b"" for f in batches)
    msgs = replayed(capture)
    assert [m.seq for m in msgs] == list(range(capture.stats["events_next_seq"]))
    assert {m.topic for m in msgs} == {capture.live[0].topic}
    by_seq = {m.seq: m for m in msgs}
    assert capture.live and all(by_seq[m.seq] == m for m in capture.live)  # byte for byte
    assert msgpack.unpackb(msgs[0].payload)[1] == [{"type": "AllBlocksCleared"}]


def test_default_topic_is_llmds(capture: Capture) -> None:
    """``kv@<pod>@<model>``: the pod's address (``$POD_IP``) and ``model.name``."""
    assert capture.live[0].topic == f"kv@{POD_IP}@{MODEL}".encode()


def test_vllm_decodes_every_batch_to_the_same_bytes(capture: Capture, vllm_python: Path) -> None:
    msgs = replayed(capture)
    schema, decoded = decode_with_vllm(vllm_python, msgs)
    for name, (fields, required) in WIRE_FIELDS.items():
        assert schema[name]["fields"] == list(fields), name
        assert schema[name]["required"] == required, name
        assert (schema[name]["tag_field"], schema[name]["tag"]) == ("type", name)
        assert not schema[name]["array_like"] and schema[name]["omit_defaults"]
    batch = schema["KVEventBatch"]
    assert batch["fields"] == ["ts", "events", "data_parallel_rank"] and batch["array_like"]
    assert len(decoded) == len(msgs)
    kinds = set()
    for msg, rec in zip(msgs, decoded, strict=True):
        assert "error" not in rec, rec
        assert rec["seq"] == msg.seq and rec["topic"] == msg.topic.decode()
        assert rec["reencoded"], f"batch {msg.seq}: vLLM encodes it to other bytes"
        assert rec["data_parallel_rank"] == 0
        assert rec["events"] == msgpack.unpackb(msg.payload)[1]
        kinds |= {e["type"] for e in rec["events"]}
    assert kinds == {"AllBlocksCleared", "BlockStored", "BlockRemoved"}


def llmd_expected(event: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """What llm-d's adapter should make of one published event (the fields kvpool sets)."""
    kind = event["type"]
    if kind == "BlockStored":
        parent = event["parent_block_hash"]
        return kind, {
            "BlockHashes": [h & U64 for h in event["block_hashes"]],
            "ParentHash": 0 if parent is None else parent & U64,
            "Tokens": event["token_ids"],
            "BlockSize": event["block_size"],
            "DeviceTier": event["medium"],
            "LoraID": None,
            "LoraName": None,
            "GroupIdx": None,
        }
    if kind == "BlockRemoved":
        return kind, {
            "BlockHashes": [h & U64 for h in event["block_hashes"]],
            "DeviceTier": event["medium"],
            "GroupIdx": None,
        }
    return kind, {}


def index_of(decoded: list[dict[str, Any]]) -> set[tuple[int, str]]:
    """The (block hash, medium) pairs an indexer fed these events holds at the end."""
    held: set[tuple[int, str]] = set()
    for rec in decoded:
        for ev in rec["events"]:
            body = ev["event"]
            if ev["type"] == "BlockStored":
                held |= {(h, body["DeviceTier"]) for h in body["BlockHashes"]}
            elif ev["type"] == "BlockRemoved":
                held -= {(h, body["DeviceTier"]) for h in body["BlockHashes"]}
            else:
                held.clear()
    return held


def check_llmd(msgs: list[Message], decoded: list[dict[str, Any]]) -> None:
    assert len(decoded) == len(msgs)
    for msg, rec in zip(msgs, decoded, strict=True):
        assert not rec.get("error"), f"llm-d dropped batch {msg.seq}: {rec['error']}"
        _, pod, model = msg.topic.decode().split("@")
        assert (rec["seq"], rec["pod"], rec["model"]) == (msg.seq, pod, model)
        ts, events, _ = msgpack.unpackb(msg.payload)
        assert rec["ts"] == ts
        assert len(rec["events"]) == len(events)
        for got, sent in zip(rec["events"], events, strict=True):
            kind, fields = llmd_expected(sent)
            assert got["type"] == kind
            assert {k: got["event"][k] for k in fields} == fields


def test_llmd_decodes_every_batch(capture: Capture, llmd_decode: Path) -> None:
    msgs = replayed(capture)
    decoded = decode_with_llmd(llmd_decode, msgs)
    check_llmd(msgs, decoded)
    # The index holds one entry per block of the agent's tree (a CPU agent's tiers share a
    # medium).
    assert len(index_of(decoded)) == capture.stats["tree_blocks"]


# ------------------------------------------------------------------ tier moves, in process


@dataclass
class TierRun:
    messages: list[Message]
    before_clear: int
    """How many of ``messages`` were published before the cache was cleared."""
    holdings: set[tuple[int, str]]
    """(block key, medium) of every block the engine held before the clear."""
    first_key: int


async def tier_scenario() -> TierRun:
    doc = agent_doc(primary_blocks=64, host_blocks=64)
    doc["events"] = {"endpoint": None, "replay_endpoint": None, "topic": f"kv@gpu-pod@{MODEL}"}
    svc = AgentService(AgentConfig.model_validate(doc))
    native = svc.engine.core_name == "native"
    svc.publisher.encoder = make_encoder(svc.engine.tpb, "GPU", native=native)  # a CUDA agent's
    await svc.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(svc)), base_url="http://agent"
        ) as c:

            async def store(tokens: list[int]) -> None:
                seq = (await c.post("/v1/sequences", json={"tokens": tokens})).json()
                assert (await c.delete(f"/v1/sequences/{seq['seq_id']}")).status_code == 204

            a = chain(1, 3) + [99]
            await store(a)
            for i in range(20):  # 80 blocks through 64: the first prefix goes to the host tier
                await store(chain(1000 * (i + 1), 4))
            await store(a)  # onboarded back
        medium = {0: "GPU", 1: "CPU"}
        holdings = {
            (node.key & U64, medium[next(b.tier for b in node.blocks if b is not None)])
            for node in svc.engine.iter_nodes()
        }
        before = svc.publisher.next_seq
        await svc.call(svc.engine.clear)
        topic = svc.publisher.topic
        messages = [Message(topic, seq, payload) for seq, payload in svc.publisher.buffer]
        first = msgpack.unpackb(messages[1].payload)[1][0]
        return TierRun(messages, before, holdings, first["block_hashes"][0])
    finally:
        await svc.stop()


@pytest.fixture(scope="module")
def tier_run() -> TierRun:
    return asyncio.run(tier_scenario())


def test_tier_moves_remove_the_old_medium_and_store_the_new(
    tier_run: TierRun, llmd_decode: Path, vllm_python: Path
) -> None:
    msgs = tier_run.messages
    assert [m.seq for m in msgs] == list(range(len(msgs)))
    _, vllm = decode_with_vllm(vllm_python, msgs)
    assert all(rec.get("reencoded") for rec in vllm), "vLLM encodes a batch to other bytes"
    decoded = decode_with_llmd(llmd_decode, msgs)
    check_llmd(msgs, decoded)
    assert decoded[0]["pod"] == "gpu-pod" and decoded[0]["model"] == MODEL

    key = tier_run.first_key & U64
    history = [
        (ev["type"], ev["event"]["DeviceTier"])
        for rec in decoded
        for ev in rec["events"]
        if ev["type"] != "AllBlocksCleared" and key in ev["event"]["BlockHashes"]
    ]
    assert history[:5] == [
        ("BlockStored", "GPU"),
        ("BlockRemoved", "GPU"),  # offloaded: the GPU copy is gone...
        ("BlockStored", "CPU"),  # ...a CPU copy exists
        ("BlockRemoved", "CPU"),  # onboarded: the reverse
        ("BlockStored", "GPU"),
    ]
    assert history[5:] == [("BlockRemoved", "GPU")]  # cleared
    # Fed these events, an indexer holds what the engine held, medium included; after the
    # clear, nothing.
    assert index_of(decoded[: tier_run.before_clear]) == tier_run.holdings
    assert {m for _, m in tier_run.holdings} == {"GPU", "CPU"}
    assert index_of(decoded) == set()
    assert decoded[-1]["events"][-1]["type"] == "AllBlocksCleared"
