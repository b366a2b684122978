"""Deterministic scenarios: exact block ids and the exact free-queue order after each step.

block_size is 4 throughout; ``free_block_order()`` lists free blocks in reuse order
(empty ones first, then cached ones least recently used first).
"""

from prefixkv import (
    Admission,
    AllBlocksCleared,
    BlockCopy,
    BlockRemoved,
    BlockStored,
    DecodeStep,
    ExtraKeys,
    Fork,
    KVCacheManager,
    PrefixCacheStats,
)

SYS = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks


def manager(num_blocks: int, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, seed=0, **kw)


def test_shared_system_prompt():
    m = manager(10)
    assert m.add_request("a", SYS + [100, 101, 102]) == Admission("a", (0, 1, 2), 0, 11)
    assert m.free_block_order() == [3, 4, 5, 6, 7, 8, 9]
    assert m.add_request("b", SYS + [200, 201]) == Admission("b", (0, 1, 3), 8, 2)
    assert m.free_block_order() == [4, 5, 6, 7, 8, 9]
    m.free("a")  # tail first: 2 (partial, no content) to the empty tier; 1 and 0 still held
    assert m.free_block_order() == [2, 4, 5, 6, 7, 8, 9]
    m.free("b")
    assert m.free_block_order() == [3, 2, 4, 5, 6, 7, 8, 9, 1, 0]
    assert m.add_request("c", SYS + [300]) == Admission("c", (0, 1, 3), 8, 1)
    assert m.free_block_order() == [2, 4, 5, 6, 7, 8, 9]
    assert m.stats == PrefixCacheStats(requests=3, queries=11 + 10 + 9, hits=16)
    m.check_invariants()


def test_multi_turn_chat_hits_history_including_decoded_blocks():
    m = manager(8)
    turn1 = [1, 2, 3, 4, 5, 6]
    assert m.add_request("t1", turn1) == Admission("t1", (0, 1), 0, 6)
    for tok in (7, 8):  # block 1 becomes full with the second decoded token
        assert m.append_tokens("t1", [tok]) == ()
    assert m.append_tokens("t1", [9]) == (2,)
    assert m.num_cached_blocks == 2
    m.free("t1")
    assert m.free_block_order() == [2, 3, 4, 5, 6, 7, 1, 0]
    turn2 = [1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 21, 22, 23]
    assert m.add_request("t2", turn2) == Admission("t2", (0, 1, 2, 3), 8, 5)
    assert m.free_block_order() == [4, 5, 6, 7]
    m.check_invariants()


def test_eviction_under_pressure_takes_the_tail_of_the_lru_chain_first():
    m = manager(4, enable_events=True)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    assert m.add_request("a", a) == Admission("a", (0, 1), 0, 8)
    m.free("a")
    assert m.free_block_order() == [2, 3, 1, 0]
    [stored] = m.take_events()  # one event for the run of two blocks
    assert type(stored) is BlockStored and stored.parent_block_hash is None
    assert stored.token_ids == a and stored.block_ids == [0, 1] and stored.first_block == 0
    assert len(stored.block_hashes) == 2 and stored.block_size == 4

    b = list(range(50, 62))
    assert m.add_request("b", b) == Admission("b", (2, 3, 1), 0, 12)
    events = m.take_events()
    assert events[0] == BlockRemoved([stored.block_hashes[1]], [1])
    assert m.free_block_order() == [0]
    assert m.lookup(a) == 4

    before = (m.free_block_order(), m.stats)
    assert m.add_request("c", a) is None  # needs 1 block beyond the hit; only the hit is free
    assert (m.free_block_order(), m.stats) == before

    m.free("b")
    assert m.free_block_order() == [0, 1, 3, 2]
    assert m.add_request("c", a) == Admission("c", (0, 1), 4, 4)  # evicts b's tail block 1
    assert m.free_block_order() == [3, 2]
    m.check_invariants()


def test_empty_blocks_are_used_before_any_cached_block_is_evicted():
    m = manager(6)
    m.add_request("a", [1, 2, 3, 4, 5])  # blocks 0 (full), 1 (partial)
    m.free("a")
    assert m.free_block_order() == [1, 2, 3, 4, 5, 0]
    assert m.add_request("b", list(range(100, 117))) == Admission("b", (1, 2, 3, 4, 5), 0, 17)
    assert m.lookup([1, 2, 3, 4, 9]) == 4  # block 0 survived
    m.check_invariants()


