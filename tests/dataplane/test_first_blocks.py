"""The first-block table: a same-node miss answered without a round trip, and never a hit lost."""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool_agent.dataplane.client import TransferError
from kvpool_agent.dataplane.first_blocks import (
    OCCUPIED,
    SLOTS,
    FirstBlockTable,
    FirstBlockView,
    buckets_for,
    first_print,
    namespace_print,
)
from kvpool_agent.dataplane.keys import KeyNamespace, chain_tokens
from kvpool_agent.dataplane.protocol import Op
from tests.conftest import ENGINE_CORES

from .conftest import BLOCKS, NS, TOKENS, TPB, agent_config, keys_for, write_auth
from .test_shm import ShmAgent, _metric

pytestmark = pytest.mark.timeout(120)


def tokens_of(key: bytes) -> list[int]:
    return chain_tokens([key], TPB)


def tokens_with_print(ns: KeyNamespace, print_: int) -> list[int]:
    """First-block tokens whose print in ``ns`` is ``print_``."""
    word = print_ ^ namespace_print(ns.salt())
    return [word & 0xFFFFFFFF, word >> 32]


def test_a_table_lists_removes_and_marks_a_full_bucket() -> None:
    table = FirstBlockTable(8)
    fd = table.reader_fd()
    view = FirstBlockView(fd, table.size)
    os.close(fd)
    ns = KeyNamespace("m")
    key = tokens_of(b"k")
    assert view.holds(ns, key) is False
    assert table.add(first_print(namespace_print(ns.salt()), key))
    assert view.holds(ns, key) is True
    assert view.holds(KeyNamespace("other"), key) is False  # the namespace is in the print
    table.remove(first_print(namespace_print(ns.salt()), key))
    assert view.holds(ns, key) is False and table.listed == 0
    # Nine prints of bucket 0: the ninth does not fit, and bucket 0's misses become unknown.
    prints = [i << 3 for i in range(1, SLOTS + 2)]
    assert [table.add(p) for p in prints] == [True] * SLOTS + [False]
    assert table.overflowed == 1 and table.listed == SLOTS
    assert view.holds(ns, tokens_with_print(ns, prints[0])) is True
    assert view.holds(ns, tokens_with_print(ns, prints[-1])) is None  # ask the agent
    assert view.holds(ns, tokens_with_print(ns, 99 << 3 | 1)) is False  # another bucket
    with pytest.raises(ValueError):  # the reader's mapping is read-only
        view._slots[0, 0] = OCCUPIED
    table.close()


def test_a_client_cannot_write_the_table() -> None:
    table = FirstBlockTable(8)
    fd = table.reader_fd()
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, table.size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.write(fd, b"x")
        with pytest.raises(OSError):
            os.ftruncate(table.fd, 1)  # sealed: no client mapping can lose its pages
    finally:
        os.close(fd)
        table.close()


def test_buckets_hold_two_slots_a_block() -> None:
    assert buckets_for(1) == 8
    assert buckets_for(1000) == 256
    assert buckets_for(1024) == 256
    assert buckets_for(1025) == 512


@pytest.fixture
def sock_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvp-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=ENGINE_CORES)
def agent(
    request: pytest.FixtureRequest, sock_dir: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ShmAgent]:
    monkeypatch.setenv("KVPOOL_CORE", request.param)
    a = ShmAgent(agent_config(auth=write_auth(Path(sock_dir))), os.path.join(sock_dir, "a.sock"))
    yield a
    a.close()


