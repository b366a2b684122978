"""Deterministic scenarios of the hybrid manager: exact block ids per group, the exact
free-queue order, window release in prefill and decode, hit rules, events and errors.

block_size is 4 throughout; block 0 is the null block whenever a group releases blocks.
"""

import pytest

from prefixkv import AllBlocksCleared, ConfigError, ExtraKeys, PrefixCacheStats, RequestError, TokenError
from prefixkv.groups import (
    GroupAdmission,
    GroupBlockCopy,
    GroupBlockRemoved,
    GroupBlockStored,
    GroupFork,
    GroupStats,
    HybridKVCacheManager,
    chunked_local,
    full_attention,
    sliding_window,
)

FULL, SW8 = full_attention(), sliding_window(8)  # a query at p reads p-7 .. p


def manager(groups, num_blocks, **kw):
    return HybridKVCacheManager(groups, num_blocks, 4, seed=0, **kw)


def test_prefill_chunks_and_decode_release_blocks_that_leave_the_window():
    m = manager([FULL, SW8], 16)
    assert m.null_block_id == 0
    prompt = list(range(1, 15))                       # 14 tokens: blocks 0..3
    adm = m.add_request("a", prompt, num_new_tokens=9)
    assert adm == GroupAdmission("a", ((1, 2, 3), (4, 5, 6)), 0, 9)
    assert adm.block_ids == (1, 2, 3)
    # the next chunk starts at 9: its first query reads 2..9, so block 0 (0..3) stays
    assert m.extend("a", 5) == ((7,), (8,))
    assert m.get_block_ids("a") == ((1, 2, 3, 7), (4, 5, 6, 8))
    # decode at 14 reads 7..14: block 0 goes back (cached, most recently used)
    assert m.append_tokens("a", [20]) == ((), ())
    assert m.get_block_ids("a") == ((1, 2, 3, 7), (0, 5, 6, 8))
    assert m.free_block_order() == [9, 10, 11, 12, 13, 14, 15, 4]
    assert m.append_tokens("a", [21]) == ((), ())    # at 15: reads 8..15, block 1 goes
    assert m.append_tokens("a", [22]) == ((9,), (10,))
    assert m.get_block_ids("a") == ((1, 2, 3, 7, 9), (0, 0, 6, 8, 10))
    assert m.free_block_order() == [11, 12, 13, 14, 15, 4, 5]
    assert m.group_stats() == (
        GroupStats(0, "full_attention", 0, 5, 4, 0, 0),
        GroupStats(1, "sliding_window", 8, 3, 4, 2, 0),
    )
    m.free("a")  # the block ending the longest prefix first, groups in order among equals
    assert m.free_block_order() == [10, 9, 11, 12, 13, 14, 15, 4, 5, 7, 8, 3, 6, 2, 1]
    m.check_invariants()


def test_a_hit_needs_every_full_block_but_only_the_window_of_the_sliding_group():
    m = manager([FULL, SW8], 16)
    prompt = list(range(1, 18))                       # 17 tokens: 4 full blocks
    m.add_request("a", prompt)
    assert m.get_block_ids("a") == ((1, 2, 3, 4, 5), (6, 7, 8, 9, 10))
    m.free("a")
    assert m.free_block_order() == [10, 5, 11, 12, 13, 14, 15, 4, 9, 3, 8, 2, 7, 1, 6]
    # hit 16 tokens: the query at 16 reads 9..16, so the sliding group takes blocks 2, 3
    adm = m.add_request("b", prompt + [5])
    assert adm == GroupAdmission("b", ((1, 2, 3, 4, 10), (0, 0, 8, 9, 5)), 16, 2)
    assert m.free_block_order() == [11, 12, 13, 14, 15, 7, 6]
    assert [s.hit_blocks for s in m.group_stats()] == [4, 2]
    m.check_invariants()


