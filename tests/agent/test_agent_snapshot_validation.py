"""Snapshots are untrusted: the whole document is checked before anything is imported.

Engine-level (no HTTP): a damaged, hostile or odd snapshot is refused with a SnapshotError
naming the record and field, quickly, and leaves the engine exactly as it was.
"""

from __future__ import annotations

import copy
import signal
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool_agent.cache import KVCacheManager, KvCacheRetentionConfig
from kvpool_agent.cache.sequences import namespace_of as _namespace
from kvpool_agent.server import snapshot as snap
from kvpool_agent.server.payload import encode_tensor
from kvpool_agent.server.snapshot import (
    SnapshotError,
    SnapshotGeometryError,
    export_snapshot,
    import_snapshot,
)

from .conftest import TPB, small_config

SALT, EXTRA = "tenant-a", ("lora", 7)
HEADER = struct.Struct("<4sHIQ")


# --------------------------------------------------------------------------- helpers


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail (TimeoutError) instead of hanging; pytest-timeout's own timer is restored."""

    def fire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"took more than {seconds}s")

    old_handler = signal.signal(signal.SIGALRM, fire)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:
            left = max(old_delay - (time.monotonic() - start), 0.001)
            signal.setitimer(signal.ITIMER_REAL, left, old_interval)


def new_engine(**overrides: Any) -> KVCacheManager:
    return KVCacheManager.from_agent_config(small_config(**overrides))


def fill(
    engine: KVCacheManager,
    prompts: list[list[int]],
    *,
    salt: str | None = None,
    extra: tuple[int | str, ...] = (),
    priority: int | None = None,
) -> None:
    """Open, write distinct KV for, and release each prompt."""
    view = engine.pool_view(0)
    retention = (
        KvCacheRetentionConfig.model_validate(
            {"token_range_retention_configs": [{"priority": priority}]}
        )
        if priority is not None
        else None
    )
    for i, toks in enumerate(prompts):
        h = engine.open_sequence(
            toks, cache_salt=salt, extra_keys=extra, retention=retention, recompute_last_token=False
        )
        ids = list(h.block_tables[0])
        kv = torch.full((view.shape[0], len(ids), *view.shape[2:]), float(i + 1))
        kv += torch.arange(len(ids)).view(1, len(ids), 1, 1, 1, 1)
        view[:, ids] = kv
        engine.release(h.seq_id)


def source_blob() -> bytes:
    """A valid snapshot: an unsalted chain and a salted one (extra keys too), 3 blocks each."""
    src = new_engine()
    fill(src, [list(range(3 * TPB))])
    fill(src, [list(range(100, 100 + 3 * TPB))], salt=SALT, extra=EXTRA, priority=80)
    return export_snapshot(src, {_namespace(SALT, EXTRA): (SALT, EXTRA)})


def decode(blob: bytes) -> dict[str, Any]:
    doc: dict[str, Any] = msgpack.unpackb(blob[HEADER.size :], raw=False, strict_map_key=False)
    return doc


def pack(doc: Any) -> bytes:
    """A snapshot with a correct header and checksum around any document."""
    body = msgpack.packb(doc, use_bin_type=True)
    return HEADER.pack(snap.MAGIC, snap.VERSION, zlib.crc32(body), len(body)) + body


VALID_BLOB = source_blob()


def target() -> KVCacheManager:
    """An engine holding some blocks of its own, and no pending events."""
    eng = new_engine()
    fill(eng, [list(range(500, 500 + 2 * TPB))])
    eng.events.drain()
    return eng


def state(engine: KVCacheManager) -> tuple[Any, ...]:
    """Everything a refused snapshot must leave unchanged."""
    s = engine.stats
    return (
        engine.num_nodes,
        engine.num_open_sequences,
        tuple(tuple(v) if isinstance(v := getattr(s, f.name), list) else v for f in fields(s)),
        tuple(tuple(sorted(row.items())) for row in engine.usage()),
        sorted((n.depth, n.tokens, n.priority) for n in engine.iter_nodes()),
        bytes(engine.storage[0].arena.numpy().tobytes()),
    )


def assert_refused(blob: bytes, *needles: str) -> SnapshotError:
    engine = target()
    before = state(engine)
    t0 = time.monotonic()
    with deadline(10), pytest.raises(SnapshotError) as info:
        import_snapshot(engine, blob)
    assert time.monotonic() - t0 < 2, "refusing a small snapshot must be quick"
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    assert state(engine) == before
    assert engine.events.drain() == []
    return info.value


def last_leaf(doc: dict[str, Any]) -> tuple[int, int]:
    """The last record (a leaf: parents come first) and its parent."""
    last = len(doc["records"]) - 1
    return last, doc["records"][last][2]


