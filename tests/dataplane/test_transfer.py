"""The transfer port against an in-process agent: round trips, leases, tenancy, failures."""

from __future__ import annotations

import socket
import threading
import time
import zlib

import pytest
import torch
from prometheus_client import generate_latest

from kvpool_agent.dataplane.client import (
    ChainGapError,
    TransferConnectionError,
    TransferError,
)
from kvpool_agent.dataplane.keys import KeyNamespace
from kvpool_agent.dataplane.protocol import F_ERROR, HEADER_SIZE, Op, data_bytes, frame
from kvpool_agent.server.metrics import AgentMetrics

from .conftest import (
    NS,
    PEER,
    TOKENS,
    Agent,
    Raw,
    agent_config,
    keys_for,
    random_kv,
    round_trip_six_blocks,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("data_path")]


def pinned(agent: Agent) -> int:
    return sum(int(row["blocks_pinned"]) for row in agent.usage())


def used(agent: Agent) -> int:
    return sum(int(row["blocks_used"]) for row in agent.usage())


# ---------------------------------------------------------------------- round trips


def test_put_then_get_round_trips_random_kv(agent: Agent) -> None:
    with agent.client() as client:
        round_trip_six_blocks(client)
    assert pinned(agent) == 0


@pytest.mark.parametrize("direct", [True, False], ids=["in-place", "staged"])
def test_several_pools_round_trip(direct: bool) -> None:
    """Two pools (kv heads 2 and 4 per layer) in one group, bf16; the staged path is what a
    CUDA primary tier uses (bytes through a host buffer)."""
    config = agent_config(
        model={"num_layers": 3, "num_kv_heads": [2, 4, 2], "head_dim": 8, "dtype": "bfloat16"},
        cpu_budget_bytes=4 << 20,
    )
    agent = Agent(config)
    agent.server.direct = direct
    try:
        with agent.client() as client:
            geo = client.geometry()
            assert [p.layers for p in geo.pools] == [(0, 2), (1,)]
            keys = keys_for(2, 5)
            kv = random_kv(client, 5, seed=2)
            assert [t.dtype for t in kv] == [torch.bfloat16] * 2
            assert client.put(NS, keys, kv).stored == 5
            lease = client.lease(NS, keys)
            assert lease is not None
            out = client.empty_kv(5)
            client.get_into(lease, out)
            assert all(torch.equal(a, b) for a, b in zip(out, kv, strict=True))
            # Layers [1, 3): layer 2 of pool 0, layer 1 of pool 1.
            part = client.empty_kv(2, layers=(1, 3))
            client.get_into(lease, part, start=3, count=2, layers=(1, 3))
            assert torch.equal(part[0], kv[0][1:2, 3:5]) and torch.equal(part[1], kv[1][:, 3:5])
            client.release(lease)
    finally:
        agent.close()


