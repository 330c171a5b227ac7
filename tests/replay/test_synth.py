"""The trace the repository ships is the generator's output, and the generator's shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool_agent.replay.synth import SAMPLE_TRACE, SharedPrefixSpec, write_trace
from kvpool_agent.traces import load_trace
from kvpool_cli import main


def test_the_shipped_trace_is_what_kvpool_trace_synth_writes(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["trace", "synth", str(out)]) == 0
    assert out.read_bytes() == SAMPLE_TRACE.read_bytes()


def test_the_default_shape_is_64_groups_of_16_with_shared_prompts() -> None:
    trace = load_trace(SAMPLE_TRACE)
    assert trace.block_size == 16 and len(trace.requests) == 1024
    assert trace.unique_blocks() == 64 * 128 + 1024 * 8
    assert trace.total_blocks == 1024 * 136
    heads = {r.hash_ids[:128] for r in trace.requests}
    assert len(heads) == 64  # one system prompt per group
    times = [r.timestamp_ms for r in trace.requests]
    assert times == sorted(times)


def test_a_seed_decides_the_order_and_nothing_else_does(tmp_path: Path) -> None:
    spec = SharedPrefixSpec(groups=4, requests_per_group=3, prefix_blocks=2, suffix_blocks=1)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    write_trace(spec, a)
    write_trace(spec, b)
    write_trace(SharedPrefixSpec(**{**spec.__dict__, "seed": 1}), c)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("flag", ["--groups=0", "--rate=0", "--suffix-blocks=-1"])
def test_bad_parameters_exit_2_naming_them(
    tmp_path: Path, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["trace", "synth", str(out), flag]) == 2
    name = flag.split("=")[0].lstrip("-").replace("-", "_")
    assert name in capsys.readouterr().err
    assert not out.exists()
