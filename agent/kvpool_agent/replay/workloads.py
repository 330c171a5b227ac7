"""More kinds of workload, generated from documented parameters, to validate eviction on.

``kvpool trace generate KIND OUT`` writes one; each kind is a function of a ``WorkloadSpec``
(every field a flag, the same for every kind; a kind reads the ones it names) and a seed, so
one command gives one file, byte for byte, on any machine. Blocks are named by their content
*and* their prefix, as in the shared traces: a block's hash id is interned from (its parent's
id, its label) in order of first appearance, so equal ids mean equal prefixes.

Kinds (the committed files, ``bench/traces/*.jsonl``, are these with the defaults):

- ``agentic``: agent sessions with tool calls. Every session starts with one of ``prompts``
  long shared system prompts (``system_blocks``); each of its ``turns`` turns re-sends the
  whole session so far plus ``turn_blocks`` new blocks (the tool result and the next
  message). ``active`` sessions run at once, interleaved; a finished one is replaced.
- ``tenants``: a multi-tenant mix. ``tenants`` tenants, each with its own system prompt
  (``system_blocks``) and its own reuse rate, spread evenly from 0.9 down to 0.1: with that
  probability a request re-reads one of the tenant's last ``docs`` contexts (``doc_blocks``),
  otherwise it brings a new one; each request adds ``turn_blocks`` blocks of its own.
- ``rag``: RAG over shared documents. ``docs`` documents of ``doc_blocks`` blocks, picked by
  Zipf(``zipf``) popularity, after one shared system prompt, each request with its own
  ``turn_blocks``-block question.
- ``shift``: the mix shifts halfway: the first half of the requests is ``rag`` (a stable hot
  set, frequency-friendly), the second half ``agentic`` (recency-friendly), disjoint ids.
- ``phases``: adversarial, recency and frequency trading places every ``phase`` requests:
  ``rag`` phases and ``agentic`` phases alternate, each kind resuming where it stopped.
- ``scan``: adversarial, a ``rag`` workload cut every ``phase`` requests by a one-shot flood:
  ``flood`` requests of ``doc_blocks`` blocks each that never come back (a scan).
"""

from __future__ import annotations

import bisect
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

Labels = list[object]
"""A request as block labels, root first; the path of labels names each block's prefix."""


