"""The vLLM-shaped adapter over layer groups (prefixkv.adapters.vllm_hybrid): vLLM's
hybrid scenarios as a vLLM scheduler drives them (get_computed_blocks -> allocate_slots
-> decode allocate_slots -> free), typed errors, and one test per difference listed in
the module docstring. vLLM's facts: tests/test_vllm_conformance_groups.py."""

from __future__ import annotations

import random

import pytest

from prefixkv import PrefixKVError, RequestError, TokenError
from prefixkv.adapters.vllm import ComputedBlocks, VllmBlockStored
from prefixkv.adapters.vllm_hybrid import GroupBlockIds, VllmHybridKVCacheManager
from prefixkv.groups import (
    GroupBlockStored,
    HybridKVCacheManager,
    chunked_local,
    full_attention,
    sliding_window,
)
from vllm_fakes import Req, admit, hidden
from vllm_sim import Sim

BS = 16
COMMON = [i for i in range(3) for _ in range(BS)]  # three full blocks


def make(groups, num_blocks, bs=BS, **kw):
    mgr = HybridKVCacheManager(groups, num_blocks, bs, hash_mode="sha256", enable_events=True)
    return VllmHybridKVCacheManager(mgr, **kw), mgr


def decode(kv, req, *tokens, lookahead=0):
    """A running request's step: its sampled tokens join ``all_token_ids``, the scheduler
    allocates their slots and advances ``num_computed_tokens``."""
    req.all_token_ids += tokens
    new = kv.allocate_slots(req, len(req.all_token_ids) - req.num_computed_tokens,
                            num_lookahead_tokens=lookahead)
    if new is not None:
        req.num_computed_tokens = len(req.all_token_ids)
    return new


def hybrid():
    """vLLM's make_kv_cache_config_hybrid_model(16, 21, 2): full, SW(32), SW(32)."""
    return make([full_attention(), sliding_window(2 * BS), sliding_window(2 * BS)], 21)


# ---- vLLM's scenarios --------------------------------------------------------------


def test_prefill_hybrid_model_through_the_adapter():
    # tests/v1/core/test_prefix_caching.py::test_prefill_hybrid_model
    kv, mgr = hybrid()
    r0 = Req("0", COMMON + [3] * 7)
    blocks, hit = kv.get_computed_blocks(r0)
    assert hit == 0 and blocks.get_block_ids() == ([], [], [])
    new = kv.allocate_slots(r0, 55, hit, blocks)
    assert new.get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])
    r0.num_computed_tokens = 55
    r1 = Req("1", COMMON + [3] * 5)
    blocks, hit = kv.get_computed_blocks(r1)
    assert hit == 48  # vLLM's hit blocks ([1, 2, 3], [0, 6, 7], [0, 10, 11]): difference 1
    new = kv.allocate_slots(r1, 53 - 48, hit, blocks)
    assert new.get_block_ids() == ([13], [14], [15])
    assert kv.get_block_ids("1") == ([1, 2, 3, 13], [0, 6, 7, 14], [0, 10, 11, 15])
    r1.num_computed_tokens = 53
    kv.free(r0)  # the hit blocks are still held by r1 (vLLM: ref_cnt 2): not free
    assert set(mgr.free_block_order()) == set(range(1, 21)) - {1, 2, 3, 6, 7, 10, 11, 13, 14, 15}
    kv.free(r1)
    assert kv.usage == 0.0 and kv.get_block_ids("1") == ([], [], [])
    stats = kv.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 108, 48)
    # _test_partial_request_hit: (group, block) entries evicted -> vLLM's hit in blocks
    cases = [([(1, 0), (2, 0)], 3), ([(0, 0)], 0), ([(0, 2), (1, 2), (2, 2)], 2),
             ([(0, 2)], 2), ([(1, 2)], 2), ([(2, 2)], 2), ([(0, 2), (1, 0), (2, 0)], 0)]
    for i, (where, want) in enumerate(cases):
        req = Req(f"p{i}", COMMON + [3] * 5)
        with hidden(mgr, req.all_token_ids, *where):
            assert kv.get_computed_blocks(req) == (ComputedBlocks(want * BS, 3), want * BS)
        kv.free(req)  # vLLM frees the request it only looked up: a no-op
    assert kv.make_prefix_cache_stats().requests == 0  # lookups are not admissions
    # the whole hit through allocate_slots: the windows take only blocks 1, 2; the new
    # blocks come from the head of the free queue (blocks without content, the last
    # released first: r1's partial blocks)
    assert mgr.free_block_order()[:6] == [15, 14, 13, 12, 8, 4]
    r2 = Req("2", COMMON + [3] * 5)
    assert admit(kv, r2)[1] == 48
    assert kv.get_block_ids("2") == ([1, 2, 3, 15], [0, 6, 7, 14], [0, 10, 11, 13])
    mgr.check_invariants()


