"""A hostile client against a real ``kvpool agent`` process on loopback.

Every probe of the trust-model review runs here, and each asserts both the refusal and that
nothing of another tenant was read, written or lost. The agent has three tenants (a, b, c)
and a peer token, a 64-block cache and short timeouts so the time limits can be seen.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import msgpack
import pytest
import torch
import yaml
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool_agent.cache import KVCacheManager
from kvpool_agent.config import AgentConfig
from kvpool_agent.credentials import token_digest
from kvpool_agent.server.payload import decode_tensor, encode_tensor
from kvpool_agent.server.snapshot import MAGIC, VERSION, geometry

if TYPE_CHECKING:  # the shared helper's type, from tests/conftest.py
    from tests.conftest import AgentProcess

pytestmark = pytest.mark.slow

TPB = 4
BLOCKS = 64
HEADS, DIM, LAYERS = 2, 8, 2
BLOCK_BYTES = 2 * LAYERS * HEADS * DIM * TPB * 4
MAX_REPLAY = 5
HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.5
IDLE_SEQ_TIMEOUT = 4.0
MAX_OPEN = 8
TOKENS = {"a": "token-of-tenant-a-0123456789", "b": "token-of-tenant-b-0123456789"}
TOKENS["c"] = "token-of-tenant-c-0123456789"
PEER = "the-pools-own-peer-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    url: str
    host: str
    port: int
    replay: str
    config: dict[str, Any]
    log: Path

    def client(self, tenant: str | None) -> httpx.Client:
        token = PEER if tenant == "peer" else TOKENS.get(tenant or "", tenant)
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=10, trust_env=False)


def agent_doc(port: int, replay_port: int, auth_dir: Path) -> dict[str, Any]:
    return {
        "model": {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": DIM, "dtype": "float32"},
        "kv_cache_config": {"tokens_per_block": TPB, "enable_partial_reuse": False},
        "device": "cpu",
        "cpu_budget_bytes": BLOCKS * BLOCK_BYTES,
        "server": {"host": "127.0.0.1", "port": port},
        "events": {"endpoint": None, "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"},
        "transfer": {"port": 0},
        "auth": {
            "tenants_file": str(auth_dir / "tenants.yaml"),
            "peer_token_file": str(auth_dir / "peer-token"),
        },
        "limits": {
            "max_json_body_bytes": 4 << 20,
            "header_timeout_s": HEADER_TIMEOUT,
            "body_timeout_s": BODY_TIMEOUT,
            "idle_timeout_s": 2.0,
            "tenant_max_open_sequences": MAX_OPEN,
            "tenant_max_pinned_fraction": 0.5,
            "sequence_idle_timeout_s": IDLE_SEQ_TIMEOUT,
            "max_replay_batches": MAX_REPLAY,
        },
    }


@pytest.fixture(scope="module")
def agent(
    tmp_path_factory: pytest.TempPathFactory, start_agent: Callable[..., AgentProcess]
) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("hostile")
    auth = tmp / "auth"
    auth.mkdir()
    (auth / "tenants.yaml").write_text(
        yaml.safe_dump({name: token_digest(tok) for name, tok in TOKENS.items()})
    )
    (auth / "peer-token").write_text(PEER + "\n")
    port, replay_port = free_port(), free_port()
    doc = agent_doc(port, replay_port, auth)
    config = tmp / "agent.yaml"
    config.write_text(yaml.safe_dump(doc))
    running = start_agent(config, port)
    try:
        yield Running(
            running.url, "127.0.0.1", port, f"tcp://127.0.0.1:{replay_port}", doc, running.log
        )
    finally:
        running.stop()


def open_seq(c: httpx.Client, tokens: list[int], **extra: Any) -> dict[str, Any]:
    resp = c.post("/v1/sequences", json={"tokens": tokens, **extra})
    assert resp.status_code == 201, resp.text
    doc: dict[str, Any] = resp.json()
    return doc


def kv_frame(blocks: int, value: float | None = None) -> bytes:
    shape = (LAYERS, blocks, 2, TPB, HEADS, DIM)
    kv = torch.full(shape, value) if value is not None else torch.rand(shape) + 1.0
    return encode_tensor(kv)


def read_blocks(c: httpx.Client, seq_id: int, count: int) -> torch.Tensor:
    resp = c.get(f"/v1/sequences/{seq_id}/kv/0/0", params={"count": count})
    assert resp.status_code == 200, resp.text
    return decode_tensor(resp.content)


def prompt(tag: int, blocks: int) -> list[int]:
    return list(range(tag * 10_000, tag * 10_000 + blocks * TPB))


# ----------------------------------------------------------------------- authentication


ROUTES = [
    ("POST", "/v1/sequences", {"tokens": [1, 2, 3]}),
    ("GET", "/v1/sequences/1", None),
    ("POST", "/v1/sequences/1/tokens", {"tokens": [4]}),
    ("POST", "/v1/sequences/1/commit", None),
    ("DELETE", "/v1/sequences/1", None),
    ("GET", "/v1/sequences/1/kv/0/0", None),
    ("GET", "/v1/stats", None),
    ("GET", "/v1/events", None),
    ("POST", "/v1/handoff", None),
    ("POST", "/v1/attention", {"seq_ids": [1], "q_lens": [1], "layer": 0, "num_qo_heads": 2,
                               "q": ""}),
]  # fmt: skip


@pytest.mark.parametrize("token", [None, "not-a-token", "Basic abc"])
def test_every_route_but_the_probes_needs_a_valid_token(agent: Running, token: str | None) -> None:
    headers = {"authorization": token if token and " " in token else f"Bearer {token}"}
    with httpx.Client(base_url=agent.url, timeout=10, headers=headers if token else {}) as c:
        for method, path, body in ROUTES:
            resp = c.request(method, path, json=body)
            assert resp.status_code == 401, (method, path, resp.text)
            assert resp.headers["www-authenticate"] == "Bearer"
        for path in ("/healthz", "/readyz", "/metrics"):
            assert c.get(path).status_code == 200
        metrics = c.get("/metrics").text
    assert 'kvpool_requests_refused_total{reason="unauthenticated"}' in metrics


def test_tenant_and_peer_tokens_open_only_their_own_routes(agent: Running) -> None:
    with agent.client("peer") as peer, agent.client("a") as a:
        assert peer.post("/v1/sequences", json={"tokens": [1, 2]}).status_code == 403
        assert a.get("/v1/events").status_code == 403
        assert a.post("/v1/handoff", content=b"x").status_code == 403
        assert peer.get("/v1/events").status_code == 200
        assert a.get("/v1/stats").status_code == 200


def test_an_unauthenticated_agent_refuses_to_bind_beyond_loopback(tmp_path: Path) -> None:
    doc = agent_doc(free_port(), free_port(), tmp_path)
    doc["server"]["host"] = "0.0.0.0"
    del doc["auth"]
    config = tmp_path / "open.yaml"
    config.write_text(yaml.safe_dump(doc))
    done = subprocess.run(
        [sys.executable, "-m", "kvpool_cli", "agent", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "auth.tenants_file" in done.stderr and "0.0.0.0" in done.stderr


# ----------------------------------------------------------------------- tenancy


def test_sequence_ids_are_unguessable_and_other_tenants_get_404(agent: Running) -> None:
    with agent.client("a") as a, agent.client("b") as b:
        first = open_seq(a, prompt(1, 3))
        second = open_seq(a, prompt(2, 3))
        sid = first["seq_id"]
        assert abs(second["seq_id"] - sid) > 1 << 20  # not sequential
        a.put(f"/v1/sequences/{sid}/kv/0/0", content=kv_frame(3, 7.0)).raise_for_status()
        before = read_blocks(a, sid, 3)
        for method, path, kwargs in [
            ("GET", f"/v1/sequences/{sid}", {}),
            ("GET", f"/v1/sequences/{sid}/kv/0/0", {}),
            ("PUT", f"/v1/sequences/{sid}/kv/0/0", {"content": kv_frame(1, 9.0)}),
            ("POST", f"/v1/sequences/{sid}/tokens", {"json": {"tokens": [5]}}),
            ("POST", f"/v1/sequences/{sid}/commit", {}),
            ("DELETE", f"/v1/sequences/{sid}", {}),
        ]:
            resp = b.request(method, path, **kwargs)
            assert resp.status_code == 404, (method, path, resp.text)
        q = {"seq_ids": [sid], "q_lens": [1], "layer": 0, "num_qo_heads": 2, "causal": True}
        import base64

        q["q"] = base64.b64encode(encode_tensor(torch.zeros(1, 2, DIM))).decode()
        assert b.post("/v1/attention", json=q).status_code == 404
        # a's sequence is intact: same tokens, same KV
        assert a.get(f"/v1/sequences/{sid}").json()["num_tokens"] == 3 * TPB
        assert torch.equal(read_blocks(a, sid, 3), before)
        for s in (first, second):
            assert a.delete(f"/v1/sequences/{s['seq_id']}").status_code == 204


def test_the_tenant_not_the_salt_decides_the_namespace(agent: Running) -> None:
    tokens = prompt(3, 4)
    with agent.client("a") as a, agent.client("b") as b:
        for salt in (None, "shared-salt"):
            extra = {"cache_salt": salt} if salt else {}
            s = open_seq(a, tokens, **extra)
            a.put(f"/v1/sequences/{s['seq_id']}/kv/0/0", content=kv_frame(4)).raise_for_status()
            a.delete(f"/v1/sequences/{s['seq_id']}").raise_for_status()
            again = open_seq(a, tokens, **extra)
            assert again["num_reused_tokens"] == 3 * TPB  # a reuses its own prefix
            probe = open_seq(b, tokens, **extra)
            assert probe["num_reused_tokens"] == 0  # b learns nothing of a's prefix
            for c, s in ((a, again), (b, probe)):
                c.delete(f"/v1/sequences/{s['seq_id']}", params={"discard": "true"})


def test_a_recycled_block_never_shows_the_previous_owners_kv(agent: Running) -> None:
    """Tenant a fills blocks with KV and leaves them (released and committed); tenant b's
    new sequences get those block ids and read zeros, never a's bytes."""
    with agent.client("a") as a, agent.client("b") as b, agent.client("c") as c:
        a_ids: set[int] = set()
        for tag in range(4):
            s = open_seq(a, prompt(100 + tag, 7))
            a_ids |= set(s["block_tables"][0])
            a.put(f"/v1/sequences/{s['seq_id']}/kv/0/0", content=kv_frame(7, 5.0))
            a.delete(f"/v1/sequences/{s['seq_id']}", params={"discard": str(tag % 2 == 0)})
        overlap: set[int] = set()
        for tag in range(2):  # b and c together hold 56 of 64 blocks: a's get recycled
            held = [
                (cl, open_seq(cl, prompt(200 + 2 * tag + i, 28))) for i, cl in enumerate((b, c))
            ]
            for cl, s in held:
                ids = s["block_tables"][0]
                kv = read_blocks(cl, s["seq_id"], len(ids))
                for j, block in enumerate(ids):
                    if block in a_ids:
                        overlap.add(block)
                        assert not kv[:, j].any(), f"block {block} still holds tenant a's KV"
            for cl, s in held:
                cl.delete(f"/v1/sequences/{s['seq_id']}", params={"discard": "true"})
        assert overlap  # the probe did reach a's blocks


