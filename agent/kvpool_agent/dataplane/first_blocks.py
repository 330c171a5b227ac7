"""Which chains a tenant's blocks start, in shared memory: a miss answered without a round trip.

A connector's scheduler asks the pool about every new prompt (LOOKUP), most of them misses. On
the same node that round trip is small, but it waits for the agent to wake up: half a
millisecond on the development machine (``bench/lookup_wakeup.py``), about 4% of a 1k-token
request. So the agent also publishes, per tenant, the set of chains whose *first* block it
holds: a table in a memfd that a same-node client maps read-only (``Op.MAP_INDEX``). A lookup
whose first key is not in it holds nothing, and is answered there; any other is asked as before.

The table is a filter, never the answer to a hit: a first block it lists may have gone since
(the LOOKUP that follows says so), and one it lacks can only have arrived in a race with the
lookup, as a LOOKUP's answer can be stale, or be in a bucket that overflowed (the bucket says
so and the client asks). What makes a negative answer right:

- every path that finds a chain's first block resident for a tenant (a store's commit, a store
  that found the chain held, a LOOKUP or LEASE that counted it) lists it, inside the same
  engine call, before anything can evict it; a new table starts with every such block the
  cache holds, and a warm handoff's import lists the chains it brought in;
- a listed block's key (the engine's) is watched in the agent's event encoder
  (``WireEncoder.watch``), whose BlockRemoved or AllBlocksCleared takes it out of the table
  after that call. The events of the call so far are published before the block is listed,
  so that a removal among them (of an earlier copy) cannot take the new listing out. That
  needs the engine's KV events (``kv_cache_config.event_buffer_max_size`` > 0): without them
  the agent refuses MAP_INDEX and clients ask every time.

Layout (little-endian): a 64-byte header (``MAGIC``, version u32, slots per bucket u32,
buckets u64), then ``buckets`` rows of ``SLOTS`` u64 slots, then one overflow byte per bucket.
A slot holds ``print | OCCUPIED`` or 0. A chain's print is 63 bits of its first block's
synthetic tokens (``keys.chain_tokens``: a BLAKE2b digest of the key) mixed with a digest of
its namespace; its bucket is the print's low bits. One writer at a time (the agent, under its
engine lock) stores whole aligned words; readers in other processes see each slot before or
after a change.
Tables are per tenant, so a client learns nothing of another tenant's chains.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import mmap
import os
import struct
from collections.abc import Iterable, Sequence

import numpy as np

from kvpool_agent.cache.packed import block_key
from kvpool_agent.cache.sequences import namespace_of
from kvpool_agent.dataplane.keys import KeyNamespace

MAGIC = b"kvpfirst"
VERSION = 1
SLOTS = 8
"""Slots per bucket: 64 bytes, one cache line a lookup reads."""
HEADER = struct.Struct("<8sIIQ")
HEADER_BYTES = 64
OCCUPIED = 1 << 63
PRINT_MASK = OCCUPIED - 1
_PERSON = b"kvpool-first-v1"


@functools.lru_cache(maxsize=1024)
def namespace_print(ns_salt: str) -> int:
    """What a namespace adds to its chains' prints: 64 bits of a BLAKE2b of its salt
    (``KeyNamespace.salt()``, without the tenant: each tenant has its own table)."""
    digest = hashlib.blake2b(ns_salt.encode(), digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "little")


def first_print(ns_print: int, first_tokens: Sequence[int]) -> int:
    """A chain's print: its first block's first two synthetic tokens (one when the block is
    a single token) as a 64-bit word, mixed with the namespace's print, 63 bits."""
    word = int(first_tokens[0]) | (int(first_tokens[1]) << 32 if len(first_tokens) > 1 else 0)
    return (word ^ ns_print) & PRINT_MASK


def table_bytes(buckets: int) -> int:
    return HEADER_BYTES + buckets * SLOTS * 8 + buckets