def test_a_sliding_window_pool_serves_the_window_at_the_end_of_the_prefix() -> None:
    config = agent_config(
        model={"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
        kv_cache_config={"tokens_per_block": 4, "max_attention_window": [8, 1024]},
        cpu_budget_bytes=1 << 20,
    )
    agent = Agent(config)
    try:
        with agent.client() as client:
            keys = keys_for(3, 6)
            kv = random_kv(client, 6, seed=3)
            assert client.put(NS, keys, kv).stored == 6
            lease = client.lease(NS, keys)
            assert lease is not None and lease.count == 6
            window_pool = next(p.index for p in client.geometry().pools if p.window == 8)
            first = lease.first_block[window_pool]
            assert first > 0
            out = client.empty_kv(6 - first)
            client.get_into(lease, out, start=first)
            assert all(torch.equal(o, k[:, first:]) for o, k in zip(out, kv, strict=True))
            with pytest.raises(TransferError) as err:
                client.get_into(lease, client.empty_kv(6))
            assert err.value.status == 422 and "window" in err.value.reason
            client.release(lease)
    finally:
        agent.close()


def test_put_skips_what_the_cache_holds(agent: Agent) -> None:
    with agent.client() as client:
        keys = keys_for(4, 6)
        kv = random_kv(client, 6, seed=4)
        assert client.put(NS, keys[:3], [t[:, :3] for t in kv]).stored == 3
        # The client sends only what the lookup says is missing...
        count = len(client.lookup(NS, keys))
        assert count == 3
        result = client.put(NS, keys, [t[:, count:] for t in kv], first=count)
        assert (result.stored, result.resident) == (3, 3)
        # ...or everything: the agent drains the bytes of the blocks it holds.
        again = client.put(NS, keys, kv)
        assert (again.stored, again.resident) == (0, 6)
        lease = client.lease(NS, keys)
        assert lease is not None
        out = client.empty_kv(6)
        client.get_into(lease, out)
        assert torch.equal(out[0], kv[0])
        client.release(lease)
        # Data that starts past the resident prefix cannot be stored: nothing changes.
        other = keys_for(5, 4)
        before = agent.state()
        with pytest.raises(ChainGapError) as gap:
            client.put(NS, other, [t[:, 2:] for t in random_kv(client, 4, 5)], first=2)
        assert gap.value.resident == 0 and gap.value.status == 409
        assert agent.state() == before
        client.ping()  # the connection is still good


def test_concurrent_clients_round_trip(agent: Agent) -> None:
    errors: list[BaseException] = []

    def worker(tag: int) -> None:
        try:
            with agent.client() as client:
                shared = keys_for(99, 3)  # every worker also stores the same chain
                kv_shared = random_kv(client, 3, seed=99)
                for round_ in range(4):
                    keys = keys_for(1000 * tag + round_, 3)
                    kv = random_kv(client, 3, seed=tag * 10 + round_)
                    client.put(NS, keys, kv)
                    client.put(NS, shared, kv_shared)
                    for chain, want in ((keys, kv), (shared, kv_shared)):
                        lease = client.lease(NS, chain)
                        assert lease is not None and lease.count == 3
                        out = client.empty_kv(3)
                        client.get_into(lease, out)
                        assert torch.equal(out[0], want[0])
                        client.release(lease)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert pinned(agent) == 0 and not agent.service.stores and not agent.service.leases


def test_checksums_round_trip_and_a_bad_crc_stores_nothing(agent: Agent) -> None:
    with agent.client(checksums=True) as client:
        keys = keys_for(6, 2)
        kv = random_kv(client, 2, seed=6)
        assert client.put(NS, keys, kv).stored == 2
        lease = client.lease(NS, keys)
        assert lease is not None
        out = client.empty_kv(2)
        client.get_into(lease, out)
        assert torch.equal(out[0], kv[0])
        client.release(lease)
    raw = Raw(agent.address)
    raw.request(Op.AUTH, {"crc": True})
    raw.reply()
    data = torch.ones(2, 1, 2, 4, 2, 8).numpy().tobytes()
    before = agent.state(arena=False)
    meta = {"ns": [NS.model, 0, 0], "keys": [b"fresh"], "first": 0}
    raw.request(Op.PUT, meta, rid=7, data_len=len(data), crc=zlib.crc32(data) ^ 1)
    raw.send(data)
    head, reply = raw.reply()
    assert head.flags & F_ERROR and reply["status"] == 400 and "CRC" in reply["reason"]
    assert agent.state(arena=False) == before
    raw.request(Op.PING, rid=8)  # still in step
    assert raw.reply()[0].request_id == 8
    raw.close()


# ---------------------------------------------------------------------- failures


def test_partial_frames_are_reassembled(agent: Agent) -> None:
    raw = Raw(agent.address)
    for byte in frame(Op.AUTH, 1, {"token": None}):
        raw.send(bytes([byte]))
    assert raw.reply()[0].request_id == 1
    keys = keys_for(7, 2)
    data = torch.arange(2 * 2 * 2 * 4 * 2 * 8, dtype=torch.float32).reshape(2, 2, 2, 4, 2, 8)
    blob = (
        frame(
            Op.PUT,
            2,
            {"ns": [NS.model, 0, 0], "keys": keys, "first": 0},
            data_len=data.numel() * 4,
        )
        + data.numpy().tobytes()
    )
    for i in range(0, len(blob), 7):  # in 7-byte pieces, with pauses
        raw.send(blob[i : i + 7])
        if i % 700 == 0:
            time.sleep(0.001)
    head, reply = raw.reply()
    assert not head.flags & F_ERROR and reply == {"stored": 2, "resident": 0}
    with agent.client() as client:
        lease = client.lease(NS, keys)
        assert lease is not None
        out = client.empty_kv(2)
        client.get_into(lease, out)
        assert torch.equal(out[0], data)
        client.release(lease)
    raw.close()


def test_pipelined_requests_are_answered_in_order(agent: Agent) -> None:
    raw = Raw(agent.address)
    raw.auth()
    meta = {"ns": [NS.model, 0, 0], "keys": [b"k1"]}
    raw.send(b"".join(frame(Op.LOOKUP, rid, meta) for rid in (11, 12, 13)))
    assert [raw.reply()[0].request_id for _ in range(3)] == [11, 12, 13]
    raw.close()


def test_a_client_dying_mid_put_leaks_nothing(agent: Agent) -> None:
    before_used, before_nodes = used(agent), agent.service.engine.num_nodes
    with agent.client() as client:
        client.put(NS, keys_for(8, 2), random_kv(client, 2, 8))  # a resident prefix
    before_used, before_nodes = used(agent), agent.service.engine.num_nodes
    keys = keys_for(8, 2) + keys_for(9, 4)
    raw = Raw(agent.address)
    raw.auth()
    full = 4 * 1024  # 4 new blocks of 2 layers x [2, 4, 2, 8] float32
    raw.request(Op.PUT, {"ns": [NS.model, 0, 0], "keys": keys, "first": 2}, data_len=full)
    raw.send(b"\x07" * (full // 3))
    deadline = time.monotonic() + 10
    while not agent.service.stores and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(agent.service.stores) == 1 and pinned(agent) == 6
    raw.close()  # dies mid-PUT
    while agent.service.stores and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not agent.service.stores
    assert pinned(agent) == 0 and used(agent) == before_used
    assert agent.service.engine.num_nodes == before_nodes
    with agent.client() as client:
        assert client.lookup(NS, keys) == ["primary"] * 2  # nothing half-written entered


def test_a_stalled_put_times_out_and_leaks_nothing() -> None:
    agent = Agent(agent_config(transfer={"port": 0, "body_timeout_s": 0.3}))
    try:
        raw = Raw(agent.address)
        raw.auth()
        raw.request(Op.PUT, {"ns": [NS.model, 0, 0], "keys": [b"a"], "first": 0}, data_len=1024)
        raw.send(b"\x00" * 100)
        assert raw.closed(timeout=5)
        deadline = time.monotonic() + 5
        while agent.service.stores and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not agent.service.stores and pinned(agent) == 0 and used(agent) == 0
    finally:
        agent.close()


def test_a_lease_expires_unpins_and_is_counted(agent: Agent) -> None:
    with agent.client() as client:
        keys = keys_for(10, 3)
        client.put(NS, keys, random_kv(client, 3, 10))
        lease = client.lease(NS, keys, ttl_s=0.3)
        assert lease is not None and lease.ttl_s == pytest.approx(0.3)
        assert pinned(agent) == 3 and len(agent.service.leases) == 1
        deadline = time.monotonic() + 5
        while agent.service.leases and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not agent.service.leases and pinned(agent) == 0
        assert agent.service.expired_leases == 1
        text = generate_latest(AgentMetrics(agent.service).registry).decode()
        assert "kvpool_leases_expired_total 1.0" in text
        with pytest.raises(TransferError) as err:
            client.get_into(lease, client.empty_kv(3))
        assert err.value.status == 404
        client.release(lease)  # an expired lease counts as released


def test_only_a_deadline_before_the_housekeepers_wake_wakes_it(agent: Agent) -> None:
    """A lease (or a same-node reservation) wakes the sleeping housekeeper only when it expires
    before the housekeeper's own next wake. The default deadlines lie past it, and a wake per
    request cost the agent a housekeeping pass (and an engine call) per same-node PUT."""
    svc = agent.service
    wakes = []
    real_set = svc._lease_added.set

    def counting_set() -> None:
        wakes.append(time.monotonic())
        real_set()

    svc._lease_added.set = counting_set  # type: ignore[method-assign]
    with agent.client() as client:
        keys = keys_for(13, 2)
        client.put(NS, keys, random_kv(client, 2, 13))

        def sleeps_for() -> float:
            return float(agent.call(lambda: svc._wake_at - time.monotonic()))

        deadline = time.monotonic() + 10
        while sleeps_for() < 0.5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sleeps_for() >= 0.3, "the housekeeper never slept for half a second"
        late = client.lease(NS, keys)  # transfer.lease_ttl_s: 30 s, past the next wake
        assert late is not None and late.ttl_s == 30.0
        assert wakes == []
        soon = client.lease(NS, keys, ttl_s=0.05)
        assert soon is not None and len(wakes) == 1
        while len(svc.leases) > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(svc.leases) == [late.lease_id] and svc.expired_leases == 1
        client.release(late)


def test_a_lease_ttl_is_bounded_and_leases_count_as_open_sequences(auth_agent: Agent) -> None:
    with auth_agent.client(TOKENS["a"]) as client:
        keys = keys_for(11, 2)
        client.put(NS, keys, random_kv(client, 2, 11))
        leases = [client.lease(NS, keys, ttl_s=1e9) for _ in range(4)]
        assert all(x is not None and x.ttl_s == 600.0 for x in leases)
        with pytest.raises(TransferError) as err:  # tenant_max_open_sequences: 4
            client.lease(NS, keys)
        assert err.value.status == 429
        with pytest.raises(TransferError):
            client.put(NS, keys_for(12, 1), random_kv(client, 1, 12))
        # A chain the cache holds whole needs nothing admitted: stored 0, not 429.
        again = client.put(NS, keys, random_kv(client, 2, 11))
        assert (again.stored, again.resident) == (0, 2)
        for lease in leases:
            assert lease is not None
            client.release(lease)
        assert pinned(auth_agent) == 0


def test_a_release_during_a_read_waits_for_the_read(agent: Agent) -> None:
    from kvpool_agent.credentials import ANONYMOUS

    with agent.client() as client:
        keys = keys_for(13, 2)
        client.put(NS, keys, random_kv(client, 2, 13))
        lease = client.lease(NS, keys)
        assert lease is not None
    svc = agent.service
    held, _ = agent.run(svc.begin_read(ANONYMOUS, lease.lease_id, 0, 2, [0]))
    agent.run(svc.release_lease(ANONYMOUS, lease.lease_id))
    assert lease.lease_id not in svc.leases and pinned(agent) == 2  # the read still pins
    agent.run(svc.end_read(held))
    assert pinned(agent) == 0


def test_lookup_never_changes_state(agent: Agent) -> None:
    with agent.client() as client:
        keys = keys_for(14, 4)
        client.put(NS, keys, random_kv(client, 4, 14))
        before = agent.state()
        for n in range(1, 5):
            assert client.lookup(NS, keys[:n]) == ["primary"] * n
        assert client.lookup(NS, keys_for(15, 3)) == []
        assert client.lookup(KeyNamespace("other"), keys) == []
        assert agent.state() == before


def test_two_tenants_never_share_blocks(auth_agent: Agent) -> None:
    keys = keys_for(16, 3)
    a = auth_agent.client(TOKENS["a"])
    b = auth_agent.client(TOKENS["b"])
    kv = random_kv(a, 3, 16)
    assert a.put(NS, keys, kv).stored == 3
    assert b.lookup(NS, keys) == []
    assert b.lease(NS, keys) is None
    assert b.put(NS, keys, random_kv(b, 3, 17)).stored == 3  # b's own copy
    lease_a = a.lease(NS, keys)
    assert lease_a is not None
    stolen = b.empty_kv(3)
    with pytest.raises(TransferError) as err:  # another tenant's lease is unknown
        b.get_into(lease_a, stolen)
    assert err.value.status == 404
    raw = Raw(auth_agent.address)
    raw.auth(TOKENS["b"])
    raw.request(Op.RELEASE, {"lease": lease_a.lease_id})
    head, meta = raw.reply()
    assert head.flags & F_ERROR and meta["status"] == 404
    raw.close()
    out = a.empty_kv(3)
    a.get_into(lease_a, out)
    assert torch.equal(out[0], kv[0])  # a's KV, not b's
    a.release(lease_a)
    a.close()
    b.close()


# ---------------------------------------------------------------------- auth and frames


def test_auth_is_required_first(auth_agent: Agent) -> None:
    raw = Raw(auth_agent.address)
    raw.request(Op.LOOKUP, {"ns": [NS.model, 0, 0], "keys": [b"k"]}, rid=5)
    head, meta = raw.reply()
    assert head.flags & F_ERROR and meta["status"] == 401 and meta["closing"]
    assert raw.closed()
    for token in (None, "wrong-token", "x" * 600):
        raw = Raw(auth_agent.address)
        raw.request(Op.AUTH, {"token": token})
        head, meta = raw.reply()
        assert head.flags & F_ERROR and meta["status"] == 401
        assert raw.closed()
    with pytest.raises(TransferError) as err:
        auth_agent.client("wrong-token").lookup(NS, [b"k"])
    assert err.value.status == 401
    peer = auth_agent.client(PEER)  # the peer credential is not a tenant
    with pytest.raises(TransferError) as err:
        peer.lookup(NS, [b"k"])
    assert err.value.status == 403
    assert auth_agent.service.refusals["unauthenticated"] >= 5


def test_anonymous_agent_takes_any_token(agent: Agent) -> None:
    for token in (None, "anything"):
        with agent.client(token) as client:
            assert client.geometry().tenant is None
            client.ping()


def test_limits_refuse_without_changing_state() -> None:
    agent = Agent(
        agent_config(
            transfer={"port": 0, "max_keys": 4, "max_frame_bytes": 4096, "max_connections": 2}
        )
    )
    try:
        with agent.client() as client:
            before = agent.state()
            with pytest.raises(TransferError) as err:
                client.lookup(NS, keys_for(1, 5))
            assert err.value.status == 422
            with pytest.raises(TransferError) as err:
                client.lookup(NS, [b"x" * 65])
            assert err.value.status == 422
            keys = keys_for(2, 4)
            with pytest.raises(TransferError) as err:  # 5 blocks of 1 KiB: past max_frame_bytes
                client.put(NS, keys + keys_for(3, 1), random_kv(client, 5, 1))
            assert err.value.status == 413
            assert agent.state() == before
            assert client.put(NS, keys, random_kv(client, 4, 2)).stored == 4
            lease = client.lease(NS, keys)
            assert lease is not None
            client.release(lease)
            # max_connections: 2 (the client holds one)
            raws = [Raw(agent.address)]
            third = Raw(agent.address)
            head, meta = third.reply()
            assert head.flags & F_ERROR and meta["status"] == 503
            assert third.closed()
            for r in raws:
                r.close()
    finally:
        agent.close()


def test_idle_connections_are_closed() -> None:
    agent = Agent(
        agent_config(transfer={"port": 0, "idle_timeout_s": 0.3, "header_timeout_s": 0.3})
    )
    try:
        idle = Raw(agent.address)
        idle.auth()
        assert idle.closed(timeout=5)
        slow = Raw(agent.address)
        slow.send(frame(Op.AUTH, 1)[:10])  # a header that never completes
        assert slow.closed(timeout=5)
        with agent.client() as client:  # a pooled connection the agent closed is replaced
            client.ping()
            time.sleep(0.6)
            client.ping()
    finally:
        agent.close()


def test_a_frame_whose_metadata_trickles_in_is_cut_off_at_the_header_deadline() -> None:
    """``header_timeout_s`` bounds a frame's header and metadata together: bytes that keep
    coming, each well within it, do not keep the connection open past it."""
    agent = Agent(agent_config(transfer={"port": 0, "header_timeout_s": 0.5}))
    try:
        slow = Raw(agent.address)
        slow.auth()
        whole = frame(Op.PING, 2, {"pad": "x" * 64})
        slow.send(whole[: HEADER_SIZE + 1])
        start = time.monotonic()
        with pytest.raises(OSError):  # the agent closes the connection under the sender
            for byte in whole[HEADER_SIZE + 1 :]:
                slow.send(bytes([byte]))
                time.sleep(0.05)
        assert time.monotonic() - start < 0.5 + 2
        assert slow.closed(timeout=5)
        with agent.client() as client:  # the agent serves others as before
            client.ping()
    finally:
        agent.close()


def test_a_put_whose_connection_breaks_is_not_retried(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpool_agent.dataplane import client as client_module

    with agent.client(retries=3) as client:
        keys = keys_for(20, 2)
        kv = random_kv(client, 2, 20)
        sends = []
        real = client_module._Connection._send

        def broken(self: object, buffers: list[object]) -> None:
            sends.append(1)
            real(self, buffers[:1])  # type: ignore[arg-type]
            self.sent_any = True  # type: ignore[attr-defined]
            raise ConnectionResetError("cable pulled")

        monkeypatch.setattr(client_module._Connection, "_send", broken)
        with pytest.raises(TransferConnectionError) as err:
            client.put(NS, keys, kv)
        assert err.value.request_sent and len(sends) == 1
        monkeypatch.undo()
        deadline = time.monotonic() + 5
        while agent.service.stores and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pinned(agent) == 0 and client.lookup(NS, keys) == []
        assert client.put(NS, keys, kv).stored == 2  # calling put again is safe


def test_data_bytes_matches_the_wire(agent: Agent) -> None:
    with agent.client() as client:
        geo = client.geometry()
        assert data_bytes(geo.pools, 3) == 3 * geo.block_bytes == 3 * 1024


def test_transfer_port_config() -> None:
    from kvpool_agent.config import AgentConfig
    from kvpool_agent.dataplane.server import TransferServer
    from kvpool_agent.server.service import AgentService

    model = agent_config().model.model_dump()
    assert AgentConfig.model_validate({"model": model}).transfer.port == 8100
    disabled = agent_config(transfer={"port": None})
    with pytest.raises(ValueError, match="disabled"):
        TransferServer(AgentService(disabled))


# ---------------------------------------------------------------------- large transfers


def big_agent(**transfer: object) -> Agent:
    """128 KiB blocks (2 layers x 8 heads x 64 dim x 16 tokens x float32): 8 blocks are
    1 MiB, so transfers of that size run in worker threads."""
    return Agent(
        agent_config(
            model={"num_layers": 2, "num_kv_heads": 8, "head_dim": 64, "dtype": "float32"},
            kv_cache_config={"tokens_per_block": 16, "enable_partial_reuse": False},
            cpu_budget_bytes=64 * (128 << 10),
            transfer={"port": 0, **transfer},
        )
    )


@pytest.mark.parametrize("checksums", [False, True])
def test_large_transfers_round_trip_through_worker_threads(checksums: bool) -> None:
    agent = big_agent()
    try:
        with agent.client(checksums=checksums) as client:
            keys = keys_for(30, 24)
            kv = random_kv(client, 24, 30)
            assert kv[0].nbytes == 3 << 20
            assert client.put(NS, keys[:12], [t[:, :12] for t in kv]).stored == 12
            # 12 resident blocks drained (1.5 MiB: more than the scratch buffer), 12 written.
            result = client.put(NS, keys, kv)
            assert (result.stored, result.resident) == (12, 12)
            lease = client.lease(NS, keys)
            assert lease is not None and lease.count == 24
            out = client.empty_kv(24)
            client.get_into(lease, out)
            assert torch.equal(out[0], kv[0])
            client.release(lease)
        assert agent.service.transfer.bytes_received == (12 + 24) * (128 << 10)
        assert agent.service.transfer.bytes_sent == 24 * (128 << 10)
    finally:
        agent.close()


def test_stopping_the_server_mid_put_aborts_the_store() -> None:
    agent = big_agent()
    try:
        raw = Raw(agent.address)
        raw.auth()
        meta = {"ns": [NS.model, 0, 0], "keys": keys_for(31, 16), "first": 0}
        raw.request(Op.PUT, meta, data_len=16 * (128 << 10))
        raw.send(b"\x05" * (1 << 20))  # half of it
        deadline = time.monotonic() + 10
        while not agent.service.stores and time.monotonic() < deadline:
            time.sleep(0.01)
        assert agent.service.stores and pinned(agent) == 16
        agent.run(agent.server.stop())  # the receiving thread is told to stop, then aborts
        assert not agent.service.stores and pinned(agent) == 0 and used(agent) == 0
        assert raw.closed()
    finally:
        agent.close()


def test_a_large_put_from_a_dying_client_leaks_nothing() -> None:
    agent = big_agent()
    try:
        raw = Raw(agent.address)
        raw.auth()
        meta = {"ns": [NS.model, 0, 0], "keys": keys_for(32, 16), "first": 0}
        raw.request(Op.PUT, meta, data_len=16 * (128 << 10))
        raw.send(b"\x05" * (1 << 20))
        raw.close()
        deadline = time.monotonic() + 10
        while agent.service.transfer.connections and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not agent.service.stores and pinned(agent) == 0 and used(agent) == 0
    finally:
        agent.close()


def test_a_client_dying_mid_get_ends_the_read_and_leaks_nothing() -> None:
    agent = big_agent()
    try:
        with agent.client() as client:
            keys = keys_for(33, 48)  # 6 MiB: more than the socket buffers hold
            client.put(NS, keys, random_kv(client, 48, 33))
            lease = client.lease(NS, keys)
            assert lease is not None and lease.count == 48
            raw = Raw(agent.address)
            raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            raw.auth()
            raw.request(Op.GET, {"lease": lease.lease_id, "start": 0, "count": 48})
            raw.recv_exact(64 << 10)  # the head and some data, then the reader dies
            raw.close()
            deadline = time.monotonic() + 10
            while agent.service.transfer.connections > 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert agent.service.transfer.connections == 1  # the client's own
            assert agent.service.transfer.bytes_sent == 0  # the reply never went out whole
            client.release(lease)  # a read still in progress would keep the blocks pinned
            assert pinned(agent) == 0
            out = client.empty_kv(48)  # and the agent still serves
            again = client.lease(NS, keys)
            assert again is not None
            client.get_into(again, out)
            client.release(again)
    finally:
        agent.close()
