"""``held_contents`` (core and hybrid managers): each block's ``held_content`` id in one
call, 0 where it holds none, writing no pending run (index/pending.py: a miss's run is
recorded unwritten; ``content_of`` writes it, ``contents_of`` reads its ids from the
run). Compared with ``held_content`` block by block over random streams (asked first,
so the runs are still pending), and bad ids refused with RequestError."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import KVCacheManager, RequestError
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window

OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "step", "free", "free", "uncache"]),
                         st.integers(0, 3), st.integers(0, 3), st.integers(1, 14)), min_size=1, max_size=25)


def _manager(hybrid: bool) -> KVCacheManager | HybridKVCacheManager:
    if hybrid:
        return HybridKVCacheManager([full_attention(), sliding_window(8)], 48, 4, vocab_size=100)
    return KVCacheManager(24, 4, vocab_size=100)


def _flat(ids: object) -> list[int]:
    return [i for row in ids for i in row] if ids and isinstance(ids[0], tuple) else list(ids)  # type: ignore[index]


@pytest.mark.parametrize("hybrid", [False, True])
@settings(max_examples=40, deadline=None)
@given(ops=OPS)
def test_held_contents_is_held_content_block_by_block(hybrid, ops):
    m = _manager(hybrid)
    live: set[int] = set()
    for op, slot, prompt, n in ops:
        try:
            if op == "add" and slot not in live:
                m.add_request(slot, [prompt * 10 + k % 3 for k in range(n)])
                live.add(slot)
            elif op == "step" and slot in live:
                m.append_tokens(slot, [n % 5] * 3)
            elif op == "free" and slot in live:
                m.free(slot)
                live.discard(slot)
            elif op == "uncache" and slot in live:
                ids = _flat(m.get_block_ids(slot))
                m.uncache_blocks(ids[len(ids) // 2:len(ids) // 2 + 1])
        except RequestError:
            pass  # (the pool is short: nothing changed)
        every = list(range(m.num_blocks))
        at_once = m.held_contents(every)  # (first: the runs still pending)
        one_by_one = [(c or (0, 0))[1] for c in map(m.held_content, every)]
        assert at_once == one_by_one, (op, at_once, one_by_one)


@pytest.mark.parametrize("hybrid", [False, True])
def test_held_contents_refuses_bad_ids_and_takes_any_sequence(hybrid):
    m = _manager(hybrid)
    m.add_request("a", list(range(9)))
    ids = _flat(m.get_block_ids("a"))
    assert m.held_contents(tuple(ids)) == [(c or (0, 0))[1] for c in map(m.held_content, ids)]
    assert m.held_contents([]) == []
    for bad in ([-1], [m.num_blocks], [1.0], [True], ["x"], None, 3):
        with pytest.raises(RequestError):
            m.held_contents(bad)
