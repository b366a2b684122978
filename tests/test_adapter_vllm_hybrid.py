"""The vLLM-shaped adapter over layer groups (prefixkv.adapters.vllm_hybrid): vLLM's
hybrid scenarios as a vLLM scheduler drives them (get_computed_blocks -> allocate_slots
-> decode allocate_slots -> free), typed errors, and one test per difference listed in
the module docstring. vLLM's facts: tests/test_vllm_conformance_groups.py."""

from __future__ import annotations

import random

import pytest
from vllm_fakes import Req, admit, hidden
from vllm_sim import Sim

from prefixkv import PrefixKVError, RequestError, TokenError
from prefixkv.adapters.vllm import ComputedBlocks, VllmBlockStored
from prefixkv.adapters.vllm_hybrid import GroupBlockIds, VllmHybridKVCacheManager
from prefixkv.groups import (
    GroupBlockStored, HybridKVCacheManager, chunked_local, full_attention, sliding_window,
)

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
    rng = random.Random(seed)
    shared = [rng.randrange(1, 50) for _ in range(12)]
    for i in range(12):
        prompt = shared[:rng.randrange(13)] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 15))]
        sim.add(Req(f"r{i}", prompt), num_outputs=rng.randrange(1, 25))
    sim.run()
    assert sim.mgr.usage == 0.0 and sim.preemptions > 0 and sim.hits > 0
    assert sum(s.blocks_released for s in sim.mgr.group_stats()) > 0
