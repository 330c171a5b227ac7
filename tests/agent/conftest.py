"""Fixtures for the agent tests: a small CPU agent driven in-process over an ASGI transport."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from kvpool_agent.config import AgentConfig
from kvpool_agent.server import AgentService, create_app

TPB = 4


def small_config(**overrides: Any) -> AgentConfig:
    """2 layers, 2 kv heads, head_dim 8, float32, 4 tokens per block, 64 primary blocks."""
    doc: dict[str, Any] = {
        "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
        "kv_cache_config": {"tokens_per_block": TPB},
        "device": "cpu",
        "cpu_budget_bytes": 64 * 2 * 2 * 2 * 8 * TPB * 4,
        "events": {"endpoint": None, "replay_endpoint": None},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    return AgentConfig.model_validate(doc)


@pytest.fixture
def config() -> AgentConfig:
    return small_config()


@pytest_asyncio.fixture
async def service(config: AgentConfig) -> AsyncIterator[AgentService]:
    svc = AgentService(config)
    await svc.start()
    yield svc
    await svc.stop()


@pytest_asyncio.fixture
async def client(service: AgentService) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(service)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://agent") as c:
        yield c


def snapshot_state(service: AgentService, arena: bool = True) -> tuple[Any, ...]:
    """Everything a rejected request must leave unchanged (``arena=False``: all but the
    pool bytes)."""
    eng = service.engine
    s = eng.stats
    return (
        s.queries_tokens,
        tuple(s.hits_tokens),
        s.sequences_opened,
        eng.num_open_sequences,
        eng.num_nodes,
        tuple(tuple(sorted(row.items())) for row in eng.usage()),
        tuple(sorted(service.sequences)),
        tuple(sorted(service.leases)),
        len(service.stores),
        service.publisher.next_seq,
        bytes(eng.storage[0].arena.numpy().tobytes()) if arena else b"",
    )
