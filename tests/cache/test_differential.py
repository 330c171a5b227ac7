"""The engine against the golden file of the differential harness (``differential.py``).

The golden file holds, per seeded script, the digest of everything the engine let a client
observe, recorded from the engine before ``cache/manager.py`` was split into the façade and
the request-level core. A refactor must leave every digest as it is; re-recording is for an
intended behaviour change only (see ``differential.py``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import differential as d
import pytest

from kvpool_agent.cache import KVCacheManager

GOLDEN = d.load_golden()


def test_the_golden_file_covers_every_seed() -> None:
    assert sorted(map(int, GOLDEN["scripts"])) == list(range(d.NUM_SCRIPTS))
    assert GOLDEN["op_digest_chars"] == d.OP_DIGEST_CHARS


@pytest.mark.parametrize("seed", range(d.NUM_SCRIPTS))
def test_a_script_records_what_the_golden_file_holds(seed: int) -> None:
    why = d.check_against_golden(seed, GOLDEN)
    assert why is None, why


@pytest.mark.parametrize("seed", range(8))
def test_the_cores_agree_on_blocks_longer_than_a_head_row(seed: int) -> None:
    """Blocks of 32 tokens: past the compiled core's 16-token head row, about half of them
    end in 0s (no tail row kept, as for the data plane's blocks), the others keep a tail row
    that is freed and reused as blocks are evicted. The golden file's blocks are 16 tokens at
    most, so only this comparison reaches the tail rows."""
    pytest.importorskip("kvpool_native")
    script = d.random_script(10_000 + seed, tpb=2 * d.HEAD_TOKENS)
    assert script.engine.config["tokens_per_block"] == 32
    found = d.compare(
        partial(d.build_manager, core="native"), partial(d.build_manager, core="python"), script
    )
    assert found is None, found


def test_compare_agrees_with_itself_and_finds_the_first_difference() -> None:
    script = d.random_script(7, num_ops=80)
    assert d.compare(d.build_manager, d.build_manager, script) is None

    class Blind(KVCacheManager):
        def lookup(self, tokens: Any, **kwargs: Any) -> list[str]:
            super().lookup(tokens, **kwargs)
            return ["nowhere"]

    def blind(spec: d.EngineSpec, clock: d.Clock) -> KVCacheManager:
        mgr = d.build_manager(spec, clock)
        mgr.__class__ = Blind
        return mgr

    found = d.compare(d.build_manager, blind, script)
    assert found is not None
    first = next(i for i, op in enumerate(script.ops) if op["op"] == "lookup")
    assert found.index == first + 1 and found.op == script.ops[first]
    assert found.path.startswith(".result")
