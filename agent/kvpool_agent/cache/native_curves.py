"""The compiled curves with the interface of the Python ones.

``kvpool_native.MissRatioCurve`` and ``kvpool_native.PolicyMiniature`` (``agent/native/src/
curves/``) reproduce ``mrc.MissRatioCurve`` and ``miniature.PolicyMiniature`` exactly: the
same sampling masks, counts, drops and warm-up, and snapshots equal to the last bit of every
float (``tests/native/test_curves.py``). The Python classes stay the specification and the
fallback; the classes here wrap the compiled ones so that whoever reads a curve (the
agent's ``/metrics`` and ``/v1/stats``, its housekeeping's ``drain``, the benchmarks) reads
either through the same attributes and methods.

A compiled curve is fed one of two ways. Made here, it is fed like the Python one
(``access``, ``access_nodes``, ``access_chain``, ...). ``attach``\\ ed to a
``kvpool_native.Engine`` (what ``native.NativeCore`` does with its own curves), it moves
into the engine, which feeds it on every request with no Python involved; the object
becomes a view of it (reads and ``drain`` go through the engine) until ``detach`` takes it
back.

What the compiled curves take is narrower than what Python's do: keys are 64-bit (the
engine's keys are), shifts at most 63, and parameters whose float arithmetic a ``float``
reproduces exactly. ``like`` says which Python curves have a compiled equivalent.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

from kvpool_agent.cache.block import TreeNode
from kvpool_agent.cache.miniature import (
    MAX_PENDING,
    MIN_BLOCKS,
    RATIOS,
    PolicyCurveSnapshot,
    PolicyMiniature,
    checked_ratios,
)
from kvpool_agent.cache.mrc import MAX_RATIO, MAX_SAMPLES, MIN_SHIFT, CurveSnapshot, MissRatioCurve

try:
    import kvpool_native
except ImportError:  # the compiled core is optional
    kvpool_native = None

MAX_SHIFT = 63
"""Largest sampling shift of a compiled curve (a 64-bit key mask)."""


def _native() -> Any:
    if kvpool_native is None:
        raise RuntimeError("the compiled curves need kvpool_native (pip install ./agent/native)")
    return kvpool_native


def _exact_float(value: float, name: str) -> float:
    """``value`` as a float that compares with every other float as ``value`` does."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}: an int or a float, got {value!r}")
    converted = float(value)
    if converted != value:
        raise ValueError(f"{name}: {value!r} has no exact float (the compiled curve needs one)")
    return converted


class CompiledSampler:
    """What a compiled curve and a compiled miniature share: the handle (``_raw``), the
    sampling (a key is sampled when ``key & mask == 0``, at ``rate = 2**-shift``) and a
    place in an engine, which feeds what it holds on every request."""

    __slots__ = ("_raw",)
    _raw: Any

    @property
    def capacity(self) -> int:
        return int(self._raw.capacity)

    @property
    def shift(self) -> int:
        return int(self._raw.shift)

    @property
    def rate(self) -> float:
        return float(self._raw.rate)

    @property
    def mask(self) -> int:
        """A key is sampled when ``key & mask == 0``."""
        return int(self._raw.mask)

    def access(self, key: int) -> None:
        """One accessed key (counted by a curve; a miniature queues it, when sampled, as a
        request of one block)."""
        self._raw.access(key)

    @property
    def attached(self) -> bool:
        """Whether an engine holds (and feeds) this one."""
        return bool(self._raw.attached)

    def attach(self, engine: Any) -> None:
        """Move this into ``engine`` (a ``kvpool_native.Engine`` holding none of its kind),
        which feeds it on every request from then on."""
        self._raw.attach(engine)

    def detach(self) -> None:
        """Take this back from its engine (no-op when not attached)."""
        self._raw.detach()

    def memory_bytes(self) -> int:
        return int(self._raw.memory_bytes())


class NativeMissRatioCurve(CompiledSampler):
    """``MissRatioCurve`` (``mrc.py``) compiled: the same constructor, feeding, ``snapshot``
    and ``len``."""

    __slots__ = ()

    def __init__(
        self,
        capacity: int,
        *,
        max_samples: int = MAX_SAMPLES,
        min_shift: int = MIN_SHIFT,
        max_ratio: float = MAX_RATIO,
    ) -> None:
        if min_shift < 0:
            raise ValueError("negative shift count")
        self._raw = _native().MissRatioCurve(
            max(int(capacity), 1),
            max_samples=_exact_float(max_samples, "max_samples"),
            min_shift=min_shift,
            max_ratio=float(max_ratio),
        )

    @classmethod
    def like(cls, curve: MissRatioCurve) -> NativeMissRatioCurve | None:
        """A compiled curve equal to ``curve`` (a ``MissRatioCurve`` never fed), or None:
        ``curve`` was fed, is a subclass, or has a shape the compiled curve does not take."""
        if kvpool_native is None or type(curve) is not MissRatioCurve:
            return None
        if curve._seen or curve._now or len(curve) or any(curve._counts):
            return None
        if not 0 <= curve.shift <= MAX_SHIFT or not 0 <= curve.capacity < 1 << 63:
            return None
        try:
            raw = kvpool_native.MissRatioCurve.shaped(curve.capacity, curve.shift, curve._limit)
        except (ValueError, OverflowError, TypeError):
            return None
        made = cls.__new__(cls)
        made._raw = raw
        return made

    # ------------------------------------------------------------------ feeding

    def access_nodes(self, nodes: Sequence[TreeNode]) -> None:
        """Record an access to each node's ``key``."""
        self._raw.access_keys([node.key for node in nodes])

    def access_sampled(self, count: int, keys: Sequence[int]) -> None:
        """``count`` accesses, of which ``keys`` (in order) are the sampled ones."""
        self._raw.access_sampled(count, list(keys))

    # ------------------------------------------------------------------ reading

    def snapshot(self, *, adjusted: bool = True) -> CurveSnapshot:
        """The estimated histogram (``MissRatioCurve.snapshot``)."""
        capacity, rate, cumulative, distance_sum = self._raw.snapshot(adjusted)
        return CurveSnapshot(
            capacity=capacity, rate=rate, cumulative=tuple(cumulative), distance_sum=distance_sum
        )

    def __len__(self) -> int:
        """Keys tracked now."""
        return len(self._raw)