def test_sliding_window_decode_releases_blocks_as_vllm():
    # test_single_type_kv_cache_manager.py::test_sliding_window_remove_skipped_blocks:
    # block size 2, window 4; steps start at 7, then 11; vLLM frees [1003, 1002]: the
    # block ending the longer prefix first
    kv, mgr = make([sliding_window(4)], 16, bs=2)
    a = Req("a", list(range(1, 8)))  # positions 0..6
    new, hit = admit(kv, a)
    assert hit == 0 and new.get_block_ids() == ([1, 2, 3, 4],)
    assert decode(kv, a, 8, 9, 10, 11).get_block_ids() == ([5, 6],)  # at 7: reads 4..10
    assert kv.get_block_ids("a") == ([0, 0, 3, 4, 5, 6],)
    assert mgr.free_block_order() == [7, 8, 9, 10, 11, 12, 13, 14, 15, 2, 1]
    assert decode(kv, a, 12) == kv.empty_kv_cache_blocks            # at 11: reads 8..11
    assert kv.get_block_ids("a") == ([0, 0, 0, 0, 5, 6],)
    assert mgr.free_block_order()[-4:] == [2, 1, 4, 3]
    assert kv.usage == pytest.approx(2 / 15)  # the null block is not usable
    kv.free(a)
    assert mgr.free_block_order()[-6:] == [2, 1, 4, 3, 6, 5]
    # a new request with the same tokens hits the window's blocks only
    b = Req("b", list(range(1, 13)) + [0])
    assert admit(kv, b)[1] == 12
    assert kv.get_block_ids("b") == ([0, 0, 0, 0, 5, 6, 7],)  # 12 reads 9..12: blocks 4, 5
    mgr.check_invariants()


def test_chunked_local_decode_releases_and_hits_from_the_chunk_start():
    # test_single_type_kv_cache_manager.py, block size 2, chunk 4: a step at n releases
    # the blocks below n // 4 * 4; a hit needs the blocks from its chunk start on, and
    # blocks before it are the null block
    kv, mgr = make([chunked_local(4)], 16, bs=2)
    a = Req("a", [1, 2, 3, 4])
    assert admit(kv, a)[0].get_block_ids() == ([1, 2],)
    assert decode(kv, a, 5).get_block_ids() == ([3],)             # at 4: blocks 0, 1 go
    assert kv.get_block_ids("a") == ([0, 0, 3],)
    assert mgr.free_block_order()[-2:] == [2, 1]
    assert decode(kv, a, 6) == kv.empty_kv_cache_blocks
    assert decode(kv, a, 7).get_block_ids() == ([4],)             # at 6: chunk 4..7 stays
    assert decode(kv, a, 8) == kv.empty_kv_cache_blocks
    assert decode(kv, a, 9).get_block_ids() == ([5],)             # at 8: blocks 2, 3 go
    assert kv.get_block_ids("a") == ([0, 0, 0, 0, 5],)
    assert mgr.free_block_order()[-4:] == [2, 1, 4, 3]
    b = Req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8  # a query at 8 reads 8..: no block of the hit is needed
    assert kv.allocate_slots(b, 2, hit, blocks).get_block_ids() == ([6],)
    assert kv.get_block_ids("b") == ([0, 0, 0, 0, 6],)
    kv.free(a)
    kv.free(b)
    mgr.check_invariants()


@pytest.mark.parametrize("groups", [
    [full_attention(), sliding_window(8), sliding_window(8)],
    [sliding_window(6), full_attention(), chunked_local(8)],
    [chunked_local(4), sliding_window(5)],
])
@pytest.mark.parametrize("seed, asynchronous, drafts, lookahead", [
    (0, False, 0, 0), (1, False, 3, 3), (2, True, 0, 0), (3, True, 0, 2), (4, False, 2, 0)])
