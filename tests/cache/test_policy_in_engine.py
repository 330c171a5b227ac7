"""The policies beyond LRU inside the real engine keep the reference's priority semantics."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool_agent.cache.manager import KVCacheManager
from kvpool_agent.config import KvCacheConfig
from kvpool_agent.replay.runner import REPLAY_MODEL

HIGH_FOR_A_SECOND: dict[str, Any] = {
    "token_range_retention_configs": [{"token_start": 0, "priority": 80, "duration_ms": 1000}]
}


def block(i: int) -> list[int]:
    return [4 * i + j for j in range(4)]


@pytest.mark.parametrize("policy", ["reuse-gap", "mixture"])
def test_priorities_order_eviction_and_expire(policy: str) -> None:
    now = [0.0]
    config = KvCacheConfig(tokens_per_block=4, eviction_policy=policy)
    manager = KVCacheManager.with_capacity(REPLAY_MODEL, config, num_blocks=2, clock=lambda: now[0])

    def run(tokens: list[int], retention: dict[str, Any] | None = None) -> int:
        handle = manager.open_sequence(tokens, retention=retention, recompute_last_token=False)
        manager.release(handle.seq_id)
        return handle.num_reused_tokens

    run(block(1), HIGH_FOR_A_SECOND)  # A: kept at priority 80 for one second
    for _ in range(5):
        run(block(2))  # B: hot, default priority
    run(block(3))  # C needs room: B goes, although the policy alone would keep it
    assert run(block(1)) == 4  # A survived
    assert run(block(2)) == 0  # B was evicted (and is back now)

    now[0] = 5.0  # A's priority has expired: it competes at the default level
    for _ in range(5):
        run(block(2))
    run(block(4))
    assert run(block(2)) == 4  # the hot block stays