class PendingKeys(Sequence[int]):
    """The keys a compiled miniature holds for ``drain``, oldest first: a read-only view
    (its length costs nothing; the keys are copied out when read)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def __len__(self) -> int:
        return int(self._raw.num_pending)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        keys: list[int] = self._raw.pending()
        return keys[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._raw.pending())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PendingKeys({list(self)!r})"


class NativePolicyMiniature(CompiledSampler):
    """``PolicyMiniature`` (``miniature.py``) compiled: the same constructor, feeding,
    ``drain``, ``snapshot`` and counters (``hits``, ``accesses``, ``dropped``, ``pending``)."""

    __slots__ = ("_min_blocks", "ratios")

    def __init__(
        self,
        policy: str,
        capacity: int,
        *,
        ratios: Iterable[float] = RATIOS,
        min_blocks: int = MIN_BLOCKS,
        max_pending: int = MAX_PENDING,
        shift: int | None = None,
    ) -> None:
        self.ratios = checked_ratios(policy, ratios)
        for r in self.ratios:
            _exact_float(r, "ratios")
        if isinstance(max_pending, bool) or not isinstance(max_pending, int):
            raise TypeError(f"max_pending: an int, got {max_pending!r}")
        self._min_blocks = min_blocks
        self._raw = _native().PolicyMiniature(
            policy,
            max(int(capacity), 1),
            ratios=[float(r) for r in self.ratios],
            min_blocks=_exact_float(min_blocks, "min_blocks"),
            max_pending=max_pending,
            shift=None if shift is None else max(shift, 0),
        )

    @classmethod
    def like(cls, mini: PolicyMiniature) -> NativePolicyMiniature | None:
        """A compiled miniature equal to ``mini`` (a ``PolicyMiniature`` never fed), or None:
        ``mini`` was fed, is a subclass, runs a policy the compiled core lacks, or has a
        shape the compiled miniature does not take."""
        if kvpool_native is None or type(mini) is not PolicyMiniature:
            return None
        if mini.pending or mini.dropped or mini.accesses or mini._seen or any(mini.hits):
            return None
        if mini.policy not in kvpool_native.POLICIES or not 0 <= mini.shift <= MAX_SHIFT:
            return None
        try:
            return cls(
                mini.policy,
                mini.capacity,
                ratios=mini.ratios,
                min_blocks=mini.min_blocks,
                max_pending=mini.max_pending,
                shift=mini.shift,
            )
        except (ValueError, OverflowError, TypeError):
            return None

    @property
    def policy(self) -> str:
        return str(self._raw.policy)

    @property
    def min_blocks(self) -> int:
        return self._min_blocks

    @property
    def max_pending(self) -> int:
        return int(self._raw.max_pending)

    @max_pending.setter
    def max_pending(self, value: int) -> None:
        self._raw.max_pending = value

    def sizes(self) -> list[int]:
        """Blocks in each miniature at the current rate."""
        return list(self._raw.sizes())

    @property
    def hits(self) -> list[int]:
        """Hits per ratio (a copy)."""
        return list(self._raw.hits)

    @property
    def accesses(self) -> int:
        return int(self._raw.accesses)

    @property
    def dropped(self) -> int:
        return int(self._raw.dropped)

    @property
    def pending(self) -> PendingKeys:
        """The sampled keys waiting for ``drain``, oldest first."""
        return PendingKeys(self._raw)

    # ------------------------------------------------------------------ feeding

    def access_chain(self, keys: Iterable[int]) -> None:
        """One request: the keys of its prompt's full blocks, root first; the sampled ones
        are queued as one chain."""
        self._raw.access_chain(list(keys))

    def queue_chain(self, sampled: Sequence[int]) -> None:
        """One request's sampled keys, root first."""
        self._raw.queue_chain(list(sampled))

    # ------------------------------------------------------------------ simulation

    def drain(self, limit: int | None = None) -> int:
        """Replay pending chains, oldest first, through every miniature: all when ``limit``
        is None, else until ``limit`` keys were (the last chain whole). Returns how many
        keys were replayed."""
        return int(self._raw.drain(limit))

    def snapshot(self) -> PolicyCurveSnapshot:
        policy, capacity, rate, _, hits, accesses, dropped = self._raw.snapshot()
        return PolicyCurveSnapshot(
            policy=policy,
            capacity=capacity,
            rate=rate,
            ratios=self.ratios,
            hits=tuple(hits),
            accesses=accesses,
            dropped=dropped,
        )


AnyMissRatioCurve = MissRatioCurve | NativeMissRatioCurve
"""A miss-ratio curve of either implementation."""
AnyPolicyMiniature = PolicyMiniature | NativePolicyMiniature
"""A policy curve of either implementation."""
