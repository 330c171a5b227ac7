"""The same-node path: the agent's Unix socket, its memfd arena and the shm client."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest
from pydantic import ValidationError

from kvpool_agent.config import AgentConfig
from kvpool_agent.dataplane.client import (
    ChainGapError,
    TransferClient,
    TransferConnectionError,
    TransferError,
)
from kvpool_agent.dataplane.cuda_ipc import CudaArenaHandle, NotOnCuda, export_arena, local_index
from kvpool_agent.dataplane.protocol import (
    F_ERROR,
    FORBIDDEN,
    HEADER_SIZE,
    NOT_FOUND,
    SHM_OPS,
    Op,
    frame,
    unpack_header,
    unpack_meta,
)
from kvpool_agent.dataplane.server import TransferServer
from kvpool_agent.dataplane.shm import ShmClient
from kvpool_agent.server.metrics import AgentMetrics
from kvpool_agent.server.service import AgentService

from .conftest import (
    NS,
    TOKENS,
    TPB,
    Agent,
    Raw,
    advice_works,
    agent_config,
    keys_for,
    random_kv,
    vm_flags,
    write_auth,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("data_path")]


class ShmAgent(Agent):
    """An agent whose transfer server also listens on a Unix socket (the arena in a memfd)."""

    def __init__(self, config: AgentConfig, path: str) -> None:
        self.path = path
        super().__init__(config)

    async def _start(self) -> AgentService:
        service = AgentService(self.config)
        await service.start()
        self.server = TransferServer(service, host="127.0.0.1", port=0, unix_socket=self.path)
        await self.server.start()
        return service

    def shm(self, token: str | None = None, **kw: Any) -> ShmClient:
        return ShmClient(self.path, token=token, **kw)


@pytest.fixture
def sock_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvp-")  # short: a Unix socket path has 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm_agent(sock_dir: str) -> Iterator[ShmAgent]:
    a = ShmAgent(agent_config(), os.path.join(sock_dir, "agent.sock"))
    yield a
    a.close()


@pytest.fixture
def shm_auth_agent(sock_dir: str) -> Iterator[ShmAgent]:
    auth = write_auth(Path(sock_dir))
    a = ShmAgent(agent_config(auth=auth), os.path.join(sock_dir, "agent.sock"))
    yield a
    a.close()


def pinned(agent: Agent) -> int:
    return sum(int(row["blocks_pinned"]) for row in agent.usage())


def used(agent: Agent) -> int:
    return sum(int(row["blocks_used"]) for row in agent.usage())


def read_chain(client: ShmClient | TransferClient, keys: list[bytes]) -> torch.Tensor:
    """Every block of the chain ``keys`` as the agent holds it (pool 0), read under a lease
    that is released again."""
    lease = client.lease(NS, keys)
    assert lease is not None and lease.count == len(keys)
    out = client.empty_kv(len(keys))
    client.get_into(lease, out)
    client.release(lease)
    return out[0]


# ---------------------------------------------------------------------- round trips


def test_shm_put_then_get_round_trips_random_kv(shm_agent: ShmAgent) -> None:
    with shm_agent.shm() as client, shm_agent.client() as tcp:
        keys = keys_for(1, 6)
        kv = random_kv(tcp, 6, seed=1)
        assert client.lookup(NS, keys) == []
        result = client.put(NS, keys, kv)
        assert (result.stored, result.resident) == (6, 0)
        assert client.lookup(NS, keys) == ["primary"] * 6
        lease = client.lease(NS, keys, ttl_s=30)
        assert lease is not None and lease.count == 6
        out = client.empty_kv(6)
        client.get_into(lease, out)
        assert torch.equal(out[0], kv[0])
        part = client.empty_kv(3, layers=(1, 2))
        client.get_into(lease, part, start=2, count=3, layers=(1, 2))
        assert torch.equal(part[0], kv[0][1:2, 2:5])
        assert pinned(shm_agent) > 0
        client.release(lease)
        client.release(lease)  # gone already: counts as released
    assert pinned(shm_agent) == 0


def _count_requests(client: ShmClient) -> list[Op]:
    """The ops ``client`` sends from now on (its connection's requests, in order)."""
    sent: list[Op] = []
    conn = client._conn
    send = conn.send

    def counting(op: Op, meta: dict[str, Any], data: Any = None) -> int:
        sent.append(op)
        return send(op, meta, data)

    conn.send = counting  # type: ignore[method-assign]
    return sent


def test_one_read_of_a_lease_serves_every_range_and_layer(shm_agent: ShmAgent) -> None:
    """The first GET_SHM of a lease names all of its blocks; the client's later reads of
    other ranges and layers copy with no round trip, and end with its RELEASE."""
    with shm_agent.shm() as client, shm_agent.client() as tcp:
        keys = keys_for(31, 6)
        kv = random_kv(tcp, 6, seed=31)
        client.put(NS, keys, kv)
        lease = client.lease(NS, keys, ttl_s=30)
        assert lease is not None
        sent = _count_requests(client)
        part = client.empty_kv(3, layers=(1, 2))
        client.get_into(lease, part, start=2, count=3, layers=(1, 2))
        assert torch.equal(part[0], kv[0][1:2, 2:5])
        whole = client.empty_kv(6)
        client.get_into(lease, whole)
        assert torch.equal(whole[0], kv[0])
        tail = client.empty_kv(1)
        client.get_into(lease, tail, start=5)
        assert torch.equal(tail[0], kv[0][:, 5:])
        assert sent == [Op.GET_SHM]
        with pytest.raises(TransferError) as outside:  # checked as the agent checks it
            client.get_into(lease, client.empty_kv(2), start=5, count=2)
        assert outside.value.status == 422 and "outside the lease" in outside.value.reason
        assert sent == [Op.GET_SHM] and pinned(shm_agent) == 6
        client.release(lease)
        assert pinned(shm_agent) == 0
        with pytest.raises(TransferError) as gone:  # released: the next read asks again
            client.get_into(lease, client.empty_kv(6))
        assert gone.value.status == NOT_FOUND
        assert sent == [Op.GET_SHM, Op.RELEASE, Op.GET_SHM]


def test_a_read_names_each_pools_window(sock_dir: str) -> None:
    """A whole-lease read of a sliding-window pool starts at the window, as a ranged one
    must: blocks before it are refused (422) without asking the agent again."""
    config = agent_config(
        kv_cache_config={"tokens_per_block": TPB, "max_attention_window": [8, 1024]},
        cpu_budget_bytes=1 << 20,
    )
    agent = ShmAgent(config, os.path.join(sock_dir, "agent.sock"))
    try:
        with agent.shm() as client, agent.client() as tcp:
            keys = keys_for(32, 6)
            kv = random_kv(tcp, 6, seed=32)
            assert client.put(NS, keys, kv).stored == 6
            lease = client.lease(NS, keys)
            assert lease is not None
            window = next(p.index for p in client.geometry().pools if p.window == 8)
            first = lease.first_block[window]
            assert first > 0
            out = client.empty_kv(6 - first)
            client.get_into(lease, out, start=first)
            assert all(torch.equal(o, k[:, first:]) for o, k in zip(out, kv, strict=True))
            sent = _count_requests(client)
            with pytest.raises(TransferError) as err:
                client.get_into(lease, client.empty_kv(6))
            assert err.value.status == 422 and "window" in err.value.reason and not sent
            client.release(lease)
    finally:
        agent.close()


def test_a_read_on_a_connection_the_agent_closed_is_not_trusted(sock_dir: str) -> None:
    """An idle connection the agent closed has lost its reads (the lease's blocks may
    move): a later copy from the ids it held fails instead of returning what may be
    someone else's KV."""
    config = agent_config(transfer={"port": 0, "idle_timeout_s": 0.3})
    agent = ShmAgent(config, os.path.join(sock_dir, "agent.sock"))
    try:
        with agent.shm() as client:
            keys = keys_for(33, 3)
            client.put(NS, keys, random_kv(client, 3, seed=33))
            lease = client.lease(NS, keys, ttl_s=0.2)
            assert lease is not None
            client.get_into(lease, client.empty_kv(3))
            deadline = time.monotonic() + 10
            while pinned(agent) and time.monotonic() < deadline:
                time.sleep(0.05)  # idle: the agent closes the connection, the read ends
            assert pinned(agent) == 0
            with pytest.raises(TransferConnectionError):
                client.get_into(lease, client.empty_kv(3))
            assert client.broken
    finally:
        agent.close()


def test_a_partial_range_in_get_shm_is_malformed(shm_agent: ShmAgent) -> None:
    with shm_agent.shm() as client:
        keys = keys_for(34, 2)
        client.put(NS, keys, random_kv(client, 2, seed=34))
        lease = client.lease(NS, keys)
        assert lease is not None
        with pytest.raises(TransferError) as err:
            client._request(Op.GET_SHM, {"lease": lease.lease_id, "start": 0})
        assert err.value.status == 400 and "go together" in err.value.reason
    # The malformed frame closed the connection before any read began: the lease alone
    # pins the blocks.
    assert [held.readers for held in shm_agent.service.leases.values()] == [0]


def test_tcp_sees_what_shm_put_and_shm_sees_what_tcp_put(shm_agent: ShmAgent) -> None:
    with shm_agent.shm() as client, shm_agent.client() as tcp:
        a, b = keys_for(2, 5), keys_for(3, 4)
        kv_a, kv_b = random_kv(tcp, 5, seed=2), random_kv(tcp, 4, seed=3)
        assert client.put(NS, a, kv_a).stored == 5
        assert tcp.put(NS, b, kv_b).stored == 4
        assert tcp.lookup(NS, a) == ["primary"] * 5
        assert torch.equal(read_chain(tcp, a), kv_a[0])
        assert torch.equal(read_chain(client, b), kv_b[0])
    assert pinned(shm_agent) == 0


def test_shm_put_extends_a_resident_prefix(shm_agent: ShmAgent, data_path: str) -> None:
    with shm_agent.shm() as client:
        sent = _count_requests(client)
        keys = keys_for(4, 6)
        kv = random_kv(client, 6, seed=4)
        assert client.put(NS, keys[:2], [t[:, :2] for t in kv]).stored == 2
        # Data from block 1: block 1 is held already and skipped, 2..5 are written.
        result = client.put(NS, keys, [t[:, 1:] for t in kv], first=1)
        assert (result.stored, result.resident) == (4, 2)
        # Everything held: nothing to reserve.
        assert client.put(NS, keys, [t[:, 6:] for t in kv], first=6).stored == 0
        with pytest.raises(ChainGapError) as gap:
            client.put(NS, keys_for(5, 3), [t[:, 1:3] for t in kv], first=1)
        assert gap.value.resident == 0
        # The compiled exchange runs on the socket without the Python connection's sends.
        python_ops = [Op.PUT_SHM, Op.COMMIT] * 2 + [Op.PUT_SHM] * 2
        assert sent == ([] if data_path == "compiled" else python_ops)
        assert torch.equal(read_chain(client, keys), kv[0])
        assert not shm_agent.service.stores


def test_a_put_whose_data_does_not_fit_changes_nothing(shm_agent: ShmAgent, data_path: str) -> None:
    with shm_agent.shm() as client:
        keys = keys_for(8, 3)
        kv = random_kv(client, 3, seed=8)
        before = shm_agent.state()
        # Two blocks of data for the three the agent reserves: aborted, nothing copied.
        with pytest.raises(ValueError, match=r"kv\[0\]"):
            client.put(NS, keys, [t[:, :2] for t in kv])
        with pytest.raises(ValueError, match=r"kv\[0\]"):  # a wrong layer count
            client.put(NS, keys, [t[:1] for t in kv])
        assert shm_agent.state() == before
        assert pinned(shm_agent) == 0 and not shm_agent.service.stores
        assert client.lookup(NS, keys) == []
        assert client.put(NS, keys, kv).stored == 3  # the connection is still in step
        assert torch.equal(read_chain(client, keys), kv[0])


def test_a_put_to_an_agent_gone_away_breaks_the_connection(sock_dir: str) -> None:
    gone = ShmAgent(agent_config(), os.path.join(sock_dir, "agent.sock"))
    client = gone.shm()
    kv = random_kv(client, 2, seed=9)
    gone.close()
    with pytest.raises(TransferConnectionError):
        client.put(NS, keys_for(9, 2), kv)
    assert client.broken
    client.close()


def test_put_many_stores_each_chain_as_put_would(shm_agent: ShmAgent) -> None:
    with shm_agent.shm() as client:
        chains = [keys_for(40 + i, 3 + i) for i in range(4)]
        kvs = [random_kv(client, len(keys), seed=40 + i) for i, keys in enumerate(chains)]
        assert client.put(NS, chains[1][:2], [t[:, :2] for t in kvs[1]]).stored == 2
        assert client.put(NS, chains[2], kvs[2]).stored == 5
        results = client.put_many(NS, iter(zip(chains, kvs, strict=True)))
        # In order; a resident prefix is skipped, a chain held whole costs nothing.
        assert [(r.stored, r.resident) for r in results] == [(3, 0), (2, 2), (0, 5), (6, 0)]
        for keys, kv in zip(chains, kvs, strict=True):
            assert torch.equal(read_chain(client, keys), kv[0])
        assert client.put_many(NS, []) == []
    assert pinned(shm_agent) == 0 and not shm_agent.service.stores


def test_put_many_stops_at_a_failed_copy_and_leaves_nothing_reserved(
    shm_agent: ShmAgent,
) -> None:
    with shm_agent.shm() as client:
        chains = [keys_for(50 + i, 3) for i in range(4)]
        kv = random_kv(client, 3, seed=50)
        bad = [t[:, :2] for t in kv]  # two blocks of data for a chain of three
        # Chain 1's copy fails after chain 0's commit and chain 2's reservation were sent.
        with pytest.raises(ValueError, match="kv"):
            client.put_many(NS, zip(chains, [kv, bad, kv, kv], strict=True))
        assert client.lookup(NS, chains[0]) == ["primary"] * 3
        for keys in chains[1:]:
            assert client.lookup(NS, keys) == []
        assert pinned(shm_agent) == 0 and not shm_agent.service.stores
        assert client.put(NS, chains[3], kv).stored == 3  # the connection is still in step


def test_put_many_stops_at_a_refused_chain(shm_agent: ShmAgent) -> None:
    with shm_agent.shm() as client:
        chains = [keys_for(60, 3), [b"k" * 65, *keys_for(61, 2)], keys_for(62, 3)]
        kv = random_kv(client, 3, seed=60)
        with pytest.raises(TransferError) as refused:
            client.put_many(NS, [(keys, kv) for keys in chains])
        assert 400 <= refused.value.status < 500 and "keys[0]" in refused.value.reason
        assert client.lookup(NS, chains[0]) == ["primary"] * 3  # committed before it
        assert client.lookup(NS, chains[2]) == []  # never sent
        assert pinned(shm_agent) == 0 and not shm_agent.service.stores
        assert client.put(NS, chains[2], kv).stored == 3


def test_a_client_without_the_arena_asks_but_moves_no_kv(shm_agent: ShmAgent) -> None:
    with shm_agent.shm() as writer:
        keys = keys_for(70, 3)
        kv = random_kv(writer, 3, seed=70)
        writer.put(NS, keys, kv)
    with shm_agent.shm(map_arena=False) as asker:
        assert asker.arena is None and asker.geometry().tokens_per_block == TPB
        assert asker.lookup(NS, keys) == ["primary"] * 3
        lease = asker.lease(NS, keys)
        assert lease is not None and lease.count == 3
        with pytest.raises(ValueError, match="map_arena=False"):
            asker.get_into(lease, asker.empty_kv(3))
        with pytest.raises(ValueError, match="map_arena=False"):
            asker.put(NS, keys_for(71, 2), [t[:, :2] for t in kv])
        assert not shm_agent.service.stores  # refused before anything was reserved
        asker.release(lease)
    assert pinned(shm_agent) == 0


def test_several_pools_round_trip_over_shm(sock_dir: str) -> None:
    config = agent_config(
        model={"num_layers": 3, "num_kv_heads": [2, 4, 2], "head_dim": 8, "dtype": "bfloat16"},
        cpu_budget_bytes=4 << 20,
    )
    agent = ShmAgent(config, os.path.join(sock_dir, "agent.sock"))
    try:
        with agent.shm() as client, agent.client() as tcp:
            keys = keys_for(6, 5)
            kv = random_kv(tcp, 5, seed=6)
            assert client.put(NS, keys, kv).stored == 5
            for reader in (client, tcp):
                lease = reader.lease(NS, keys)
                assert lease is not None
                out = reader.empty_kv(5)
                reader.get_into(lease, out)
                reader.release(lease)
                assert all(torch.equal(x, y) for x, y in zip(out, kv, strict=True))
            part = client.empty_kv(2, layers=(1, 2))
            lease = client.lease(NS, keys)
            assert lease is not None
            client.get_into(lease, part, start=3, count=2, layers=(1, 2))
            client.release(lease)
            # Model layer 1 is in pool 1 only (pool 0 holds layers 0 and 2).
            assert part[0].shape[0] == 0 and torch.equal(part[1], kv[1][:, 3:5])
    finally:
        agent.close()


def test_concurrent_shm_clients_round_trip(shm_agent: ShmAgent) -> None:
    errors: list[BaseException] = []

    def work(tag: int) -> None:
        try:
            with shm_agent.shm() as client:
                for round_ in range(5):
                    keys = keys_for(100 * tag + round_, 3)
                    kv = random_kv(client, 3, seed=tag * 10 + round_)
                    client.put(NS, keys, kv)
                    lease = client.lease(NS, keys)
                    assert lease is not None and lease.count == 3
                    out = client.empty_kv(3)
                    client.get_into(lease, out)
                    client.release(lease)
                    assert torch.equal(out[0], kv[0])
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert pinned(shm_agent) == 0


# ---------------------------------------------------------------------- failures


def _metric(agent: Agent, name: str) -> float:
    text = generate_latest(AgentMetrics(agent.service).registry).decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_a_sibling_shares_the_mapping_on_a_connection_of_its_own(shm_agent: ShmAgent) -> None:
    """A sibling reserves while its twin holds a read: each connection keeps its own, and
    closing the sibling aborts only its reservation. Both see the same bytes."""
    with shm_agent.shm() as client, shm_agent.client() as tcp:
        twin = client.sibling()
        assert twin.arena is client.arena and twin.device == client.device
        a, b = keys_for(20, 4), keys_for(21, 3)
        kv_a, kv_b = random_kv(tcp, 4, seed=20), random_kv(tcp, 3, seed=21)
        assert twin.put(NS, a, kv_a).stored == 4
        lease = client.lease(NS, a, ttl_s=30)
        assert lease is not None
        out = client.empty_kv(4)
        client.get_into(lease, out)  # a read on the first connection, still open
        assert torch.equal(out[0], kv_a[0])
        reservation = twin.reserve(NS, b)
        assert pinned(shm_agent) == 4 + 3
        twin.close()  # its reservation goes; the first connection's read stays
        deadline = time.monotonic() + 10
        while pinned(shm_agent) > 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pinned(shm_agent) == 4 and reservation.store_id
        client.release(lease)
        assert client.put(NS, b, kv_b).stored == 3
        assert tcp.lookup(NS, b) == ["primary"] * 3
    assert pinned(shm_agent) == 0


def test_a_sibling_of_a_restarted_agent_is_refused(sock_dir: str) -> None:
    """The agent behind the socket restarted (a new memfd): a sibling would read another
    arena's bytes through the old mapping, so it is refused."""
    path = os.path.join(sock_dir, "agent.sock")
    first = ShmAgent(agent_config(), path)
    client = first.shm()
    first.close()
    second = ShmAgent(agent_config(), path)
    try:
        with pytest.raises(TransferError, match="not the one mapped") as refused:
            client.sibling()
        assert refused.value.status == 409
        with second.shm() as fresh:
            fresh.sibling().sibling().close()  # the same agent: accepted, twice over
        with second.shm(map_arena=False) as keys_only, pytest.raises(ValueError, match="no arena"):
            keys_only.sibling()
    finally:
        client.close()
        second.close()


def test_a_client_dying_after_reserving_leaks_nothing(shm_agent: ShmAgent) -> None:
    before = shm_agent.state(arena=False)
    client = shm_agent.shm()
    keys = keys_for(7, 4)
    reservation = client.reserve(NS, keys)
    assert reservation.store_id and len(reservation.blocks[0]) == 4
    assert pinned(shm_agent) == 4
    client.close()  # dies before COMMIT: the reservation is aborted with its connection
    deadline = time.monotonic() + 10
    while pinned(shm_agent) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pinned(shm_agent) == 0 and used(shm_agent) == 0
    assert not shm_agent.service.stores
    assert shm_agent.state(arena=False) == before
    assert _metric(shm_agent, "kvpool_reservations_expired_total") == 1
    with shm_agent.shm() as other:
        assert other.lookup(NS, keys) == []


def test_an_uncommitted_reservation_expires_and_frees_its_blocks(shm_agent: ShmAgent) -> None:
    with shm_agent.shm() as client:
        keys = keys_for(8, 3)
        kv = random_kv(client, 3, seed=8)
        reservation = client.reserve(NS, keys, ttl_s=0.2)
        client.write(reservation, kv)
        assert pinned(shm_agent) == 3
        deadline = time.monotonic() + 10  # the housekeeper expires it at its deadline
        while shm_agent.service.stores and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not shm_agent.service.stores
        assert pinned(shm_agent) == 0 and used(shm_agent) == 0
        with pytest.raises(TransferError) as late:
            client.commit(reservation)
        assert late.value.status == NOT_FOUND
        assert client.lookup(NS, keys) == []
        assert _metric(shm_agent, "kvpool_reservations_expired_total") == 1
        # The connection is still good: a fresh put works.
        assert client.put(NS, keys, kv).stored == 3
        assert client.lookup(NS, keys) == ["primary"] * 3


def test_abort_frees_a_reservation(shm_agent: ShmAgent) -> None:
    with shm_agent.shm() as client:
        keys = keys_for(9, 2)
        reservation = client.reserve(NS, keys)
        client.abort(reservation)
        assert pinned(shm_agent) == 0 and client.lookup(NS, keys) == []
        with pytest.raises(TransferError) as gone:
            client.commit(reservation)
        assert gone.value.status == NOT_FOUND


def test_a_client_dying_mid_read_unpins_its_lease(shm_agent: ShmAgent) -> None:
    with shm_agent.shm() as writer:
        keys = keys_for(10, 3)
        writer.put(NS, keys, random_kv(writer, 3, seed=10))
    reader = shm_agent.shm()
    lease = reader.lease(NS, keys, ttl_s=0.3)
    assert lease is not None
    reader.get_into(lease, reader.empty_kv(3))
    assert pinned(shm_agent) == 3
    reader.close()  # no RELEASE: the lease expires, the read ends with the connection
    deadline = time.monotonic() + 10
    while pinned(shm_agent) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pinned(shm_agent) == 0 and not shm_agent.service.leases


def test_a_released_lease_stays_pinned_only_while_read(shm_agent: ShmAgent) -> None:
    """GET_SHM's read ends with RELEASE on the same connection; a lease expired meanwhile
    keeps its blocks until then."""
    with shm_agent.shm() as client:
        keys = keys_for(11, 2)
        client.put(NS, keys, random_kv(client, 2, seed=11))
        lease = client.lease(NS, keys, ttl_s=0.1)
        assert lease is not None
        client.get_into(lease, client.empty_kv(2))
        time.sleep(0.3)
        shm_agent.run(shm_agent.service.expire_leases())
        assert not shm_agent.service.leases
        assert pinned(shm_agent) == 2  # still being read
        client.release(lease)  # 404 (expired) counts as done; the read ends
        assert pinned(shm_agent) == 0


def test_an_unauthenticated_client_gets_no_fd(shm_auth_agent: ShmAgent) -> None:
    path = shm_auth_agent.path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    try:
        sock.sendall(frame(Op.MAP, 1, {}))
        data, fds, _, _ = socket.recv_fds(sock, 65536, 4)
        assert fds == []
        head = unpack_header(data[:HEADER_SIZE])
        meta = unpack_meta(data[HEADER_SIZE : HEADER_SIZE + head.meta_len])
        assert head.flags & F_ERROR and meta["status"] == 401
    finally:
        sock.close()
    with pytest.raises(TransferError) as bad:
        shm_auth_agent.shm(token="not-a-token-of-anyone-0123456789")
    assert bad.value.status == 401
    with shm_auth_agent.shm(token=TOKENS["a"]) as client:
        assert client.geometry().tenant == "a"
        client.put(NS, keys_for(12, 2), random_kv(client, 2, seed=12))
    with shm_auth_agent.shm(token=TOKENS["b"]) as other:  # tenants stay apart
        assert other.lookup(NS, keys_for(12, 2)) == []


def test_same_node_ops_are_refused_over_tcp(shm_agent: ShmAgent) -> None:
    raw = Raw(shm_agent.address)
    try:
        raw.auth()
        assert Op.MAP_INDEX in SHM_OPS
        for op in sorted(SHM_OPS):
            raw.request(op, {})
            head, meta = raw.reply()
            assert head.flags & F_ERROR and meta["status"] == FORBIDDEN, meta
        raw.request(Op.PING)
        head, _ = raw.reply()
        assert not head.flags & F_ERROR
    finally:
        raw.close()


def test_a_rejected_request_leaves_the_cache_alone(shm_agent: ShmAgent) -> None:
    with shm_agent.shm() as client:
        keys = keys_for(13, 3)
        client.put(NS, keys, random_kv(client, 3, seed=13))
        lease = client.lease(NS, keys)
        assert lease is not None
        before = shm_agent.state()
        with pytest.raises(TransferError) as outside:
            client.get_into(lease, client.empty_kv(5), count=5)
        assert outside.value.status == 422
        with pytest.raises(TransferError):
            client._request(Op.COMMIT, {"store": 12345})
        assert shm_agent.state() == before
        client.release(lease)


def test_map_refusals_name_the_other_way() -> None:
    """A CPU tier has no CUDA IPC handle: a clear refusal, not a crash."""
    with pytest.raises(NotOnCuda, match="memfd"):
        export_arena(torch.zeros(16, dtype=torch.uint8))


def test_cuda_handle_meta_round_trips() -> None:
    handle = CudaArenaHandle(0, b"h" * 64, 1 << 20, 0, b"r" * 8, 16, b"e" * 64, True, 0, 1 << 20)
    doc = handle.to_meta()
    assert doc["kind"] == "cuda"
    assert CudaArenaHandle.from_meta(doc) == handle
    with pytest.raises(ValueError, match="not a CUDA arena"):
        CudaArenaHandle.from_meta({**doc, "kind": "memfd"})


def test_the_engine_finds_the_agents_gpu_by_uuid() -> None:
    """Containers number a node's GPUs each their own way: the handle names the GPU by
    UUID, and one the engine does not see is refused with both sides named."""
    handle = CudaArenaHandle(2, b"h", 1, 0, b"r", 0, b"", False, 0, 1, uuid="GPU-c")
    assert CudaArenaHandle.from_meta(handle.to_meta()) == handle
    assert local_index(handle, ["GPU-a", "GPU-c"]) == 1  # the agent's 2 is this process's 1
    old_agent = CudaArenaHandle(2, b"h", 1, 0, b"r", 0, b"", False, 0, 1)
    assert local_index(old_agent, ["GPU-a"]) == 2  # no UUID sent: the agent's index
    with pytest.raises(NotOnCuda, match=r"GPU-c, which this process does not see.*GPU-a"):
        local_index(handle, ["GPU-a", "GPU-b"])


def test_map_with_cuda_on_a_cpu_agent_is_refused(shm_agent: ShmAgent) -> None:
    with pytest.raises(TransferError) as refused:
        shm_agent.shm(cuda=True)
    assert refused.value.status == 409 and "CPU memory" in refused.value.reason


def test_the_unix_socket_is_removed_on_stop_and_a_stale_one_replaced(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "agent.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # a socket file nobody listens on (an agent that died)
    agent = ShmAgent(agent_config(), path)
    try:
        with agent.shm() as client:
            client.ping()
    finally:
        agent.close()
    assert not os.path.exists(path)
    Path(path).write_text("not a socket")
    with pytest.raises(OSError, match="not a socket"):
        ShmAgent(agent_config(), path)


def test_config_validates_the_socket_path() -> None:
    assert agent_config(transfer={"unix_socket": "/run/kvpool.sock"}).transfer.unix_socket
    with pytest.raises(ValidationError, match="absolute path"):
        agent_config(transfer={"unix_socket": "kvpool.sock"})
    with pytest.raises(ValidationError, match="sun_path"):
        agent_config(transfer={"unix_socket": "/" + "x" * 120})
    with pytest.raises(ValidationError, match="any local user"):
        agent_config(transfer={"unix_socket": "/run/k.sock", "unix_socket_mode": 0o666})


@pytest.mark.gpu
def test_cuda_ipc_export_opens_in_another_process() -> None:
    """Export a CUDA arena, open it in a spawned process, write there, read here."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import multiprocessing as mp

    arena = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    doc = export_arena(arena).to_meta()
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_fill_remote, args=(doc,))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    torch.cuda.synchronize()
    assert int(arena[:4096].sum()) == 7 * 4096


def _fill_remote(doc: dict[str, Any]) -> None:
    from kvpool_agent.dataplane.cuda_ipc import open_arena

    peer = open_arena(CudaArenaHandle.from_meta(doc))
    peer[:4096].fill_(7)
    torch.cuda.synchronize()


# ---------------------------------------------------------------------- a real agent

_DYING_CLIENT = """
import os, sys, time
from kvpool_agent.dataplane.keys import KeyNamespace
from kvpool_agent.dataplane.shm import ShmClient
client = ShmClient(sys.argv[1], token=sys.argv[2])
keys = [bytes([i]) * 32 for i in range(4)]
reservation = client.reserve(KeyNamespace("test-model"), keys, ttl_s=600)
client.views[0][:, reservation.blocks[0][0]].fill_(1.0)  # half-way through its writes
print(reservation.store_id, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_real_agent_on_a_unix_socket_only(start_agent: Any, sock_dir: str) -> None:
    """``kvpool agent`` with the socket and no TCP port: a client process killed between
    reserving and committing leaks nothing; another client round-trips through the memfd."""
    import subprocess
    import sys

    tmp = Path(sock_dir)
    path = str(tmp / "t.sock")
    port = _free_port()
    doc = {
        "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
        "kv_cache_config": {"tokens_per_block": 4},
        "device": "cpu",
        "cpu_budget_bytes": 256 * 1024,
        "events": {"endpoint": None, "replay_endpoint": None},
        "auth": write_auth(tmp),
        "transfer": {"port": None, "unix_socket": path},
    }
    config = tmp / "agent.yaml"
    import yaml

    config.write_text(yaml.safe_dump(doc))
    agent = start_agent(config, port, "--port", str(port))
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        child = subprocess.Popen(
            [sys.executable, "-c", _DYING_CLIENT, path, TOKENS["a"]], stdout=subprocess.PIPE
        )
        assert child.stdout is not None
        assert int(child.stdout.readline())  # reserved, and writing
        assert agent.metric("kvpool_cache_blocks_pinned") == 4
        child.kill()
        child.wait()
        deadline = time.monotonic() + 20
        while agent.metric("kvpool_cache_blocks_pinned") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.metric("kvpool_cache_blocks_pinned") == 0
        assert agent.metric("kvpool_reservations_expired_total") == 1
        assert agent.metric("kvpool_stores_in_flight") == 0
        with ShmClient(path, token=TOKENS["a"]) as client:
            keys = [bytes([i]) * 32 for i in range(4)]
            assert client.lookup(NS, keys) == []  # nothing half-written entered the tree
            kv = random_kv(client, 4, seed=20)
            assert client.put(NS, keys, kv).stored == 4
            lease = client.lease(NS, keys)
            assert lease is not None
            out = client.empty_kv(4)
            client.get_into(lease, out)
            client.release(lease)
            assert torch.equal(out[0], kv[0])
    finally:
        agent.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@advice_works
def test_the_shared_arena_and_an_engines_mapping_are_advised(
    sock_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvpool.agent.transfer")
    agent = ShmAgent(agent_config(), os.path.join(sock_dir, "agent.sock"))
    try:
        # The agent says what backs the arena it shares (4 KiB pages, or how much is huge).
        said = [r.getMessage() for r in caplog.records if "same-node arena" in r.getMessage()]
        assert len(said) == 1 and ("4 KiB pages" in said[0] or "2 MiB pages" in said[0])
        primary = agent.service.engine.storage[0]
        assert primary.shared_fd is not None
        assert "hg" in vm_flags(primary.arena.data_ptr())  # the agent's memfd mapping
        with agent.shm() as client:
            assert client.arena is not None
            flags = vm_flags(client.arena.data_ptr())
            assert {"sh", "hg"} <= flags  # shared, and advised
        text = generate_latest(AgentMetrics(agent.service).registry).decode()
        for tier, storage in zip(
            ("primary", "secondary"), agent.service.engine.storage, strict=True
        ):
            line = f'kvpool_cache_arena_huge_page_bytes{{tier="{tier}"}} '
            assert line + f"{float(storage.huge_page_bytes)}" in text
    finally:
        agent.close()