def test_a_write_racing_a_release_never_lands_in_another_sequence(agent: Running) -> None:
    with agent.client("a") as a, ThreadPoolExecutor(3) as pool:
        for i in range(12):
            x = open_seq(a, prompt(300 + i, 4))
            sid = x["seq_id"]
            put = pool.submit(
                a.put, f"/v1/sequences/{sid}/kv/0/0", content=kv_frame(4, float(i + 1))
            )
            gone = pool.submit(a.delete, f"/v1/sequences/{sid}", params={"discard": "true"})
            y = pool.submit(open_seq, a, prompt(400 + i, 4)).result()
            assert put.result().status_code in (204, 404)
            assert gone.result().status_code == 204
            kv = read_blocks(a, y["seq_id"], 4)
            assert not kv.any(), f"round {i}: another sequence's write landed in a fresh one"
            a.delete(f"/v1/sequences/{y['seq_id']}", params={"discard": "true"})


# ----------------------------------------------------------------------- limits


def test_open_sequences_per_tenant_are_capped(agent: Running) -> None:
    with agent.client("c") as c, agent.client("a") as a:
        opened = [open_seq(c, prompt(500 + i, 1)) for i in range(MAX_OPEN)]
        over = c.post("/v1/sequences", json={"tokens": prompt(600, 1)})
        assert over.status_code == 429 and "tenant_max_open_sequences" in over.text
        assert over.headers["retry-after"]
        other = open_seq(a, prompt(601, 1))  # other tenants are not affected
        a.delete(f"/v1/sequences/{other['seq_id']}")
        for s in opened:
            c.delete(f"/v1/sequences/{s['seq_id']}", params={"discard": "true"})


