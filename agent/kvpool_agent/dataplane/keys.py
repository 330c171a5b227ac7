"""Engine keys: content-addressed blocks on top of the token-keyed engine, unchanged.

An inference engine names a block of KV by a key it computed itself (opaque bytes, 1 to 64
of them) and a chain by the list of its blocks' keys from the first block on. Keys are
scoped by a ``KeyNamespace`` (model id, parallel rank, layer group) and by the caller's
tenant. The engine (``KVCacheManager``) knows only token ids, so each key stands for one
block of *synthetic tokens* derived from the key, and the namespace for a cache salt:

- **tokens of a key**: ``w = min(tokens_per_block, 16)`` words of one BLAKE2b digest of the
  key (``4 * w`` bytes, personalised ``kvpool-key-v2``), each read little-endian as a 32-bit
  token id; the rest of the block is filler token 0. Token ids below 2**32 are what the
  engine packs (4 bytes each, one compiled pass), so an engine-keyed block costs what a
  block of real tokens costs (``kvpool-key-v1`` used 63-bit words, which the engine keeps
  in a side table: about 160 B more per block and up to twice the time to store one;
  ``bench/engine_keys.py``). A chain of keys is the
  concatenation of its blocks' tokens, so the radix tree's parent relation is the list order
  (vLLM's and SGLang's hashes are chained already: each commits to its parent, so the tree
  adds nothing wrong, and a key under another parent is simply another node).
- **collision odds**: two different keys under the same parent in one namespace share a block
  only if all ``w`` words agree: 2**-(32 w) for a pair of siblings, 2**-64 at 2 tokens per
  block, 2**-128 at 4, 2**-512 from 16 on. Over ``N`` stored blocks of which at most ``S``
  share a parent, the chance of any collision is below ``N * S / 2**(32 w + 1)`` (below
  2**-79 for a trillion blocks with a thousand siblings each, at 4 tokens per block). The
  key's own collision odds (the engine's hash) come on top.
- **namespace**: ``KeyNamespace.salt()`` is a cache salt ``<US>keys<US>model<US>rank<US>group``
  (``<US>`` = ``\\x1f``), which the agent passes through ``service.tenant_salt(tenant, ...)``:
  the tenant, not the client, decides the tree, so two tenants sending the same keys never
  share a block. A client of the token API that sends exactly that string as its
  ``cache_salt`` reaches the same tree of its own tenant, which is harmless (its own blocks).

Storing a chain is then an ``open_sequence`` of its synthetic tokens (``recompute_last_token``
off), a KV write of the blocks the cache did not hold, commit and release, like a warm-handoff
import (``server/snapshot.py``): tree, events, priorities, retention, eviction, host tier and
stats apply unchanged. KV events carry the synthetic token ids.

Mapping engines' block hashes onto keys:

- **vLLM** (v1 ``KVCacheManager``, prefix caching): ``BlockHash`` is the bytes of
  ``hash_function((parent_block_hash, block_token_ids, extra_keys))`` (``sha256_cbor`` by
  default: 32 bytes), the parent of the first block being ``NONE_HASH``; ``extra_keys`` fold in
  the LoRA name, multimodal input hashes and the request's ``cache_salt`` (first block).
  Pass ``bytes(block_hash)`` per block, in ``request.block_hashes`` order; ``KeyNamespace``
  = (served model name, the worker's TP/PP rank, the KV cache group id). ``NONE_HASH`` is
  random per process unless ``PYTHONHASHSEED`` is set: set it, to the same value, on every
  vLLM instance that shares a pool, or their keys never match. Older vLLM versions with
  integer hashes: ``engine_key(int)`` below. The pool's ``tokens_per_block`` must equal
  vLLM's ``block_size`` and its geometry the worker's KV slice.
- **SGLang** (HiCache storage): a page's hash is the hex SHA-256 of its tokens chained with the
  prior page's hash (``get_hash_str(token_ids, prior_hash)``); pass
  ``bytes.fromhex(page_hash)`` (``engine_key(str)`` does this), with ``page_size`` equal to
  ``tokens_per_block``; namespace = (model path, TP rank, 0).
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool_agent.cache.packed import PackedTokens

MAX_KEY_BYTES = 64
"""Longest engine key (a SHA-512 fits; SHA-256 and 64-bit hashes are shorter)."""
MAX_MODEL_CHARS = 256
MAX_RANK = (1 << 32) - 1
MAX_LAYER_GROUP = (1 << 32) - 1
DIGEST_WORDS = 16
"""Most 32-bit digest words a block carries (64 bytes of BLAKE2b)."""
FILLER_TOKEN = 0
_PERSON = b"kvpool-key-v2"
_SEP = "\x1f"
KEYS_SALT_PREFIX = f"{_SEP}keys{_SEP}"
"""How ``KeyNamespace.salt`` marks an engine-keyed namespace."""


class KeyFormatError(ValueError):
    """A namespace or key that is not acceptable (the message names what and why)."""


@dataclass(frozen=True)
class KeyNamespace:
    """Where a chain of engine keys lives (inside the caller's tenant)."""

    model: str
    """Model id: 1 to 256 printable characters."""
    rank: int = 0
    """Parallel rank (tensor/pipeline) whose KV slice the blocks hold: 0 to 2**32 - 1."""
    layer_group: int = 0
    """Layer group (vLLM's KV cache group): 0 to 2**32 - 1."""

    def check(self) -> KeyNamespace:
        if not isinstance(self.model, str) or not 1 <= len(self.model) <= MAX_MODEL_CHARS:
            raise KeyFormatError(f"namespace.model: 1 to {MAX_MODEL_CHARS} characters")
        if not self.model.isprintable():
            raise KeyFormatError("namespace.model: printable characters only")
        for name, value, top in (
            ("rank", self.rank, MAX_RANK),
            ("layer_group", self.layer_group, MAX_LAYER_GROUP),
        ):
            if type(value) is not int or not 0 <= value <= top:
                raise KeyFormatError(f"namespace.{name}: an integer in [0, {top}]")
        return self

    def salt(self) -> str:
        """The cache salt of this namespace (the agent scopes it by tenant)."""
        return f"{KEYS_SALT_PREFIX}{self.model}{_SEP}{self.rank}{_SEP}{self.layer_group}"


def check_keys(keys: Sequence[bytes], max_keys: int) -> list[bytes]:
    """The keys as a list, or KeyFormatError: 1 to ``max_keys`` keys of 1 to 64 bytes."""
    if not isinstance(keys, (list, tuple)):
        raise KeyFormatError("keys: a list of byte strings")
    if not 1 <= len(keys) <= max_keys:
        raise KeyFormatError(f"keys: 1 to {max_keys} keys per request, got {len(keys)}")
    if set(map(type, keys)) == {bytes} and 1 <= min(map(len, keys)) <= max(map(len, keys)) <= 64:
        return list(keys)  # the common case, checked at C speed
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
            raise KeyFormatError(f"keys[{i}]: 1 to {MAX_KEY_BYTES} bytes")
    return list(keys)


def block_tokens(key: bytes, tokens_per_block: int) -> list[int]:
    """The synthetic tokens of one key's block (see the module docstring)."""
    words = min(tokens_per_block, DIGEST_WORDS)
    digest = hashlib.blake2b(bytes(key), digest_size=4 * words, person=_PERSON).digest()
    head = list(struct.unpack(f"<{words}I", digest))
    return head + [FILLER_TOKEN] * (tokens_per_block - words)


try:
    from kvpool_native import chain_tokens as _fast_chain
    from kvpool_native import chain_tokens_packed as _fast_packed_chain
except ImportError:  # the compiled core is optional
    _fast_chain = _fast_packed_chain = None

CACHE_KEYS = 1 << 16
"""Keys whose blocks ``chain_tokens`` remembers (per ``tokens_per_block``), without the
compiled core."""
_blocks: dict[int, dict[bytes, tuple[int, ...]]] = {}


def chain_tokens(keys: Sequence[bytes], tokens_per_block: int) -> list[int]:
    """The synthetic tokens of a chain: its blocks' tokens, first block first (``block_tokens``
    of each key). With the compiled core, its ``chain_tokens`` digests the keys four at a time
    (about 0.35 µs a key, the Python list included; no cache). Without it, a chain whose keys
    were all seen lately comes from a cache of 65,536 keys; any other is computed whole, one
    digest per key and the words in one array pass (about 2 µs a key)."""
    if _fast_chain is not None and type(keys) is list:
        return _fast_chain(keys, tokens_per_block, _PERSON)
    return _python_chain_tokens(keys, tokens_per_block)


def packed_chain_tokens(keys: Sequence[bytes], tokens_per_block: int) -> PackedTokens:
    """``chain_tokens``, packed (``PackedTokens``): what the agent hands the engine for a
    chain, with no Python int per token (4,096 of them for a 256-block chain at 16 tokens a
    block, made here and read again by the engine and the event encoder)."""
    if _fast_packed_chain is not None and type(keys) is list:
        return PackedTokens(_fast_packed_chain(keys, tokens_per_block, _PERSON))
    return PackedTokens(array("I", _python_chain_tokens(keys, tokens_per_block)).tobytes())


def _python_chain_tokens(keys: Sequence[bytes], tokens_per_block: int) -> list[int]:
    cache = _blocks.get(tokens_per_block)
    if cache is None:
        cache = _blocks[tokens_per_block] = {}
    try:
        return list(itertools.chain.from_iterable([cache[k] for k in keys]))
    except KeyError:
        pass
    n = len(keys)
    words = min(tokens_per_block, DIGEST_WORDS)
    blake2b = hashlib.blake2b
    digests = b"".join([blake2b(k, digest_size=4 * words, person=_PERSON).digest() for k in keys])
    table = np.zeros((n, tokens_per_block), dtype=np.uint32)
    table[:, :words] = np.frombuffer(digests, dtype="<u4").reshape(n, words)
    out: list[int] = table.ravel().tolist()
    if len(cache) + n > CACHE_KEYS:  # keep the newer half
        kept = list(cache.items())[len(cache) // 2 :] if n < CACHE_KEYS // 2 else []
        cache.clear()
        cache.update(kept)
    for i, key in enumerate(keys[: CACHE_KEYS // 2]):
        cache[key] = tuple(out[i * tokens_per_block : (i + 1) * tokens_per_block])
    return out


def engine_key(value: bytes | bytearray | memoryview | int | str) -> bytes:
    """A block hash as an engine key: bytes as they are (vLLM's ``BlockHash``), an int as
    8 bytes two's complement big-endian when it fits 64 bits else 32 bytes unsigned (older
    vLLM hashes), a hex string as its bytes (SGLang page hashes)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, bool):
        raise KeyFormatError("engine_key: a bool is not a block hash")
    if isinstance(value, int):
        if -(1 << 63) <= value < 1 << 63:
            return value.to_bytes(8, "big", signed=True)
        if 0 <= value < 1 << 256:
            return value.to_bytes(32, "big")
        raise KeyFormatError("engine_key: an int hash wider than 256 bits")
    if isinstance(value, str):
        try:
            return bytes.fromhex(value)
        except ValueError:
            raise KeyFormatError("engine_key: a string hash must be hex") from None
    raise KeyFormatError(f"engine_key: unsupported hash type {type(value).__name__}")
