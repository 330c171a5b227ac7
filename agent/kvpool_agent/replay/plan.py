"""Capacity planning: the smallest pool that reaches a target hit rate on a trace.

Hit rate grows with capacity for the optimum and, up to small wobbles, for the online
policies, so a bracketing search finds the capacity: doubling until the target is met,
then bisection down to a relative tolerance. The optimum is cheap (seconds on millions of
blocks), so its search is exact; each probe of a policy is a full replay through the
engine, so that search stops at the tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpool_agent.config import KvCacheConfig, ModelGeometry


@dataclass(frozen=True, slots=True)
class CapacitySearch:
    """Outcome of a search: the capacity found (None if the target is out of reach)."""

    target: float
    capacity_blocks: int | None
    hit_rate: float | None
    """Hit rate at ``capacity_blocks``."""
    probes: int


def smallest_capacity(
    hit_rate_at: Callable[[int], float],
    target: float,
    max_blocks: int,
    *,
    min_blocks: int = 1,
    rel_tol: float = 0.0,
    max_rate: float | None = None,
) -> CapacitySearch:
    """Smallest capacity in ``min_blocks..max_blocks`` whose hit rate reaches ``target``.

    Assumes the hit rate grows with capacity. With ``rel_tol`` > 0 the answer may exceed
    the true smallest capacity by up to that share of the answer. ``max_blocks`` (all unique blocks)
    reaches the infinite-cache hit rate, ``max_rate`` when the caller knows it; a target
    above it is reported as out of reach.
    """
    probes = 0
    cache: dict[int, float] = {}
    if max_rate is not None:
        cache[max_blocks] = max_rate

    def rate(cap: int) -> float:
        nonlocal probes
        if cap not in cache:
            probes += 1
            cache[cap] = hit_rate_at(cap)
        return cache[cap]

    if rate(max_blocks) < target:
        return CapacitySearch(target, None, None, probes)
    low, high = min_blocks - 1, max_blocks  # rate(low) < target or low below range
    probe = max(1, min_blocks)
    while probe < max_blocks and rate(probe) < target:
        low = probe
        probe *= 2
    if probe < max_blocks:
        high = probe
    while high - low > 1 and (high - low) > rel_tol * high:
        mid = (low + high) // 2
        if rate(mid) >= target:
            high = mid
        else:
            low = mid
    return CapacitySearch(target, high, rate(high), probes)


def bytes_per_block(model: ModelGeometry, tokens_per_block: int) -> int:
    """Bytes one trace block takes in every pool of ``model`` (all layers, K and V)."""
    from kvpool_agent.cache.sizing import build_pools

    config = KvCacheConfig(tokens_per_block=tokens_per_block)
    _, groups, _ = build_pools(model, config)
    return sum(g.block_bytes for g in groups)


def parse_geometry(text: str) -> ModelGeometry:
    """A model geometry from a YAML/JSON file, or inline ``layers=32,kv_heads=8,head_dim=128``.

    Inline keys: ``layers``, ``kv_heads``, ``head_dim``, ``dtype`` (or the field names of
    ``ModelGeometry``). A file may hold the geometry itself or an agent config's ``model``.
    """
    from pathlib import Path

    import yaml
    from pydantic import ValidationError

    from kvpool_agent.config import ConfigError, format_validation_error

    path = Path(text)
    data: object
    if path.is_file():
        data = yaml.safe_load(path.read_text())
        if isinstance(data, dict) and "model" in data and isinstance(data["model"], dict):
            data = data["model"]
        source = str(path)
    else:
        aliases = {"layers": "num_layers", "kv_heads": "num_kv_heads"}
        fields: dict[str, object] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            if not sep:
                raise ConfigError(
                    f"--model: expected a geometry file or key=value pairs, got {part!r}"
                )
            name = aliases.get(name.strip(), name.strip())
            fields[name] = int(value) if value.strip().isdigit() else value.strip()
        data = fields
        source = "--model"
    try:
        return ModelGeometry.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None
