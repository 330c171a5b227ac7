"""Frames of the transfer protocol (docs/dataplane.md has them byte by byte).

Every frame, both ways, is a fixed 32-byte little-endian header, a msgpack map of the op's
metadata (``meta_len`` bytes), then ``data_len`` raw bytes (KV, for GET replies and PUT
requests only):

    offset  size  field
    0       4     magic b"KVPX"
    4       1     version (1)
    5       1     opcode (``Op``)
    6       2     flags (``F_RESPONSE`` | ``F_ERROR`` | ``F_CRC``)
    8       8     request id (echoed in the reply)
    16      4     meta_len
    20      4     CRC-32 of the data (when ``F_CRC`` is set, else 0)
    24      8     data_len

This module is light (struct, msgpack): the client imports it without torch or the server.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvpool_agent.config import DTYPE_BYTES

MAGIC = b"KVPX"
VERSION = 1
HEADER = struct.Struct("<4sBBHQIIQ")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 32

F_RESPONSE = 0x1
"""Set on every frame the agent sends."""
F_ERROR = 0x2
"""The reply is an error: meta ``{"status": int, "reason": str, ...}``."""
F_CRC = 0x4
"""The header's CRC-32 field covers the data (connections that asked for checksums)."""
KNOWN_FLAGS = F_RESPONSE | F_ERROR | F_CRC
MAX_REQUEST_ID = (1 << 64) - 1


class Op(enum.IntEnum):
    AUTH = 1
    PING = 2
    LOOKUP = 3
    LEASE = 4
    RELEASE = 5
    GET = 6
    PUT = 7
    # Same-node ops (the Unix socket only, docs/dataplane.md "Same node"): the engine maps
    # the agent's arena and copies itself; these frames carry block ids, never KV bytes.
    MAP = 8
    GET_SHM = 9
    PUT_SHM = 10
    COMMIT = 11
    ABORT = 12
    MAP_INDEX = 13
    """The caller's tenant's first-block table, read-only (``dataplane/first_blocks.py``)."""


SHM_OPS = frozenset({Op.MAP, Op.GET_SHM, Op.PUT_SHM, Op.COMMIT, Op.ABORT, Op.MAP_INDEX})
"""Ops a TCP connection may not use (they name memory only a local peer can map)."""


OPS_WITH_DATA = frozenset({Op.PUT})
"""Requests that carry data (every other request must declare ``data_len`` 0)."""

# Status codes of error replies (HTTP's numbers, so they read the same as the HTTP API's).
BAD_FRAME = 400
UNAUTHENTICATED = 401
FORBIDDEN = 403
NOT_FOUND = 404
CONFLICT = 409
TOO_LARGE = 413
INVALID = 422
LIMITED = 429
UNAVAILABLE = 503


class ProtocolError(Exception):
    """A frame the peer should not have sent: the connection closes after the error reply."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Header:
    op: int
    flags: int
    request_id: int
    meta_len: int
    crc: int
    data_len: int


def pack_header(
    op: int, flags: int, request_id: int, meta_len: int, data_len: int = 0, crc: int = 0
) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, flags, request_id, meta_len, crc, data_len)


def unpack_header(buf: bytes | bytearray | memoryview) -> Header:
    """The fields of a header; ProtocolError for a wrong magic, version or flag."""
    magic, version, op, flags, request_id, meta_len, crc, data_len = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(BAD_FRAME, f"frame: bad magic {bytes(magic)!r} (want {MAGIC!r})")
    if version != VERSION:
        raise ProtocolError(BAD_FRAME, f"frame: version {version} (this agent speaks {VERSION})")
    if flags & ~KNOWN_FLAGS:
        raise ProtocolError(BAD_FRAME, f"frame: unknown flags {flags:#x}")
    return Header(op, flags, request_id, meta_len, crc, data_len)


def pack_meta(meta: dict[str, Any]) -> bytes:
    out: bytes = msgpack.packb(meta, use_bin_type=True)
    return out


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def unpack_meta(buf: bytes | bytearray | memoryview) -> dict[str, Any]:
    """A frame's metadata map; ProtocolError when it is not one msgpack map."""
    if not buf:
        return {}
    try:
        meta = msgpack.unpackb(buf, raw=False, strict_map_key=True, ext_hook=_no_ext, use_list=True)
    except Exception as err:  # msgpack raises several kinds; all mean a damaged frame
        raise ProtocolError(BAD_FRAME, f"meta: not a msgpack map ({type(err).__name__})") from None
    if not isinstance(meta, dict):
        raise ProtocolError(BAD_FRAME, f"meta: a map is expected, got {type(meta).__name__}")
    return meta


