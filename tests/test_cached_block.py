"""``KVCacheManager.cached_block_id`` and ``HybridKVCacheManager.cached_block_ids``: which
block holds one prefix now, read by content (what vLLM's ``BlockPool.get_cached_block``
asks; the plug-in's view, tests/engines/test_vllm_block_hashes.py), and
``has_pending_events``. Scenario tests with exact block ids; every Raises."""

from __future__ import annotations

import pytest

from prefixkv import ExtraKeys, KVCacheManager, RequestError
from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, sliding_window

PROMPT = list(range(8))  # two full blocks of 4


def test_each_full_block_of_a_prompt_is_found_its_last_included():
    m = KVCacheManager(8, 4)
    a = m.add_request("a", PROMPT)
    assert a.block_ids == (0, 1)
    assert [m.cached_block_id(PROMPT, n) for n in (4, 8)] == [0, 1]
    # (lookup leaves out the block holding a prompt's last token)
    assert m.lookup_block_ids(PROMPT) == (0,)
    # a longer prompt's prefix, the same blocks; other content, no block
    assert m.cached_block_id([*PROMPT, 9, 9], 8) == 1
    assert m.cached_block_id([0, 1, 2, 3, 5, 5, 5, 5], 8) is None
    assert m.cached_block_id(PROMPT, 8, extra=ExtraKeys(cache_salt="s")) is None
    assert m.cached_block_id(m.prepare(PROMPT), 8) == 1
    order = m.free_block_order()
    m.cached_block_id(PROMPT, 4)
    assert m.free_block_order() == order  # (read-only: no LRU update)


def test_an_evicted_block_is_not_found():
    m = KVCacheManager(2, 4)
    m.add_request("a", PROMPT)
    m.free("a")
    m.add_request("b", [50] * 3)  # one block: the least recent cached one, a's tail (freed first)
    assert m.cached_block_id(PROMPT, 4) is not None
    assert m.cached_block_id(PROMPT, 8) is None


@pytest.mark.parametrize("n", [0, 3, 12, -4, 4.0, None, True])
def test_a_bad_token_count_is_a_request_error(n):
    m = KVCacheManager(8, 4)
    m.add_request("a", PROMPT)
    with pytest.raises(RequestError, match="num_tokens"):
        m.cached_block_id(PROMPT, n)


def test_a_hybrid_manager_answers_per_group():
    m = HybridKVCacheManager([full_attention(), sliding_window(4)], 16, 4)
    a = m.add_request("a", [*PROMPT, 1, 2, 3, 4, 5])  # 3 full blocks; the window keeps what it reads
    ids = a.group_block_ids
    assert [m.cached_block_ids([*PROMPT, 1, 2, 3, 4], n) for n in (4, 8, 12)] == [
        (ids[0][j], ids[1][j]) for j in range(3)]
    assert m.cached_block_ids([9] * 8, 8) == (None, None)


@pytest.mark.parametrize("events", [False, True])
def test_a_group_of_larger_blocks_answers_at_its_block_ends_and_its_tail_entry(events):
    m = HybridKVCacheManager([full_attention(), sliding_window(8)], 32, BlockSizes.of([8, 4]),
                             enable_events=events)
    prompt = list(range(16))
    assert m.add_request("a", prompt).group_block_ids == ((1, 2), (3, 4, 5, 6))
    # the full group keys its 8-token blocks at their ends; inside its last one, the
    # prompt's last hash boundary before its last token (12) is a partial tail entry
    # of block 2, kept with events only (groups/tails.py)
    assert [m.cached_block_ids(prompt, n) for n in (4, 8, 12, 16)] == [
        (None, 3), (1, 4), (2 if events else None, 5), (2, 6)]


@pytest.mark.parametrize("n", [0, 3, 20])
def test_a_bad_token_count_of_the_hybrid_manager_is_a_request_error(n):
    m = HybridKVCacheManager([full_attention(), sliding_window(4)], 16, 4)
    with pytest.raises(RequestError, match="num_tokens"):
        m.cached_block_ids(list(range(17)), n)


@pytest.mark.parametrize("hybrid", [False, True])
def test_pending_events_are_told_before_they_are_taken(hybrid):
    def make(events: bool):
        if hybrid:
            return HybridKVCacheManager([full_attention(), sliding_window(4)], 16, 4, enable_events=events)
        return KVCacheManager(16, 4, enable_events=events)

    m = make(True)
    assert not m.has_pending_events
    m.add_request("a", PROMPT)
    assert m.has_pending_events
    m.take_events()
    assert not m.has_pending_events
    quiet = make(False)
    quiet.add_request("a", PROMPT)
    assert not quiet.has_pending_events
