"""Ring-aware handoff, in-process: owners as the clients route, the split by owner, handback."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
import yaml

from kvpool_agent.cache import KVCacheManager
from kvpool_agent.client import PoolClient
from kvpool_agent.credentials import token_digest
from kvpool_agent.server import AgentService, create_app
from kvpool_agent.server.rebalance import Ring, client_salt, self_url
from kvpool_agent.server.service import tenant_salt
from kvpool_agent.server.snapshot import (
    export_by_owner,
    export_snapshot,
    import_snapshot,
    read_snapshot,
)

from .conftest import TPB, small_config

REPLICAS = (
    "http://kv-0.kv.ns.svc:8000",
    "http://kv-1.kv.ns.svc:8000",
    "http://kv-2.kv.ns.svc:8000",
)
AFFINITY = 2


def prompts(seed: int = 0, groups: int = 6) -> list[list[int]]:
    """Groups of prompts sharing one block, then diverging (some shorter than the affinity
    prefix), so owners split inside shared prefixes."""
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        head = [rng.randrange(1 << 20) for _ in range(TPB)]
        for n in (1, 3, 4):
            out.append(head + [rng.randrange(1 << 20) for _ in range(n * TPB)])
    out.append([rng.randrange(1 << 20) for _ in range(TPB)])  # one block: shorter than AFFINITY
    return out


def filled(tokens: list[list[int]], salt: str | None = None) -> AgentService:
    service = AgentService(small_config(cpu_budget_bytes=256 * 2 * 2 * 2 * 8 * TPB * 4))
    for t in tokens:
        h = service.engine.open_sequence(t, cache_salt=salt, recompute_last_token=False)
        service.engine.release(h.seq_id)
    if salt is not None:
        from kvpool_agent.server.service import _namespace

        service.namespaces[_namespace(salt, ())] = (salt, ())
    return service


def reused(engine: KVCacheManager, tokens: list[int], salt: str | None = None) -> int:
    h = engine.open_sequence(tokens, cache_salt=salt, recompute_last_token=False)
    engine.release(h.seq_id)
    return h.num_reused_tokens


# ------------------------------------------------------------------ owners


@pytest.mark.parametrize("tenant", [None, "team-a"])
@pytest.mark.parametrize("salt", [None, "s", "with\x1fseparator"])
def test_client_salt_undoes_the_tenant_salt(tenant: str | None, salt: str | None) -> None:
    assert client_salt(tenant_salt(tenant, salt)) == (True, salt)


def test_engine_keyed_namespaces_have_no_owner() -> None:
    from kvpool_agent.dataplane.keys import KeyNamespace

    salt = KeyNamespace("m", 0, 0).salt()
    assert client_salt(tenant_salt("t", salt)) == (False, None)
    assert Ring(REPLICAS, TPB, AFFINITY).owner((tenant_salt("t", salt), ()), [1] * TPB) is None


def test_the_owner_is_the_replica_the_pool_client_picks() -> None:
    ring = Ring(REPLICAS, TPB, AFFINITY)
    client = PoolClient(REPLICAS, tokens_per_block=TPB, affinity_blocks=AFFINITY)
    seen = set()
    for t in prompts(1, groups=40):
        for salt in (None, "x"):
            head = t[: min(len(t) // TPB, AFFINITY) * TPB]
            owner = ring.owner((tenant_salt("tenant", salt), ()), head)
            assert owner == client.replica_for(t, cache_salt=salt)
            seen.add(owner)
    assert seen == set(REPLICAS)


def test_self_url_from_config_env_or_pod_name(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = small_config(lifecycle={"handoff_peers": list(REPLICAS)}).lifecycle
    monkeypatch.delenv("KVPOOL_SELF_URL", raising=False)
    monkeypatch.delenv("POD_NAME", raising=False)
    assert self_url(cfg) is None
    monkeypatch.setenv("POD_NAME", "kv-1")
    assert self_url(cfg) == REPLICAS[1]
    monkeypatch.setenv("KVPOOL_SELF_URL", "http://me:1/")
    assert self_url(cfg) == "http://me:1"
    cfg = small_config(lifecycle={"self_url": "http://10.0.0.1:8000"}).lifecycle
    assert self_url(cfg) == "http://10.0.0.1:8000"


# ------------------------------------------------------------------ the split by owner


@pytest.mark.parametrize("salt", [None, tenant_salt("t", None), tenant_salt("t", "c")])
def test_every_chain_goes_to_its_owner_and_hits_there(salt: str | None) -> None:
    tokens = prompts()
    service = filled(tokens, salt)
    ring = Ring(REPLICAS[1:], TPB, AFFINITY)  # kv-0 leaves: the chains go to kv-1 and kv-2
    parts = export_by_owner(service.engine, service.namespaces, ring.owner, AFFINITY)
    assert set(parts) == set(REPLICAS[1:])
    client = PoolClient(REPLICAS[1:], tokens_per_block=TPB, affinity_blocks=AFFINITY)
    routing_salt = client_salt(salt)[1]
    engines = {}
    for who, blob in parts.items():
        engines[who] = AgentService(small_config()).engine
        import_snapshot(engines[who], blob)
    for t in tokens:
        owner = client.replica_for(t, cache_salt=routing_salt)
        assert reused(engines[owner], t, salt) == len(t), (owner, len(t))
    # nothing is handed to a replica that does not own it, beyond shared ancestors
    for who, blob in parts.items():
        _, records = read_snapshot(blob)
        leaves = set(range(len(records))) - {r[2] for r in records}
        assert leaves
        for i in leaves:
            chain = []
            while i >= 0:
                chain.append(records[i])
                i = records[i][2]
            head = [tok for rec in reversed(chain) for tok in rec[3]][: AFFINITY * TPB]
            assert ring.owner((salt, ()), head) == who


def test_the_split_respects_max_blocks_and_shares_ancestors() -> None:
    tokens = prompts()
    service = filled(tokens)
    ring = Ring(REPLICAS, TPB, AFFINITY)
    everything = export_by_owner(service.engine, service.namespaces, ring.owner, AFFINITY)
    total = sum(len(read_snapshot(b)[1]) for b in everything.values())
    assert total > service.engine.num_nodes  # first blocks shared by owners go to each
    capped = export_by_owner(service.engine, service.namespaces, ring.owner, AFFINITY, 10)
    hottest = read_snapshot(export_snapshot(service.engine, service.namespaces, 10))[1]
    got = [r for b in capped.values() for r in read_snapshot(b)[1]]
    assert {tuple(r[3]) for r in got} == {tuple(r[3]) for r in hottest}


def test_only_the_chains_one_owner_owns() -> None:
    tokens = prompts()
    service = filled(tokens)
    ring = Ring(REPLICAS, TPB, AFFINITY)
    client = PoolClient(REPLICAS, tokens_per_block=TPB, affinity_blocks=AFFINITY)
    for who in REPLICAS:
        parts = export_by_owner(service.engine, service.namespaces, ring.owner, AFFINITY, only=who)
        engine = AgentService(small_config()).engine
        if parts:
            import_snapshot(engine, parts[who])
        for t in tokens:
            mine = client.replica_for(t) == who
            got = reused(engine, t)
            assert got == len(t) if mine else got < len(t), (who, mine, got, len(t))


# ------------------------------------------------------------------ /v1/handback


@pytest.fixture
def auth_dir(tmp_path: Path) -> Path:
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump({"t": token_digest("tenant-token")}))
    (tmp_path / "peer-token").write_text("peer-token\n")
    return tmp_path


@pytest.mark.asyncio
async def test_handback_returns_what_the_asker_owns_to_the_peer_token_only(
    auth_dir: Path,
) -> None:
    cfg = small_config(
        auth={
            "tenants_file": str(auth_dir / "tenants.yaml"),
            "peer_token_file": str(auth_dir / "peer-token"),
        },
        lifecycle={"affinity_blocks": AFFINITY},
    )
    service = AgentService(cfg)
    await service.start()
    transport = httpx.ASGITransport(app=create_app(service))
    tokens = prompts()
    body = {"owner": REPLICAS[2] + "/", "replicas": list(REPLICAS[:2])}
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://a") as c:
            tenant = {"authorization": "Bearer tenant-token"}
            peer = {"authorization": "Bearer peer-token"}
            for t in tokens:
                seq = await c.post("/v1/sequences", json={"tokens": t}, headers=tenant)
                await c.delete(f"/v1/sequences/{seq.json()['seq_id']}", headers=tenant)
            assert (await c.post("/v1/handback", json=body)).status_code == 401
            assert (await c.post("/v1/handback", json=body, headers=tenant)).status_code == 403
            bad = {"owner": "file:///etc/passwd", "replicas": []}
            assert (await c.post("/v1/handback", json=bad, headers=peer)).status_code == 422
            resp = await c.post("/v1/handback", json=body, headers=peer)
            assert resp.status_code == 200
            engine = AgentService(small_config()).engine
            import_snapshot(engine, resp.content)
            client = PoolClient(REPLICAS, tokens_per_block=TPB, affinity_blocks=AFFINITY)
            salt = tenant_salt("t", None)
            owned = [t for t in tokens if client.replica_for(t) == REPLICAS[2]]
            assert owned and all(reused(engine, t, salt) == len(t) for t in owned)
            stranger = {"owner": "http://kv-9.kv.ns.svc:8000", "replicas": []}
            resp = await c.post("/v1/handback", json=stranger, headers=peer)
            assert resp.status_code == 200  # a ring of one: it owns every chain
            nobody = {"owner": "http://kv-9.kv.ns.svc:8000", "replicas": list(REPLICAS) * 90}
            assert (await c.post("/v1/handback", json=nobody, headers=peer)).status_code == 422
            service.draining = True
            assert (await c.post("/v1/handback", json=body, headers=peer)).status_code == 503
    finally:
        await service.stop()


@pytest.mark.asyncio
async def test_handback_of_nothing_owned_is_empty(client: httpx.AsyncClient) -> None:
    body = {"owner": REPLICAS[0], "replicas": list(REPLICAS)}
    resp = await client.post("/v1/handback", json=body)
    assert resp.status_code == 204 and resp.content == b""


# ------------------------------------------------------------------ in a pool


def test_pod_agents_find_themselves_in_the_operators_peers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The operator's handoff peers are the clients' ring, and each pod finds its own name
    there from POD_NAME (a selfUrl in the pool would name one pod for all: it is cleared)."""
    from kvpool_operator.children import pool_agent_config
    from kvpool_operator.models import KVCachePool

    pool = KVCachePool.model_validate(
        {
            "apiVersion": "kvpool.io/v1alpha1",
            "kind": "KVCachePool",
            "metadata": {"name": "kv", "namespace": "ns"},
            "spec": {
                "replicas": 3,
                "model": {"numLayers": 2, "numKvHeads": 2, "headDim": 8},
                "agent": {"lifecycle": {"selfUrl": "http://kv-0.kv.ns.svc:8000"}},
            },
        }
    )
    cfg = pool_agent_config(pool).lifecycle
    assert cfg.handoff_peers == list(REPLICAS) and cfg.self_url is None and cfg.ring_aware
    for i, url in enumerate(REPLICAS):
        monkeypatch.setenv("POD_NAME", f"kv-{i}")
        assert self_url(cfg) == url


