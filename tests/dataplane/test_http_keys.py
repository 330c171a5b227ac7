"""Lookup and leases over the HTTP API (JSON, keys in hex), for simple clients and debugging."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from kvpool_agent.credentials import Principal
from kvpool_agent.server import AgentService, create_app

from .conftest import NS, TOKENS, agent_config, keys_for, write_auth

pytestmark = pytest.mark.asyncio

A = Principal(tenant="a", peer=False)


@pytest_asyncio.fixture
async def service(tmp_path: Path) -> AsyncIterator[AgentService]:
    svc = AgentService(agent_config(auth=write_auth(tmp_path)))
    await svc.start()
    yield svc
    await svc.stop()


@pytest_asyncio.fixture
async def http(service: AgentService) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(service))
    async with httpx.AsyncClient(transport=transport, base_url="http://agent") as c:
        yield c


def body(keys: list[bytes], **extra: Any) -> dict[str, Any]:
    return {"namespace": {"model": NS.model}, "keys": [k.hex() for k in keys], **extra}


def auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {TOKENS[tenant]}"}


async def store(service: AgentService, keys: list[bytes]) -> None:
    start = await service.begin_store(A, NS, keys, 0)
    assert start.store is not None
    await service.finish_store(start.store)


async def test_lookup_lease_and_release_over_http(
    service: AgentService, http: httpx.AsyncClient
) -> None:
    keys = keys_for(1, 3)
    resp = await http.post("/v1/keys/lookup", json=body(keys), headers=auth("a"))
    assert resp.status_code == 200 and resp.json() == {"count": 0, "tiers": []}
    await store(service, keys[:2])
    resp = await http.post("/v1/keys/lookup", json=body(keys), headers=auth("a"))
    assert resp.json() == {"count": 2, "tiers": ["primary", "primary"]}
    resp = await http.post("/v1/leases", json=body(keys, ttl_s=5), headers=auth("a"))
    assert resp.status_code == 201, resp.text
    lease = resp.json()
    assert lease["count"] == 2 and lease["ttl_s"] == 5 and lease["first_block"] == [0]
    assert sum(r["blocks_pinned"] for r in service.engine.usage()) == 2
    # Another tenant sees nothing of it, and cannot release it.
    resp = await http.post("/v1/keys/lookup", json=body(keys), headers=auth("b"))
    assert resp.json()["count"] == 0
    resp = await http.post("/v1/leases", json=body(keys), headers=auth("b"))
    assert resp.status_code == 200 and resp.json()["lease_id"] is None
    resp = await http.delete(f"/v1/leases/{lease['lease_id']}", headers=auth("b"))
    assert resp.status_code == 404
    resp = await http.delete(f"/v1/leases/{lease['lease_id']}", headers=auth("a"))
    assert resp.status_code == 204
    assert sum(r["blocks_pinned"] for r in service.engine.usage()) == 0
    resp = await http.delete(f"/v1/leases/{lease['lease_id']}", headers=auth("a"))
    assert resp.status_code == 404
    stats = (await http.get("/v1/stats", headers=auth("a"))).json()
    assert stats["open_leases"] == 0 and stats["expired_leases"] == 0


@pytest.mark.parametrize(
    ("doc", "status"),
    [
        ({"namespace": {"model": "m"}, "keys": ["abc"]}, 422),  # odd hex
        ({"namespace": {"model": "m"}, "keys": ["zz"]}, 422),
        ({"namespace": {"model": "m"}, "keys": []}, 422),
        ({"namespace": {"model": "m"}, "keys": ["00" * 65]}, 422),
        ({"namespace": {"model": ""}, "keys": ["00"]}, 422),
        ({"namespace": {"model": "a\u001fb"}, "keys": ["00"]}, 422),
        ({"namespace": {"model": "m", "rank": -1}, "keys": ["00"]}, 422),
        ({"namespace": {"model": "m"}, "keys": ["00"], "extra": 1}, 422),
        ({"namespace": {"model": "m"}, "keys": ["00"] * 4097}, 422),  # transfer.max_keys
    ],
)
async def test_bad_lookups_are_refused(
    service: AgentService, http: httpx.AsyncClient, doc: dict[str, Any], status: int
) -> None:
    resp = await http.post("/v1/keys/lookup", json=doc, headers=auth("a"))
    assert resp.status_code == status, resp.text


async def test_keys_routes_need_a_tenant_token(http: httpx.AsyncClient) -> None:
    keys = keys_for(2, 1)
    assert (await http.post("/v1/keys/lookup", json=body(keys))).status_code == 401
    assert (await http.post("/v1/leases", json=body(keys))).status_code == 401
    assert (await http.delete("/v1/leases/1")).status_code == 401
    resp = await http.post("/v1/leases", json=body(keys, ttl_s=-1), headers=auth("a"))
    assert resp.status_code == 422


async def test_a_lease_asks_the_policy_curve_with_the_whole_chain(service: AgentService) -> None:
    """A lease is the data plane's query: the policy curve sees its whole chain once, and
    neither the lease's open of the resident prefix nor the store after a miss."""
    from kvpool_agent.cache.miniature import PolicyMiniature

    engine = service.engine
    engine.miniature = PolicyMiniature("lru", 3, ratios=(1.0,), shift=0)
    keys = keys_for(1, 3)
    lease, _ = await service.lease_keys(A, NS, keys, None)
    assert lease is None
    await store(service, keys[:2])
    lease, tiers = await service.lease_keys(A, NS, keys, None)
    assert lease is not None and tiers == ["primary", "primary"]
    await service.release_lease(A, lease.public_id)
    stats = engine.stats
    assert stats.queries_blocks == 6 and sum(stats.hits_blocks) == 2
    mini = engine.miniature
    assert mini is not None and len(mini.pending) == 6  # two chains of 3
    assert mini.drain() == 6
    # The first chain warms the 3-block miniature; the second hits whole (the curve's
    # cache keeps what a query asked for, as the connector stores what it missed).
    snap = mini.snapshot()
    assert (snap.accesses, snap.hits) == (3, (3,))