def test_engine_loop_reads_only_kv_it_wrote(groups, seed, asynchronous, drafts, lookahead):
    """The vLLM-like engine of tests/vllm_sim.py over layer groups: chunked prefill,
    shared prefixes, speculative or asynchronous decoding, preemption. Every key a step
    reads in every group (hits included, windows only) holds the request's own token."""
    sim = Sim(seed, num_blocks=24 * len(groups), asynchronous=asynchronous, drafts=drafts,
              lookahead=lookahead, groups=groups)
    sim.add_shared_prefix_requests(random.Random(seed), 12, 25)
    sim.run()
    assert sim.mgr.usage == 0.0 and sim.preemptions > 0 and sim.hits > 0
    assert sum(s.blocks_released for s in sim.mgr.group_stats()) > 0


def test_a_step_that_fits_only_through_its_own_release_is_allocated():
    # vLLM removes the skipped blocks before it counts the free ones; so does the
    # adapter's count (net of the release): 3 usable blocks, the request holds them all
    kv, mgr = make([sliding_window(2)], 4, bs=2)
    a = Req("a", [1, 2, 3, 4, 5, 6])
    assert admit(kv, a)[0].get_block_ids() == ([1, 2, 3],)
    assert mgr.num_free_blocks == 0
    assert decode(kv, a, 7).get_block_ids() == ([2],)  # at 6: reads 5, 6; blocks 0, 1 go
    assert kv.get_block_ids("a") == ([0, 0, 3, 2],) and mgr.num_free_blocks == 1
    mgr.check_invariants()


# ---- the one-group adapter's semantics, per group ----------------------------------


def state(kv, mgr, *ids):
    return mgr.free_block_order(), [kv.get_block_ids(i) for i in ids], mgr.stats


def test_hit_changed_between_lookup_and_allocate_raises_and_releases():
    kv, mgr = hybrid()
    r1 = Req("1", COMMON + [3] * 5)
    blocks, hit = kv.get_computed_blocks(r1)
    assert hit == 0
    admit(kv, Req("0", COMMON + [3] * 7))
    kv.make_prefix_cache_stats()
    with pytest.raises(RequestError, match="48 of its tokens, not the 0"):
        kv.allocate_slots(r1, 53, hit, blocks)
    assert kv.get_block_ids("1") == ([], [], []) and mgr.num_free_blocks == 8
    assert kv.make_prefix_cache_stats().requests == 0
    assert admit(kv, r1)[1] == 48  # asked again, it hits
    mgr.check_invariants()


def test_shortage_returns_none_and_changes_nothing():
    kv, mgr = make([full_attention(), sliding_window(32)], 9)
    a = Req("a", COMMON + [3])
    admit(kv, a)  # 4 blocks per group: all 8 usable
    b = Req("b", COMMON + [4])
    before = state(kv, mgr, "a", "b")
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 48 and kv.allocate_slots(b, 1, hit, blocks) is None
    assert state(kv, mgr, "a", "b") == before and kv.make_prefix_cache_stats().requests == 1
    a.all_token_ids += [5] * 16  # a decode step of 16 tokens needs a block per group
    assert kv.allocate_slots(a, 16) is None
    assert state(kv, mgr, "a", "b") == before
    kv.free(a)  # a's partial blocks, without content, go to the head of the free queue
    assert admit(kv, b)[0].get_block_ids() == ([8], [4])
    mgr.check_invariants()


def test_lookahead_is_reserved_in_every_group_and_filled_later():
    kv, mgr = make([full_attention(), chunked_local(32)], 21)
    a = Req("a", COMMON[:30])
    new, _ = admit(kv, a, num_lookahead_tokens=3)  # positions 0..32: 3 blocks a group
    assert new.get_block_ids() == ([1, 2, 3], [4, 5, 6])
    assert decode(kv, a, 7, 8) == kv.empty_kv_cache_blocks  # 30, 31 land in reserved slots
    assert decode(kv, a, 9).get_block_ids() == ([], [])     # 32 too; nothing released yet
    assert decode(kv, a, 10).get_block_ids() == ([], [])    # at 33: the chunk at 32 starts
    assert kv.get_block_ids("a") == ([1, 2, 3], [0, 0, 6])
    mgr.check_invariants()