def test_an_evicted_window_block_shortens_the_hit_to_what_every_group_can_serve():
    m = manager([FULL, SW8], 12)
    prompt = list(range(1, 18))
    m.add_request("a", prompt)                        # (1..5), (6..10)
    m.free("a")
    assert m.free_block_order() == [10, 5, 11, 4, 9, 3, 8, 2, 7, 1, 6]
    m.add_request("x", list(range(50, 63)))           # 4 blocks a group: evicts 4 9 3 8 2
    assert m.get_block_ids("x") == ((10, 5, 11, 4), (9, 3, 8, 2))
    m.free("x")
    assert m.free_block_order() == [2, 4, 7, 1, 6, 11, 8, 5, 3, 10, 9]
    # a's cached blocks left: full block 0 (id 1), sliding blocks 0 (6) and 1 (7). The
    # full group serves 1 block; a query at 4 reads 0..4: sliding block 0, cached
    assert m.lookup(prompt) == 4 and m.lookup_block_ids(prompt) == ((1,), (6,))
    assert m.add_request("b", prompt) == GroupAdmission(
        "b", ((1, 2, 4, 7, 11), (6, 8, 5, 3, 10)), 4, 13)
    m.check_invariants()


def test_sliding_only_model_hits_through_released_and_evicted_leading_blocks():
    m = manager([sliding_window(5)], 8)
    prompt = list(range(1, 22))                       # 21 tokens: blocks 0..5
    m.add_request("a", prompt, num_new_tokens=12)
    assert m.extend("a", 9) == ((4, 5, 6),)           # at 12 a query reads 8..12
    assert m.get_block_ids("a") == ((0, 0, 3, 4, 5, 6),)
    assert m.free_block_order() == [7, 2, 1]
    m.free("a")
    assert m.free_block_order() == [6, 7, 2, 1, 5, 4, 3]
    m.add_request("x", [7] * 9)                       # evicts a's block 1 (id 2)
    assert m.get_block_ids("x") == ((6, 7, 2),)
    m.free("x")
    # the prefix ids of blocks 0, 1 outlive block 1: a hit of 20 reads 16..20, block 4
    assert m.lookup(prompt) == 20
    assert m.lookup_block_ids(prompt) == ((0, 0, 0, 0, 5),)   # as b's table will begin
    assert m.add_request("b", prompt) == GroupAdmission("b", ((0, 0, 0, 0, 5, 2),), 20, 1)
    m.check_invariants()


def test_chunked_local_releases_whole_chunks_and_hits_at_a_chunk_start_need_nothing():
    m = manager([FULL, chunked_local(8)], 16)
    prompt = list(range(1, 18))
    m.add_request("a", prompt, num_new_tokens=8)
    # a query at 8 starts the chunk 8..15: blocks 0, 1 (ids 3, 4) go
    assert m.extend("a", 9) == ((5, 6, 7), (8, 9, 10))
    assert m.get_block_ids("a") == ((1, 2, 5, 6, 7), (0, 0, 8, 9, 10))
    m.free("a")
    # a hit of 16 starts a chunk: the chunked group needs no cached block for it
    assert m.add_request("b", prompt + [1]) == GroupAdmission(
        "b", ((1, 2, 5, 6, 10), (0, 0, 0, 0, 7)), 16, 2)
    m.check_invariants()


def test_fork_shares_full_blocks_and_released_entries_and_copies_partial_blocks_per_group():
    m = manager([FULL, SW8], 16)
    m.add_request("p", list(range(1, 11)))            # 10 tokens
    m.append_tokens("p", [11, 12, 13])                # at 10: reads 3.. (blocks 0 kept)
    m.append_tokens("p", [14])                        # at 13: reads 6..: block 0 released
    assert m.get_block_ids("p") == ((1, 2, 3, 7), (0, 5, 6, 8))
    fork = m.fork("p", "c")
    assert fork == GroupFork("c", ((1, 2, 3, 9), (0, 5, 6, 10)),
                             (GroupBlockCopy(7, 9, 0), GroupBlockCopy(8, 10, 1)))
    assert m.take_kv_ops() == list(fork.copies) and m.take_kv_ops() == []
    m.check_invariants()
    m.free("p")
    m.free("c")
    m.check_invariants()