def buckets_for(blocks: int) -> int:
    """Buckets for a cache of ``blocks`` blocks: two slots a block, a power of two."""
    want = max(8, -(-2 * blocks // SLOTS))
    return 1 << (want - 1).bit_length()


class FirstBlockTable:
    """One tenant's table, written by the agent: a memfd of ``table_bytes(buckets)``."""

    def __init__(self, buckets: int) -> None:
        if buckets < 1 or buckets & (buckets - 1):
            raise ValueError(f"buckets: a power of two, got {buckets}")
        self.buckets = buckets
        self.size = table_bytes(buckets)
        self.fd = os.memfd_create("kvpool-first-blocks", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            # Readers rely on the size: nobody can shrink it under their mappings.
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self._map = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self._map[: HEADER.size] = HEADER.pack(MAGIC, VERSION, SLOTS, buckets)
        self.slots = np.frombuffer(
            self._map, dtype="<u8", count=buckets * SLOTS, offset=HEADER_BYTES
        ).reshape(buckets, SLOTS)
        self.overflow = np.frombuffer(
            self._map, dtype=np.uint8, count=buckets, offset=HEADER_BYTES + buckets * SLOTS * 8
        )
        self.listed = 0
        self.overflowed = 0
        """Prints that found their bucket full (that bucket's misses are asked, not answered)."""

    def add(self, print_: int) -> bool:
        """List ``print_``; False when its bucket is full (then marked as overflowed)."""
        row = self.slots[print_ & (self.buckets - 1)]
        value = print_ | OCCUPIED
        free = -1
        for i in range(SLOTS):
            slot = int(row[i])
            if slot == value:
                return True
            if slot == 0 and free < 0:
                free = i
        if free < 0:
            self.overflow[print_ & (self.buckets - 1)] = 1
            self.overflowed += 1
            return False
        row[free] = value
        self.listed += 1
        return True

    def remove(self, print_: int) -> None:
        row = self.slots[print_ & (self.buckets - 1)]
        value = print_ | OCCUPIED
        for i in range(SLOTS):
            if int(row[i]) == value:
                row[i] = 0
                self.listed -= 1
                return

    def reader_fd(self) -> int:
        """A new read-only descriptor of the table, to hand a client (the caller closes it)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        """Drop the agent's side (clients keep their mappings of what it held last)."""
        self.slots = np.zeros((0, SLOTS), dtype="<u8")  # (the mapping's last views)
        self.overflow = np.zeros(0, dtype=np.uint8)
        self._map.close()
        os.close(self.fd)


class FirstBlockIndex:
    """The agent's tables (one per tenant that asked for one) and which engine block keys
    list which print, so that the block's removal takes its print out."""

    def __init__(self, buckets: int, tokens_per_block: int) -> None:
        self.buckets = buckets
        self.tpb = tokens_per_block
        self.tables: dict[str | None, FirstBlockTable] = {}
        self._by_key: dict[int, tuple[FirstBlockTable, int]] = {}

    def table(self, tenant: str | None) -> FirstBlockTable:
        """The tenant's table, made on first use (it then lists what the tenant stores and
        finds from now on)."""
        table = self.tables.get(tenant)
        if table is None:
            table = self.tables[tenant] = FirstBlockTable(self.buckets)
        return table

    def note(
        self, tenant: str | None, ns_salt: str, salt: str | None, tokens: Sequence[int]
    ) -> int | None:
        """The chain of namespace ``ns_salt`` whose synthetic tokens start with ``tokens`` has
        its first block in the cache now, in the tree of ``salt`` (the tenant's salt of the
        namespace): list it in the tenant's table, if the tenant has one. Returns the block's
        key (the engine's) when it is newly listed, for the caller to watch."""
        table = self.tables.get(tenant)
        if table is None or len(tokens) < self.tpb:
            return None
        key = block_key(namespace_of(salt, ()), tuple(tokens[: self.tpb]))
        if key in self._by_key:
            return None
        print_ = first_print(namespace_print(ns_salt), tokens)
        if not table.add(print_):
            return None
        self._by_key[key] = (table, print_)
        return key

    def forget(self, keys: Iterable[int]) -> None:
        """These blocks went: their prints leave their tables."""
        for key in keys:
            listed = self._by_key.pop(key, None)
            if listed is not None:
                listed[0].remove(listed[1])

    def close(self) -> None:
        for table in self.tables.values():
            table.close()
        self.tables.clear()
        self._by_key.clear()


class FirstBlockView:
    """A client's read-only mapping of its tenant's table (``ShmClient``)."""

    def __init__(self, fd: int, size: int) -> None:
        self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        magic, version, slots, buckets = HEADER.unpack_from(self._map)
        if magic != MAGIC or version != VERSION or slots != SLOTS:
            self._map.close()
            raise ValueError(f"first-block table: not version {VERSION} of {MAGIC!r}")
        if size < table_bytes(buckets):
            self._map.close()
            raise ValueError("first-block table: shorter than its header says")
        self.buckets = int(buckets)
        self._slots = np.frombuffer(
            self._map, dtype="<u8", count=self.buckets * SLOTS, offset=HEADER_BYTES
        ).reshape(self.buckets, SLOTS)
        self._overflow = np.frombuffer(
            self._map,
            dtype=np.uint8,
            count=self.buckets,
            offset=HEADER_BYTES + self.buckets * SLOTS * 8,
        )

    def holds(self, ns: KeyNamespace, first_tokens: Sequence[int]) -> bool | None:
        """Whether the table lists the chain that starts with ``first_tokens``: True or
        False, or None when its bucket overflowed (ask the agent)."""
        print_ = first_print(namespace_print(ns.salt()), first_tokens)
        bucket = print_ & (self.buckets - 1)
        if (print_ | OCCUPIED) in self._slots[bucket].tolist():
            return True
        return None if self._overflow[bucket] else False
