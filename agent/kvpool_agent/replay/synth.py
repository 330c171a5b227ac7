"""Deterministic workload traces with shared prefixes, so the repository carries its own.

``shared_prefix_trace`` builds the "generated shared prefix" pattern: ``groups`` system
prompts of ``prefix_blocks`` blocks each, and ``requests_per_group`` requests per group that
append ``suffix_blocks`` blocks of their own. Requests of all groups arrive interleaved, in an
order drawn from ``seed``, with exponential gaps at ``rate`` requests per second. Hash ids are
numbered as they first appear, so one seed gives one file, byte for byte, on any machine.

With the defaults it has the shape of ``gsp_default_bs16.jsonl`` in the shared traces (64
groups x 16 requests, 128 + 8 blocks of 16 tokens): 1,024 requests, 16,384 unique of 139,264
blocks, 88.24% hit rate with an unbounded cache.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SharedPrefixSpec:
    """The parameters of a shared-prefix trace (each one a ``kvpool trace synth`` flag)."""

    groups: int = 64
    requests_per_group: int = 16
    prefix_blocks: int = 128
    suffix_blocks: int = 8
    block_size: int = 16
    output_length: int = 256
    rate: float = 10.0
    """Requests per second (mean of the exponential arrival gaps)."""
    seed: int = 0

    def check(self) -> None:
        for name in ("groups", "requests_per_group", "prefix_blocks", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.suffix_blocks < 0 or self.output_length < 0:
            raise ValueError("suffix_blocks and output_length must not be negative")
        if self.rate <= 0:
            raise ValueError(f"rate must be positive, got {self.rate}")


def shared_prefix_trace(spec: SharedPrefixSpec) -> Iterator[dict[str, object]]:
    """The trace's lines (Mooncake JSON Lines records), in arrival order."""
    spec.check()
    rng = random.Random(spec.seed)
    order = [g for g in range(spec.groups) for _ in range(spec.requests_per_group)]
    rng.shuffle(order)
    next_id = 0
    prefixes: dict[int, list[int]] = {}
    clock_ms = 0.0
    for group in order:
        prefix = prefixes.get(group)
        if prefix is None:
            prefix = list(range(next_id, next_id + spec.prefix_blocks))
            next_id += spec.prefix_blocks
            prefixes[group] = prefix
        suffix = list(range(next_id, next_id + spec.suffix_blocks))
        next_id += spec.suffix_blocks
        clock_ms += rng.expovariate(spec.rate) * 1000.0
        blocks = prefix + suffix
        yield {
            "timestamp": round(clock_ms),
            "input_length": len(blocks) * spec.block_size,
            "output_length": spec.output_length,
            "hash_ids": blocks,
        }


def write_trace(spec: SharedPrefixSpec, path: Path) -> int:
    """Write the trace to ``path``; returns the number of requests."""
    lines = [json.dumps(r, separators=(",", ":")) for r in shared_prefix_trace(spec)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


SAMPLE_TRACE = Path(__file__).resolve().parents[3] / "examples" / "traces" / "gsp_64g_bs16.jsonl"
"""The trace the repository ships (``SharedPrefixSpec()``): the demo's, the README's and the
end-to-end tests' workload. ``KVPOOL_TRACES`` points them at the larger shared traces instead."""
