"""vLLM uses a pool: real vLLM engines (``.venv-vllm``) and a real agent process on loopback.

Engines, in order, all against one agent (two tenants, 64 blocks of capacity):
* ``baseline``: no connector; the reference greedy tokens and logprobs;
* ``A`` (tenant a): serves prompts P and stores their blocks;
* ``C`` (tenant b): prompts Q sharing prefixes with P: no hit, tenant a's blocks are not its;
* ``B`` (tenant a, a fresh process): prompts Q, in phases with vLLM's own prefix cache reset
  between them: hits from the pool with the baseline's outputs; loaded KV corrupted (outputs
  change: the check can fail); the pool's blocks evicted between lookup and lease, the agent
  killed between lease and read, then the pool down: outputs equal the baseline every time.

Loads and saves go layer by layer (the counters show vLLM's layer hooks at work); on a pool of
its own, an engine's load cut between its first and second layer range is recomputed, while
the same load with its second layer silently zeroed changes the outputs.
"""

from __future__ import annotations

import math
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from kvpool_agent.credentials import token_digest

from .conftest import free_port, run_engine

if TYPE_CHECKING:
    from tests.conftest import AgentProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

TOKENS = {"a": "vllm-tenant-a-token-0123456789", "b": "vllm-tenant-b-token-0123456789"}
BLOCK = 32
SHARED = 4 * BLOCK
"""Prefix every prompt of P shares."""
POOL_BLOCKS = 64
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4  # layers x K/V x tokens x kv heads x head dim x fp32
LOGPROB_TOLERANCE = 1e-3
LAYERS = 2
"""The tiny model's layers: a load is read in 2 layer ranges (``load_layer_chunks`` 4)."""


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    """P: 3 prompts of 232 tokens sharing 4 blocks; Q: P's first 200 tokens (6 full blocks)
    and 40 new ones."""
    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    shared = tokens(SHARED)
    p = [shared + tokens(232 - SHARED) for _ in range(3)]
    q = [prompt[:200] + tokens(40) for prompt in p]
    return p, q


P, Q = _prompts()
Q_HIT_TOKENS = 200 // BLOCK * BLOCK
R = [P[0][:84]]
"""A prompt of 2 full blocks and 20 tokens, answered with R_GENERATED tokens: the KV of the
first 84 + 49 = 133 tokens is computed (the last answer token never is), 4 full blocks."""
R_GENERATED = 50
R_NEXT = {"from": "r", "take": 44, "extra": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]}
"""The next turn: R, 44 tokens of its answer, 10 new ones (138 tokens, 4 full blocks)."""


@dataclass
class Pool:
    agent: AgentProcess
    transfer: str

    def hits_tokens(self) -> float:
        return self.agent.metric("kvpool_prefix_cache_hits_tokens_total")


def start_pool(
    tmp: Path, start_agent: Callable[..., AgentProcess], unix_socket: str | None = None
) -> Pool:
    """A CPU agent of POOL_BLOCKS blocks whose tenants are ``TOKENS`` (also serving the
    same-node path on ``unix_socket``)."""
    (tmp / "tenants.yaml").write_text(
        yaml.safe_dump({name: token_digest(tok) for name, tok in TOKENS.items()})
    )
    port, transfer = free_port(), free_port()
    doc = {
        "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "dtype": "float32"},
        "kv_cache_config": {"tokens_per_block": BLOCK},
        "device": "cpu",
        "cpu_budget_bytes": POOL_BLOCKS * BLOCK_BYTES,
        "events": {"endpoint": None, "replay_endpoint": None},
        "auth": {"tenants_file": str(tmp / "tenants.yaml")},
        "transfer": {"port": transfer, "unix_socket": unix_socket},
    }
    config = tmp / "agent.yaml"
    config.write_text(yaml.safe_dump(doc))
    agent = start_agent(config, port, "--port", str(port))
    return Pool(agent, f"127.0.0.1:{transfer}")


