"""The pool client: rendezvous hashing keeps prefixes together and moves only a fair share."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_agent.client import PoolClient, affinity_key, rendezvous_rank, stable_url

REPLICAS = [f"http://kvpool-{i}.kvpool:8000" for i in range(5)]


def keys(n: int) -> list[bytes]:
    rng = random.Random(0)
    return [affinity_key([rng.randrange(50_000) for _ in range(64)], 16, 4) for _ in range(n)]


def test_sequences_sharing_leading_blocks_go_to_the_same_replica() -> None:
    pc = PoolClient(REPLICAS, tokens_per_block=4, affinity_blocks=2)
    prefix = [5, 6, 7, 8, 9, 10, 11, 12]
    homes = {pc.replica_for(prefix + [i, i + 1, i + 2]) for i in range(50)}
    assert len(homes) == 1
    salts = {pc.replica_for(prefix, cache_salt=str(s)) for s in range(40)}
    assert len(salts) > 1  # the salt is part of the key


def test_load_spreads_evenly() -> None:
    counts = dict.fromkeys(REPLICAS, 0)
    for k in keys(5000):
        counts[rendezvous_rank(k, REPLICAS)[0]] += 1
    assert min(counts.values()) > 5000 / 5 * 0.85


def test_adding_a_replica_moves_only_its_share_and_removing_moves_only_its_keys() -> None:
    ks = keys(4000)
    before = {k: rendezvous_rank(k, REPLICAS)[0] for k in ks}
    grown = [*REPLICAS, "http://kvpool-5.kvpool:8000"]
    after = {k: rendezvous_rank(k, grown)[0] for k in ks}
    moved = [k for k in ks if before[k] != after[k]]
    assert all(after[k] == grown[-1] for k in moved)
    assert abs(len(moved) / len(ks) - 1 / 6) < 0.03
    shrunk = [r for r in REPLICAS if r != REPLICAS[2]]
    gone = {k: rendezvous_rank(k, shrunk)[0] for k in ks}
    assert all(gone[k] == before[k] for k in ks if before[k] != REPLICAS[2])


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(0, 2**31), min_size=1, max_size=80),
    st.sets(st.text(min_size=1, max_size=12), min_size=1, max_size=8),
)
def test_ranking_is_a_permutation_independent_of_list_order(
    toks: list[int], names: set[str]
) -> None:
    k = affinity_key(toks, 4, 4)
    ranked = rendezvous_rank(k, sorted(names))
    assert sorted(ranked) == sorted(names)
    assert rendezvous_rank(k, sorted(names, reverse=True)) == ranked


def fake_agents(seen: list[str], draining: set[str]) -> httpx.Client:
    """An HTTP client whose every host answers like an agent (503 from ``draining`` hosts);
    ``seen`` records the base URL of each request."""

    def handler(request: httpx.Request) -> httpx.Response:
        host = f"http://{request.url.host}:{request.url.port}"
        seen.append(host)
        if request.method == "POST" and host in draining:
            return httpx.Response(503, json={"detail": "draining"})
        if request.method == "POST":
            body = json.loads(request.content)
            return httpx.Response(
                201,
                json={
                    "seq_id": 1,
                    "num_tokens": len(body["tokens"]),
                    "num_reused_tokens": 0,
                    "block_tables": [[0]],
                    "first_token": [0],
                    "tokens_per_block": 4,
                    "last_page_len": 1,
                },
            )
        return httpx.Response(204)

    return httpx.Client(transport=httpx.MockTransport(handler))


def test_client_fails_over_to_the_next_ranked_replica_on_503() -> None:
    seen: list[str] = []
    draining: set[str] = set()
    http = fake_agents(seen, draining)
    pc = PoolClient(REPLICAS, tokens_per_block=4, client=http)
    toks = list(range(20))
    ranked = pc.ranking(toks)
    draining.add(ranked[0])
    seq = pc.open(toks)
    assert seq.replica == ranked[1] and seen == ranked[:2]
    pc.release(seq)
    assert seen[-1] == ranked[1]
    pc.remove_replica(ranked[1])
    draining.clear()
    assert pc.open(toks).replica == ranked[0]
    with pytest.raises(ValueError, match="replicas"):
        PoolClient([], tokens_per_block=4)


def test_replicas_are_ranked_by_name_and_reached_at_their_address() -> None:
    """Pods ranked by their stable names (as the agents rank them for warm handoff) are
    reached at their IPs; a pod back under the same name at a new IP keeps its prefixes."""
    names = [stable_url(f"kvp-{i}", "kvp", "ns", 8000) for i in range(3)]
    assert names[0] == "http://kvp-0.kvp.ns.svc:8000"
    ips = {n: f"http://10.0.0.{i + 1}:8000" for i, n in enumerate(names)}
    seen: list[str] = []
    pc = PoolClient(names, tokens_per_block=4, client=fake_agents(seen, set()), addresses=ips)
    toks = list(range(20))
    owner = pc.ranking(toks)[0]
    assert pc.ranking(toks) == rendezvous_rank(affinity_key(toks, 4, 4), names)
    seq = pc.open(toks)
    pc.append(seq, [1, 2, 3])
    pc.release(seq)
    assert seq.replica == owner and seen == [ips[owner]] * 3
    pc.remove_replica(owner)
    pc.add_replica(owner, "http://10.0.0.9:8000/")  # the replacement pod, a new IP
    assert pc.replica_for(toks) == owner and pc.open(toks).replica == owner
    assert seen[-1] == "http://10.0.0.9:8000"
    unmapped = PoolClient(["http://127.0.0.5:8000"], tokens_per_block=4)
    assert unmapped.url("http://127.0.0.5:8000") == "http://127.0.0.5:8000"