# --------------------------------------------------------------------------- valid snapshots


def test_a_valid_snapshot_still_imports_with_its_namespaces_and_priorities() -> None:
    blob = VALID_BLOB
    doc = decode(blob)
    assert [len(r) for r in doc["records"]] == [6] * 6  # version 1 records, unchanged
    engine = new_engine()
    result = import_snapshot(engine, blob)
    assert (result.chains, result.blocks_written, result.skipped) == (2, 6, 0)
    assert result.namespaces == {(SALT, EXTRA)}
    assert engine.stats.queries_tokens == 0
    h = engine.open_sequence(
        list(range(100, 100 + 3 * TPB)),
        cache_salt=SALT,
        extra_keys=EXTRA,
        recompute_last_token=False,
    )
    assert h.num_reused_tokens == 3 * TPB
    engine.release(h.seq_id)
    assert sorted(n.priority for n in engine.iter_nodes()) == [35, 35, 35, 80, 80, 80]


def test_a_chain_with_many_priority_changes_imports_in_segments() -> None:
    """More priority changes than one retention policy may hold (80 runs): the chain is
    opened in segments and every block keeps its own priority, lower ones included."""
    n = 120
    big = {"cpu_budget_bytes": 256 * 2 * 2 * 2 * 8 * TPB * 4}
    src = new_engine(**big)
    fill(src, [list(range(n * TPB))])
    doc = decode(export_snapshot(src, {}))
    priorities = [(10, 90, 35)[j % 3] for j in range(n)]
    for j, record in enumerate(doc["records"]):  # one chain, parents first
        assert record[2] == j - 1
        record[4] = priorities[j]
    assert sum(p != 35 for p in priorities) > 2 * snap.MAX_RANGES_PER_OPEN
    engine = new_engine(**big)
    result = import_snapshot(engine, pack(doc))
    assert (result.chains, result.blocks_written, result.skipped) == (1, n, 0)
    got = sorted((node.depth, node.priority) for node in engine.iter_nodes())
    assert got == [(d + 1, p) for d, p in enumerate(priorities)]
    h = engine.open_sequence(list(range(n * TPB)), recompute_last_token=False)
    assert h.num_reused_tokens == n * TPB
    src_ids = [x.blocks[0].block_id for x in sorted(src.iter_nodes(), key=lambda x: x.depth)]
    assert torch.equal(
        engine.pool_view(0)[:, list(h.block_tables[0])], src.pool_view(0)[:, src_ids]
    )


def test_a_chain_longer_than_this_pool_is_skipped_not_fatal() -> None:
    src = new_engine()
    fill(src, [list(range(12 * TPB)), list(range(1000, 1000 + 2 * TPB))])
    small = new_engine(cpu_budget_bytes=8 * 2 * 2 * 2 * 8 * TPB * 4)
    result = import_snapshot(small, export_snapshot(src, {}))
    assert (result.chains, result.skipped) == (1, 1)
    assert small.num_nodes == 2