def test_free_and_get_block_ids_accept_unknown_ids_and_stats_and_reset():
    kv, mgr = hybrid()
    kv.free(Req("nobody", [1]))
    assert kv.get_block_ids("nobody") == ([], [], []) and kv.get_block_ids(["x"]) == ([], [], [])
    a = Req("a", COMMON + [3])
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    kv.free(a)  # a second free is a no-op, as in vLLM
    assert kv.reset_prefix_cache() is True
    stats = kv.make_prefix_cache_stats()
    assert stats.reset and (stats.requests, stats.queries, stats.hits) == (1, 49, 0)
    assert admit(kv, Req("b", COMMON + [3]))[1] == 0  # the cache was dropped
    quiet, _ = make([full_attention(), sliding_window(16)], 8, log_stats=False)
    assert quiet.make_prefix_cache_stats() is None
    mgr.check_invariants()


def test_free_withdraws_blocks_scheduled_but_not_computed_in_every_group():
    # the one-group adapter's difference 6: a request preempted in the step that
    # scheduled its prompt computed none of it, so no group may serve it
    kv, mgr = hybrid()
    a = Req("a", COMMON + [3])
    blocks, hit = kv.get_computed_blocks(a)
    kv.allocate_slots(a, 49, hit, blocks)
    kv.free(a)  # num_computed_tokens is still 0
    assert kv.get_computed_blocks(Req("b", COMMON + [3]))[1] == 0
    admit(kv, Req("c", COMMON + [3]))
    kv.free(Req("c", COMMON + [3], num_computed_tokens=49))
    assert kv.get_computed_blocks(Req("d", COMMON + [4]))[1] == 48
    mgr.check_invariants()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"bogus": 1}, PrefixKVError, "bogus=1 \\(unknown argument\\)"),
    ({"num_external_computed_tokens": 16}, PrefixKVError, "KV connectors"),
    ({"delay_cache_blocks": True}, PrefixKVError, "delayed caching"),
    ({"num_encoder_tokens": 4}, PrefixKVError, "encoder-decoder"),
    ({"reserved_blocks": 2}, PrefixKVError, "reserved-block"),
    ({"num_new_tokens": 0}, RequestError, "num_new_tokens"),
    ({"num_lookahead_tokens": -1}, RequestError, "num_lookahead_tokens"),
    ({"full_sequence_must_fit": 1}, RequestError, "full_sequence_must_fit"),
    ({"num_new_computed_tokens": -16}, RequestError, "num_new_computed_tokens"),
])
def test_bad_arguments_raise_before_any_change(kwargs, error, match):
    kv, mgr = hybrid()
    a = Req("a", COMMON + [3])
    admit(kv, a)
    a.all_token_ids.append(4)
    b = Req("b", COMMON + [3] * 2)
    before = state(kv, mgr, "a", "b")
    for req in (a, b):  # running and waiting
        if req is a and "num_new_computed_tokens" in kwargs:
            continue  # read at admission only
        with pytest.raises(error, match=match):
            kv.allocate_slots(req, **{"num_new_tokens": 1, **kwargs})
        assert state(kv, mgr, "a", "b") == before
    mgr.check_invariants()


def test_bad_tokens_and_counts_raise_before_any_change():
    kv, mgr = hybrid()
    a = Req("a", COMMON + [3])
    admit(kv, a)
    before = state(kv, mgr, "a")
    with pytest.raises(TokenError):
        kv.get_computed_blocks(Req("b", [5, -1, 7]))
    with pytest.raises(TokenError):
        kv.allocate_slots(Req("b", [5, -1, 7]), 3)
    a.all_token_ids.append(2**32)
    with pytest.raises(TokenError):
        kv.allocate_slots(a, 1)
    a.all_token_ids[-1] = 7
    a.num_computed_tokens = -1
    with pytest.raises(RequestError, match="num_computed_tokens"):
        kv.allocate_slots(a, 1)
    with pytest.raises(RequestError, match="num_computed_tokens"):
        kv.free(a)
    with pytest.raises(PrefixKVError, match="not allocated but has"):
        kv.allocate_slots(Req("c", [1, 2, 3], num_computed_tokens=2), 1)
    assert state(kv, mgr, "a") == before
    mgr.check_invariants()