@pytest.fixture(scope="module")
def pool(
    tmp_path_factory: pytest.TempPathFactory, start_agent: Callable[..., AgentProcess]
) -> Iterator[Pool]:
    running = start_pool(tmp_path_factory.mktemp("vllm-pool"), start_agent)
    yield running
    running.agent.stop()


def connector(pool: Pool, **extra: Any) -> dict[str, Any]:
    return {
        "module": "faulty",
        "class": "FaultyConnector",
        "extra": {"replicas": [pool.transfer], "lookup_timeout_s": 2.0, **extra},
    }


def same_outputs(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> bool:
    for g, w in zip(got, want, strict=True):
        if g["tokens"] != w["tokens"]:
            return False
        for a, b in zip(g["logprobs"], w["logprobs"], strict=True):
            if not math.isclose(a, b, abs_tol=LOGPROB_TOLERANCE):
                return False
    return True


def phase(result: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(p for p in result["phases"] if p["name"] == name)
    return found


@pytest.fixture(scope="module")
def baseline(vllm_python: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("vllm-baseline")
    spec = {
        "model": str(model_dir),
        "connector": None,
        "phases": [
            {"name": "p", "prompts": P},
            {"name": "q", "prompts": Q, "reset": True},
            {"name": "r", "prompts": R, "reset": True, "max_tokens": R_GENERATED},
            {"name": "r-next", "extend": R_NEXT, "reset": True},
        ],
    }
    return run_engine(vllm_python, tmp, "baseline", spec)


def test_engines_share_kv_through_the_pool_and_a_failing_pool_costs_only_speed(
    vllm_python: Path,
    model_dir: Path,
    pool: Pool,
    baseline: dict[str, Any],
    tmp_path: Path,
) -> None:
    want_p, want_q = phase(baseline, "p")["outputs"], phase(baseline, "q")["outputs"]
    # The weights make attention matter: different prompts give different continuations.
    assert len({tuple(o["tokens"]) for o in want_q}) > 1

    # A stores P's full prompt blocks: 4 shared + 3 x 3 of their own.
    a = run_engine(
        vllm_python,
        tmp_path,
        "A",
        {
            "model": str(model_dir),
            "connector": connector(pool),
            "phases": [
                {"name": "store", "prompts": P},
            ],
        },
        token=TOKENS["a"],
    )
    store = phase(a, "store")
    assert same_outputs(store["outputs"], want_p)
    assert store["worker_stats"]["saved_blocks"] == 4 + 3 * 3
    assert store["worker_stats"]["save_errors"] == 0
    assert store["scheduler_stats"]["hit_blocks"] == 0  # the pool was empty
    # Copied out layer by layer, from inside vLLM's attention layers.
    assert store["worker_stats"]["layer_saves"] >= LAYERS
    assert store["worker_stats"]["layer_saves"] % LAYERS == 0

    # C, another tenant, asks for the same prefixes: nothing of tenant a's is visible.
    c = run_engine(
        vllm_python,
        tmp_path,
        "C",
        {
            "model": str(model_dir),
            "connector": connector(pool),
            "phases": [
                {"name": "other-tenant", "prompts": Q},
            ],
        },
        token=TOKENS["b"],
    )
    other = phase(c, "other-tenant")
    # (Q's prompts share 4 blocks among themselves, which vLLM's own cache may serve.)
    assert other["outputs"][0]["num_cached_tokens"] == 0
    assert other["scheduler_stats"]["hit_blocks"] == 0
    assert other["worker_stats"]["loaded_blocks"] == 0
    assert other["scheduler_stats"]["lookup_errors"] == 0
    assert same_outputs(other["outputs"], want_q)

    # B, a fresh engine of tenant a: Q's shared blocks come from the pool.
    hits_before = pool.hits_tokens()
    flood = {"replicas": [pool.transfer], "token": TOKENS["a"], "blocks": POOL_BLOCKS + 16}
    kill = {"replicas": [pool.transfer], "pid": pool.agent.proc.pid}
    b = run_engine(
        vllm_python,
        tmp_path,
        "B",
        {
            "model": str(model_dir),
            "connector": connector(pool),
            "pool_metrics": f"{pool.agent.url}/metrics",
            "phases": [
                {"name": "hit", "prompts": Q, "fault": "none"},
                {"name": "corrupt", "prompts": Q, "fault": "corrupt", "reset": True},
                {
                    "name": "evict",
                    "prompts": Q,
                    "fault": "evict",
                    "fault_args": flood,
                    "reset": True,
                },
                {"name": "kill", "prompts": Q, "fault": "kill", "fault_args": kill, "reset": True},
                {"name": "down", "prompts": Q, "fault": "none", "reset": True},
            ],
        },
        token=TOKENS["a"],
    )
    hit = phase(b, "hit")
    assert [o["num_cached_tokens"] for o in hit["outputs"]] == [Q_HIT_TOKENS] * 3
    loaded = hit["worker_stats"]["loaded_blocks"]
    assert loaded == hit["scheduler_stats"]["hit_blocks"] >= Q_HIT_TOKENS // BLOCK
    assert hit["worker_stats"]["load_error_blocks"] == 0
    assert same_outputs(hit["outputs"], want_q)
    # Read in layer ranges (one GET per request and range), taken by vLLM layer by layer.
    assert_layerwise_loads(hit)
    # The pool counted those hits (B's leases).
    assert hit["pool_hits_tokens"] - hits_before >= loaded * BLOCK

    # Wrong KV changes the output: the equality above is evidence, not a coincidence.
    corrupt = phase(b, "corrupt")
    assert corrupt["worker_stats"]["loaded_blocks"] > hit["worker_stats"]["loaded_blocks"]
    assert not same_outputs(corrupt["outputs"], want_q)

    # Evicted between lookup and lease: those blocks fail to load and are recomputed.
    evict = phase(b, "evict")
    stats = evict["scheduler_stats"]
    assert stats["lease_short_blocks"] > corrupt["scheduler_stats"]["lease_short_blocks"]
    assert evict["worker_stats"]["load_error_blocks"] > 0
    assert same_outputs(evict["outputs"], want_q)

    # The agent dies between lease and read: recomputed again.
    killed = phase(b, "kill")
    failed_before = evict["worker_stats"]["load_error_blocks"]
    assert killed["worker_stats"]["load_error_blocks"] > failed_before
    assert same_outputs(killed["outputs"], want_q)
    assert pool.agent.proc.wait(timeout=10) != 0

    # The pool is down: lookups fail fast, nothing is hit, outputs are unchanged.
    down = phase(b, "down")

    def unanswered(stats: dict[str, int]) -> int:
        return stats["lookup_errors"] + stats["lookups_skipped"]  # failed, or in back-off

    assert unanswered(down["scheduler_stats"]) > unanswered(killed["scheduler_stats"])
    assert down["outputs"][0]["num_cached_tokens"] == 0
    assert down["worker_stats"]["loaded_blocks"] == killed["worker_stats"]["loaded_blocks"]
    assert same_outputs(down["outputs"], want_q)


def test_engines_share_kv_through_a_same_node_agent(
    vllm_python: Path,
    model_dir: Path,
    baseline: dict[str, Any],
    tmp_path: Path,
    start_agent: Callable[..., AgentProcess],
) -> None:
    """``unix_socket`` instead of replicas: A's workers copy P's blocks into the agent's
    arena, a fresh engine B copies Q's prefix out of it (layer by layer), the schedulers ask
    over the same socket; B's outputs equal the baseline, and no KV byte crossed a socket."""
    sock_dir = Path(tempfile.mkdtemp(prefix="kvp-"))  # a socket path has at most 107 bytes
    (tmp_path / "pool").mkdir()
    own = start_pool(tmp_path / "pool", start_agent, unix_socket=str(sock_dir / "agent.sock"))
    same_node = {
        "module": "faulty",
        "class": "FaultyConnector",
        "extra": {"unix_socket": str(sock_dir / "agent.sock"), "lookup_timeout_s": 2.0},
    }

    def engine(name: str, phases: list[dict[str, Any]]) -> dict[str, Any]:
        spec = {
            "model": str(model_dir),
            "connector": same_node,
            "pool_metrics": f"{own.agent.url}/metrics",
            "phases": phases,
        }
        return run_engine(vllm_python, tmp_path, name, spec, token=TOKENS["a"])

    want_q = phase(baseline, "q")["outputs"]
    kill = {"replicas": [own.transfer], "pid": own.agent.proc.pid}
    try:
        store = phase(engine("A-same-node", [{"name": "store", "prompts": P}]), "store")
        assert same_outputs(store["outputs"], phase(baseline, "p")["outputs"])
        assert store["worker_stats"]["saved_blocks"] == 4 + 3 * 3
        assert store["worker_stats"]["save_errors"] == 0
        # The pool held none of P yet: at least the first prompt's miss was answered by the
        # agent's first-block table, with no round trip.
        assert store["scheduler_stats"]["lookups_local"] >= 1
        b = engine(
            "B-same-node",
            [
                {"name": "hit", "prompts": Q, "fault": "none"},
                {"name": "kill", "prompts": Q, "fault": "kill", "fault_args": kill, "reset": True},
                {"name": "down", "prompts": Q, "fault": "none", "reset": True},
            ],
        )
        hit = phase(b, "hit")
        assert [o["num_cached_tokens"] for o in hit["outputs"]] == [Q_HIT_TOKENS] * 3
        assert hit["scheduler_stats"]["lookups_local"] == 0  # Q's first blocks are P's
        assert hit["worker_stats"]["loaded_blocks"] == hit["scheduler_stats"]["hit_blocks"] > 0
        assert hit["worker_stats"]["load_error_blocks"] == 0
        assert same_outputs(hit["outputs"], want_q)
        assert_layerwise_loads(hit)
        # Stored and read through the mapped arena: the transfer port moved no KV.
        assert hit["pool_transfer_bytes"] == 0
        # The agent dies between lease and read: those blocks are recomputed.
        killed = phase(b, "kill")
        assert killed["worker_stats"]["load_error_blocks"] > 0
        assert same_outputs(killed["outputs"], want_q)
        assert own.agent.proc.wait(timeout=10) != 0
        # Down: the socket refuses, lookups answer 0 (and wait backoff_s before trying again).
        down = phase(b, "down")
        skipped = down["scheduler_stats"]["lookups_skipped"]
        assert skipped > killed["scheduler_stats"]["lookups_skipped"]
        assert down["outputs"][0]["num_cached_tokens"] == 0
        assert down["worker_stats"]["loaded_blocks"] == killed["worker_stats"]["loaded_blocks"]
        assert same_outputs(down["outputs"], want_q)
    finally:
        own.agent.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_a_pools_agent_on_this_node_is_reached_through_its_socket(
    vllm_python: Path,
    model_dir: Path,
    baseline: dict[str, Any],
    tmp_path: Path,
    start_agent: Callable[..., AgentProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``unix_socket`` beside ``replicas``: the agent behind the socket says it is pod
    ``localhost``, the ring member ``localhost:PORT``, so A stores and B loads its chains
    through the arena (its transfer port moves no KV) with the baseline's outputs. Named by
    address instead, the ring has no member of that pod: C goes over the transfer port."""
    sock_dir = Path(tempfile.mkdtemp(prefix="kvp-"))  # a socket path has at most 107 bytes
    (tmp_path / "pool").mkdir()
    monkeypatch.setenv("POD_NAME", "localhost")  # the agent's pod name (its AUTH reply)
    own = start_pool(tmp_path / "pool", start_agent, unix_socket=str(sock_dir / "agent.sock"))
    port = own.transfer.rsplit(":", 1)[1]

    def engine(name: str, ring: str, phases: list[dict[str, Any]]) -> dict[str, Any]:
        extra = {"replicas": [ring], "unix_socket": str(sock_dir / "agent.sock")}
        spec = {
            "model": str(model_dir),
            "connector": {"module": "faulty", "class": "FaultyConnector", "extra": extra},
            "pool_metrics": f"{own.agent.url}/metrics",
            "phases": phases,
        }
        return run_engine(vllm_python, tmp_path, name, spec, token=TOKENS["a"])

    want_q = phase(baseline, "q")["outputs"]
    try:
        by_name = f"localhost:{port}"
        store = phase(engine("A-node", by_name, [{"name": "store", "prompts": P}]), "store")
        assert store["worker_stats"]["saved_blocks"] == 4 + 3 * 3
        assert store["worker_stats"]["node_saved_blocks"] == 4 + 3 * 3  # all by the socket
        assert store["worker_stats"]["save_errors"] == 0
        hit = phase(engine("B-node", by_name, [{"name": "hit", "prompts": Q}]), "hit")
        assert [o["num_cached_tokens"] for o in hit["outputs"]] == [Q_HIT_TOKENS] * 3
        assert hit["worker_stats"]["loaded_blocks"] == hit["scheduler_stats"]["hit_blocks"] > 0
        assert same_outputs(hit["outputs"], want_q)
        assert hit["pool_transfer_bytes"] == 0  # stored and read through the arena
        assert hit["scheduler_stats"]["node_leases"] == hit["scheduler_stats"]["leases"] > 0
        by_address = phase(engine("C-node", own.transfer, [{"name": "hit", "prompts": Q}]), "hit")
        # B saved Q's own blocks as well: C hits every full block of Q but the last token's.
        whole = [(len(q) - 1) // BLOCK * BLOCK for q in Q]
        assert [o["num_cached_tokens"] for o in by_address["outputs"]] == whole
        assert same_outputs(by_address["outputs"], want_q)
        assert by_address["pool_transfer_bytes"] > 0  # the same blocks, over the transfer port
        assert by_address["scheduler_stats"]["node_leases"] == 0
        assert by_address["scheduler_stats"]["leases"] > 0
    finally:
        own.agent.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def assert_layerwise_loads(record: dict[str, Any]) -> None:
    worker, scheduler = record["worker_stats"], record["scheduler_stats"]
    assert worker["load_chunks"] == LAYERS * scheduler["leases"] > 0
    assert worker["load_chunk_errors"] == 0
    assert worker["layer_loads"] >= LAYERS
    assert worker["layer_loads"] % LAYERS == 0
    assert worker["layerwise_fallbacks"] == 0


def test_a_load_cut_between_layers_is_recomputed(
    vllm_python: Path,
    model_dir: Path,
    baseline: dict[str, Any],
    tmp_path: Path,
    start_agent: Callable[..., AgentProcess],
) -> None:
    """One engine stores P, then loads Q's prefix from the pool (vLLM's own cache reset before
    each phase): layer by layer; with its second layer zeroed and nothing reported (outputs
    change: the second layer's KV matters); with the agent killed once the first layer range
    landed (the second fails: recomputed, outputs equal the baseline)."""
    (tmp_path / "pool").mkdir()
    own = start_pool(tmp_path / "pool", start_agent)
    kill = {"replicas": [own.transfer], "pid": own.agent.proc.pid}
    try:
        run = run_engine(
            vllm_python,
            tmp_path,
            "layers",
            {
                "model": str(model_dir),
                "connector": connector(own),
                "phases": [
                    {"name": "store", "prompts": P, "fault": "none"},
                    {"name": "hit", "prompts": Q, "reset": True},
                    {"name": "drop", "prompts": Q, "fault": "drop-layer", "reset": True},
                    {
                        "name": "cut",
                        "prompts": Q,
                        "fault": "kill-mid",
                        "fault_args": kill,
                        "reset": True,
                    },
                ],
            },
            token=TOKENS["a"],
        )
    finally:
        own.agent.stop()
    want_q = phase(baseline, "q")["outputs"]
    store, hit = phase(run, "store"), phase(run, "hit")
    assert store["worker_stats"]["saved_blocks"] == 4 + 3 * 3
    assert store["worker_stats"]["layer_saves"] >= LAYERS
    assert hit["worker_stats"]["loaded_blocks"] >= Q_HIT_TOKENS // BLOCK
    assert_layerwise_loads(hit)
    assert same_outputs(hit["outputs"], want_q)

    # The second layer's loaded KV is read: zeroed, it changes the outputs.
    drop = phase(run, "drop")
    assert drop["worker_stats"]["loaded_blocks"] > hit["worker_stats"]["loaded_blocks"]
    assert drop["worker_stats"]["load_error_blocks"] == 0
    assert not same_outputs(drop["outputs"], want_q)

    # Cut after the first range: it landed, the second failed, every loaded block is recomputed.
    cut, before = phase(run, "cut"), drop

    def grew(name: str, side: str = "worker_stats") -> int:
        return int(cut[side][name] - before[side][name])

    leases = grew("leases", "scheduler_stats")
    assert leases > 0
    assert grew("load_chunks") == leases  # the first range of each load, not the second
    assert grew("load_chunk_errors") == leases
    assert grew("loaded_blocks") == 0
    assert grew("load_error_blocks") >= Q_HIT_TOKENS // BLOCK
    assert cut["worker_stats"]["layerwise_fallbacks"] == 0
    assert same_outputs(cut["outputs"], want_q)
    assert own.agent.proc.wait(timeout=10) != 0


def test_decode_blocks_are_saved_when_asked_and_a_next_turn_hits_them(
    vllm_python: Path,
    model_dir: Path,
    baseline: dict[str, Any],
    tmp_path: Path,
    start_agent: Callable[..., AgentProcess],
) -> None:
    (tmp_path / "pool").mkdir()
    own = start_pool(tmp_path / "pool", start_agent)
    try:
        # Two tenants of one agent: two disjoint namespaces, so the runs cannot see each other.
        results = {}
        for save_decode, tenant in ((False, "b"), (True, "a")):
            results[save_decode] = run_engine(
                vllm_python,
                tmp_path,
                f"decode-{save_decode}",
                {
                    "model": str(model_dir),
                    "connector": connector(own, save_decode=save_decode),
                    "phases": [
                        {"name": "r", "prompts": R, "max_tokens": R_GENERATED},
                        {"name": "r-next", "extend": R_NEXT, "reset": True},
                    ],
                },
                token=TOKENS[tenant],
            )
        want_r, want_next = phase(baseline, "r")["outputs"], phase(baseline, "r-next")["outputs"]
        plain, decode = results[False], results[True]
        # Without save_decode only R's 2 full prompt blocks reach the pool, and the next turn
        # (vLLM's own cache reset) finds only those.
        assert phase(plain, "r")["worker_stats"]["saved_blocks"] == 2
        assert phase(plain, "r-next")["outputs"][0]["num_cached_tokens"] == 2 * BLOCK
        # With it, the 2 blocks the answer filled follow the prompt's 2.
        assert phase(decode, "r")["worker_stats"]["saved_blocks"] == 4
        assert phase(decode, "r-next")["outputs"][0]["num_cached_tokens"] == 4 * BLOCK
        assert phase(decode, "r-next")["worker_stats"]["loaded_blocks"] == 4
        for run in (plain, decode):
            assert same_outputs(phase(run, "r")["outputs"], want_r)
            assert same_outputs(phase(run, "r-next")["outputs"], want_next)
    finally:
        own.agent.stop()


def test_a_request_turns_the_pool_off_for_itself(
    vllm_python: Path,
    model_dir: Path,
    baseline: dict[str, Any],
    tmp_path: Path,
    start_agent: Callable[..., AgentProcess],
) -> None:
    """``kv_transfer_params: {"kvpool": {...}}`` narrows what the pool does for one request:
    no save (the prompt never reaches the pool), no load (the pool's blocks are not used), a
    mistyped entry neither (fails closed); outputs are the baseline's every time."""
    (tmp_path / "pool").mkdir()
    own = start_pool(tmp_path / "pool", start_agent)
    try:
        run = run_engine(
            vllm_python,
            tmp_path,
            "per-request",
            {
                "model": str(model_dir),
                "connector": connector(own),
                "timeline": True,  # bench/vllm_stream.py --timeline's timing, checked below
                "phases": [
                    {"name": name, "prompts": P, "reset": True, "kv_transfer_params": params}
                    for name, params in (
                        ("private", {"kvpool": {"save": False}}),
                        ("typo", {"kvpool": {"sav": False}}),
                        ("stored", None),
                        ("no-load", {"kvpool": {"load": False}, "other_connector": 1}),
                        ("load", {"other_connector": 1}),
                    )
                ],
            },
            token=TOKENS["a"],
        )
        sched = {p["name"]: p["scheduler_stats"] for p in run["phases"]}
        worker = {p["name"]: p["worker_stats"] for p in run["phases"]}
        cached = {p["name"]: [o["num_cached_tokens"] for o in p["outputs"]] for p in run["phases"]}
        unique_blocks = 4 + 3 * (232 // BLOCK - 4)  # the shared prefix, then each its own
        # No save: looked up (it may load), nothing stored.
        assert sched["private"]["requests_without_save"] == len(P)
        assert sched["private"]["lookups"] == len(P)
        assert worker["private"]["saved_blocks"] == 0
        # A malformed entry: neither looked up nor stored.
        assert sched["typo"]["request_params_invalid"] == len(P)
        assert sched["typo"]["lookups"] == sched["private"]["lookups"]
        assert worker["typo"]["saved_blocks"] == 0
        # What vLLM's own cache gives within a batch (the prompts' shared prefix, once the
        # first computed it), with nothing from the pool: the pattern of a pool not used.
        local = cached["private"]
        assert local[0] == 0 and cached["typo"] == local
        # Without an entry the blocks go to the pool ...
        assert worker["stored"]["saved_blocks"] == unique_blocks
        # ... and a request that does not load does not use them (nor re-store them) ...
        assert sched["no-load"]["requests_without_load"] == len(P)
        assert cached["no-load"] == local
        assert sched["no-load"]["hit_blocks"] == sched["stored"]["hit_blocks"]
        assert worker["no-load"]["saved_blocks"] == unique_blocks
        # ... while the next one does (another connector's entry beside none of kvpool's).
        full = (232 - 1) // BLOCK * BLOCK
        assert cached["load"] == [full, full, full]
        assert worker["load"]["loaded_blocks"] > 0
        for p in run["phases"]:
            assert same_outputs(p["outputs"], phase(baseline, "p")["outputs"]), p["name"]
        # The runner's timeline (which changed none of the outputs above): every phase's
        # steps, and saves queued and sent only where the pool stores.
        tags = {p["name"]: [tag for tag, _ in p["timeline"]] for p in run["phases"]}
        for name, seen in tags.items():
            assert seen.count("step") >= seen.count("step_end") > 0, name
        assert not {"queued", "save", "save_end"} & set(tags["private"] + tags["typo"])
        stored = tags["stored"]
        assert stored.count("queued") == stored.count("save") == stored.count("save_end") > 0
    finally:
        own.agent.stop()
