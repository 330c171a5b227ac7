"""The compiled checks of token ids (``sequences.check_and_pack``'s fast paths)."""

from __future__ import annotations

import pytest
from kvpool_native import pack_tokens, tokens_valid

from kvpool_agent.cache.errors import InvalidTokensError
from kvpool_agent.cache.sequences import check_and_pack


class Int(int):
    pass


def test_ids_past_32_bits_are_valid_and_left_unpacked() -> None:
    wide = [1 << 40, 3, (1 << 63) - 1]
    assert pack_tokens(wide) is None and tokens_valid(wide) and tokens_valid(tuple(wide))
    assert check_and_pack(wide) == (wide, None)
    assert check_and_pack([1, 2]) == ([1, 2], b"\x01\x00\x00\x00\x02\x00\x00\x00")


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1 << 40, 1 << 63], "below 2\\*\\*63"),
        ([1 << 40, -1], "non-negative"),
        ([1 << 40, True], "must be ints, got bool"),
        ([1 << 40, Int(2)], "must be ints, got Int"),
        ([1 << 40, 2.0], "must be ints, got float"),
    ],
)
def test_a_bad_id_among_wide_ones_is_named(tokens: list[object], message: str) -> None:
    assert not tokens_valid(tokens)
    with pytest.raises(InvalidTokensError, match=message):
        check_and_pack(tokens)  # type: ignore[arg-type]


def test_only_lists_and_tuples_are_checked_fast() -> None:
    assert not tokens_valid(range(3)) and not tokens_valid(iter([1]))
    assert check_and_pack(range(3)) == (
        [0, 1, 2],
        b"\x00\x00\x00\x00\x01\x00\x00\x00\x02\x00\x00\x00",
    )
