"""A pool over the transfer port with the replica on this node reached through its socket
(``dataplane/routed.py``): two in-process agents, one of them "on this node"."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

from kvpool_agent.dataplane.client import TransferClient
from kvpool_agent.dataplane.routed import RoutedClient, ring_member
from kvpool_agent.dataplane.shm import ShmClient

from .conftest import NS, agent_config, keys_for, random_kv
from .test_shm import ShmAgent

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def pair() -> Iterator[tuple[ShmAgent, ShmAgent]]:
    sock_dir = tempfile.mkdtemp(prefix="kvp-")  # short: a Unix socket path has 107 bytes
    a = ShmAgent(agent_config(), os.path.join(sock_dir, "a.sock"))
    b = ShmAgent(agent_config(), os.path.join(sock_dir, "b.sock"))
    yield a, b
    a.close()
    b.close()
    shutil.rmtree(sock_dir, ignore_errors=True)


def chains(tcp: TransferClient, owner: str, n: int, start: int) -> list[list[bytes]]:
    """``n`` 3-block chains that rank to ``owner``."""
    out: list[list[bytes]] = []
    tag = start
    while len(out) < n:
        keys = keys_for(tag, 3)
        tag += 1
        if tcp.replica_for(NS, keys) == owner:
            out.append(keys)
    return out


def test_chains_of_the_local_replica_move_through_its_arena(
    pair: tuple[ShmAgent, ShmAgent],
) -> None:
    """Chains ranked to the local agent are stored and read through its socket (no byte on
    its transfer port), the others over TCP; every read is bit-exact, and each lease comes
    from where its chain lives."""
    a, b = pair
    tcp = TransferClient([a.address, b.address], retries=0)
    routed = RoutedClient(tcp, ShmClient(a.path), a.address)
    kv = random_kv(tcp, 3, seed=1)
    local, remote = chains(tcp, a.address, 3, 100), chains(tcp, b.address, 3, 200)
    for keys in local + remote:
        assert routed.put(NS, keys, kv).stored == 3
    assert a.service.transfer.bytes_received == 0  # all of a's came through the arena
    assert b.service.transfer.bytes_received == 3 * 3 * kv[0][:, 0].numel() * 4
    for keys in local + remote:
        assert routed.lookup(NS, keys) == ["primary"] * 3
        lease = routed.lease(NS, keys, ttl_s=30)
        assert lease is not None
        assert lease.replica == (a.path if keys in local else b.address)
        out = [torch.zeros_like(kv[0])]
        routed.get_into(lease, out)
        routed.release(lease)
        assert torch.equal(out[0], kv[0])
    assert a.service.transfer.bytes_sent == 0
    routed.close()


def test_a_broken_socket_falls_back_to_the_transfer_port(pair: tuple[ShmAgent, ShmAgent]) -> None:
    a, b = pair
    tcp = TransferClient([a.address, b.address], retries=0)
    shm = ShmClient(a.path)
    routed = RoutedClient(tcp, shm, a.address)
    kv = random_kv(tcp, 3, seed=2)
    (keys,) = chains(tcp, a.address, 1, 300)
    shm.close()
    assert routed.put(NS, keys, kv).stored == 3
    assert a.service.transfer.bytes_received > 0  # over a's TCP port this time
    lease = routed.lease(NS, keys, ttl_s=30)
    assert lease is not None and lease.replica == a.address
    routed.release(lease)
    tcp.close()


def test_the_local_agent_is_found_in_the_ring_by_its_pod_name() -> None:
    ring = ["pool-0.pool.ns.svc.cluster.local:7071", "pool-1.pool.ns.svc.cluster.local:7071"]
    assert ring_member(ring, "pool-1") == ring[1]
    assert ring_member(ring, "pool-2") is None
    assert ring_member(ring, None) is None
    assert ring_member(["10.0.0.1:7071"], "10") is None  # an address, not a name
    with pytest.raises(ValueError, match="not one of the replicas"):
        RoutedClient(TransferClient(ring), None, "elsewhere:1")  # type: ignore[arg-type]


def test_the_agent_says_which_pod_it_is(
    pair: tuple[ShmAgent, ShmAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = pair
    monkeypatch.delenv("POD_NAME", raising=False)
    with ShmClient(a.path) as shm:
        assert shm.pod is None  # no POD_NAME: outside a pod
    monkeypatch.setenv("POD_NAME", "pool-1")
    with ShmClient(a.path) as shm:
        assert shm.pod == "pool-1"
