"""Workload traces with prefix structure (the Mooncake JSON Lines format).

One request per line, in arrival order:
``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``.
Equal hash ids mean equal block content and equal prefix, so a request can reuse the
longest run of its leading blocks that are still cached. The block size is not in the file;
it is the power of two ``B`` for which ``len(hash_ids) == ceil(input_length / B)`` holds on
every line (or given explicitly when the lines do not pin it down).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvpool_agent.config import ConfigError


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: its prompt blocks (hash ids, in order) and its lengths."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Trace:
    """A whole trace in arrival order, with the block size its lines imply."""

    name: str
    block_size: int
    requests: tuple[TraceRequest, ...]

    @property
    def total_blocks(self) -> int:
        return sum(len(r.hash_ids) for r in self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    def unique_blocks(self) -> int:
        """Distinct blocks; ids are prefix-unique, so this is the number of distinct ids."""
        seen: set[int] = set()
        for r in self.requests:
            seen.update(r.hash_ids)
        return len(seen)

    def head(self, limit: int | None) -> Trace:
        """The first ``limit`` requests (all of them when ``limit`` is None)."""
        if limit is None or limit >= len(self.requests):
            return self
        return Trace(self.name, self.block_size, self.requests[:limit])

    def capacity_blocks(self, fraction: float) -> int:
        """A capacity given as a share of the unique blocks, rounded, at least one block."""
        if not fraction > 0.0:
            raise ConfigError(f"capacity fraction must be positive, got {fraction}")
        return max(1, round(fraction * self.unique_blocks()))


def load_trace(path: str | Path, block_size: int | None = None) -> Trace:
    """Read a trace file; raises ConfigError naming the line and field that is wrong."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read trace {path}: {err.strerror}") from None
    requests: list[TraceRequest] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        requests.append(_parse_line(path, lineno, line))
    if not requests:
        raise ConfigError(f"trace {path} holds no requests")
    size = block_size if block_size is not None else infer_block_size(requests, path)
    return Trace(path.stem, size, tuple(requests))


def _parse_line(path: Path, lineno: int, line: str) -> TraceRequest:
    where = f"trace {path} line {lineno}"
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected an object, got {type(raw).__name__}")
    ids = raw.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(h, int) for h in ids):
        raise ConfigError(f"{where}: hash_ids must be a list of integers")
    length = raw.get("input_length")
    if not isinstance(length, int) or length < 0:
        raise ConfigError(f"{where}: input_length must be a non-negative integer")
    out = raw.get("output_length", 0)
    if not isinstance(out, int) or out < 0:
        raise ConfigError(f"{where}: output_length must be a non-negative integer")
    stamp = raw.get("timestamp", 0)
    if not isinstance(stamp, int | float):
        raise ConfigError(f"{where}: timestamp must be a number")
    return TraceRequest(float(stamp), length, out, tuple(ids))


def infer_block_size(requests: tuple[TraceRequest, ...] | list[TraceRequest], path: Path) -> int:
    """The power of two ``B`` for which ``len(hash_ids)`` is ``ceil`` or ``floor`` of
    ``input_length / B`` on the most lines (the smallest such ``B`` on a tie).

    Traces differ on whether a trailing partial block gets an id (the Mooncake trace counts
    it, the multi-round QA trace does not), so both readings are accepted.
    """
    best, best_fits = 0, -1
    for shift in range(1, 21):
        size = 1 << shift
        fits = 0
        for r in requests:
            n = len(r.hash_ids)
            if n in (-(-r.input_length // size), r.input_length // size):
                fits += 1
        if fits > best_fits:
            best, best_fits = size, fits
    if best_fits * 2 < len(requests):
        raise ConfigError(
            f"trace {path}: no power-of-two block size fits most lines "
            f"(best {best} fits {best_fits} of {len(requests)}); pass the block size explicitly"
        )
    return best


class HitRates:
    """Block and token hit rates of a replay (hits over queries), shared by the in-process
    replay and the HTTP drive so both report the same figures the same way."""

    query_blocks: int
    hit_blocks: int
    query_tokens: int
    hit_tokens: int

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