def test_groups_never_match_each_others_keys_and_events_name_the_group():
    m = manager([SW8, FULL], 16, enable_events=True)
    m.add_request("a", [1, 2, 3, 4, 5])
    stored = m.take_events()
    assert [(e.group_idx, e.spec_kind, e.spec_tokens, e.block_ids) for e in stored] == [
        (0, "sliding_window", 8, (1,)), (1, "full_attention", 0, (3,))]
    assert isinstance(stored[0], GroupBlockStored) and stored[0].block_hashes == stored[1].block_hashes
    m.free("a")
    assert m.lookup([1, 2, 3, 4, 5]) == 4
    m.add_request("x", list(range(100, 125)))         # 14 blocks: evicts the LRU block, 1
    removed = [e for e in m.take_events() if isinstance(e, GroupBlockRemoved)]
    assert [(e.group_idx, e.block_ids, e.block_hashes) for e in removed] == [
        (0, (1,), stored[0].block_hashes)]
    assert m.lookup([1, 2, 3, 4, 5]) == 0             # the full group has it, the window not
    m.free("x")
    assert m.reset_prefix_cache() and m.take_events() == [AllBlocksCleared()]
    assert m.null_block_id == 0 and m.free_block_order()[0] == 1
    m.check_invariants()


def test_a_reset_keeps_the_free_order_and_the_null_block():
    # vLLM's reset drops the hashes and keeps its free queue: blocks freed last (an
    # offload of theirs may still read them) are reused last after it too
    m = manager([FULL, SW8], 12)
    assert m.add_request("a", list(range(1, 11))).group_block_ids == ((1, 2, 3), (4, 5, 6))
    assert m.add_request("c", [70] * 5).group_block_ids == ((7, 8), (9, 10))
    m.free("a")
    m.free("c")
    # the partial blocks (empty) first, last freed on top; then the cached ones, LRU first
    order = [10, 8, 6, 3, 11, 2, 5, 1, 4, 7, 9]
    assert m.free_block_order() == order
    assert m.reset_prefix_cache()
    assert m.null_block_id == 0 and m.free_block_order() == order and m.lookup(list(range(1, 11))) == 0
    assert m.add_request("e", [80] * 9).group_block_ids == ((10, 8, 6), (3, 11, 2))
    m.check_invariants()


def test_event_log_overflow_restates_every_group():
    m = manager([FULL, SW8], 16, enable_events=True, max_events=3)
    m.add_request("a", list(range(1, 10)))            # 2 full blocks x 2 groups: 4 events
    out = m.take_events()
    assert out[0] == AllBlocksCleared() and len(out) == 5
    assert [(e.group_idx, e.block_ids) for e in out[1:]] == [(0, (1,)), (0, (2,)), (1, (4,)), (1, (5,))]


def test_shortage_changes_nothing_and_blocks_a_step_releases_count_as_free():
    m = manager([FULL, SW8], 8)                       # 7 usable blocks
    assert m.add_request("big", list(range(1, 14))) is None   # 4 blocks x 2 groups
    assert m.free_block_order() == [1, 2, 3, 4, 5, 6, 7] and m.stats == PrefixCacheStats()
    m.add_request("a", list(range(1, 10)))                     # (1, 2, 3), (4, 5, 6)
    assert m.append_tokens("a", [10, 11, 12]) == ((), ())      # at 9: reads 2..
    assert m.free_block_order() == [7]
    # at 12 a query reads 5..: block 0 of the sliding group goes; 17 tokens need 4
    # blocks, 1 free + 1 released: short, and nothing changes (block 4 stays)
    assert m.append_tokens("a", [13, 14, 15, 16, 17]) is None
    assert m.get_block_ids("a") == ((1, 2, 3), (4, 5, 6)) and m.num_tokens("a") == 12
    # one token needs 2 blocks: the free one and the released one (evicted at once)
    assert m.append_tokens("a", [13]) == ((7,), (4,))
    assert m.get_block_ids("a") == ((1, 2, 3, 7), (0, 5, 6, 4))
    m.check_invariants()


def test_stats_count_the_hit_every_group_served():
    m = manager([FULL, SW8], 16)
    m.add_request("a", list(range(1, 10)))
    m.free("a")
    m.add_request("b", list(range(1, 10)), resumed=True)
    assert m.take_stats() == PrefixCacheStats(1, 9, 0, 1, 9, 8)
    assert m.usage == 3 * 2 / 15


def test_a_request_dropped_before_its_step_ran_leaves_nothing_findable_in_any_group():
    m = manager([FULL, SW8], 16, enable_events=True)
    m.add_request("a", list(range(1, 10)))
    m.take_events()
    m.free("a", num_computed_tokens=0)
    assert sorted(type(e).__name__ for e in m.take_events()) == ["GroupBlockRemoved"] * 4
    assert m.lookup(list(range(1, 10))) == 0
    m.check_invariants()