async def test_stop_returns_at_once_right_after_a_lease(tmp_path: Path) -> None:
    """A lease wakes the housekeeper as ``stop`` cancels it: the stop must still return (it
    waited forever on Python 3.11 while the housekeeper slept in ``asyncio.wait_for``)."""
    import asyncio

    svc = AgentService(agent_config(auth=write_auth(tmp_path)))
    await svc.start()
    keys = keys_for(2, 3)
    assert (await svc.lease_keys(A, NS, keys, None))[0] is None
    await store(svc, keys[:2])
    lease, _ = await svc.lease_keys(A, NS, keys, None)
    assert lease is not None
    await svc.release_lease(A, lease.public_id)
    stopping = asyncio.ensure_future(svc.stop())
    done, _ = await asyncio.wait((stopping,), timeout=5)  # (wait_for would cancel it)
    assert stopping in done, "stop hangs"


async def test_public_ids_are_random_62_bit_and_never_reused_while_open(
    service: AgentService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ids of stores, leases and sequences come from the OS's random bytes, drawn many at a
    time; a draw that names an id still open is skipped."""
    begun = await service.begin_store(A, NS, keys_for(5, 2), 0)
    assert begun.store is not None
    taken = begun.store.store_id
    assert 1 <= taken <= 1 << 62
    # The next batch's last draw (ids are taken from the end) repeats the open store's id.
    draws = [7 << 2, (taken - 1) << 2]
    monkeypatch.setattr("os.urandom", lambda n: b"".join(d.to_bytes(8, "little") for d in draws))
    service._random_ids.clear()
    assert service._new_id() == 8  # the open store's id was drawn, and skipped
    monkeypatch.undo()
    ids = {service._new_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(1 <= i <= 1 << 62 for i in ids)
    await service.finish_store(begun.store)
