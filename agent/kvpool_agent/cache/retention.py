"""Retention policies: the priorities a request gives its blocks (the reference's names).

A ``TokenRangeRetentionConfig`` sets the priority of prompt tokens in
``[token_start, token_end)``; ``decode_retention_priority`` sets it for blocks holding
generated tokens. A priority with a duration reverts to the default (35) once the duration
has passed since the block first became reusable; ``None`` never expires.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from kvpool_agent.config import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY

MAX_DURATION_MS = 366 * 24 * 3600 * 1000
"""Longest retention duration (a year): a bound, so no duration overflows a clock."""
MAX_RANGES = 64
"""Most token ranges in one policy: each is checked per block of the request."""
MAX_TOKEN_INDEX = 1 << 40


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class TokenRangeRetentionConfig(_Model):
    """Priority of prompt tokens ``[token_start, token_end)``; no ``token_end``: to the end."""

    token_start: int = Field(0, ge=0, le=MAX_TOKEN_INDEX)
    token_end: int | None = Field(None, gt=0, le=MAX_TOKEN_INDEX)
    priority: int = Field(..., ge=MIN_PRIORITY, le=MAX_PRIORITY)
    duration_ms: int | None = Field(None, ge=0, le=MAX_DURATION_MS)

    @model_validator(mode="after")
    def _ordered(self) -> TokenRangeRetentionConfig:
        if self.token_end is not None and self.token_end <= self.token_start:
            raise ValueError(
                f"token_end ({self.token_end}) must exceed token_start ({self.token_start})"
            )
        return self


class KvCacheRetentionConfig(_Model):
    """A request's retention policy."""

    token_range_retention_configs: list[TokenRangeRetentionConfig] = Field(
        default_factory=list, max_length=MAX_RANGES
    )
    decode_retention_priority: int = Field(DEFAULT_PRIORITY, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    decode_duration_ms: int | None = Field(None, ge=0, le=MAX_DURATION_MS)

    def block_priority(
        self, start: int, end: int, num_prompt_tokens: int
    ) -> tuple[int, int | None]:
        """Priority and duration (ms) of a block holding tokens ``[start, end)``.

        A block with any generated token takes the decode priority. Otherwise it takes the
        highest priority among the ranges that overlap it (the default when none does), with
        that range's duration.
        """
        if end > num_prompt_tokens:
            return self.decode_retention_priority, self.decode_duration_ms
        best: tuple[int, int | None] = (DEFAULT_PRIORITY, None)
        found = False
        for rng in self.token_range_retention_configs:
            rng_end = rng.token_end if rng.token_end is not None else num_prompt_tokens
            if rng.token_start < end and start < rng_end and (not found or rng.priority > best[0]):
                best = (rng.priority, rng.duration_ms)
                found = True
        return best


DEFAULT_RETENTION = KvCacheRetentionConfig()
