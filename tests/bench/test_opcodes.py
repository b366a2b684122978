"""The benchmarks' one bytecode counter (prefixkv.bench.opcodes)."""

from __future__ import annotations

import sys
from collections import Counter
from functools import partial

import pytest

from prefixkv.bench.opcodes import code_name, count_opcodes


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


def test_each_functions_own_bytecodes_and_calls_add_up_to_the_count() -> None:
    own: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    total = count_opcodes(lambda: [_loop(10), _loop(20)], own, calls)
    name = code_name(_loop.__code__)
    assert name.endswith("test_opcodes.py:_loop")
    assert sum(own.values()) == total
    # (a partial is C: counted alone, _loop's bytecodes)
    assert own[name] == count_opcodes(partial(_loop, 10)) + count_opcodes(partial(_loop, 20))
    assert calls[name] == 2
    assert len(calls) == len(own) == 2  # (_loop and the lambda)


def test_a_name_is_the_path_from_the_package_folder_under_src() -> None:
    name = code_name(count_opcodes.__code__)
    assert name.endswith("prefixkv/bench/opcodes.py:count_opcodes")
    assert "/src/" not in name