def test_the_work_of_an_import_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A comb (a long spine with a leaf on every block) costs the square of its size to open
    chain by chain; past the budget, chains are skipped."""
    src = new_engine()
    spine = list(range(10 * TPB))
    fill(src, [spine])
    fill(src, [spine[: d * TPB] + [7000 + d] * TPB for d in range(1, 10)])
    blob = export_snapshot(src, {})
    monkeypatch.setattr(snap, "IMPORT_WORK_BASE", 40)
    monkeypatch.setattr(snap, "IMPORT_WORK_PER_RECORD", 0)
    result = import_snapshot(new_engine(), blob)
    assert result.skipped > 0 and result.chains > 0
    assert result.chains + result.skipped == 10


# --------------------------------------------------------------------------- refusals


def test_cyclic_parents_are_refused_quickly_and_change_nothing() -> None:
    """Record 0's parent is record 2, whose parent is record 0; record 4 hangs below them.
    Walking that chain used to loop forever inside the engine lock."""
    doc = decode(VALID_BLOB)
    records = doc["records"]
    leaf = next(
        i for i in range(len(records)) if records[i][2] >= 0 and records[records[i][2]][2] >= 0
    )
    middle = records[leaf][2]
    first = records[middle][2]
    records[first][2] = middle
    assert_refused(pack(doc), f"record {first}: parent", "earlier record")


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        node: Any = doc
        steps = [last_leaf(doc)[0] if s == "L" else s for s in path]
        for step in steps[:-1]:
            node = node[step]
        node[steps[-1]] = value(node[steps[-1]]) if callable(value) else value

    return mutate


def _self_parent(doc: dict[str, Any]) -> None:
    last, _ = last_leaf(doc)
    doc["records"][last][2] = last


def _frame(tensor: torch.Tensor) -> Callable[[Any], bytes]:
    return lambda _: encode_tensor(tensor)


BLOCK = (2, 2, TPB, 2, 8)  # [layers, 2, tpb, kv_heads, head_dim] of the small config


MUTATIONS: dict[str, tuple[Callable[[dict[str, Any]], None], tuple[str, ...]]] = {
    "self parent": (_self_parent, ("record L: parent", "earlier record")),
    "parent after itself": (_set(("records", 0, 2), 1), ("record 0: parent",)),
    "parent beyond the records": (_set(("records", "L", 2), 10**6), ("parent",)),
    "parent below -1": (_set(("records", "L", 2), -2), ("parent",)),
    "parent bool": (_set(("records", "L", 2), False), ("parent",)),
    "parent string": (_set(("records", "L", 2), "0"), ("parent",)),
    "one token short": (_set(("records", "L", 3), lambda t: t[:-1]), ("record L: tokens",)),
    "one token too many": (_set(("records", "L", 3), lambda t: [*t, 1]), ("tokens",)),
    "tokens not a list": (_set(("records", "L", 3), 5), ("tokens",)),
    "negative token": (_set(("records", "L", 3, 0), -1), ("tokens[0]",)),
    "token 2**63": (_set(("records", "L", 3, 1), 1 << 63), ("tokens[1]",)),
    "bool token": (_set(("records", "L", 3, 2), True), ("tokens[2]",)),
    "float token": (_set(("records", "L", 3, 0), 1.0), ("tokens[0]",)),
    "priority 101": (_set(("records", "L", 4), 101), ("record L: priority", "0..100")),
    "priority -1": (_set(("records", "L", 4), -1), ("priority",)),
    "bool priority": (_set(("records", "L", 4), True), ("priority",)),
    "float priority": (_set(("records", "L", 4), 50.0), ("priority",)),
    "a frame too many": (
        _set(("records", "L", 5), lambda f: [*f, None]),
        ("record L: frames", "one entry per pool"),
    ),
    "no frames": (_set(("records", "L", 5), []), ("frames",)),
    "frames not a list": (_set(("records", "L", 5), b"x"), ("frames",)),
    "frame of text": (_set(("records", "L", 5, 0), "KVPT"), ("frames[0]",)),
    "damaged frame": (
        _set(("records", "L", 5, 0), lambda f: f[:-1] + bytes([f[-1] ^ 1])),
        ("record L: frames[0]", "checksum"),
    ),
    "truncated frame": (_set(("records", "L", 5, 0), lambda f: f[:-4]), ("frames[0]",)),
    "frame of another shape": (
        _set(("records", "L", 5, 0), _frame(torch.zeros(2, 2, TPB, 2, 4))),
        ("frames[0]",),
    ),
    "frame of a reshaped block": (
        _set(("records", "L", 5, 0), _frame(torch.zeros(2, 2, TPB, 4, 4))),
        ("frames[0]", "not a version 1 frame"),
    ),
    "frame claiming 134 dimensions": (
        _set(("records", "L", 5, 0), lambda f: f[:7] + bytes([134]) + f[8:]),
        ("record L: frames[0]", "not a version 1 frame"),
    ),
    "frame of another dtype": (
        _set(("records", "L", 5, 0), _frame(torch.zeros(*BLOCK, dtype=torch.float16))),
        ("frames[0]",),
    ),
    "record not a list": (_set(("records", "L"), {"salt": None}), ("record L: must be",)),
    "record an int": (_set(("records", "L"), 7), ("record",)),
    "record of 5 fields": (_set(("records", "L"), lambda r: r[:5]), ("record L", "5 fields")),
    "record of 7 fields": (_set(("records", "L"), lambda r: [*r, 0]), ("record", "7 fields")),
    "salt an int": (_set(("records", "L", 0), 5), ("salt",)),
    "salt too long": (_set(("records", "L", 0), "s" * 257), ("salt",)),
    "salt not the parent's": (_set(("records", "L", 0), "other"), ("record L: salt and",)),
    "17 extra keys": (_set(("records", "L", 1), list(range(17))), ("extra_keys",)),
    "float extra key": (_set(("records", "L", 1), [1.5]), ("extra_keys[0]",)),
    "bool extra key": (_set(("records", "L", 1), [True]), ("extra_keys[0]",)),
    "extra_keys a string": (_set(("records", "L", 1), "lora"), ("extra_keys",)),
    "records a map": (_set(("records",), {}), ("records",)),
    "records of nothing": (_set(("records",), [None] * 1000), ("records", "1000 records")),
    "geometry a list": (_set(("geometry",), []), ("geometry must be a map",)),
    "tokens_per_block 0": (
        _set(("geometry", "tokens_per_block"), 0),
        ("geometry.tokens_per_block must be an int",),
    ),
    "pools not a list": (_set(("geometry", "pools"), 3), ("geometry.pools must be a list",)),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_malformed_record_is_refused_naming_the_field(name: str) -> None:
    """The mutation hits the last record: every chain before it is valid and would be
    imported, were the snapshot not checked whole first."""
    mutate, needles = MUTATIONS[name]
    doc = decode(VALID_BLOB)
    last, _ = last_leaf(doc)
    mutate(doc)
    assert_refused(pack(doc), *(n.replace("record L", f"record {last}") for n in needles))


def test_another_geometry_is_a_geometry_error() -> None:
    """Well formed, but of another geometry: its own error class (the API answers 409)."""
    doc = decode(VALID_BLOB)
    doc["geometry"]["kv_dtype"] = "float16"
    err = assert_refused(pack(doc), "geometry", "differs")
    assert isinstance(err, SnapshotGeometryError)


@pytest.mark.parametrize(
    "doc, needle",
    [
        ([], "map"),
        ({"geometry": {}}, "missing 'records'"),
        ({"geometry": {}, "records": [], "more": 1}, "unknown 'more'"),
    ],
)
def test_a_malformed_body_is_refused(doc: Any, needle: str) -> None:
    assert_refused(pack(doc), needle)


# --------------------------------------------------------------------------- fuzz

_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.integers(min_value=-3, max_value=8)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=24)
)
VALUES = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)
MUTATION = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 5), st.integers(0, 5), VALUES),
    st.tuples(st.just("set item"), st.integers(0, 5), st.integers(0, 5), st.integers(0, 4), VALUES),
    st.tuples(st.just("parent"), st.integers(0, 5), st.integers(-3, 8)),
    st.tuples(st.just("drop"), st.integers(0, 5)),
    st.tuples(st.just("duplicate"), st.integers(0, 5)),
    st.tuples(st.just("swap"), st.integers(0, 5), st.integers(0, 5)),
)


def _apply(doc: dict[str, Any], mutation: tuple[Any, ...]) -> None:
    records = doc["records"]
    if not records:
        return
    kind, i, *rest = mutation
    i %= len(records)
    if kind == "set":
        records[i][rest[0]] = rest[1]
    elif kind == "set item":
        field = records[i][rest[0]]
        if isinstance(field, list) and field:
            field[rest[1] % len(field)] = rest[2]
        else:
            records[i][rest[0]] = rest[2]
    elif kind == "parent":
        records[i][2] = rest[0]
    elif kind == "drop":
        del records[i]
    elif kind == "duplicate":
        records.append(copy.deepcopy(records[i]))
    else:
        j = rest[0] % len(records)
        records[i], records[j] = records[j], records[i]


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(MUTATION, min_size=1, max_size=3))
def test_fuzzed_snapshots_import_or_are_refused_cleanly(
    mutations: list[tuple[Any, ...]],
) -> None:
    doc = decode(VALID_BLOB)
    for mutation in mutations:
        _apply(doc, mutation)
    engine = target()
    before = state(engine)
    with deadline(10):
        try:
            result = import_snapshot(engine, pack(doc))
        except SnapshotError:
            assert state(engine) == before
            assert engine.events.drain() == []
            return
    assert isinstance(result, snap.ImportResult)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 255), st.binary(max_size=64))
def test_fuzzed_bodies_are_imported_whole_or_refused_whole(
    at: int, value: int, garbage: bytes
) -> None:
    """A changed byte (checksum fixed up) or a garbage body: refused with SnapshotError and
    nothing changed, or imported with no chain skipped (a damaged frame used to be skipped
    quietly while the rest went in)."""
    body = bytearray(VALID_BLOB[HEADER.size :])
    body[at % len(body)] = value
    for blob in (
        HEADER.pack(snap.MAGIC, snap.VERSION, zlib.crc32(body), len(body)) + bytes(body),
        HEADER.pack(snap.MAGIC, snap.VERSION, zlib.crc32(garbage), len(garbage)) + garbage,
    ):
        engine = target()
        before = state(engine)
        with deadline(10):
            try:
                result = import_snapshot(engine, blob)
            except SnapshotError:
                assert state(engine) == before
                assert engine.events.drain() == []
                continue
        assert result.skipped == 0 and result.chains >= 1