# ------------------------------------------------------------------ the drain's sends


@pytest.mark.asyncio
async def test_a_refused_share_goes_to_a_peer_that_took_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kv-0 drains; kv-1 takes its share, kv-2 is ready but refuses (its share goes to kv-1
    instead), a peer that is not ready gets nothing; every send carries the peer token."""
    import time

    from kvpool_agent.server import rebalance

    service = filled(prompts())
    service.config = small_config(
        lifecycle={
            "handoff_peers": [*REPLICAS, "http://kv-3.kv.ns.svc:8000"],
            "self_url": REPLICAS[0],
            "affinity_blocks": AFFINITY,
        }
    )
    monkeypatch.setattr(type(service.credentials), "peer_token", property(lambda _: "pt"))
    got: dict[str, list[bytes]] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        peer = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == "/readyz":
            assert peer != REPLICAS[0]  # never asks itself
            return httpx.Response(503 if "kv-3" in peer else 200)
        assert request.headers["authorization"] == "Bearer pt"
        if peer == REPLICAS[2]:
            return httpx.Response(500)
        got.setdefault(peer, []).append(request.content)
        return httpx.Response(200, json={})

    real = httpx.AsyncClient
    monkeypatch.setattr(
        rebalance.httpx,
        "AsyncClient",
        lambda **kw: real(transport=httpx.MockTransport(handler), **kw),
    )
    outcome = await rebalance.handoff_by_owner(service, time.monotonic() + 5)
    assert outcome.accepted.keys() == {REPLICAS[1]} and outcome.failed == 0
    assert len(got[REPLICAS[1]]) == 2  # its own share, then kv-2's
    engine = AgentService(small_config()).engine
    for blob in got[REPLICAS[1]]:
        import_snapshot(engine, blob)
    assert all(reused(engine, t) == len(t) for t in prompts())