def test_one_tenant_cannot_pin_more_than_its_share(agent: Running) -> None:
    with agent.client("c") as c, agent.client("a") as a:
        first = open_seq(c, prompt(700, 24))
        over = c.post("/v1/sequences", json={"tokens": prompt(701, 12)})
        assert over.status_code == 429 and "tenant_max_pinned_fraction" in over.text
        grow = c.post(f"/v1/sequences/{first['seq_id']}/tokens", json={"tokens": [1] * 40})
        assert grow.status_code == 429
        assert c.get(f"/v1/sequences/{first['seq_id']}").json()["num_tokens"] == 24 * TPB
        other = open_seq(a, prompt(702, 24))  # a still gets its share
        for cl, s in ((c, first), (a, other)):
            cl.delete(f"/v1/sequences/{s['seq_id']}", params={"discard": "true"})


def test_idle_sequences_expire_and_unpin(agent: Running) -> None:
    with agent.client("c") as c:
        s = open_seq(c, prompt(800, 3))
        deadline = time.monotonic() + IDLE_SEQ_TIMEOUT + 5
        while c.get(f"/v1/sequences/{s['seq_id']}").status_code == 200:
            assert time.monotonic() < deadline, "an idle sequence was never released"
            time.sleep(IDLE_SEQ_TIMEOUT + 1.5)
        metrics = c.get("/metrics").text
    assert "kvpool_sequences_expired_total" in metrics
    line = next(x for x in metrics.splitlines() if x.startswith("kvpool_sequences_expired_total"))
    assert float(line.split()[-1]) >= 1