def count_lookups(agent: ShmAgent, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The LOOKUPs the agent serves from now on, as a list that grows by one each."""
    asked: list[int] = []
    real = agent.service.lookup_keys

    async def counted(*args: Any) -> list[str]:
        asked.append(1)
        return await real(*args)

    monkeypatch.setattr(agent.service, "lookup_keys", counted)
    return asked


def test_misses_are_answered_locally_and_hits_still_asked(
    agent: ShmAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    stored = keys_for(1, 3)
    with agent.shm(TOKENS["a"]) as writer:
        writer.put(NS, stored, writer.empty_kv(3))
        scheduler = agent.shm(TOKENS["a"], map_arena=False, map_index=True)
        assert scheduler._conn.auth_reply["first_blocks"] is True
        assert scheduler.index is not None
        # Stored before the table existed: listed when it was made, so the LOOKUP asks.
        index = agent.service.first_blocks
        assert index is not None and index.tables["a"].listed == 1
        assert scheduler.lookup(NS, stored) == ["primary"] * 3
        assert scheduler.local_misses == 0
        assert agent.service.publisher.encoder.watched == 1
        # A chain the agent does not hold: answered here, and the agent saw no request.
        asked = count_lookups(agent, monkeypatch)
        assert scheduler.lookup(NS, keys_for(2, 3)) == []
        assert scheduler.lookup(KeyNamespace("other"), stored) == []
        assert scheduler.local_misses == 2 and asked == []
        # A chain stored now is listed by its commit: its lookup asks, and is a hit.
        fresh = keys_for(3, 2)
        writer.put(NS, fresh, writer.empty_kv(2))
        assert scheduler.lookup(NS, fresh) == ["primary"] * 2
        assert scheduler.local_misses == 2
        # Same first block, a different tail: asked (the table knows first blocks only).
        assert scheduler.lookup(NS, [fresh[0], *keys_for(4, 1)]) == ["primary"]
        assert len(asked) == 2
        scheduler.close()


def test_another_tenants_chains_are_not_in_a_tenants_table(agent: ShmAgent) -> None:
    keys = keys_for(5, 2)
    a = agent.shm(TOKENS["a"], map_arena=False, map_index=True)
    b = agent.shm(TOKENS["b"], map_arena=False, map_index=True)
    with agent.shm(TOKENS["a"]) as writer:
        writer.put(NS, keys, writer.empty_kv(2))
    assert a.lookup(NS, keys) == ["primary"] * 2 and a.local_misses == 0
    assert b.lookup(NS, keys) == [] and b.local_misses == 1
    a.close()
    b.close()


def test_an_evicted_chain_leaves_the_table(agent: ShmAgent) -> None:
    scheduler = agent.shm(TOKENS["a"], map_arena=False, map_index=True)
    first = keys_for(6, 1)
    with agent.shm(TOKENS["a"]) as writer:
        writer.put(NS, first, writer.empty_kv(1))
        assert scheduler.lookup(NS, first) == ["primary"]
        for tag in range(100, 100 + 2 * BLOCKS // 4):  # twice the pool: the first chain goes
            writer.put(NS, keys_for(tag, 4), writer.empty_kv(4))
    with agent.shm(TOKENS["a"], map_arena=False) as asking:  # no table: the agent answers
        assert asking.lookup(NS, first) == []
    misses = scheduler.local_misses
    assert scheduler.lookup(NS, first) == []
    assert scheduler.local_misses == misses + 1
    index = agent.service.first_blocks
    assert index is not None
    table = index.tables["a"]
    assert table.listed == agent.service.publisher.encoder.watched  # one per listed chain
    assert 0 < table.listed <= BLOCKS
    assert _metric(agent, "kvpool_first_block_chains") == table.listed
    assert _metric(agent, "kvpool_first_block_overflows_total") == 0
    scheduler.close()


def test_without_kv_events_there_is_no_table_and_every_lookup_asks(sock_dir: str) -> None:
    config = agent_config(kv_cache_config={"tokens_per_block": TPB, "event_buffer_max_size": 0})
    a = ShmAgent(config, os.path.join(sock_dir, "b.sock"))
    try:
        raw = a.shm(map_arena=False)
        assert raw._conn.auth_reply["first_blocks"] is False  # so a client does not ask
        with pytest.raises(TransferError) as err:
            raw._conn.request(Op.MAP_INDEX, {}, fds=[])
        assert err.value.status == 409 and "event_buffer_max_size" in str(err.value)
        raw.close()
        client = a.shm(map_arena=False, map_index=True)
        assert client.index is None
        assert client.lookup(NS, keys_for(7, 2)) == [] and client.local_misses == 0
        client.close()
    finally:
        a.close()


def test_a_restarted_agent_is_asked_not_its_old_table(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "c.sock")
    config = agent_config(auth=write_auth(Path(sock_dir)))
    first = ShmAgent(config, path)
    scheduler = first.shm(TOKENS["a"], map_arena=False, map_index=True)
    assert scheduler.lookup(NS, keys_for(8, 1)) == []
    first.close()
    # The old table still says "not held"; the closed connection says not to trust it.
    assert scheduler.broken
    second = ShmAgent(config, path)
    try:
        with second.shm(TOKENS["a"]) as writer:
            writer.put(NS, keys_for(8, 1), writer.empty_kv(1))
        with pytest.raises(OSError):
            scheduler.lookup(NS, keys_for(8, 1))
        fresh = second.shm(TOKENS["a"], map_arena=False, map_index=True)
        assert fresh.lookup(NS, keys_for(8, 1)) == ["primary"]
        fresh.close()
    finally:
        scheduler.close()
        second.close()


def test_chains_a_handoff_brings_in_are_listed(agent: ShmAgent, sock_dir: str) -> None:
    keys = keys_for(9, 3)
    with agent.shm(TOKENS["a"]) as writer:
        writer.put(NS, keys, writer.empty_kv(3))
    blob = agent.run(agent.service.export_hottest())
    config = agent_config(auth=write_auth(Path(sock_dir)))
    successor = ShmAgent(config, os.path.join(sock_dir, "d.sock"))
    try:
        scheduler = successor.shm(TOKENS["a"], map_arena=False, map_index=True)
        assert scheduler.lookup(NS, keys) == [] and scheduler.local_misses == 1
        successor.run(successor.service.import_blocks(blob))
        assert scheduler.lookup(NS, keys) == ["primary"] * 3
        assert scheduler.local_misses == 1
        scheduler.close()
    finally:
        successor.close()