@dataclass(frozen=True)
class WorkloadSpec:
    """The parameters of every kind (each one a ``kvpool trace generate`` flag)."""

    requests: int = 1200
    block_size: int = 16
    prompts: int = 4
    system_blocks: int = 16
    sessions_active: int = 24
    turns: int = 6
    turn_blocks: int = 3
    tenants: int = 6
    docs: int = 200
    doc_blocks: int = 8
    zipf: float = 1.0
    phase: int = 200
    flood: int = 40
    output_length: int = 128
    rate: float = 10.0
    """Requests per second (mean of the exponential arrival gaps)."""
    seed: int = 0

    def check(self) -> None:
        for name in (
            "requests",
            "block_size",
            "prompts",
            "system_blocks",
            "sessions_active",
            "turns",
            "turn_blocks",
            "tenants",
            "docs",
            "doc_blocks",
            "phase",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.flood < 0 or self.output_length < 0 or self.zipf < 0:
            raise ValueError("flood, output_length and zipf must not be negative")
        if self.rate <= 0:
            raise ValueError(f"rate must be positive, got {self.rate}")


class _Ids:
    """Interns (parent id, label) -> hash id, numbered in order of first appearance."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, object], int] = {}

    def path(self, labels: Labels) -> list[int]:
        out: list[int] = []
        parent = -1
        for label in labels:
            key = (parent, label)
            found = self._ids.get(key)
            if found is None:
                found = self._ids[key] = len(self._ids)
            out.append(found)
            parent = found
        return out


def _agentic(spec: WorkloadSpec, rng: random.Random, tag: str = "a") -> Iterator[Labels]:
    fresh = 0
    sessions: list[tuple[int, Labels, int]] = []  # (session, labels so far, turns left)

    def start() -> tuple[int, Labels, int]:
        nonlocal fresh
        fresh += 1
        prompt = rng.randrange(spec.prompts)
        system: Labels = [(tag, "sys", prompt, i) for i in range(spec.system_blocks)]
        return (fresh, system, spec.turns)

    sessions = [start() for _ in range(spec.sessions_active)]
    turn = 0
    while True:
        slot = rng.randrange(len(sessions))
        session, labels, left = sessions[slot]
        turn += 1
        labels = labels + [(tag, "turn", session, turn, i) for i in range(spec.turn_blocks)]
        yield labels
        sessions[slot] = (session, labels, left - 1) if left > 1 else start()


def _zipf_picker(n: int, s: float, rng: random.Random) -> Callable[[], int]:
    weights = [1.0 / (rank + 1) ** s for rank in range(n)]
    cumulative: list[float] = []
    total = 0.0
    for w in weights:
        total += w
        cumulative.append(total)
    order = list(range(n))
    rng.shuffle(order)  # popularity unrelated to document number
    return lambda: order[min(n - 1, bisect.bisect_left(cumulative, rng.random() * total))]


def _rag(spec: WorkloadSpec, rng: random.Random, tag: str = "r") -> Iterator[Labels]:
    pick = _zipf_picker(spec.docs, spec.zipf, rng)
    system: Labels = [(tag, "sys", i) for i in range(spec.system_blocks)]
    question = 0
    while True:
        doc = pick()
        question += 1
        yield (
            system
            + [(tag, "doc", doc, i) for i in range(spec.doc_blocks)]
            + [(tag, "q", question, i) for i in range(spec.turn_blocks)]
        )


def _tenants(spec: WorkloadSpec, rng: random.Random) -> Iterator[Labels]:
    n = spec.tenants
    reuse = [0.9 - 0.8 * t / max(1, n - 1) for t in range(n)]
    recent: list[list[int]] = [[] for _ in range(n)]
    fresh = 0
    while True:
        tenant = rng.randrange(n)
        contexts = recent[tenant]
        if contexts and rng.random() < reuse[tenant]:
            context = rng.choice(contexts)
        else:
            fresh += 1
            context = fresh
            contexts.append(context)
            if len(contexts) > spec.docs:
                contexts.pop(0)
        yield (
            [("t", "sys", tenant, i) for i in range(spec.system_blocks)]
            + [("t", "ctx", context, i) for i in range(spec.doc_blocks)]
            + [("t", "own", fresh, rng.random(), i) for i in range(spec.turn_blocks)]
        )


def _alternate(
    first: Iterator[Labels], second: Iterator[Labels], phase: int, flood: int = 0
) -> Iterator[Labels]:
    while True:
        for _ in range(phase):
            yield next(first)
        for _ in range(flood or phase):
            yield next(second)


def _scans(spec: WorkloadSpec) -> Iterator[Labels]:
    scan = 0
    while True:
        scan += 1
        yield [("s", scan, i) for i in range(spec.doc_blocks)]


def _shift(spec: WorkloadSpec, rng: random.Random) -> Iterator[Labels]:
    half = spec.requests // 2
    rag = _rag(spec, rng)
    for _ in range(half):
        yield next(rag)
    yield from _agentic(spec, rng)


KINDS: dict[str, Callable[[WorkloadSpec, random.Random], Iterator[Labels]]] = {
    "agentic": _agentic,
    "tenants": _tenants,
    "rag": _rag,
    "shift": _shift,
    "phases": lambda spec, rng: _alternate(_rag(spec, rng), _agentic(spec, rng), spec.phase),
    "scan": lambda spec, rng: _alternate(_rag(spec, rng), _scans(spec), spec.phase, spec.flood),
}
"""Every kind ``kvpool trace generate`` writes, by name."""


def workload(kind: str, spec: WorkloadSpec) -> Iterator[dict[str, object]]:
    """The trace's lines (Mooncake JSON Lines records), in arrival order."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    spec.check()
    rng = random.Random(f"{kind}:{spec.seed}")
    ids = _Ids()
    clock_ms = 0.0
    requests = KINDS[kind](spec, rng)
    for _ in range(spec.requests):
        labels = next(requests)
        clock_ms += rng.expovariate(spec.rate) * 1000.0
        blocks = ids.path(labels)
        yield {
            "timestamp": round(clock_ms),
            "input_length": len(blocks) * spec.block_size,
            "output_length": spec.output_length,
            "hash_ids": blocks,
        }


def write_workload(kind: str, spec: WorkloadSpec, path: Path) -> int:
    """Write the trace to ``path``; returns the number of requests."""
    lines = [json.dumps(r, separators=(",", ":")) for r in workload(kind, spec)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


GENERATED_DIR = Path(__file__).resolve().parents[3] / "bench" / "traces"
"""Where the generated traces are committed, one per kind with the defaults:
``bench/traces/<kind>.jsonl``."""