def frame(
    op: int,
    request_id: int,
    meta: dict[str, Any] | None = None,
    *,
    flags: int = 0,
    data_len: int = 0,
    crc: int | None = None,
) -> bytes:
    """Header and metadata of one frame (the data, if any, follows separately)."""
    body = pack_meta(meta) if meta else b""
    if crc is not None:
        flags |= F_CRC
    return pack_header(op, flags, request_id, len(body), data_len, crc or 0) + body


@dataclass(frozen=True)
class PoolLayout:
    """One pool as the wire sees it: the blocks' bytes of a pool are, per selected layer (in
    the pool's layer order), per block, one ``[2, tokens_per_block, kv_heads, head_dim]``
    slice of ``layer_bytes``."""

    index: int
    layers: tuple[int, ...]
    """Model layer of each of the pool's layers."""
    kv_heads: int
    head_dim: int
    dtype: str
    tokens_per_block: int
    window: int | None
    """Attention window in tokens; None for full attention."""

    @property
    def layer_bytes(self) -> int:
        return 2 * self.tokens_per_block * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        return len(self.layers) * self.layer_bytes

    def selected(self, layers: tuple[int, int] | None) -> list[int]:
        """Positions in this pool of the model layers in ``[lo, hi)`` (all when None)."""
        if layers is None:
            return list(range(len(self.layers)))
        lo, hi = layers
        return [i for i, layer in enumerate(self.layers) if lo <= layer < hi]

    def to_meta(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "layers": list(self.layers),
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "tokens_per_block": self.tokens_per_block,
            "window": self.window,
        }

    @classmethod
    def from_meta(cls, doc: dict[str, Any]) -> PoolLayout:
        return cls(
            index=int(doc["index"]),
            layers=tuple(int(x) for x in doc["layers"]),
            kv_heads=int(doc["kv_heads"]),
            head_dim=int(doc["head_dim"]),
            dtype=str(doc["dtype"]),
            tokens_per_block=int(doc["tokens_per_block"]),
            window=None if doc.get("window") is None else int(doc["window"]),
        )


def lease_range_error(
    start: int, count: int, blocks: int, first_block: Sequence[int], pools: Iterable[int]
) -> str | None:
    """Why blocks ``[start, start + count)`` of a lease of ``blocks`` blocks cannot be read in
    ``pools`` (None: they can): outside the lease, or before a pool's first held block (a
    sliding-window pool's ``first_block``). The agent refuses such a read with 422, and
    ``ShmClient`` the same range of ids it holds, without asking."""
    if count < 1 or start < 0 or start + count > blocks:
        return f"blocks [{start}, {start + count}) are outside the lease's {blocks} blocks"
    for pool in pools:
        first = first_block[pool]
        if start < first:
            return (
                f"pool {pool}: blocks before {first} are outside its attention window "
                f"(the lease holds blocks {first}..{blocks - 1} of it)"
            )
    return None


def data_bytes(
    pools: tuple[PoolLayout, ...] | list[PoolLayout],
    blocks: int,
    layers: tuple[int, int] | None = None,
) -> int:
    """Bytes of ``blocks`` blocks of every pool (of the selected layers)."""
    return sum(len(p.selected(layers)) * p.layer_bytes for p in pools) * blocks
