"""vLLM's KV events and the agent's describe the blocks a connector stored by the same hashes.

A real vLLM engine (KV events on, the kvpool connector on) serves prompts; a real agent
stores its blocks. Both publish KV events; blocks stored through engine keys go out under
vLLM's own block hash (``maybe_convert_block_hash``: the low 64 bits), with the parent of
each block as vLLM names it, so an indexer that reads both sees one set of blocks.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import pytest
import yaml
import zmq

from .conftest import free_port, run_engine

if TYPE_CHECKING:
    from tests.conftest import AgentProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

BLOCK = 32


class Subscriber:
    """Collects the BlockStored events of ZMQ publishers on a background thread."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.stored: dict[str, list[dict[str, Any]]] = {"vllm": [], "agent": []}
        self._sockets: dict[Any, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def add(self, name: str, endpoint: str, *, bind: bool) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        (sock.bind if bind else sock.connect)(endpoint)
        self._sockets[sock] = name

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                frames = sock.recv_multipart()
                _ts, events, *_ = msgpack.unpackb(frames[-1], raw=False)
                for event in events:
                    if isinstance(event, dict) and event.get("type") == "BlockStored":
                        self.stored[self._sockets[sock]].append(event)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in self._sockets:
            sock.close(linger=0)
        self.ctx.term()


def parents(events: list[dict[str, Any]]) -> dict[int, int | None]:
    """Block hash -> its parent's, from BlockStored events (one event may name a run of
    blocks, each the parent of the next)."""
    out: dict[int, int | None] = {}
    for event in events:
        parent = event["parent_block_hash"]
        for block in event["block_hashes"]:
            out[block] = parent
            parent = block
    return out


def test_vllm_and_the_agent_name_stored_blocks_alike(
    vllm_python: Path,
    model_dir: Path,
    tmp_path: Path,
    start_agent: Callable[..., AgentProcess],
) -> None:
    events_port, port, transfer = free_port(), free_port(), free_port()
    doc = {
        "model": {
            "name": "tiny-llama",
            "num_layers": 2,
            "num_kv_heads": 2,
            "head_dim": 32,
            "dtype": "float32",
        },
        "kv_cache_config": {"tokens_per_block": BLOCK},
        "device": "cpu",
        "cpu_budget_bytes": 64 * 2 * 2 * BLOCK * 2 * 32 * 4,
        "events": {"endpoint": f"tcp://127.0.0.1:{events_port}", "replay_endpoint": None},
        "transfer": {"port": transfer},
    }
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump(doc))
    agent = start_agent(config, port, "--port", str(port))
    vllm_port = free_port()
    subscriber = Subscriber()
    subscriber.add("agent", f"tcp://127.0.0.1:{events_port}", bind=False)
    # vLLM's publisher connects to a concrete tcp:// endpoint: the subscriber binds.
    subscriber.add("vllm", f"tcp://127.0.0.1:{vllm_port}", bind=True)
    subscriber.start()
    rng = random.Random(3)
    shared = [rng.randrange(3, 512) for _ in range(3 * BLOCK)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(2 * BLOCK + 5)] for _ in range(2)]
    try:
        time.sleep(0.5)  # SUB sockets need a moment before messages reach them
        run_engine(
            vllm_python,
            tmp_path,
            "events",
            {
                "model": str(model_dir),
                "kv_events_endpoint": f"tcp://127.0.0.1:{vllm_port}",
                "connector": {
                    "module": "kvpool_agent.connectors.vllm",
                    "class": "KvpoolConnector",
                    "extra": {"replicas": [f"127.0.0.1:{transfer}"]},
                },
                "phases": [{"name": "serve", "prompts": prompts}],
            },
        )
        time.sleep(1.0)
    finally:
        subscriber.close()
        agent.stop()
    vllm_blocks, agent_blocks = (
        parents(subscriber.stored["vllm"]),
        parents(subscriber.stored["agent"]),
    )
    # The pool stored the prompts' full blocks: 3 shared + 2 x 2 of their own.
    assert len(agent_blocks) == 3 + 2 * 2, subscriber.stored["agent"]
    assert vllm_blocks, "vLLM published no BlockStored (is kv_events_config on?)"
    missing = set(agent_blocks) - set(vllm_blocks)
    assert not missing, f"agent blocks vLLM never named: {sorted(missing)}"
    for block, parent in agent_blocks.items():
        assert parent == vllm_blocks[block], f"block {block}: parent differs"
    roots = [b for b, p in agent_blocks.items() if p is None]
    assert len(roots) == 1  # the shared first block
