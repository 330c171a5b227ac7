"""Many concurrent clients: engine calls are serialized, every sequence gets consistent blocks."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvpool_agent.server import AgentService

from .conftest import TPB

pytestmark = pytest.mark.asyncio


async def test_many_concurrent_clients(client: httpx.AsyncClient, service: AgentService) -> None:
    prefixes = [list(range(p * 1000, p * 1000 + 2 * TPB)) for p in range(4)]

    async def worker(i: int) -> list[int]:
        reused = []
        for j in range(6):
            tokens = prefixes[(i + j) % 4] + [50_000 + i * 100 + j]
            resp = await client.post("/v1/sequences", json={"tokens": tokens})
            if resp.status_code == 503:  # all blocks pinned right now: retry later
                await asyncio.sleep(0.01)
                continue
            assert resp.status_code == 201, resp.text
            seq = resp.json()
            reused.append(seq["num_reused_tokens"])
            more = await client.post(f"/v1/sequences/{seq['seq_id']}/tokens", json={"tokens": [7]})
            assert more.status_code == 200
            assert (await client.delete(f"/v1/sequences/{seq['seq_id']}")).status_code == 204
        return reused

    results = await asyncio.gather(*(worker(i) for i in range(32)))
    flat = [r for rs in results for r in rs]
    assert len(flat) > 100
    assert all(r in (0, 2 * TPB) for r in flat)
    assert sum(1 for r in flat if r == 2 * TPB) >= len(flat) - 8  # all but the first per prefix
    assert service.engine.num_open_sequences == 0 and not service.sequences
    usage = service.engine.usage()[0]
    assert usage["blocks_pinned"] == 0
    batches = (await client.get("/v1/events")).json()
    assert [b["seq"] for b in batches] == list(range(len(batches)))