def test_read_cache_false_and_duplicate_content_stay_consistent():
    m = manager([FULL, SW8], 16)
    m.add_request("a", list(range(1, 10)))
    adm = m.add_request("b", list(range(1, 10)), read_cache=False)
    assert adm.num_cached_tokens == 0 and adm.group_block_ids == ((7, 8, 9), (10, 11, 12))
    m.free("a")
    m.free("b")
    assert m.lookup(list(range(1, 10))) == 8
    m.check_invariants()


@pytest.mark.parametrize("args, kw", [
    (([],), {}), ((["full"],), {}), ((5,), {}), (([FULL], 0), {}), (([SW8], 1), {}),
    (([FULL], 4), {"block_size": 0}), (([FULL], 4), {"enable_events": 1}),
    (([FULL], 4), {"hash_mode": "md5"}),
])
def test_bad_construction_raises_config_error(args, kw):
    args = args + (4,) * (len(args) == 1)
    with pytest.raises(ConfigError):
        HybridKVCacheManager(*args, **kw)


def test_caller_mistakes_raise_typed_errors_before_any_change():
    m = manager([FULL, SW8], 16)
    m.add_request("a", [1, 2, 3, 4, 5], num_new_tokens=2)
    before = (m.free_block_order(), m.get_block_ids("a"), m.stats)
    bad = [
        (RequestError, lambda: m.add_request("a", [1])),
        (RequestError, lambda: m.add_request(["x"], [1])),
        (RequestError, lambda: m.add_request("b", [1], num_new_tokens=0)),
        (RequestError, lambda: m.add_request("b", [1], resumed=1)),
        (RequestError, lambda: m.add_request("b", [1], read_cache="no")),
        (TokenError, lambda: m.add_request("b", [])),
        (TokenError, lambda: m.add_request("b", [-1])),
        (TokenError, lambda: m.lookup([])),
        (RequestError, lambda: m.extend("a", 4)),
        (RequestError, lambda: m.extend("zz", 1)),
        (RequestError, lambda: m.append_tokens("a", [1])),
        (RequestError, lambda: m.fork("a", "c")),
        (RequestError, lambda: m.free("a", num_computed_tokens=3)),
        (RequestError, lambda: m.free("zz")),
        (RequestError, lambda: m.get_block_ids("zz")),
    ]
    for error, call in bad:
        with pytest.raises(error):
            call()
    assert (m.free_block_order(), m.get_block_ids("a"), m.stats) == before
    m.extend("a", 3)
    with pytest.raises(TokenError):
        m.append_tokens("a", [2**32])
    with pytest.raises(RequestError):
        m.fork("a", "a")
    m.check_invariants()


def test_a_failing_hash_callable_changes_nothing():
    calls = []

    def fn(data):
        calls.append(data)
        if len(calls) > 2:
            raise RuntimeError("boom")
        return b"h" * 16

    m = HybridKVCacheManager([FULL, SW8], 16, 4, hash_mode=fn, enable_events=True)
    m.add_request("a", [1, 2, 3, 4, 5, 6])
    with pytest.raises(ConfigError):
        m.append_tokens("a", [7, 8, 9])
    assert m.num_tokens("a") == 6 and m.get_block_ids("a") == ((1, 2), (3, 4))
    m.check_invariants()


def test_multimodal_inputs_and_salts_enter_every_groups_keys():
    from prefixkv import MultiModalInput
    m = manager([FULL, SW8], 32)
    prompt = list(range(1, 22))                       # 21 tokens: 5 full blocks
    img = lambda h: ExtraKeys(mm=(MultiModalInput(h, 9, 4),))  # noqa: E731 (positions 9..12)
    m.add_request("a", prompt, extra=img("cat"))
    m.free("a")
    assert m.lookup(prompt, extra=img("cat")) == 20
    # another image: blocks 2 and 3 (8..15) differ, and so does every block after them
    assert m.lookup(prompt, extra=img("dog")) == 8
    assert m.lookup(prompt, extra=ExtraKeys(cache_salt="t")) == 0
    m.check_invariants()
