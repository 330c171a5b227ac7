"""Probes and start-up settings: readiness reasons, --host/--port overrides."""

from __future__ import annotations

import httpx
import pytest

from kvpool_agent.server import AgentService, create_app
from kvpool_agent.server.reload import apply_overrides
from kvpool_agent.server.runner import endpoint_overrides

from .conftest import small_config

pytestmark = pytest.mark.asyncio


async def test_readyz_says_why_it_is_not_ready() -> None:
    svc = AgentService(small_config())
    app = create_app(svc)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as c:
        assert (await c.get("/healthz")).status_code == 200
        resp = await c.get("/readyz")
        assert resp.status_code == 503 and "not serving" in resp.text
        await svc.start()
        assert (await c.get("/readyz")).text == "ready"
        svc.draining = True
        resp = await c.get("/readyz")
        assert resp.status_code == 503 and "draining" in resp.text
        metrics = (await c.get("/metrics")).text
        assert "kvpool_agent_draining 1.0" in metrics and "kvpool_agent_ready 0.0" in metrics
    await svc.stop()


async def test_host_and_port_flags_override_the_file_and_the_event_hosts() -> None:
    cfg = small_config(events={"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"})
    overrides = endpoint_overrides("127.0.0.5", 8001)
    new = apply_overrides(cfg, overrides)
    assert (new.server.host, new.server.port) == ("127.0.0.5", 8001)
    svc = AgentService(new)  # a * event host is the server host
    assert svc.publisher.endpoint == "tcp://127.0.0.5:5557"
    assert svc.publisher.replay_endpoint == "tcp://127.0.0.5:5558"
    assert endpoint_overrides(None, None) == {}
    assert small_config().server.port == 8000


async def test_a_stalled_engine_fails_readiness_then_liveness() -> None:
    """An engine call that holds the engine past ``engine_stall_s`` turns /readyz 503, and
    past twice that /healthz too, so the kubelet restarts a wedged agent."""
    import asyncio
    import time

    svc = AgentService(small_config(limits={"engine_stall_s": 0.3}))
    app = create_app(svc)
    await svc.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as c:
        assert (await c.get("/readyz")).status_code == 200
        stuck = asyncio.create_task(svc.call(lambda: time.sleep(1.2), heavy=True))
        await asyncio.sleep(0.45)
        ready, alive = await c.get("/readyz"), await c.get("/healthz")
        assert ready.status_code == 503 and "engine stalled" in ready.text
        assert alive.status_code == 200
        await asyncio.sleep(0.4)
        alive = await c.get("/healthz")
        assert alive.status_code == 503 and "engine stalled" in alive.text
        await stuck
        assert (await c.get("/readyz")).status_code == 200
        assert (await c.get("/healthz")).status_code == 200
    await svc.stop()
