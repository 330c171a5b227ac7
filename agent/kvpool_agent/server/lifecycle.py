"""Graceful drain (SIGTERM) and warm start.

Drain, within ``lifecycle.grace_period_s`` of the signal:
1. stop admitting: ``/readyz`` turns 503 (the Service stops routing here) and opening a
   sequence answers 503; every other call keeps working;
2. wait for the open sequences to be released, until the handoff reserve of the grace period;
3. release what is still open (their unwritten KV is dropped);
4. hand the hottest blocks over (``POST /v1/handoff``): with ``lifecycle.ring_aware`` (the
   default) each chain to the ready peer that owns its key once this agent is gone
   (``server/rebalance.py``), else all to the first peer that accepts them; what no peer
   took goes to ``lifecycle.snapshot_path`` when set (atomically: temp file and rename);
5. stop the server.
A restarted agent of the same geometry loads the snapshot, then (ring-aware) takes back from
its ready peers the chains it owns, before it reports ready (``warm_start``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from kvpool_agent.server.rebalance import handoff_by_owner, take_back
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
    log.info(
        "draining: %d open sequences, %d leases, %d stores, grace %.1fs",
        len(service.sequences),
        len(service.leases),
        len(service.stores),
        grace,
    )
    while service.open_handles and time.monotonic() < deadline - reserve:
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
    """Hand the hottest blocks over; returns the peers that took them (comma-separated),
    the snapshot file, or ``none``."""
    cfg = service.config.lifecycle
    if service.engine.num_nodes == 0:
        return "none"
    if cfg.ring_aware and cfg.handoff_peers:
        outcome = await handoff_by_owner(service, deadline)
        if outcome.accepted and not outcome.failed:
            return outcome.describe()
        if cfg.snapshot_path:  # what a peer missed (or everything) is kept on disk
            write_snapshot(Path(cfg.snapshot_path), await service.export_hottest())
            return ",".join([*sorted(outcome.accepted), cfg.snapshot_path])
        return outcome.describe()
    blob = await service.export_hottest()
    headers = {"content-type": "application/octet-stream"}
    token = service.credentials.peer_token
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    for peer in cfg.handoff_peers:
        remaining = deadline - time.monotonic()
        if remaining <= 0.1:
            break
        try:
            async with httpx.AsyncClient(timeout=remaining) as client:
                resp = await client.post(
                    f"{peer.rstrip('/')}/v1/handoff",
                    content=blob,
                    headers=headers,
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
    """Load the snapshot named in the config, if any, then take back from the ready peers the
    chains this agent owns (``rebalance.take_back``; ring-aware only). Returns what the
    snapshot file gave.

    A snapshot that cannot be loaded (damaged, hostile, of another geometry, unreadable, or
    any error while importing it) is logged and moved aside (``<name>.rejected-<unix time>``,
    kept for inspection, never loaded again) and the agent starts empty: a bad file must not
    keep the agent from starting.
    """
    result = await _load_snapshot(service)
    try:
        await take_back(service)
    except Exception:  # best effort: the agent starts with what it has
        log.exception("warm start: taking back owned chains from the peers failed")
    return result


async def _load_snapshot(service: AgentService) -> ImportResult | None:
    path = service.config.lifecycle.snapshot_path
    if not path:
        return None
    snapshot = Path(path)
    try:
        if not snapshot.is_file():
            return None
    except (OSError, ValueError) as err:
        log.error("warm start: cannot look at snapshot %s, starting empty: %s", path, err)
        return None
    nodes_before = service.engine.num_nodes
    try:
        result = await service.import_blocks(snapshot.read_bytes())
    except Exception as err:
        if isinstance(err, SnapshotError):
            log.error("warm start: snapshot %s refused, starting empty: %s", path, err)
        else:
            log.exception("warm start: loading snapshot %s failed, starting empty", path)
        await _start_empty(service, nodes_before)
        moved = set_aside(snapshot)
        if moved is not None:
            log.warning("warm start: moved the rejected snapshot to %s", moved)
        return None
    log.info(
        "warm start: %d blocks in %d chains from %s", result.blocks_written, result.chains, path
    )
    return result


async def _start_empty(service: AgentService, nodes_before: int) -> None:
    """Drop what a failed import left in the cache (a refused snapshot imports nothing)."""
    if service.engine.num_nodes <= nodes_before:
        return
    try:
        await service.call(service.engine.clear)
    except Exception:
        log.exception("warm start: clearing a partly imported snapshot failed")


def set_aside(path: Path) -> Path | None:
    """Rename a rejected snapshot to ``<name>.rejected-<unix time>[-n]``; None if it cannot."""
    stamp = int(time.time())
    for n in range(100):
        target = path.with_name(f"{path.name}.rejected-{stamp}" + (f"-{n}" if n else ""))
        if target.exists():
            continue
        try:
            os.replace(path, target)
        except OSError as err:
            log.error("warm start: cannot move the rejected snapshot %s aside: %s", path, err)
            return None
        return target
    log.error("warm start: cannot move the rejected snapshot %s aside: names taken", path)
    return None
