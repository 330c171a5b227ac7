"""The transfer client: routing by leading keys, failover and retries, argument checks."""

from __future__ import annotations

import socket
import time
from collections import Counter

import pytest
import torch

from kvpool_agent.dataplane.client import TransferClient, TransferConnectionError
from kvpool_agent.dataplane.keys import KeyNamespace

from .conftest import NS, Agent, keys_for, random_kv

pytestmark = pytest.mark.timeout(120)


def dead_address() -> str:
    """A loopback port nobody listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_chains_sharing_their_leading_keys_go_to_one_replica() -> None:
    replicas = [f"10.0.0.{i}:8100" for i in range(1, 6)]
    client = TransferClient(replicas, affinity_blocks=4)
    base = keys_for(1, 4)
    homes = {client.replica_for(NS, base + keys_for(100 + i, 3)) for i in range(20)}
    assert len(homes) == 1  # the same first 4 keys: the same replica
    spread = Counter(client.replica_for(NS, keys_for(i, 6)) for i in range(500))
    assert len(spread) == 5 and min(spread.values()) > 50
    # The namespace takes part: another rank may live elsewhere.
    ranks = {client.replica_for(KeyNamespace(NS.model, rank=r), base) for r in range(16)}
    assert len(ranks) > 1
    # Removing a replica moves only the chains it held.
    fewer = TransferClient(replicas[:-1])
    for i in range(200):
        chain = keys_for(i, 5)
        if client.replica_for(NS, chain) != replicas[-1]:
            assert fewer.replica_for(NS, chain) == client.replica_for(NS, chain)


def test_bad_replica_addresses_are_refused() -> None:
    for bad in ([], ["no-port"], ["host:port"]):
        with pytest.raises(ValueError):
            TransferClient(bad)


def test_unreachable_replicas_are_retried_then_skipped(agent: Agent) -> None:
    dead = dead_address()
    client = TransferClient([dead, agent.address], retries=1, backoff_s=0.01)
    keys = next(
        keys_for(i, 3) for i in range(1000) if client.replica_for(NS, keys_for(i, 3)) == dead
    )
    kv = random_kv(TransferClient([agent.address]), 3, 1)
    started = time.monotonic()
    result = client.put(NS, keys, kv)  # nothing was sent to the dead one: safe to fail over
    assert result.replica == agent.address and result.stored == 3
    assert client.lookup(NS, keys) == ["primary"] * 3
    assert time.monotonic() - started < 10
    alone = TransferClient([dead], retries=2, backoff_s=0.01)
    with pytest.raises(TransferConnectionError) as err:
        alone.lookup(NS, keys)
    assert not err.value.request_sent


def test_tensor_arguments_are_checked(agent: Agent) -> None:
    with agent.client() as client:
        keys = keys_for(2, 2)
        with pytest.raises(ValueError, match="shape"):
            client.put(NS, keys, torch.zeros(2, 3, 2, 4, 2, 8))  # 3 blocks for 2 keys
        with pytest.raises(ValueError, match="shape"):
            client.put(NS, keys, torch.zeros(2, 2, 2, 4, 2, 8, dtype=torch.float16))
        kv = random_kv(client, 2, 2)
        # Non-contiguous input is copied first.
        wide = torch.cat([kv[0], kv[0]], dim=1)[:, ::2]
        assert not wide.is_contiguous()
        assert client.put(NS, keys, wide).stored == 2
        lease = client.lease(NS, keys)
        assert lease is not None
        strided = torch.zeros(2, 4, 2, 4, 2, 8)[:, ::2]  # a non-contiguous destination
        client.get_into(lease, strided)  # filled through a host copy
        assert torch.equal(strided, wide.contiguous())
        client.release(lease)


def test_a_silent_agent_times_out() -> None:
    with socket.socket() as silent:  # accepts (the kernel does), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        client = TransferClient([address], timeout=0.3, retries=1, backoff_s=0.01)
        started = time.monotonic()
        with pytest.raises(TransferConnectionError, match="timed out"):
            client.lookup(NS, [b"k"])
        assert time.monotonic() - started < 5
