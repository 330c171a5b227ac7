"""The seam between the façade and the request-level core (``cache/core.py``)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from cache_helpers import make_manager, write_kv

from kvpool_agent.cache import OutOfBlocksError
from kvpool_agent.cache import manager as manager_mod
from kvpool_agent.cache.block import PRIMARY, SECONDARY
from kvpool_agent.cache.core import CacheCore, CopyOp, CoreLayout, CoreSettings, TierLayout
from kvpool_agent.cache.retention import DEFAULT_RETENTION

# The Python core's own seam (the compiled core is held to it by test_differential.py).
pytestmark = pytest.mark.python_core


def test_the_core_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "import kvpool_agent.cache.core\n"
        "assert 'torch' not in sys.modules, 'the core must stay torch-free'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _core(blocks: int = 8, host: int = 0) -> CacheCore:
    """A core of one full-attention group, built from plain numbers."""

    def tier(n: int) -> TierLayout:
        return TierLayout(n * 64, 1 if n else 0, (1 if n else 0,), (n,))

    layout = CoreLayout(
        tokens_per_block=4,
        windows=(1 << 62,),
        full_attention=(True,),
        block_bytes=(64,),
        tiers=(tier(blocks), tier(host)),
    )
    settings = CoreSettings(
        enable_block_reuse=True,
        enable_partial_reuse=True,
        copy_on_partial_reuse=True,
        secondary_offload_min_priority=35,
        eviction_policy="lru",
        event_buffer_max_size=100,
    )
    return CacheCore(layout, settings)


def test_the_core_runs_on_plain_data_and_returns_its_copies_in_order() -> None:
    core = _core(blocks=4, host=4)
    first = list(range(100, 116))  # 4 full blocks: the whole primary tier
    view = core.open(first, None, 0, DEFAULT_RETENTION, False, now=1.0)
    assert view.num_reused_tokens == 0 and view.tables == ((0, 1, 2, 3),)
    core.release(view.seq_id, False, now=1.0)
    assert core.take_copies() == []
    other = core.open([7] * 12, None, 0, DEFAULT_RETENTION, False, now=2.0)
    # Three leaves went to the host tier, deepest first, in one batched copy.
    assert core.take_copies() == [CopyOp(0, PRIMARY, SECONDARY, (3, 2, 1), (0, 1, 2))]
    assert core.take_copies() == []  # taken once
    core.release(other.seq_id, False, now=2.0)
    assert core.lookup(first, 0) == [PRIMARY, SECONDARY, SECONDARY, SECONDARY]
    again = core.open(first, None, 0, DEFAULT_RETENTION, False, now=3.0)
    assert again.num_reused_tokens == 16
    copies = core.take_copies()
    # Making room offloads the other sequence's blocks before the onboard reads its own.
    assert [(op.src_tier, op.dst_tier) for op in copies] == [
        (PRIMARY, SECONDARY),
        (SECONDARY, PRIMARY),
    ]


def test_copies_recorded_before_an_error_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = make_manager(4, host_blocks=4)
    ran: list[tuple[int, list[int], list[int]]] = []
    monkeypatch.setattr(
        manager_mod,
        "copy_group_blocks",
        lambda plan, g, src, dst, src_ids, dst_ids: ran.append((g, src_ids, dst_ids)),
    )

    def failing(*args: Any) -> Any:
        mgr._core.tiers.copies.append(CopyOp(0, PRIMARY, SECONDARY, (1, 2), (0, 3)))
        raise OutOfBlocksError("no block left")

    monkeypatch.setattr(mgr._core, "open", failing)
    with pytest.raises(OutOfBlocksError):
        mgr.open_sequence([1, 2, 3])
    assert ran == [(0, [1, 2], [0, 3])]


def test_the_facade_reads_the_clock_once_per_call() -> None:
    reads = []

    def clock() -> float:
        reads.append(1)
        return 5.0

    mgr = make_manager(4, host_blocks=4, clock=clock)
    tokens = list(range(40, 56))
    h = mgr.open_sequence(tokens)
    write_kv(mgr, h, tokens)
    mgr.release(h.seq_id)
    reads.clear()
    mgr.open_sequence([9] * 12)  # evicts (offloads) in the middle of the call
    assert mgr.stats.offloads == 3
    assert len(reads) == 1
