"""The agent as a real process on loopback: SIGTERM drain, warm vs cold restart, peer handoff."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml

from kvpool_agent.server.payload import encode_tensor

from .conftest import TPB

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT = 90.0  # importing torch on a loaded 2-core machine is slow


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Agent:
    def __init__(self, tmp: Path, name: str, host: str, **lifecycle: Any) -> None:
        self.host, self.port = host, free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.config = tmp / f"{name}.yaml"
        doc = {
            "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
            "kv_cache_config": {"tokens_per_block": TPB},
            "device": "cpu",
            "cpu_budget_bytes": 256 * 1024,
            "events": {"endpoint": "tcp://*:*", "replay_endpoint": None},
            "transfer": {"port": 0},  # several agents share 127.0.0.1
            "lifecycle": {"grace_period_s": 8.0, **lifecycle},
        }
        self.config.write_text(yaml.safe_dump(doc))
        self.log = tmp / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Agent:
        cmd = [
            sys.executable,
            "-m",
            "kvpool_cli",
            "agent",
            "--config",
            str(self.config),
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"agent not ready: {self.log.read_text()}")

    def terminate(self) -> float:
        """SIGTERM; returns seconds until exit."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        return time.monotonic() - t0

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[Agent]]:
    started: list[Agent] = []
    yield started
    for agent in started:
        agent.kill()


def prompts(n: int) -> list[list[int]]:
    return [list(range(p * 1000, p * 1000 + 8 * TPB)) for p in range(n)]


def fill(c: httpx.Client, toks: list[list[int]]) -> None:
    for i, t in enumerate(toks):
        seq = c.post("/v1/sequences", json={"tokens": t}).json()
        kv = torch.full((2, len(seq["block_tables"][0]), 2, TPB, 2, 8), float(i))
        assert (
            c.put(f"/v1/sequences/{seq['seq_id']}/kv/0/0", content=encode_tensor(kv)).status_code
            == 204
        )
        assert c.delete(f"/v1/sequences/{seq['seq_id']}").status_code == 204


def hit_rate(c: httpx.Client, toks: list[list[int]]) -> float:
    reused = total = 0
    for t in toks:
        seq = c.post("/v1/sequences", json={"tokens": t}).json()
        reused += seq["num_reused_tokens"]
        total += len(t)
        c.delete(f"/v1/sequences/{seq['seq_id']}")
    return reused / total


def test_warm_restart_against_cold(tmp_path: Path, agents: list[Agent]) -> None:
    snap = tmp_path / "snap.bin"
    first = Agent(tmp_path, "first", "127.0.0.21", snapshot_path=str(snap)).start()
    cold = Agent(tmp_path, "cold", "127.0.0.22").start()
    agents += [first, cold]
    first.wait_ready()
    toks = prompts(6)
    with httpx.Client(base_url=first.url) as c:
        fill(c, toks)
        inflight = c.post("/v1/sequences", json={"tokens": [1, 2, 3]}).json()
        first.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        time.sleep(0.3)
        assert c.post("/v1/sequences", json={"tokens": [4]}).status_code == 503
        assert c.delete(f"/v1/sequences/{inflight['seq_id']}").status_code == 204
    assert first.proc is not None and first.proc.wait(timeout=8) == 0
    assert snap.is_file()

    warm = Agent(tmp_path, "warm", "127.0.0.23", snapshot_path=str(snap)).start()
    agents.append(warm)
    warm.wait_ready()
    cold.wait_ready()
    with httpx.Client(base_url=warm.url) as w, httpx.Client(base_url=cold.url) as c:
        warm_rate, cold_rate = hit_rate(w, toks), hit_rate(c, toks)
        seq = w.post("/v1/sequences", json={"tokens": toks[2]}).json()
        kv = w.get(f"/v1/sequences/{seq['seq_id']}/kv/0/0", params={"count": 7})
        from kvpool_agent.server.payload import decode_tensor

        assert torch.equal(decode_tensor(kv.content), torch.full((2, 7, 2, TPB, 2, 8), 2.0))
        metrics = w.get("/metrics").text
    assert warm_rate > 0.9 and cold_rate == 0.0, (warm_rate, cold_rate)
    assert (
        f"kvpool_prefix_cache_queries_tokens_total {float(6 * 8 * TPB + len(toks[2]))}" in metrics
    )


def test_drain_hands_the_hottest_blocks_to_a_peer(tmp_path: Path, agents: list[Agent]) -> None:
    peer = Agent(tmp_path, "peer", "127.0.0.31").start()
    agents.append(peer)
    leaving = Agent(tmp_path, "leaving", "127.0.0.32", handoff_peers=[peer.url]).start()
    agents.append(leaving)
    leaving.wait_ready()
    peer.wait_ready()
    toks = prompts(4)
    with httpx.Client(base_url=leaving.url) as c:
        fill(c, toks)
    elapsed = leaving.terminate()
    assert elapsed < 8.0 and leaving.proc is not None and leaving.proc.returncode == 0
    assert f"hottest blocks: {peer.url}" in leaving.log.read_text()
    with httpx.Client(base_url=peer.url) as c:
        assert hit_rate(c, toks) > 0.9
        assert c.get("/readyz").status_code == 200
    os.kill(peer.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
    assert peer.proc is not None and peer.proc.wait(timeout=10) == 0
