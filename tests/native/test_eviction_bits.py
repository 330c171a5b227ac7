"""The building blocks that must match CPython to the bit: the float functions the policies
compute with."""

from __future__ import annotations

import math
import random

import pytest

from .twins import bits

kvpool_native = pytest.importorskip("kvpool_native")


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
