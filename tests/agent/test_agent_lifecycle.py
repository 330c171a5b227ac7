"""Drain and warm handoff, in-process: snapshot export/import, the drain sequence."""

from __future__ import annotations

import asyncio
import struct
import zlib
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import torch

from kvpool_agent.credentials import ANONYMOUS
from kvpool_agent.server import AgentService, create_app
from kvpool_agent.server import snapshot as snapshot_module
from kvpool_agent.server.lifecycle import drain, warm_start
from kvpool_agent.server.payload import encode_tensor
from kvpool_agent.server.snapshot import (
    SnapshotError,
    export_snapshot,
    import_snapshot,
    select_hottest,
)

from .conftest import TPB, small_config

pytestmark = pytest.mark.asyncio


async def fill(
    client: httpx.AsyncClient, service: AgentService, prompts: list[list[int]]
) -> dict[int, torch.Tensor]:
    """Open, write distinct KV for, and release each prompt; returns KV by prompt index."""
    written = {}
    view = service.engine.pool_view(0)
    for i, toks in enumerate(prompts):
        seq = (await client.post("/v1/sequences", json={"tokens": toks})).json()
        n = len(seq["block_tables"][0])
        kv = torch.full((view.shape[0], n, *view.shape[2:]), float(i + 1))
        kv += torch.arange(n).view(1, n, 1, 1, 1, 1)
        resp = await client.put(f"/v1/sequences/{seq['seq_id']}/kv/0/0", content=encode_tensor(kv))
        assert resp.status_code == 204
        written[i] = kv
        await client.delete(f"/v1/sequences/{seq['seq_id']}")
    return written


async def test_export_import_moves_blocks_and_their_kv(
    client: httpx.AsyncClient, service: AgentService
) -> None:
    prompts = [list(range(p * 100, p * 100 + 6 * TPB)) for p in range(3)]
    written = await fill(client, service, prompts)
    salted = (
        await client.post("/v1/sequences", json={"tokens": prompts[0], "cache_salt": "s"})
    ).json()
    await client.delete(f"/v1/sequences/{salted['seq_id']}")
    blob = export_snapshot(service.engine, service.namespaces)

    target = AgentService(small_config())
    result = import_snapshot(target.engine, blob)
    assert result.chains == 4 and result.blocks_written == 4 * 6
    assert target.engine.stats.queries_tokens == 0  # import is not traffic
    for i, toks in enumerate(prompts):
        h = target.engine.open_sequence(toks, recompute_last_token=False)
        assert h.num_reused_tokens == len(toks)
        got = target.engine.pool_view(0)[:, list(h.block_tables[0])]
        assert torch.equal(got, written[i])
        target.engine.release(h.seq_id)
    h = target.engine.open_sequence(prompts[0], cache_salt="s", recompute_last_token=False)
    assert h.num_reused_tokens == len(prompts[0])
    assert result.namespaces == {("s", ())}


async def test_hottest_blocks_go_first_and_ancestors_come_along(
    client: httpx.AsyncClient, service: AgentService
) -> None:
    cold = list(range(0, 4 * TPB))
    hot = list(range(1000, 1000 + 4 * TPB))
    await fill(client, service, [cold, hot])
    seq = (
        await client.post(
            "/v1/sequences",
            json={"tokens": hot, "retention": {"tokenRangeRetentionConfigs": [{"priority": 90}]}},
        )
    ).json()
    await client.delete(f"/v1/sequences/{seq['seq_id']}")
    picked = select_hottest(service.engine.iter_nodes(), max_blocks=4)
    assert [n.tokens for n in picked] == [tuple(hot[i : i + TPB]) for i in range(0, 16, TPB)]
    assert {n.priority for n in picked} == {90}
    partial = select_hottest(service.engine.iter_nodes(), max_blocks=2)
    assert [n.depth for n in partial] == [1, 2]  # a deep node needs its whole prefix


async def test_handoff_endpoint_checks_geometry_and_integrity(
    client: httpx.AsyncClient, service: AgentService
) -> None:
    await fill(client, service, [list(range(3 * TPB))])
    blob = export_snapshot(service.engine, {})
    before = service.engine.num_nodes
    other = AgentService(small_config(model={"head_dim": 16}))
    with pytest.raises(SnapshotError, match="geometry"):
        import_snapshot(other.engine, blob)
    bad = blob[:-1] + bytes([blob[-1] ^ 1])
    resp = await client.post("/v1/handoff", content=bad)
    assert resp.status_code == 400 and "checksum" in resp.json()["detail"]
    foreign = export_snapshot(other.engine, {})
    other.engine.open_sequence(list(range(5)))
    resp = await client.post("/v1/handoff", content=foreign)
    assert resp.status_code == 409 and service.engine.num_nodes == before


