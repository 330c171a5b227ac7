"""Open sequences: their records, and the validators every request's input passes first.

The validators raise the engine's typed errors (``cache/errors.py``) before anything
changes; the façade (``manager.py``) runs them, so the core only ever sees plain, valid
data: token lists of non-negative ints (packed when they fit 32 bits), a namespace int, a
validated retention policy.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from kvpool_agent.cache.block import Block, TreeNode
from kvpool_agent.cache.errors import (
    InvalidRetentionError,
    InvalidTokensError,
    UnknownSequenceError,
)
from kvpool_agent.cache.packed import pack_all
from kvpool_agent.cache.retention import DEFAULT_RETENTION, KvCacheRetentionConfig
from kvpool_agent.config import format_validation_error


class SequenceRecord:
    """What the engine keeps of one open sequence."""

    __slots__ = (
        "committed_blocks",
        "held",
        "namespace",
        "nodes",
        "num_prompt",
        "observed",
        "packed",
        "retention",
        "reused",
        "seq_id",
        "slide_from",
        "tokens",
    )

    def __init__(
        self,
        seq_id: int,
        namespace: int,
        tokens: list[int],
        retention: KvCacheRetentionConfig,
        num_groups: int,
    ) -> None:
        self.seq_id = seq_id
        self.namespace = namespace
        self.tokens = tokens
        self.num_prompt = len(tokens)
        self.retention = retention
        self.nodes: list[TreeNode] = []
        """Tree nodes of the sequence's leading full blocks (matched or stored)."""
        self.held: list[list[Block | None]] = [[] for _ in range(num_groups)]
        """Per group, the block of each block index (None once released from a window)."""
        self.committed_blocks = 0
        self.reused = 0
        self.observed = 0
        """Leading full blocks the eviction policy has been told about."""
        self.slide_from = 0
        """Tokens before the latest appended chunk: windows are kept relative to it."""
        self.packed: bytes | None = None
        """The prompt's tokens packed (``pack_all``; None if some does not fit): a commit
        slices the prompt's blocks from it instead of packing each."""


# --------------------------------------------------------------------- validators


def check_seq_id(seq_id: Any) -> int:
    """A sequence id must be an int (not a bool); whether it is open is the core's to say."""
    if isinstance(seq_id, bool) or not isinstance(seq_id, int):
        raise UnknownSequenceError(f"seq_id must be an int, got {seq_id!r}")
    return seq_id


def not_open(seq_id: int) -> UnknownSequenceError:
    return UnknownSequenceError(f"sequence {seq_id} is not open (unknown or released)")


def check_tokens(tokens: Sequence[int]) -> list[int]:
    return check_and_pack(tokens)[0]


try:
    from kvpool_native import pack_tokens as _fast_pack
    from kvpool_native import tokens_valid as _fast_valid
except ImportError:  # the compiled core is optional
    _fast_pack = _fast_valid = None

TOKEN_LIMIT = 1 << 63
"""Token ids are below 2**63, as the HTTP API and snapshots take them (and as the compiled
core keeps them, in 64 bits)."""


def check_and_pack(tokens: Sequence[int]) -> tuple[list[int], bytes | None]:
    """The validated tokens, and them packed (``pack_all``) when every one fits."""
    if _fast_pack is not None:
        # The compiled core's one pass over exact ints in [0, 2**32): the common case. It
        # gives pack_all's bytes or None, and None leaves everything to the checks below.
        packed = _fast_pack(tokens)
        if packed is not None and packed:
            return list(tokens), packed
        if packed is None and _fast_valid(tokens):  # valid, some id past 32 bits: no packing
            return list(tokens), None
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (list, tuple, range)):
        raise InvalidTokensError(f"tokens must be a list of ints, got {type(tokens).__name__}")
    toks = list(tokens)
    if toks and set(map(type, toks)) == {int}:
        # the common case, checked at C speed: packing fails for a negative token
        packed = pack_all(toks)
        if packed is not None or (min(toks) >= 0 and max(toks) < TOKEN_LIMIT):
            return toks, packed
    for t in toks:
        if type(t) is not int:
            raise InvalidTokensError(f"tokens must be ints, got {type(t).__name__} ({t!r})")
        if t < 0:
            raise InvalidTokensError(f"tokens must be non-negative, got {t}")
        if t >= TOKEN_LIMIT:
            raise InvalidTokensError(f"tokens must be below 2**63, got {t}")
    return toks, pack_all(toks)


def check_retention(
    retention: KvCacheRetentionConfig | dict[str, Any] | None,
) -> KvCacheRetentionConfig:
    """The request's retention policy, validated (``DEFAULT_RETENTION`` when it gave none)."""
    if retention is None:
        return DEFAULT_RETENTION
    if isinstance(retention, KvCacheRetentionConfig):
        return retention
    try:
        return KvCacheRetentionConfig.model_validate(retention)
    except ValidationError as err:
        raise InvalidRetentionError(format_validation_error(err, "retention policy")) from None


def namespace_of(cache_salt: str | None, extra_keys: Sequence[int | str]) -> int:
    """Root key of a tenant's tree: 0 without salt or keys, else a stable 63-bit digest."""
    if cache_salt is None and not extra_keys:
        return 0
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidTokensError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    if not extra_keys:
        return _salt_digest(cache_salt)
    return _namespace_digest(cache_salt, tuple(extra_keys))


def _namespace_digest(cache_salt: str | None, extra_keys: tuple[int | str, ...]) -> int:
    text = repr((cache_salt, extra_keys)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1


@functools.lru_cache(maxsize=4096)
def _salt_digest(cache_salt: str) -> int:
    """A salt's root, remembered: a data-plane store asks for its tenant's twice, and a node
    serves few tenants."""
    return _namespace_digest(cache_salt, ())
