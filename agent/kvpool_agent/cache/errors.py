"""Typed errors of the cache engine. Every one is raised before any state changes."""

from __future__ import annotations


class CacheError(Exception):
    """Base of the engine's errors."""


class UnknownSequenceError(CacheError, KeyError):
    """The sequence id is not open (never opened, or already released)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown sequence"


class RequestTooLargeError(CacheError, ValueError):
    """The request needs more blocks than the whole pool holds."""


class OutOfBlocksError(CacheError, RuntimeError):
    """Not enough free or evictable blocks right now (the rest are pinned by open sequences)."""


class InvalidTokensError(CacheError, TypeError):
    """Tokens must be a sequence of non-negative ints."""


class InvalidRetentionError(CacheError, ValueError):
    """A retention policy outside the allowed ranges (priority 0..100, durations >= 0)."""
