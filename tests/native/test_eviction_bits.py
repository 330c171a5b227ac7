"""The building blocks that must match CPython to the bit: the float functions the policies
compute with, and the iteration order of a set of ints (the mixture re-buckets blocks in
its ``_dirty`` set's order)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .twins import bits

kvpool_native = pytest.importorskip("kvpool_native")

keys = st.one_of(
    st.integers(-50, 50),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([-1, -2, 2**61 - 1, 2**61, -(2**61) + 1, 2**63 - 1, -(2**63)]),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.one_of(keys, st.none()), max_size=200))
def test_a_set_iterates_in_cpythons_order(ops: list[int | None]) -> None:
    s: set[int] = set()
    for op in ops:
        if op is None:
            s.clear()
        else:
            s.add(op)
    assert kvpool_native.pyset_order(ops) == list(s)


@pytest.mark.parametrize("size", [100, 5_000, 60_000])
def test_a_large_set_iterates_in_cpythons_order(size: int) -> None:
    """Past the growth steps, and past 50,000 entries (where growth slows to 2x)."""
    rng = random.Random(size)
    ops: list[int | None] = [rng.getrandbits(64) - 2**63 for _ in range(size)]
    ops += [rng.randrange(size) for _ in range(size // 10)]  # repeats and small ints
    ops += [None] + ops[: size // 3]
    s: set[int] = set()
    for op in ops:
        if op is None:
            s.clear()
        else:
            s.add(op)
    assert kvpool_native.pyset_order(ops) == list(s)


def test_the_float_functions_match_python_to_the_bit() -> None:
    rng = random.Random(11)
    decay = 1e-5
    for _ in range(20_000):
        age = rng.randrange(0, 10_000_000)
        x = -decay * age
        assert bits([kvpool_native.py_pow(2.0, x)]) == bits([2.0**x])
        crf = 1.0 + rng.random() * rng.choice([1.0, 10.0, 1e6])
        assert bits([kvpool_native.py_log2(crf)]) == bits([math.log2(crf)])
        size = rng.randrange(1, 1_000_000)
        for horizon in (0.25, 1.0):
            d = 0.5 ** (1.0 / (horizon * size))
            assert bits([kvpool_native.py_pow(0.5, 1.0 / (horizon * size))]) == bits([d])
            spread = rng.randrange(0, 200)
            assert bits([kvpool_native.py_pow(d, float(spread))]) == bits([d**spread])