def test_fork_copies_the_partial_last_block_and_children_diverge():
    m = manager(8)
    m.add_request("p", [1, 2, 3, 4, 5, 6])
    assert m.fork("p", "c") == Fork("c", (0, 2), (BlockCopy(1, 2),))
    assert m.free_block_order() == [3, 4, 5, 6, 7]
    assert m.take_kv_ops() == [BlockCopy(1, 2)]      # the engine copies before the next step
    assert m.append_tokens("p", [7, 8]) == ()
    assert m.append_tokens("c", [70, 80]) == ()
    assert m.lookup([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    assert m.lookup([1, 2, 3, 4, 5, 6, 70, 80, 0]) == 8
    assert m.fork("p", "d") == Fork("d", (0, 1), ())  # no partial block: nothing to copy
    for rid in ("p", "c", "d"):
        m.free(rid)
    assert m.free_block_order() == [3, 4, 5, 6, 7, 2, 1, 0]
    m.check_invariants()


def test_preempt_and_readmit_hits_what_is_still_cached():
    m = manager(6)
    m.add_request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    for tok in (10, 11, 12):
        m.append_tokens("r", [tok])
    tokens = m.preempt("r")
    assert tokens == tuple(range(1, 13))
    assert m.free_block_order() == [3, 4, 5, 2, 1, 0]
    # three full blocks are cached, but one token must be computed: the last block is
    # recomputed into a fresh block (a shared block is never written again)
    assert m.add_request("r", tokens) == Admission("r", (0, 1, 3), 8, 4)
    assert m.free_block_order() == [4, 5, 2]
    m.free("r")
    assert m.free_block_order() == [3, 4, 5, 2, 1, 0]  # 3 was a spare copy of 2: empty
    m.check_invariants()


def test_salts_isolate_tenants():
    m = manager(16)
    prompt = SYS + [1]
    m.add_request("a", prompt, extra=ExtraKeys(cache_salt="tenant-1"))
    assert m.add_request("b", prompt, extra=ExtraKeys(cache_salt="tenant-2")).num_cached_tokens == 0
    assert m.add_request("c", prompt).num_cached_tokens == 0
    assert m.add_request("d", prompt, extra=ExtraKeys(cache_salt="tenant-1")).num_cached_tokens == 8
    assert m.add_request("e", prompt, extra=ExtraKeys(lora="tenant-1")).num_cached_tokens == 0


def test_chunked_prefill_caches_only_scheduled_blocks():
    m = manager(8)
    prompt = list(range(1, 15))  # 14 tokens
    assert m.add_request("a", prompt, num_new_tokens=5) == Admission("a", (0, 1), 0, 5)
    assert m.lookup(prompt) == 4  # block 1 is not full within the scheduled tokens
    assert m.extend("a", 6) == (2,)
    assert m.lookup(prompt) == 8
    assert m.extend("a", 3) == (3,)
    assert m.lookup(prompt) == 12
    m.check_invariants()


def test_reset_only_when_nothing_is_in_use():
    m = manager(4, enable_events=True)
    m.add_request("a", [1, 2, 3, 4, 5])
    assert m.reset_prefix_cache() is False
    m.free("a")
    m.take_events()
    assert m.free_block_order() == [1, 2, 3, 0]  # a's partial block first, its cached one last
    assert m.reset_prefix_cache() is True
    assert m.take_events() == [AllBlocksCleared()]
    # the free order is kept (vLLM's reset keeps its free queue): not block-id order
    assert m.free_block_order() == [1, 2, 3, 0] and m.num_cached_blocks == 0
    assert m.add_request("b", [6] * 13).block_ids == (1, 2, 3, 0)
    assert m.lookup([1, 2, 3, 4, 5]) == 0
    m.check_invariants()


def test_take_stats_is_get_and_reset_and_usage_counts_held_blocks():
    m = manager(4)
    m.add_request("a", [1, 2, 3, 4, 5])
    m.add_request("b", [1, 2, 3, 4, 6])
    assert m.take_stats() == PrefixCacheStats(2, 10, 4)
    assert m.take_stats() == PrefixCacheStats(0, 0, 0)
    assert m.stats.hit_rate == 0.4
    assert m.usage == 0.75


def test_resumed_admissions_count_as_preempted_not_as_new_traffic():
    m = manager(8)
    m.add_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert m.take_stats() == PrefixCacheStats(1, 9, 0)
    tokens = m.preempt("a")
    assert m.add_request("a", tokens, resumed=True).num_cached_tokens == 8
    m.add_request("b", [1, 2, 3, 4, 7])
    assert m.take_stats() == PrefixCacheStats(1, 5, 4, preempted_requests=1, preempted_queries=9,
                                              preempted_hits=8)
    assert m.stats == PrefixCacheStats(2, 14, 4, 1, 9, 8) and m.stats.hit_rate == 4 / 14
    m.check_invariants()


def test_stats_add_and_subtract_field_by_field():
    a, b = PrefixCacheStats(1, 2, 3, 4, 5, 6), PrefixCacheStats(6, 5, 4, 3, 2, 1)
    assert a + b == PrefixCacheStats(7, 7, 7, 7, 7, 7) and (a + b) - b == a


def test_paged_baseline_never_reuses():
    from prefixkv import PagedAllocator
    m = PagedAllocator(4, 4)
    m.add_request("a", [1, 2, 3, 4, 5])
    m.free("a")
    assert m.free_block_order() == [1, 0, 2, 3]  # (vLLM's: the tail first)
    assert m.add_request("b", [1, 2, 3, 4, 5]) == Admission("b", (1, 0), 0, 5)


def test_a_request_dropped_before_its_step_ran_leaves_nothing_findable():
    m = manager(8, enable_events=True)
    prompt = list(range(1, 11))               # blocks 0, 1 full; 2 partial
    m.add_request("warm", prompt[:4] + [99])  # block 0 computed by an earlier request
    m.free("warm")
    m.take_events()
    assert m.add_request("a", prompt) == Admission("a", (0, 1, 2), 4, 6)
    [stored] = m.take_events()                # block 1 is findable from its step on
    m.free("a", num_computed_tokens=4)        # but that step never ran
    assert m.take_events() == [BlockRemoved(stored.block_hashes, [1])]
    assert m.lookup(prompt) == 4              # the hit block computed earlier stays
    assert m.free_block_order() == [2, 1, 3, 4, 5, 6, 7, 0]  # (a's tail first, as vLLM)
    m.check_invariants()


def test_append_step_appends_one_token_per_request_and_reports_growth_and_shortage():
    m = manager(5)
    m.add_request("a", [1, 2, 3])            # block 0, 3 tokens
    m.add_request("b", [5, 6, 7, 8])         # block 1 full
    m.add_request("c", [9, 9])               # block 2
    assert m.append_step(["a", "b", "c"], [4, 9, 9]) == DecodeStep(grown=(("b", (3,)),), short=())
    assert m.lookup([1, 2, 3, 4, 0]) == 4    # a's block filled and cached
    assert m.append_step(["a", "c"], [10, 9]) == DecodeStep(grown=(("a", (4,)),), short=())
    assert m.lookup([9, 9, 9, 9, 0]) == 4    # c filled block 2 in the same step
    assert m.num_free_blocks == 0
    assert m.append_step(["b", "a"], [7, 7]) == DecodeStep(grown=(), short=())
    assert m.append_step(["c", "b"], [5, 8]) == DecodeStep(grown=(), short=("c",))  # c needs a block
    assert m.num_tokens("c") == 4 and m.num_tokens("b") == 7   # c unchanged, b advanced
    m.check_invariants()


def test_reserve_and_lookahead_give_slots_before_their_tokens_are_known():
    m = manager(6)
    adm = m.add_request("a", [1, 2, 3, 4, 5, 6, 7, 8], num_lookahead_tokens=1)
    assert adm.block_ids == (0, 1, 2)          # position 8 already has a slot
    assert m.append_tokens("a", [9]) == ()     # its token arrives: no new block
    assert m.reserve("a", 4) == (3,)           # positions 9..12
    assert m.reserve("a", 2) == ()
    assert m.append_tokens("a", [10, 11, 12]) == ()
    assert m.lookup(list(range(1, 13)) + [0]) == 12
    m.check_invariants()
    assert m.reserve("a", 100) is None and m.get_block_ids("a") == (0, 1, 2, 3)
    m.free("a")
    assert sorted(m.free_block_order()) == list(range(6))
    m.check_invariants()


def test_require_full_fit_gates_a_chunked_admission_on_the_whole_prompt():
    m = manager(4)
    m.add_request("x", [9])                    # holds block 0
    prompt = list(range(1, 14))                # 13 tokens: 4 blocks, 3 free
    assert m.add_request("a", prompt, num_new_tokens=4, require_full_fit=True) is None
    assert m.free_block_order() == [1, 2, 3]
    assert m.add_request("a", prompt, num_new_tokens=4) == Admission("a", (1,), 0, 4)


def test_require_full_fit_counts_the_lookahead_with_the_chunk_not_past_the_prompt():
    # vLLM's full_sequence_must_fit: the whole prompt must fit; the lookahead slots
    # follow the scheduled chunk (an async load's positions are inside the prompt)
    m = manager(4)
    prompt = list(range(1, 14))                # 13 tokens: 4 blocks, 4 free
    adm = m.add_request("a", prompt, num_new_tokens=4, num_lookahead_tokens=4, require_full_fit=True)
    assert adm == Admission("a", (0, 1), 0, 4)  # covers 0..7: 2 blocks held
    assert m.free_block_order() == [2, 3]
    m.check_invariants()


def test_read_cache_false_computes_everything_and_still_caches():
    m = manager(8)
    m.add_request("a", SYS + [1])
    adm = m.add_request("b", SYS + [2], read_cache=False)
    assert adm.num_cached_tokens == 0 and adm.block_ids == (3, 4, 5)
    m.free("a")
    m.free("b")
    assert m.lookup(SYS + [3]) == 8
    m.check_invariants()


def test_fork_copies_reach_the_kv_op_stream_once():
    m = manager(8)
    m.add_request("p", [1, 2, 3, 4, 5, 6])
    fork = m.fork("p", "c")
    assert m.take_kv_ops() == list(fork.copies) == [BlockCopy(1, 2)]
    assert m.take_kv_ops() == []


def test_the_constructors_settings_are_the_managers_attributes():
    # (mutants-r23: ``enable_caching`` not set survived: the vLLM plug-in reads it)
    for caching in (True, False):
        m = KVCacheManager(8, 4, enable_caching=caching, vocab_size=50)
        assert (m.num_blocks, m.block_size, m.enable_caching, m.vocab_size) == (8, 4, caching, 50)
