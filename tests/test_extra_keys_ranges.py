"""``ExtraKeys.for_range``: the keys of one block, found without walking every multimodal
input (a 32k-token prompt fed by embeddings has one per block: 2,048)."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import ExtraKeys, ExtraKeysError, MultiModalInput


def _naive(e: ExtraKeys, start: int, end: int) -> tuple[MultiModalInput, ...]:
    return tuple(m for m in e.mm if m.offset < end and m.offset + m.length > start)


@settings(max_examples=50, deadline=None)
@given(spans=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 40)), max_size=40),
       ranges=st.lists(st.tuples(st.integers(0, 250), st.integers(1, 32)), min_size=1, max_size=20),
       lora=st.sampled_from([None, "adapter"]))
def test_for_range_is_the_inputs_overlapping_the_range_in_their_order(spans, ranges, lora):
    # overlapping, unsorted, nested inputs alike
    e = ExtraKeys(lora=lora, mm=tuple(MultiModalInput(f"m{i}", o, n) for i, (o, n) in enumerate(spans)))
    for start, size in ranges:
        got = e.for_range(start, start + size)
        want = _naive(e, start, start + size)
        if not want and lora is None:
            assert got is None
        else:
            assert got is not None and got.mm == want and got.lora == lora


def test_the_keys_of_every_block_of_a_long_embedded_prompt_cost_per_block_not_per_input():
    # 2,048 blocks, an input per block: every block's keys (as events ask) took a pass over
    # all 2,048 inputs each (4.2 million steps); counted in Python line events, not timed
    bs, n = 16, 2048
    e = ExtraKeys(mm=tuple(MultiModalInput(f"e{j}", j * bs, bs) for j in range(n)))
    lines = 0

    def trace(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
        return trace

    sys.settrace(trace)
    try:
        got = [e.for_range(j * bs, (j + 1) * bs) for j in range(n)]
    finally:
        sys.settrace(None)
    assert [g.mm for g in got] == [(m,) for m in e.mm]
    assert lines < 48 * n, lines  # (per block: the bisection and a checked ExtraKeys)


def test_a_lora_path_enters_the_keys_and_needs_a_name():
    from prefixkv.errors import ExtraKeysError

    a = ExtraKeys(lora="sql", lora_path="/w/v1")
    b = ExtraKeys(lora="sql", lora_path="/w/v2")
    assert a.base_bytes() != b.base_bytes() != ExtraKeys(lora="sql").base_bytes()
    assert ExtraKeys(lora="sql", lora_path="/w/v1").base_bytes() == a.base_bytes()
    e = ExtraKeys(lora="sql", lora_path="/w", mm=(MultiModalInput("i", 0, 4), MultiModalInput("j", 8, 4)))
    assert e.for_range(0, 4).lora_path == "/w"
    for bad in ({"lora_path": "/w"}, {"lora": "x", "lora_path": ""}, {"lora": "x", "lora_path": 3},
                {"lora": "x", "lora_path": "\ud800"}):
        with pytest.raises(ExtraKeysError, match="lora_path"):
            ExtraKeys(**bad)


@pytest.mark.parametrize(("num_blocks", "block_size"), [
    pytest.param(None, 4, id="num_blocks-None"),
    pytest.param(-1, 4, id="num_blocks-negative"),
    pytest.param(1.5, 4, id="num_blocks-float"),
    pytest.param(True, 4, id="num_blocks-bool"),
    pytest.param(2, 0, id="block_size-zero"),
    pytest.param(2, -4, id="block_size-negative"),
    pytest.param(2, None, id="block_size-None"),
    pytest.param(2, 2.0, id="block_size-float"),
])
def test_block_bytes_takes_counts_and_refuses_others_with_an_extra_keys_error(num_blocks, block_size):
    """``ExtraKeys.block_bytes`` (public) with counts that are not: a block size of 0
    was a ZeroDivisionError, None a TypeError, and a negative count or block size gave
    an answer silently (review-r21)."""
    keys = ExtraKeys(lora="a", mm=(MultiModalInput("h", 2, 4),))
    with pytest.raises(ExtraKeysError):
        keys.block_bytes(num_blocks, block_size)