async def test_drain_finishes_in_flight_sequences_then_snapshots(tmp_path: Path) -> None:
    snap = tmp_path / "snap.bin"
    svc = AgentService(small_config(lifecycle={"snapshot_path": str(snap), "grace_period_s": 10}))
    await svc.start()
    app = create_app(svc)
    stopped = asyncio.Event()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as c:
        await fill(c, svc, [list(range(4 * TPB))])
        inflight = (
            await c.post("/v1/sequences", json={"tokens": list(range(500, 500 + 3 * TPB))})
        ).json()
        task = asyncio.create_task(drain(svc, stopped.set))
        await asyncio.sleep(0.05)
        assert (await c.get("/readyz")).status_code == 503
        assert (await c.get("/healthz")).status_code == 200
        refused = await c.post("/v1/sequences", json={"tokens": [1, 2, 3]})
        assert refused.status_code == 503 and "draining" in refused.json()["detail"]
        more = await c.post(f"/v1/sequences/{inflight['seq_id']}/tokens", json={"tokens": [9]})
        assert more.status_code == 200  # in-flight work goes on
        assert not task.done()
        await c.delete(f"/v1/sequences/{inflight['seq_id']}")
        where = await asyncio.wait_for(task, 5)
    assert where == str(snap) and stopped.is_set()
    await svc.stop()

    restarted = AgentService(small_config(lifecycle={"snapshot_path": str(snap)}))
    result = await warm_start(restarted)
    assert result is not None and result.blocks_written == 4 + 3
    h = restarted.engine.open_sequence(list(range(4 * TPB)))
    assert h.num_reused_tokens == 4 * TPB - 1  # the last token is recomputed


async def test_drain_releases_leftovers_at_the_deadline(tmp_path: Path) -> None:
    svc = AgentService(small_config(lifecycle={"grace_period_s": 0.5}))
    await svc.start()
    svc.engine.open_sequence([1, 2, 3])
    await svc.open(ANONYMOUS, [4, 5, 6, 7, 8], None, [], None, True)
    t0 = asyncio.get_running_loop().time()
    where = await drain(svc, lambda: None)
    assert asyncio.get_running_loop().time() - t0 < 0.6
    assert where == "none" and not svc.sequences
    await svc.stop()


# ------------------------------------------------------------------ warm start from a bad file


def cyclic_snapshot() -> bytes:
    """A well-framed snapshot whose first record hangs from the second (a cycle), with a
    third record below them: walking its chain used to loop forever."""
    src = AgentService(small_config()).engine
    h = src.open_sequence(list(range(3 * TPB)), recompute_last_token=False)
    src.release(h.seq_id)
    blob = export_snapshot(src, {})
    header = struct.Struct("<4sHIQ")
    doc = msgpack.unpackb(blob[header.size :], raw=False)
    assert [r[2] for r in doc["records"]] == [-1, 0, 1]
    doc["records"][0][2] = 1
    body = msgpack.packb(doc, use_bin_type=True)
    return header.pack(b"KVPS", 1, zlib.crc32(body), len(body)) + body


async def assert_starts_empty_and_sets_aside(snap: Path, content: bytes) -> None:
    svc = AgentService(small_config(lifecycle={"snapshot_path": str(snap)}))
    await svc.start()
    try:
        result = await asyncio.wait_for(warm_start(svc), 10)
        assert result is None
        assert svc.engine.num_nodes == 0 and svc.engine.num_open_sequences == 0
        assert not snap.exists()
        aside = list(snap.parent.glob(f"{snap.name}.rejected-*"))
        assert len(aside) == 1 and aside[0].read_bytes() == content
        assert aside[0].name.removeprefix(f"{snap.name}.rejected-").isdigit()
        assert svc.ready
        transport = httpx.ASGITransport(app=create_app(svc))
        async with httpx.AsyncClient(transport=transport, base_url="http://a") as c:
            assert (await c.get("/readyz")).status_code == 200
        assert await warm_start(svc) is None  # not loaded again
        assert len(list(snap.parent.glob(f"{snap.name}.rejected-*"))) == 1
    finally:
        await svc.stop()


async def test_warm_start_from_a_garbage_file_starts_empty(tmp_path: Path) -> None:
    snap = tmp_path / "snap.bin"
    snap.write_bytes(b"not a snapshot at all\n" * 100)
    await assert_starts_empty_and_sets_aside(snap, snap.read_bytes())


async def test_warm_start_from_a_cyclic_snapshot_starts_empty(tmp_path: Path) -> None:
    snap = tmp_path / "snap.bin"
    snap.write_bytes(cyclic_snapshot())
    await assert_starts_empty_and_sets_aside(snap, snap.read_bytes())


async def test_warm_start_from_a_snapshot_of_another_geometry_starts_empty(
    tmp_path: Path,
) -> None:
    other = AgentService(small_config(model={"head_dim": 16})).engine
    h = other.open_sequence(list(range(2 * TPB)), recompute_last_token=False)
    other.release(h.seq_id)
    snap = tmp_path / "snap.bin"
    snap.write_bytes(export_snapshot(other, {}))
    await assert_starts_empty_and_sets_aside(snap, snap.read_bytes())


async def test_warm_start_survives_an_unexpected_error_mid_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any exception while importing, not only SnapshotError: what was imported is dropped."""
    src = AgentService(small_config()).engine
    for base in (0, 100):
        h = src.open_sequence(list(range(base, base + 2 * TPB)), recompute_last_token=False)
        src.release(h.seq_id)
    snap = tmp_path / "snap.bin"
    snap.write_bytes(export_snapshot(src, {}))
    real = snapshot_module._import_segment
    calls = 0

    def second_chain_fails(*args: Any, **kwargs: Any) -> int:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(snapshot_module, "_import_segment", second_chain_fails)
    await assert_starts_empty_and_sets_aside(snap, snap.read_bytes())
    assert calls == 2
