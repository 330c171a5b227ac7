"""The HTTP API contract: sequences, KV payloads, attention, errors that change nothing."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool_agent.server import AgentService
from kvpool_agent.server.payload import MEDIA_TYPE, decode_tensor, encode_tensor
from kvpool_kernels import PagedAttention

from .conftest import TPB, snapshot_state

pytestmark = pytest.mark.asyncio


async def open_seq(client: httpx.AsyncClient, tokens: list[int], **extra: Any) -> dict[str, Any]:
    resp = await client.post("/v1/sequences", json={"tokens": tokens, **extra})
    assert resp.status_code == 201, resp.text
    doc: dict[str, Any] = resp.json()
    return doc


def kv_for(service: AgentService, blocks: int, seed: int) -> torch.Tensor:
    view = service.engine.pool_view(0)
    g = torch.Generator().manual_seed(seed)
    shape = (view.shape[0], blocks, *view.shape[2:])
    return torch.randn(shape, generator=g, dtype=view.dtype)


async def test_open_release_reopen_reuses_the_prefix(client: httpx.AsyncClient) -> None:
    tokens = list(range(1, 11))
    first = await open_seq(client, tokens)
    assert first["num_reused_tokens"] == 0
    assert first["num_tokens"] == 10 and first["tokens_per_block"] == TPB
    assert len(first["block_tables"][0]) == 3 and first["last_page_len"] == 2
    assert (await client.delete(f"/v1/sequences/{first['seq_id']}")).status_code == 204
    second = await open_seq(client, tokens)
    assert second["num_reused_tokens"] == 8
    assert second["block_tables"][0][:2] == first["block_tables"][0][:2]
    salted = await open_seq(client, tokens, cache_salt="tenant-b")
    assert salted["num_reused_tokens"] == 0


async def test_append_commit_and_get(client: httpx.AsyncClient) -> None:
    seq = await open_seq(client, [1, 2, 3])
    sid = seq["seq_id"]
    resp = await client.post(f"/v1/sequences/{sid}/tokens", json={"tokens": [4, 5, 6]})
    assert resp.status_code == 200 and resp.json()["num_tokens"] == 6
    assert len(resp.json()["block_tables"][0]) == 2
    assert (await client.post(f"/v1/sequences/{sid}/commit")).status_code == 200
    got = await client.get(f"/v1/sequences/{sid}")
    assert got.json()["num_tokens"] == 6
    other = await open_seq(client, [1, 2, 3, 4, 5])
    assert other["num_reused_tokens"] == 4  # the committed first block is shared


async def test_kv_write_read_roundtrip_and_shared_blocks_are_read_only(
    client: httpx.AsyncClient, service: AgentService
) -> None:
    seq = await open_seq(client, list(range(100, 109)))
    sid = seq["seq_id"]
    kv = kv_for(service, 3, seed=1)
    resp = await client.put(
        f"/v1/sequences/{sid}/kv/0/0",
        content=encode_tensor(kv),
        headers={"content-type": MEDIA_TYPE},
    )
    assert resp.status_code == 204, resp.text
    back = await client.get(f"/v1/sequences/{sid}/kv/0/0", params={"count": 3})
    assert back.status_code == 200
    assert torch.equal(decode_tensor(back.content), kv)
    await client.delete(f"/v1/sequences/{sid}")
    again = await open_seq(client, list(range(100, 109)))
    assert again["num_reused_tokens"] == 8
    reused = await client.get(f"/v1/sequences/{again['seq_id']}/kv/0/0", params={"count": 2})
    assert torch.equal(decode_tensor(reused.content), kv[:, :2])
    before = snapshot_state(service)
    denied = await client.put(
        f"/v1/sequences/{again['seq_id']}/kv/0/1", content=encode_tensor(kv_for(service, 1, 2))
    )
    assert denied.status_code == 409 and "reused" in denied.json()["detail"]
    assert snapshot_state(service) == before
    ok = await client.put(
        f"/v1/sequences/{again['seq_id']}/kv/0/2", content=encode_tensor(kv_for(service, 1, 3))
    )
    assert ok.status_code == 204


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b[:-1],  # truncated
        lambda b: b[:30] + bytes([b[30] ^ 0xFF]) + b[31:],  # corrupted data: checksum
        lambda b: b"XXXX" + b[4:],  # magic
        lambda b: b[:4] + b"\x09\x00" + b[6:],  # version
    ],
)
async def test_bad_payloads_are_rejected_and_change_nothing(
    client: httpx.AsyncClient, service: AgentService, mutate: Any
) -> None:
    seq = await open_seq(client, [1, 2, 3, 4, 5])
    before = snapshot_state(service)
    frame = mutate(encode_tensor(kv_for(service, 2, 0)))
    resp = await client.put(f"/v1/sequences/{seq['seq_id']}/kv/0/0", content=frame)
    assert resp.status_code == 400 and resp.json()["detail"]
    assert snapshot_state(service) == before


async def test_wrong_shape_dtype_and_range_are_rejected(
    client: httpx.AsyncClient, service: AgentService
) -> None:
    sid = (await open_seq(client, [1, 2, 3, 4, 5]))["seq_id"]
    before = snapshot_state(service)
    wrong_dtype = kv_for(service, 1, 0).to(torch.float16)
    for path, body, status in [
        (f"/v1/sequences/{sid}/kv/0/0", encode_tensor(wrong_dtype), 422),
        (f"/v1/sequences/{sid}/kv/0/0", encode_tensor(torch.zeros(3, 3)), 422),
        (f"/v1/sequences/{sid}/kv/0/1", encode_tensor(kv_for(service, 2, 0)), 422),
        (f"/v1/sequences/{sid}/kv/5/0", encode_tensor(kv_for(service, 1, 0)), 404),
        ("/v1/sequences/999/kv/0/0", encode_tensor(kv_for(service, 1, 0)), 404),
    ]:
        resp = await client.put(path, content=body)
        assert resp.status_code == status, (path, resp.text)
        assert snapshot_state(service) == before


async def test_attention_matches_the_kernel_run_in_process(
    client: httpx.AsyncClient, service: AgentService
) -> None:
    seqs = [await open_seq(client, list(range(n))) for n in (5, 9)]
    for i, seq in enumerate(seqs):
        blocks = len(seq["block_tables"][0])
        resp = await client.put(
            f"/v1/sequences/{seq['seq_id']}/kv/0/0",
            content=encode_tensor(kv_for(service, blocks, i)),
        )
        assert resp.status_code == 204
    q_lens = [2, 3]
    q = torch.randn(sum(q_lens), 4, 8, generator=torch.Generator().manual_seed(7))
    body = {
        "seq_ids": [s["seq_id"] for s in seqs],
        "q_lens": q_lens,
        "layer": 1,
        "num_qo_heads": 4,
        "q": base64.b64encode(encode_tensor(q)).decode(),
    }
    resp = await client.post("/v1/attention", json=body)
    assert resp.status_code == 200, resp.text
    out = decode_tensor(base64.b64decode(resp.json()["output"]))
    assert resp.json()["backend"] == "torch"

    # The same batch straight through the kernels over the engine's pool.
    eng = service.engine
    tables = [s["block_tables"][0] for s in seqs]
    kernel = PagedAttention(backend="torch")
    kernel.plan(
        torch.tensor([0, 2, 5], dtype=torch.int32),
        torch.tensor([0, len(tables[0]), len(tables[0]) + len(tables[1])], dtype=torch.int32),
        torch.tensor(tables[0] + tables[1], dtype=torch.int32),
        torch.tensor([1, 1], dtype=torch.int32),
        4,
        2,
        8,
        TPB,
        q_dtype=torch.float32,
        kv_dtype=torch.float32,
    )
    want = kernel.run(q, eng.pool_view(0)[1])
    assert torch.allclose(out, want, atol=1e-6)

    before = snapshot_state(service)
    for bad, status in [
        ({**body, "layer": 2}, 422),
        ({**body, "q_lens": [2]}, 422),
        ({**body, "q_lens": [6, 3]}, 422),
        ({**body, "num_qo_heads": 3}, 422),
        ({**body, "q": "not base64!"}, 400),
        ({**body, "seq_ids": [seqs[0]["seq_id"], 12345]}, 404),
    ]:
        resp = await client.post("/v1/attention", json=bad)
        assert resp.status_code == status, (bad, resp.text)
    assert snapshot_state(service) == before


async def test_engine_errors_map_to_4xx_and_change_nothing(
    client: httpx.AsyncClient, service: AgentService
) -> None:
    await open_seq(client, [1, 2, 3, 4, 5])
    before = snapshot_state(service)
    cases: list[tuple[str, str, dict[str, Any] | None, int]] = [
        ("post", "/v1/sequences", {"tokens": []}, 422),
        ("post", "/v1/sequences", {"tokens": [-1]}, 422),
        ("post", "/v1/sequences", {"tokens": [1.5]}, 422),
        ("post", "/v1/sequences", {"tokens": ["1"]}, 422),
        ("post", "/v1/sequences", {"tokens": [True]}, 422),
        ("post", "/v1/sequences", {"tokens": [1], "bogus": 1}, 422),
        (
            "post",
            "/v1/sequences",
            {"tokens": [1], "retention": {"decodeRetentionPriority": 101}},
            422,
        ),
        ("post", "/v1/sequences", {"tokens": list(range(64 * TPB + 1))}, 413),
        ("post", "/v1/sequences/999/tokens", {"tokens": [1]}, 404),
        ("post", "/v1/sequences/999/commit", None, 404),
        ("delete", "/v1/sequences/999", None, 404),
        ("get", "/v1/sequences/999", None, 404),
    ]
    for method, path, body, status in cases:
        resp = await client.request(method, path, json=body)
        assert resp.status_code == status, (path, body, resp.text)
        assert resp.json()["detail"]
        assert snapshot_state(service) == before, (path, body)


async def test_out_of_blocks_is_503_and_changes_nothing(
    client: httpx.AsyncClient, service: AgentService
) -> None:
    await open_seq(client, list(range(60 * TPB)))  # pins 60 of the 64 blocks
    before = snapshot_state(service)
    resp = await client.post(
        "/v1/sequences", json={"tokens": list(range(10_000, 10_000 + 8 * TPB))}
    )
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert snapshot_state(service) == before


async def test_retention_and_stats(client: httpx.AsyncClient, service: AgentService) -> None:
    retention = {"tokenRangeRetentionConfigs": [{"tokenStart": 0, "priority": 90}]}
    seq = await open_seq(client, list(range(9)), retention=retention)
    await client.delete(f"/v1/sequences/{seq['seq_id']}")
    assert {n.priority for n in service.engine.iter_nodes()} == {90}
    stats = (await client.get("/v1/stats")).json()
    assert stats["queries_tokens"] == 9 and stats["open_sequences"] == 0
    assert stats["pools"][0]["blocks_total"] == 64


async def test_openapi_spec_lists_the_api(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    for path in (
        "/v1/sequences",
        "/v1/sequences/{seq_id}",
        "/v1/sequences/{seq_id}/tokens",
        "/v1/sequences/{seq_id}/kv/{pool}/{start}",
        "/v1/attention",
        "/v1/stats",
        "/v1/handoff",
        "/healthz",
        "/readyz",
    ):
        assert path in spec["paths"], path
    assert "OpenSequenceRequest" in spec["components"]["schemas"]


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
open_bodies = (
    st.fixed_dictionaries(
        {},
        optional={
            "tokens": st.lists(st.integers(-3, 2**64) | json_values, max_size=20),
            "cache_salt": json_values,
            "extra_keys": json_values,
            "retention": json_values
            | st.fixed_dictionaries(
                {"decodeRetentionPriority": st.integers(-5, 120)},
                optional={"tokenRangeRetentionConfigs": json_values},
            ),
            "recompute_last_token": json_values,
        },
    )
    | json_values
)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=open_bodies)
async def test_fuzzed_open_bodies_get_4xx_or_a_consistent_201(
    client: httpx.AsyncClient, service: AgentService, body: Any
) -> None:
    before = snapshot_state(service)
    resp = await client.post("/v1/sequences", json=body)
    assert resp.status_code in (201, 413, 422), resp.text
    if resp.status_code == 201:
        doc = resp.json()
        assert doc["num_tokens"] == len(body["tokens"])
        assert service.engine.num_open_sequences == 1
        assert (await client.delete(f"/v1/sequences/{doc['seq_id']}")).status_code == 204
    else:
        assert resp.json()["detail"]
        assert snapshot_state(service) == before


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    route=st.sampled_from(
        ["/v1/sequences/{id}/tokens", "/v1/attention", "/v1/sequences/{id}/commit"]
    ),
    body=json_values,
)
async def test_fuzzed_bodies_on_other_routes_change_nothing_when_refused(
    client: httpx.AsyncClient, service: AgentService, route: str, body: Any
) -> None:
    if not service.sequences:
        await open_seq(client, [1, 2, 3, 4, 5, 6])
    sid = next(iter(service.sequences))
    before = snapshot_state(service)
    resp = await client.post(route.replace("{id}", str(sid)), json=body)
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        assert resp.json()["detail"]
        assert snapshot_state(service) == before


async def test_cli_rejects_a_bad_config_with_exit_code_2(tmp_path: Any, capsys: Any) -> None:
    from kvpool_cli import main

    bad = tmp_path / "agent.yaml"
    bad.write_text("model: {num_layers: 0, num_kv_heads: 2, head_dim: 8}\nbogus: 1\n")
    assert main(["agent", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "model.num_layers" in err and "bogus" in err