def test_bodies_are_bounded_chunked_or_not(agent: Running) -> None:
    limit = agent.config["limits"]["max_json_body_bytes"]
    with agent.client("a") as a:
        big = b"[" + b"1," * (limit // 2) + b"1]"
        resp = a.post("/v1/sequences", content=big, headers={"content-type": "application/json"})
        assert resp.status_code == 413 and "max_json_body_bytes" in resp.text

        def chunks() -> Iterator[bytes]:
            for _ in range(limit // 65536 + 2):
                yield b" " * 65536

        resp = a.post("/v1/sequences", content=chunks())
        assert resp.status_code == 413
        assert a.get("/v1/stats").json()["open_sequences"] >= 0  # still serving


def _raw(agent: Running, data: bytes) -> socket.socket:
    sock = socket.create_connection((agent.host, agent.port), timeout=10)
    sock.sendall(data)
    return sock


def test_slow_headers_and_idle_connections_are_closed(agent: Running) -> None:
    held = [_raw(agent, b"") for _ in range(40)] + [_raw(agent, b"GET /healthz HTTP/1.1\r\n")]
    t0 = time.monotonic()
    with httpx.Client(base_url=agent.url, timeout=5) as c:
        assert c.get("/healthz").status_code == 200  # the agent still serves meanwhile
    for sock in held:
        assert sock.recv(1) == b""  # closed by the agent
        sock.close()
    assert time.monotonic() - t0 < HEADER_TIMEOUT + 5


def test_a_slow_body_gets_408(agent: Running) -> None:
    token = TOKENS["a"]
    head = (
        f"POST /v1/sequences HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\n"
        "content-type: application/json\r\ncontent-length: 100\r\n\r\n"
    ).encode()
    sock = _raw(agent, head + b'{"tokens": [1')
    t0 = time.monotonic()
    reply = sock.recv(4096)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert BODY_TIMEOUT - 0.2 < time.monotonic() - t0 < BODY_TIMEOUT + 5


def test_retention_values_and_lengths_are_bounded(agent: Running) -> None:
    with agent.client("a") as a:
        stats = a.get("/v1/stats").json()
        inf = b'{"tokens":[1,2,3,4,5],"retention":{"token_range_retention_configs":' + (
            b'[{"priority":50,"duration_ms":1e309}]}}'
        )
        resp = a.post("/v1/sequences", content=inf, headers={"content-type": "application/json"})
        assert resp.status_code == 422, resp.text
        ranges = [{"token_start": i, "priority": 50} for i in range(40_000)]
        t0 = time.monotonic()
        resp = a.post(
            "/v1/sequences",
            json={"tokens": [1, 2, 3], "retention": {"token_range_retention_configs": ranges}},
        )
        assert resp.status_code == 422 and "64" in resp.text
        assert time.monotonic() - t0 < 2.0
        after = a.get("/v1/stats").json()
        assert after["sequences_opened"] == stats["sequences_opened"]


def test_a_replay_returns_a_bounded_range(agent: Running) -> None:
    with agent.client("a") as a, agent.client("peer") as peer:
        for i in range(MAX_REPLAY + 3):  # each commit publishes at least one batch
            s = open_seq(a, prompt(900 + i, 2))
            a.delete(f"/v1/sequences/{s['seq_id']}")
        batches = peer.get("/v1/events", params={"start_seq": 0, "limit": 10_000}).json()
        assert len(batches) == MAX_REPLAY
        nxt = peer.get("/v1/events", params={"start_seq": batches[-1]["seq"] + 1}).json()
        assert nxt and nxt[0]["seq"] == batches[-1]["seq"] + 1
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(agent.replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = 0
        while True:
            frames = dealer.recv_multipart()
            if frames[-1] == b"" and int.from_bytes(frames[-2], "big", signed=True) == -1:
                break
            got += 1
        assert got == MAX_REPLAY
    finally:
        ctx.destroy(linger=0)


def _snapshot(records: list[list[Any]], geo: dict[str, Any]) -> bytes:
    body = msgpack.packb({"geometry": geo, "records": records}, use_bin_type=True)
    return struct.pack("<4sHIQ", MAGIC, VERSION, zlib.crc32(body), len(body)) + body


def test_a_cyclic_handoff_is_refused_fast_and_the_agent_stays_healthy(agent: Running) -> None:
    cfg = AgentConfig.model_validate({k: v for k, v in agent.config.items() if k != "auth"} | {
        "server": {"host": "127.0.0.1"}})  # fmt: skip
    geo = geometry(KVCacheManager.from_agent_config(cfg))
    toks = list(range(TPB))
    records = [[None, [], 1, toks, 35, [None]], [None, [], 0, toks, 35, [None]]]
    records.append([None, [], 0, toks, 35, [None]])  # a leaf whose chain loops
    blob = _snapshot(records, geo)
    with agent.client("peer") as peer, agent.client("a") as a:
        stats = a.get("/v1/stats").json()
        t0 = time.monotonic()
        resp = peer.post("/v1/handoff", content=blob)
        assert resp.status_code == 400, resp.text
        assert time.monotonic() - t0 < 2.0
        assert a.get("/v1/stats").json()["tree_blocks"] == stats["tree_blocks"]
        assert a.get("/readyz").status_code == 200 and a.get("/healthz").status_code == 200


# ----------------------------------------------------------------------- fuzz

paths = st.sampled_from(
    [
        "/v1/sequences",
        "/v1/sequences/{sid}",
        "/v1/sequences/{sid}/tokens",
        "/v1/sequences/{sid}/commit",
        "/v1/sequences/{sid}/kv/0/0",
        "/v1/sequences/{sid}/kv/1/0",
        "/v1/sequences/{sid}/kv/0/-1",
        "/v1/attention",
        "/v1/handoff",
        "/v1/events",
        "/v1/stats",
        "/v1/sequences/99999999999999999999999",
    ]
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=6),
    max_leaves=30,
)  # fmt: skip


@pytest.fixture(scope="module")
def victim(agent: Running) -> Iterator[tuple[int, torch.Tensor]]:
    with agent.client("a") as a:
        s = open_seq(a, prompt(1000, 3))
        a.put(f"/v1/sequences/{s['seq_id']}/kv/0/0", content=kv_frame(3, 3.0)).raise_for_status()
        yield s["seq_id"], read_blocks(a, s["seq_id"], 3)
        a.delete(f"/v1/sequences/{s['seq_id']}")


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    path=paths,
    who=st.sampled_from([None, "b", "peer", "garbage"]),
    body=st.one_of(json_values.map(lambda v: ("json", v)), st.binary(max_size=256).map(
        lambda v: ("raw", v))),
)  # fmt: skip
def test_fuzzed_requests_from_others_never_touch_a_tenants_sequence(
    agent: Running,
    victim: tuple[int, torch.Tensor],
    method: str,
    path: str,
    who: str | None,
    body: tuple[str, Any],
) -> None:
    sid, kv = victim
    kind, value = body
    with agent.client(who) as c:
        kwargs: dict[str, Any] = {"json": value} if kind == "json" else {"content": value}
        resp = c.request(method, path.format(sid=sid), **kwargs)
        assert resp.status_code < 500, resp.text
        if resp.status_code == 201:  # b opened a sequence of its own: leave nothing open
            c.delete(f"/v1/sequences/{resp.json()['seq_id']}", params={"discard": "true"})
    with agent.client("a") as a:
        assert a.get(f"/v1/sequences/{sid}").json()["num_tokens"] == 3 * TPB
        assert torch.equal(read_blocks(a, sid, 3), kv)