# ---- the differences of the module docstring ----------------------------------------


def test_difference_1_block_zero_is_the_null_block_only_when_a_group_releases():
    kv, mgr = make([full_attention(), full_attention()], 4)
    assert admit(kv, Req("a", [1, 2, 3]))[0].get_block_ids() == ([0], [1])
    assert kv.usage == 0.5  # every block counts
    kv, mgr = make([full_attention(), sliding_window(16)], 5)
    assert admit(kv, Req("a", [1, 2, 3]))[0].get_block_ids() == ([1], [2])
    assert mgr.null_block_id == 0 and kv.usage == 0.5  # of 4 usable blocks


def test_difference_2_windows_move_only_when_known_tokens_are_scheduled():
    kv, mgr = make([full_attention(), sliding_window(4)], 9, bs=2)
    a = Req("a", list(range(1, 8)))  # 4 blocks a group: all 8 usable
    admit(kv, a)
    # at 7 the window would release blocks 0, 1; the step needs 2 new blocks a group
    # (4), the release returns 2: short, so nothing moves (vLLM releases all the same)
    a.all_token_ids += [8, 9, 10, 11, 12]
    assert kv.allocate_slots(a, 5) is None
    assert kv.get_block_ids("a") == ([1, 2, 3, 4], [5, 6, 7, 8])
    del a.all_token_ids[7:]
    # asynchronous scheduling: the token at 7 is scheduled before it is known, so the
    # call only reserves and releases nothing (vLLM: blocks 0, 1 at 7)
    assert kv.allocate_slots(a, 1) == kv.empty_kv_cache_blocks
    assert kv.get_block_ids("a") == ([1, 2, 3, 4], [5, 6, 7, 8])
    # the next call, with the token at 7 known, schedules it and releases from 7 on
    a.num_computed_tokens = 8
    a.all_token_ids.append(8)
    assert kv.allocate_slots(a, 1).get_block_ids() == ([6], [5])  # SW block 1 freed first
    assert kv.get_block_ids("a") == ([1, 2, 3, 4, 6], [0, 0, 7, 8, 5])
    mgr.check_invariants()


def test_difference_3_full_sequence_must_fit_counts_every_group_whole():
    kv, mgr = make([full_attention(), sliding_window(2)], 9, bs=2)
    a = Req("a", list(range(1, 10)))  # 5 blocks a group for the whole prompt
    blocks, hit = kv.get_computed_blocks(a)
    assert kv.allocate_slots(a, 2, hit, blocks, full_sequence_must_fit=True) is None
    assert mgr.num_free_blocks == 8
    assert kv.allocate_slots(a, 2, hit, blocks).get_block_ids() == ([1], [2])
    mgr.check_invariants()


def test_difference_4_tokens_added_before_the_prompt_is_scheduled_raise():
    kv, mgr = hybrid()
    a = Req("a", COMMON + [3])
    admit(kv, a, 20)  # a chunk of the prompt
    a.all_token_ids.append(9)
    before = state(kv, mgr, "a")
    with pytest.raises(RequestError, match="before its prompt was fully scheduled"):
        kv.allocate_slots(a, 40)
    assert state(kv, mgr, "a") == before
    del a.all_token_ids[-1]
    assert kv.allocate_slots(a, 29).get_block_ids() == ([7, 8], [9, 10], [11, 12])
    mgr.check_invariants()


def test_difference_5_events_once_per_group_without_the_group_index():
    kv, mgr = make([full_attention(), sliding_window(32), chunked_local(64)], 16)
    admit(kv, Req("a", COMMON[:BS] + [1]))
    events = kv.take_events()
    assert [type(e) for e in events] == [VllmBlockStored] * 3
    assert len({e.block_hashes[0] for e in events}) == 1
    admit(kv, Req("b", COMMON[BS:2 * BS] + [1]))
    assert [(type(e), e.group_idx) for e in mgr.take_events()] == [
        (GroupBlockStored, 0), (GroupBlockStored, 1), (GroupBlockStored, 2)]


def test_results_name_block_ids_per_group():
    ids = GroupBlockIds(((1, 2), (0, 3)))
    assert ids.get_block_ids() == ([1, 2], [0, 3])
    assert ComputedBlocks(32, 2).get_block_ids() == ([], [])
