"""The benchmarks' one bytecode counter (prefixkv.bench.opcodes)."""

from __future__ import annotations

import sys

import pytest

from prefixkv.bench.opcodes import count_opcodes


def _loop(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def test_a_count_is_the_same_each_run_and_grows_with_the_work() -> None:
    small = count_opcodes(lambda: _loop(10))
    assert small == count_opcodes(lambda: _loop(10))
    assert count_opcodes(lambda: _loop(20)) > small > 0


def test_the_tracer_is_removed_even_when_the_call_raises() -> None:
    def boom() -> None:
        raise ValueError("x")

    with pytest.raises(ValueError):
        count_opcodes(boom)
    assert sys.gettrace() is None
