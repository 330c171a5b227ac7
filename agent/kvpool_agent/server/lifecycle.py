"""Graceful drain (SIGTERM) and warm start.

Drain, within ``lifecycle.grace_period_s`` of the signal:
1. stop admitting: ``/readyz`` turns 503 (the Service stops routing here) and opening a
   sequence answers 503; every other call keeps working;
2. wait for the open sequences to be released, until the handoff reserve of the grace period;
3. release what is still open (their unwritten KV is dropped);
4. hand the hottest blocks to the first peer agent that accepts them (``POST /v1/handoff``),
   else write them to ``lifecycle.snapshot_path`` (atomically: temp file and rename);
5. stop the server.
A restarted agent of the same geometry loads the snapshot before it reports ready.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from kvpool_agent.server.service import AgentService
from kvpool_agent.server.snapshot import ImportResult, SnapshotError

log = logging.getLogger("kvpool.agent.lifecycle")

HANDOFF_RESERVE = 0.3
"""Share of the grace period kept for the handoff (capped at ``MAX_RESERVE_S``)."""
MAX_RESERVE_S = 10.0


async def drain(service: AgentService, stop: Callable[[], None]) -> str:
    """Run the drain; returns where the hottest blocks went (peer URL, file, or ``none``)."""
    if service.draining:
        return "already draining"
    start = time.monotonic()
    grace = service.config.lifecycle.grace_period_s
    reserve = min(grace * HANDOFF_RESERVE, MAX_RESERVE_S)
    deadline = start + grace
    service.draining = True
    log.info("draining: %d open sequences, grace %.1fs", len(service.handles), grace)
    while service.handles and time.monotonic() < deadline - reserve:
        await asyncio.sleep(0.02)
    left = await service.release_all()
    if left:
        log.warning("drain: released %d sequences still open at the deadline", left)
    try:
        where = await handoff(service, deadline)
    except Exception:  # the handoff is best effort; exiting in time is not
        log.exception("drain: handoff failed")
        where = "failed"
    service.handoff_result = where
    log.info("drain done in %.2fs, hottest blocks: %s", time.monotonic() - start, where)
    stop()
    return where


async def handoff(service: AgentService, deadline: float) -> str:
    cfg = service.config.lifecycle
    if service.engine.num_nodes == 0:
        return "none"
    blob = await service.export_hottest()
    for peer in cfg.handoff_peers:
        remaining = deadline - time.monotonic()
        if remaining <= 0.1:
            break
        try:
            async with httpx.AsyncClient(timeout=remaining) as client:
                resp = await client.post(
                    f"{peer.rstrip('/')}/v1/handoff",
                    content=blob,
                    headers={"content-type": "application/octet-stream"},
                )
            if resp.status_code == 200:
                return peer
            log.warning("handoff to %s refused: %s %s", peer, resp.status_code, resp.text[:200])
        except httpx.HTTPError as err:
            log.warning("handoff to %s failed: %s", peer, err)
    if cfg.snapshot_path:
        write_snapshot(Path(cfg.snapshot_path), blob)
        return cfg.snapshot_path
    return "none"


def write_snapshot(path: Path, blob: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


async def warm_start(service: AgentService) -> ImportResult | None:
    """Load the snapshot named in the config, if any; a bad or foreign one is logged, kept."""
    path = service.config.lifecycle.snapshot_path
    if not path or not Path(path).is_file():
        return None
    try:
        result = await service.import_blocks(Path(path).read_bytes())
    except SnapshotError as err:
        log.warning("warm start: snapshot %s not loaded: %s", path, err)
        return None
    log.info(
        "warm start: %d blocks in %d chains from %s", result.blocks_written, result.chains, path
    )
    return result
