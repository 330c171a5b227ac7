"""Prometheus metrics: the names the operator scrapes, read from the engine at scrape time."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool_agent.cache.miniature import PolicyMiniature
from kvpool_agent.server import AgentService

from .conftest import TPB

pytestmark = pytest.mark.asyncio


async def scrape(client: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    resp = await client.get("/metrics")
    assert resp.status_code == 200
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_operator_metric_names_and_values(
    client: httpx.AsyncClient, service: AgentService
) -> None:
    tokens = list(range(10))
    for _ in range(2):
        seq = (await client.post("/v1/sequences", json={"tokens": tokens})).json()
        await client.delete(f"/v1/sequences/{seq['seq_id']}")
    m = await scrape(client)
    assert m[("kvpool_prefix_cache_queries_tokens_total", ())] == 20
    assert m[("kvpool_prefix_cache_hits_tokens_total", (("tier", "primary"),))] == 8
    assert m[("kvpool_prefix_cache_hits_tokens_total", (("tier", "secondary"),))] == 0
    assert m[("kvpool_prefix_cache_capacity_misses_tokens_total", ())] == 0
    assert m[("kvpool_cache_blocks_total", (("pool", "0"), ("tier", "primary")))] == 64
    used = m[("kvpool_cache_blocks_used", (("pool", "0"), ("tier", "primary")))]
    assert used == service.engine.usage()[0]["blocks_used"] == 2  # the two stored blocks
    assert ("kvpool_cache_evicted_blocks_total", (("tier", "primary"),)) in m
    assert m[("kvpool_sequences_open", ())] == 0
    count = m[
        ("kvpool_request_duration_seconds_count", (("method", "POST"), ("route", "/v1/sequences")))
    ]
    assert count == 2


async def test_capacity_misses_and_evictions_are_counted(client: httpx.AsyncClient) -> None:
    first = list(range(32 * TPB))
    for base in (0, 10_000, 20_000):  # the second and third push the first out
        toks = first if base == 0 else list(range(base, base + 40 * TPB))
        seq = (await client.post("/v1/sequences", json={"tokens": toks})).json()
        await client.delete(f"/v1/sequences/{seq['seq_id']}")
    seq = (await client.post("/v1/sequences", json={"tokens": first})).json()
    m = await scrape(client)
    assert m[("kvpool_cache_evicted_blocks_total", (("tier", "primary"),))] > 0
    assert m[("kvpool_prefix_cache_capacity_misses_tokens_total", ())] > 0
    assert seq["num_reused_tokens"] < len(first) - 1


async def test_each_agent_has_its_own_registry(client: httpx.AsyncClient) -> None:
    from kvpool_agent.server import create_app

    from .conftest import small_config

    other = AgentService(small_config())
    await other.start()
    app = create_app(other)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b") as c:
        await client.post("/v1/sequences", json={"tokens": [1, 2, 3]})
        m_other = await scrape(c)
    assert m_other[("kvpool_prefix_cache_queries_tokens_total", ())] == 0
    await other.stop()


async def test_policy_curve_replays_within_its_cpu_budget_and_is_exported(
    client: httpx.AsyncClient, service: AgentService
) -> None:
    engine = service.engine
    assert engine.miniature.policy == service.config.kv_cache_config.eviction_policy
    engine.miniature = PolicyMiniature(engine.miniature.policy, 64, ratios=(0.125, 1.0), shift=0)
    tokens = list(range(8 * TPB + 1))
    for _ in range(4):
        seq = (await client.post("/v1/sequences", json={"tokens": tokens})).json()
        await client.post(f"/v1/sequences/{seq['seq_id']}/commit")
        await client.delete(f"/v1/sequences/{seq['seq_id']}")
    assert len(engine.miniature.pending) == 32  # 8 blocks stored, then matched 3 times
    now = time.monotonic()
    service._curve_at = now
    service._curve_credit = 0.0
    assert await service.simulate_policy_curve(now=now) == 0  # no time passed: no budget
    assert await service.simulate_policy_curve(now=now + 60) == 32
    m = await scrape(client)
    # Counted after the 8-block miniature's warm-up: 24 accesses, all hits at both sizes.
    assert m[("kvpool_prefix_cache_policy_curve_accesses_total", ())] == 24
    assert m[("kvpool_prefix_cache_policy_curve_hits_total", (("ratio", "0.125"),))] == 24
    assert m[("kvpool_prefix_cache_policy_curve_hits_total", (("ratio", "1"),))] == 24
    assert m[("kvpool_prefix_cache_policy_curve_sample_rate", ())] == 1.0
    stats = (await client.get("/v1/stats")).json()["policy_curve"]
    assert stats["accesses"] == 24 and stats["ratios"][1] == {
        "ratio": 1.0,
        "hits": 24,
        "hit_ratio": 1.0,
    }


async def test_a_zero_cpu_share_turns_the_policy_curve_off() -> None:
    from .conftest import small_config

    svc = AgentService(small_config(limits={"policy_curve_cpu_share": 0.0}))
    assert svc.engine.miniature is None and svc.stats_document()["policy_curve"] is None
    handle = svc.engine.open_sequence(list(range(4 * TPB + 1)))  # no curve to feed
    svc.engine.commit(handle.seq_id)
    svc.engine.release(handle.seq_id)
    assert svc.engine.miniature is None
    assert await svc.simulate_policy_curve(now=time.monotonic() + 60) == 0


async def test_the_running_core_is_exported_and_in_stats(
    client: httpx.AsyncClient, service: AgentService
) -> None:
    core = service.engine.core_name
    assert core in ("native", "python")
    m = await scrape(client)
    assert m[("kvpool_engine_core_info", (("core", core),))] == 1
    assert (await client.get("/v1/stats")).json()["engine_core"] == core
