"""Malformed and refused frames: an error reply, the connection closed when the stream cannot
be trusted, and the cache exactly as it was."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool_agent.dataplane.protocol import F_CRC, F_ERROR, F_RESPONSE, Op, frame

from .conftest import NS, Agent, Raw, agent_config, header_bytes, keys_for, random_kv

pytestmark = pytest.mark.timeout(300)

LOOKUP_META = {"ns": [NS.model, 0, 0], "keys": [b"k"]}


@pytest.fixture(scope="module")
def filled() -> Iterator[Agent]:
    """An agent with small frame limits, a stored chain and a live lease."""
    agent = Agent(agent_config(transfer={"port": 0, "max_meta_bytes": 4096, "max_keys": 16}))
    with agent.client() as client:
        keys = keys_for(1, 3)
        client.put(NS, keys, random_kv(client, 3, 1))
        lease = client.lease(NS, keys, ttl_s=600)
        assert lease is not None
    yield agent
    agent.close()


def pack(meta: Any) -> bytes:
    return msgpack.packb(meta, use_bin_type=True)  # type: ignore[no-any-return]


def raw_frame(op: int, meta: bytes, *, flags: int = 0, data: bytes = b"", rid: int = 9) -> bytes:
    head = struct.pack("<4sBBHQIIQ", b"KVPX", 1, op, flags, rid, len(meta), 0, len(data))
    return head + meta + data


MALFORMED = {
    "bad magic": header_bytes(Op.PING, 9, 0, 0, magic=b"HTTP"),
    "bad version": header_bytes(Op.PING, 9, 0, 0, version=2),
    "unknown opcode": raw_frame(99, b""),
    "response flag": raw_frame(Op.PING, b"", flags=F_RESPONSE),
    "unknown flag": raw_frame(Op.PING, b"", flags=0x80),
    "meta too large": header_bytes(Op.LOOKUP, 9, 5000, 0),
    "data too large": header_bytes(Op.PUT, 9, 0, 2 << 30),
    "data on lookup": raw_frame(Op.LOOKUP, pack(LOOKUP_META), data=b"xxxx"),
    "crc on lookup": raw_frame(Op.LOOKUP, pack(LOOKUP_META), flags=F_CRC),
    "meta not msgpack": raw_frame(Op.LOOKUP, b"\xc1\xc1\xc1"),
    "meta not a map": raw_frame(Op.LOOKUP, pack([1, 2, 3])),
    "meta with ext type": raw_frame(Op.LOOKUP, b"\xd4\x01\x00"),
    "unknown field": raw_frame(Op.LOOKUP, pack({**LOOKUP_META, "extra": 1})),
    "missing field": raw_frame(Op.LOOKUP, pack({"ns": [NS.model, 0, 0]})),
    "ns not a triple": raw_frame(Op.LOOKUP, pack({"ns": "m", "keys": [b"k"]})),
    "keys not bytes": raw_frame(Op.LOOKUP, pack({"ns": [NS.model, 0, 0], "keys": ["k"]})),
    "lease id not an int": raw_frame(Op.RELEASE, pack({"lease": "1"})),
    "negative start": raw_frame(Op.GET, pack({"lease": 1, "start": -1, "count": 1})),
    "second auth": raw_frame(Op.AUTH, b""),
    "put length mismatch": raw_frame(
        Op.PUT, pack({"ns": [NS.model, 0, 0], "keys": [b"k"], "first": 0}), data=b"x" * 10
    ),
    "put first past the keys": raw_frame(
        Op.PUT, pack({"ns": [NS.model, 0, 0], "keys": [b"k"], "first": 2}), data=b""
    ),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_frame_gets_an_error_and_a_close(filled: Agent, name: str) -> None:
    before = filled.state()
    raw = Raw(filled.address)
    raw.auth()
    raw.send(MALFORMED[name])
    head, meta = raw.reply()
    assert head.flags & F_ERROR and meta["closing"], meta
    assert meta["status"] in (400, 413), meta
    assert raw.closed()
    raw.close()
    assert filled.state() == before


REFUSED = {
    "too many keys": (Op.LOOKUP, {"ns": [NS.model, 0, 0], "keys": [b"k"] * 17}, 422),
    "empty key": (Op.LOOKUP, {"ns": [NS.model, 0, 0], "keys": [b""]}, 422),
    "control char in model": (Op.LOOKUP, {"ns": ["a\x1fb", 0, 0], "keys": [b"k"]}, 422),
    "rank out of range": (Op.LEASE, {"ns": [NS.model, 1 << 40, 0], "keys": [b"k"]}, 422),
    "negative ttl": (Op.LEASE, {"ns": [NS.model, 0, 0], "keys": [b"k"], "ttl": -1.0}, 422),
    "unknown lease": (Op.GET, {"lease": 12345, "start": 0, "count": 1}, 404),
    "release unknown": (Op.RELEASE, {"lease": 12345}, 404),
    "layers out of range": (Op.GET, {"lease": 1, "start": 0, "count": 1, "layers": [0, 9]}, 422),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_request_keeps_the_connection_and_the_state(filled: Agent, name: str) -> None:
    op, meta, status = REFUSED[name]
    before = filled.state()
    raw = Raw(filled.address)
    raw.auth()
    raw.request(op, meta, rid=21)
    head, reply = raw.reply()
    assert head.flags & F_ERROR and reply["status"] == status and not reply.get("closing")
    assert head.request_id == 21
    raw.request(Op.PING, rid=22)
    assert raw.reply()[0].request_id == 22
    raw.close()
    assert filled.state() == before


def test_a_get_of_another_lease_range_is_refused(filled: Agent) -> None:
    lease_id = next(iter(filled.service.leases))
    before = filled.state()
    raw = Raw(filled.address)
    raw.auth()
    for start, count in ((0, 4), (3, 1), (0, 0)):
        raw.request(Op.GET, {"lease": lease_id, "start": start, "count": count})
        head, meta = raw.reply()
        assert head.flags & F_ERROR and meta["status"] == 422
    raw.close()
    assert filled.state() == before


meta_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 40), 1 << 40)
    | st.binary(max_size=8)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=6,
)
meta_maps = st.dictionaries(
    st.sampled_from(["ns", "keys", "first", "lease", "start", "count", "ttl", "layers", "x"]),
    meta_values,
    max_size=4,
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    op=st.integers(0, 10),
    flags=st.sampled_from([0, 0, 0, F_CRC, F_RESPONSE, 0x40]),
    meta=st.one_of(st.binary(max_size=40), meta_maps.map(pack)),
    data=st.binary(max_size=64),
)
def test_fuzzed_frames_never_change_the_cache(
    filled: Agent, op: int, flags: int, meta: bytes, data: bytes
) -> None:
    before = filled.state()
    raw = Raw(filled.address)
    raw.auth()
    raw.send(raw_frame(op, meta, flags=flags, data=data) + frame(Op.PING, 77))
    head, reply = raw.reply()
    if head.flags & F_ERROR:
        assert filled.state() == before
        if reply.get("closing"):
            assert raw.closed()
        else:  # still in step: the PING after it is answered
            assert raw.reply()[0].request_id == 77
    else:  # a request that happened to be valid (a PING, a lookup of nothing)
        assert op in (Op.PING, Op.LOOKUP, Op.LEASE)
    raw.close()
