"""The default eviction policy's bound against LRU (the vote, ``vote.py``, registered as
``mixture``; and the default before it, ``guarded.py``), its selector before it, and the
generated validation workloads (``workloads.py``, committed in ``bench/traces``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_agent import config as config_module
from kvpool_agent.cache.eviction import POLICIES
from kvpool_agent.cache.eviction.guarded import MARGIN, GuardedPolicy
from kvpool_agent.config import KvCacheConfig
from kvpool_agent.replay.runner import ReplayResult, replay
from kvpool_agent.replay.workloads import GENERATED_DIR, KINDS, WorkloadSpec, workload
from kvpool_agent.traces import load_trace
from kvpool_cli import main

# -- the generated workloads


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_committed_trace_is_what_kvpool_trace_generate_writes(
    kind: str, tmp_path: Path
) -> None:
    committed = GENERATED_DIR / f"{kind}.jsonl"
    out = tmp_path / f"{kind}.jsonl"
    assert main(["trace", "generate", kind, str(out)]) == 0
    assert out.read_bytes() == committed.read_bytes()
    assert committed.stat().st_size < 300_000


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_generated_trace_is_prefix_consistent(kind: str) -> None:
    """Each id has one parent, and a trace's lengths agree with its blocks."""
    parent: dict[int, int] = {}
    for row in workload(kind, WorkloadSpec(requests=300, seed=3)):
        ids = row["hash_ids"]
        assert isinstance(ids, list) and ids
        assert row["input_length"] == 16 * len(ids)
        for before, block in zip([-1, *ids], ids, strict=False):
            assert parent.setdefault(block, before) == before


def test_generate_rejects_bad_parameters(tmp_path: Path) -> None:
    assert main(["trace", "generate", "rag", str(tmp_path / "x"), "--docs", "0"]) == 2


def test_a_seed_changes_the_trace_and_fixes_it() -> None:
    a = list(workload("tenants", WorkloadSpec(requests=50, seed=1)))
    assert a == list(workload("tenants", WorkloadSpec(requests=50, seed=1)))
    assert a != list(workload("tenants", WorkloadSpec(requests=50, seed=2)))


# -- the selector


def test_the_guarded_mixture_starts_with_lru_leading() -> None:
    policy = GuardedPolicy(8)
    assert policy.names[0] == "lru" and policy.leader == 0


def test_a_tie_or_a_small_lead_does_not_move_the_leader() -> None:
    """Hysteresis: a challenger must beat the leader's score by the factor ``1 + hysteresis``."""
    policy = GuardedPolicy(8)
    policy.scores = [10.0, 10.0 * (1 + policy.hysteresis) - 0.01, 0.0, 0.0]
    policy.observe([])  # no request: nothing moves
    assert policy.leader == 0
    policy.observe([1, 2])  # every expert misses alike: scores keep their order
    policy.observe([3])
    assert policy.leader == 0 and policy.switches == 0


ADVERSARIAL: list[tuple[str, dict[str, object]]] = [
    ("phases", {}),  # recency <-> frequency every 200 requests
    ("phases", {"phase": 40, "requests": 800}),  # short phases: switching costs most
    ("scan", {}),  # a hot set cut by one-shot scans
    ("scan", {"flood": 150, "phase": 60, "requests": 800}),  # long one-shot floods
    ("shift", {}),  # frequency-friendly, then recency-friendly
    ("agentic", {"requests": 800}),  # recency is right: LRU is the leader to keep
]


def against_lru(
    kind: str, changes: dict[str, object], fraction: float, policy: str, tmp_path: Path
) -> tuple[ReplayResult, ReplayResult]:
    """LRU's replay and ``policy``'s of a generated workload, at ``fraction`` of its unique
    blocks (at least one request more than the longest)."""
    path = tmp_path / "t.jsonl"
    spec = WorkloadSpec(**changes)  # type: ignore[arg-type]
    path.write_text("\n".join(json.dumps(r) for r in workload(kind, spec)) + "\n")
    trace = load_trace(path)
    longest = max(len(r.hash_ids) for r in trace.requests)
    cap = max(trace.capacity_blocks(fraction), longest + 1)
    return replay(trace, cap, "lru"), replay(trace, cap, policy)


@pytest.mark.parametrize(("kind", "changes"), ADVERSARIAL)
@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.25])
@pytest.mark.parametrize("policy", [KvCacheConfig().eviction_policy, "guarded"])
def test_the_default_is_never_below_lru_by_more_than_the_stated_margin(
    kind: str,
    changes: dict[str, object],
    fraction: float,
    policy: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default, and the default before it (a bench series, registered here)."""
    monkeypatch.setitem(POLICIES, "guarded", GuardedPolicy)
    monkeypatch.setattr(
        config_module, "EVICTION_POLICIES", (*config_module.EVICTION_POLICIES, "guarded")
    )
    lru, default = against_lru(kind, changes, fraction, policy, tmp_path)
    assert default.hit_blocks >= lru.hit_blocks - MARGIN * lru.query_blocks
    assert default.hit_blocks > 0
