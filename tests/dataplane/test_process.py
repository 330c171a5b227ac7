"""The transfer port of a real ``kvpool agent`` process (uvloop, credentials, SIGTERM)."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import yaml

from kvpool_agent.dataplane.client import TransferClient, TransferError
from kvpool_agent.dataplane.protocol import F_ERROR, Op

from .conftest import NS, TOKENS, Raw, keys_for, random_kv, write_auth

if TYPE_CHECKING:  # the shared helper's type, from tests/conftest.py
    from tests.conftest import AgentProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    """The agent process and its transfer port's address."""

    agent: AgentProcess
    address: str

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.agent.proc

    @property
    def url(self) -> str:
        return self.agent.url

    @property
    def log(self) -> Path:
        return self.agent.log

    def metric(self, name: str) -> float:
        return self.agent.metric(name)

    def pinned(self) -> float:
        return self.agent.metric("kvpool_cache_blocks_pinned")


@pytest.fixture(scope="module")
def agent(
    tmp_path_factory: pytest.TempPathFactory, start_agent: Callable[..., AgentProcess]
) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("transfer-agent")
    port, transfer = free_port(), free_port()
    doc = {
        "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "bfloat16"},
        "kv_cache_config": {"tokens_per_block": 4},
        "device": "cpu",
        "cpu_budget_bytes": 256 * 1024,
        "events": {"endpoint": None, "replay_endpoint": None},
        "auth": write_auth(tmp),
        "transfer": {"port": transfer, "body_timeout_s": 2.0},
        "lifecycle": {"grace_period_s": 5.0},
    }
    config = tmp / "agent.yaml"
    config.write_text(yaml.safe_dump(doc))
    running = start_agent(config, port, "--port", str(port))
    try:
        yield Running(running, f"127.0.0.1:{transfer}")
    finally:
        running.stop()


def test_round_trip_and_auth_against_a_real_agent(agent: Running) -> None:
    with TransferClient([agent.address], token=TOKENS["a"]) as client:
        keys = keys_for(1, 8)
        kv = random_kv(client, 8, 1)
        assert kv[0].dtype == torch.bfloat16
        assert client.put(NS, keys, kv).stored == 8
        assert client.lookup(NS, keys) == ["primary"] * 8
        lease = client.lease(NS, keys)
        assert lease is not None
        out = client.empty_kv(8)
        client.get_into(lease, out)
        assert torch.equal(out[0], kv[0])
        client.release(lease)
    with TransferClient([agent.address], token=TOKENS["b"]) as other:
        assert other.lookup(NS, keys) == []
    raw = Raw(agent.address)
    raw.request(Op.LOOKUP, {"ns": [NS.model, 0, 0], "keys": keys})
    head, meta = raw.reply()
    assert head.flags & F_ERROR and meta["status"] == 401 and raw.closed()
    with pytest.raises(TransferError) as err:
        TransferClient([agent.address], token="not-a-token").lookup(NS, keys)
    assert err.value.status == 401


def test_expiry_and_a_dead_client_leave_nothing_pinned(agent: Running) -> None:
    with TransferClient([agent.address], token=TOKENS["a"]) as client:
        keys = keys_for(2, 3)
        client.put(NS, keys, random_kv(client, 3, 2))
        expired = agent.metric("kvpool_leases_expired_total")
        lease = client.lease(NS, keys, ttl_s=0.5)
        assert lease is not None and agent.pinned() == 3
        deadline = time.monotonic() + 10
        while agent.pinned() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert agent.pinned() == 0
        assert agent.metric("kvpool_leases_expired_total") == expired + 1
    raw = Raw(agent.address)
    raw.auth(TOKENS["a"])
    block = 2 * 2 * 4 * 2 * 8 * 2  # 2 layers x [2, 4, 2, 8] bf16
    meta = {"ns": [NS.model, 0, 0], "keys": keys_for(3, 4), "first": 0}
    raw.request(Op.PUT, meta, data_len=4 * block)
    raw.send(b"\x01" * block)
    deadline = time.monotonic() + 10
    while agent.metric("kvpool_stores_in_flight") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agent.pinned() == 4
    raw.close()
    while agent.metric("kvpool_stores_in_flight") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agent.pinned() == 0 and agent.metric("kvpool_stores_in_flight") == 0
    with TransferClient([agent.address], token=TOKENS["a"]) as client:
        assert client.lookup(NS, keys_for(3, 4)) == []


def test_sigterm_closes_the_transfer_port(agent: Running) -> None:
    with TransferClient([agent.address], token=TOKENS["a"]) as client:
        client.ping()
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(30) == 0, agent.log.read_text()
    host, port = agent.address.rsplit(":", 1)
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=2):
        pass
