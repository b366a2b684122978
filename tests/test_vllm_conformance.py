"""The scenarios of vLLM's own prefix-caching unit tests (tests/v1/core in vLLM:
test_prefix_caching.py, and the lookahead case of test_kv_cache_utils.py), replayed
through the vLLM-shaped adapter and written afresh here.

Where prefixkv deliberately differs, the test asserts prefixkv's behaviour and names the
difference by its number in the module docstring of prefixkv.adapters.vllm (for block
ids, difference 2: vLLM's pool has a null block 0, so ``vllm(...)`` maps vLLM's ids to
ours by subtracting one). Not replayed, because the adapter does not offer them
(difference 9): hybrid layouts (sliding window, Mamba, several groups, different block
sizes, retention intervals; the sliding-window, chunked-local and hybrid scenarios are
replayed on ``HybridKVCacheManager`` in test_vllm_conformance_groups.py), EAGLE's shortened hits, KV connectors, reports of reused
blocks, and the scenarios that drive vLLM's block pool or hash map directly (the same
rules are tested on prefixkv's own parts in test_manager_scenarios.py and
test_index.py).
"""

from __future__ import annotations

import pytest
from vllm_fakes import MM, Lora, Pos, Req, admit, live_hashes, make

from prefixkv import PromptTooLongError, RequestError, TokenError
from prefixkv.adapters.vllm import BlockIds, VllmBlockRemoved, VllmBlockStored

BS = 16
COMMON = [i for i in range(3) for _ in range(BS)]  # three full blocks of repeated ids


def vllm(*ids: int) -> tuple[int, ...]:
    """vLLM's block ids for a scenario as prefixkv's (difference 2)."""
    return tuple(i - 1 for i in ids)


def test_prefill_hits_shares_and_evicts_in_order():
    kv, mgr = make(10)
    r0 = Req("0", COMMON + [3] * 7)
    new, hit = admit(kv, r0)
    assert hit == 0 and new == BlockIds(vllm(1, 2, 3, 4))
    (stored,) = kv.take_events()  # the three full blocks, chained from the root
    assert stored.parent_block_hash is None and stored.token_ids == COMMON
    r1 = Req("1", COMMON + [3] * 5)  # hit while r0 still holds the blocks
    new, hit = admit(kv, r1)
    assert hit == 48 and new == BlockIds(vllm(5))
    assert kv.get_block_ids("1") == ([*vllm(1, 2, 3, 5)],) and mgr.num_free_blocks == 5
    kv.free(r0)
    kv.free(r1)
    # partial blocks first (last freed first), then never used, then the cached chain
    # tail first
    assert mgr.free_block_order() == list(vllm(5, 4, 6, 7, 8, 9, 10, 3, 2, 1))
    r2 = Req("2", COMMON + [3] * 6)  # hit on free blocks; the partial block is reused
    new, hit = admit(kv, r2)
    assert hit == 48 and new == BlockIds(vllm(5)) and mgr.num_free_blocks == 6
    kv.free(r2)
    kv.take_events()
    new, hit = admit(kv, Req("3", [99] * 160))  # a miss that needs every block
    assert hit == 0 and new == BlockIds(vllm(5, 4, 6, 7, 8, 9, 10, 3, 2, 1))
    assert mgr.num_free_blocks == 0 and mgr.free_block_order() == []
    removed = [h for e in kv.take_events() if isinstance(e, VllmBlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(stored.block_hashes)
    mgr.check_invariants()


def test_prompt_logprobs_requests_compute_everything_and_still_cache():
    kv, mgr = make(10)
    r0 = Req("0", COMMON + [3] * 7, skip_reading_prefix_cache=True)
    assert admit(kv, r0) == (BlockIds(vllm(1, 2, 3, 4)), 0)
    r1 = Req("1", COMMON + [3] * 5)  # an ordinary request hits what r0 computed
    assert admit(kv, r1) == (BlockIds(vllm(5)), 48)
    kv.free(r0)
    kv.free(r1)
    assert mgr.free_block_order() == list(vllm(5, 4, 6, 7, 8, 9, 10, 3, 2, 1))
    kv.take_events()
    r2 = Req("2", COMMON + [3] * 6, skip_reading_prefix_cache=True)
    new, hit = admit(kv, r2)  # no hit: duplicates of the cached blocks
    assert hit == 0 and new == BlockIds(vllm(5, 4, 6, 7))
    assert kv.take_events() == []  # difference 4: vLLM announces the same hashes again
    kv.free(r2)
    assert kv.get_computed_blocks(Req("3", COMMON + [5]))[1] == 48
    mgr.check_invariants()


def test_decode_fills_the_last_block_then_takes_a_new_one():
    kv, mgr = make(10)
    r0 = Req("0", COMMON + [3] * 7)
    assert admit(kv, r0)[0] == BlockIds(vllm(1, 2, 3, 4))
    r0.all_token_ids += [8] * 4  # several tokens in one step (speculative decoding)
    assert kv.allocate_slots(r0, 4) == kv.empty_kv_cache_blocks
    r0.num_computed_tokens = 59
    assert kv.get_computed_blocks(Req("x", r0.all_token_ids + [1]))[1] == 48  # 59: partial
    r0.all_token_ids += [7] * 19  # 5 fill block 3, the rest go to a new block
    assert kv.allocate_slots(r0, 19) == BlockIds(vllm(5))
    r0.num_computed_tokens = 78
    assert kv.get_computed_blocks(Req("x", r0.all_token_ids + [1]))[1] == 64
    mgr.check_invariants()


def test_eviction_takes_uncached_blocks_first_then_the_lru_chain_tail():
    kv, mgr = make(10)
    r0 = Req("0", list(range(87)))
    assert len(admit(kv, r0)[0].block_ids) == 6  # 5 full + 1 partial
    r1 = Req("1", list(range(87, 87 + 48)))
    assert len(admit(kv, r1)[0].block_ids) == 3 and mgr.num_free_blocks == 1
    kv.free(r0)
    assert mgr.free_block_order() == list(vllm(6, 10, 5, 4, 3, 2, 1))
    kv.free(r1)
    assert mgr.free_block_order() == list(vllm(6, 10, 5, 4, 3, 2, 1, 9, 8, 7))
    new, hit = admit(kv, Req("2", list(range(35))))  # touches the first two blocks
    assert hit == 32 and new == BlockIds(vllm(6)) and mgr.num_free_blocks == 7
    mgr.check_invariants()


def test_a_reused_block_loses_its_old_identity():
    kv, mgr = make(1)
    r0 = Req("0", list(range(16)))
    admit(kv, r0)
    kv.free(r0)
    (stored,) = kv.take_events()
    new, _ = admit(kv, Req("1", list(range(15))))  # the same block, not full this time
    assert new == BlockIds((0,))
    (removed,) = kv.take_events()
    assert removed.block_hashes == stored.block_hashes
    assert mgr.num_cached_blocks == 0 and mgr.lookup(list(range(17))) == 0
    mgr.check_invariants()


def test_a_hit_is_not_evicted_to_make_room_for_its_own_request():
    kv, mgr = make(2)
    r0, r1 = Req("0", list(range(16))), Req("1", list(range(16, 32)))
    admit(kv, r0)
    admit(kv, r1)
    kv.free(r0)
    kv.free(r1)
    new, hit = admit(kv, Req("2", list(range(32))))
    assert hit == 16 and new == BlockIds((1,)) and kv.get_block_ids("2") == ([0, 1],)
    mgr.check_invariants()


def test_without_caching_nothing_is_shared():
    kv, mgr = make(4, 4, enable_caching=False)
    r1 = Req("1", list(range(10)))
    assert len(admit(kv, r1)[0].block_ids) == 3
    kv.free(r1)
    new, hit = admit(kv, Req("2", list(range(16))))
    assert hit == 0 and len(new.block_ids) == 4
    assert admit(kv, Req("3", list(range(4))))[0] is None  # no block left
    assert kv.take_events() == []
    mgr.check_invariants()


def test_multimodal_inputs_enter_only_the_blocks_they_overlap():
    P = 7777  # placeholder token (difference 10: vLLM's test uses -1)
    kv, mgr = make(10)
    common = list(range(10)) + [P] * 6 + [P] * 4 + list(range(10, 20)) + [P] * 2 + [P] * 16
    images = [MM("aaa", Pos(11, 10)), MM("bbb", Pos(30, 18))]
    r0 = Req("0", common + [P] * 7 + [100] * 4, mm_features=images + [MM("ccc", Pos(48, 7))])
    assert admit(kv, r0)[0] == BlockIds(vllm(1, 2, 3, 4))
    r0.all_token_ids += [8] * 5  # decoding fills block 3
    assert kv.allocate_slots(r0, 5) == kv.empty_kv_cache_blocks
    r0.num_computed_tokens = 64
    r1 = Req("1", common + [P] * 7 + [200] * 5, mm_features=images + [MM("ccc", Pos(48, 7))])
    assert kv.get_computed_blocks(r1)[1] == 48
    other = Req("2", r1.all_token_ids, mm_features=[images[0], MM("zzz", Pos(30, 18))])
    assert kv.get_computed_blocks(other)[1] == 16  # blocks 1 and 2 hold the other image
    with pytest.raises(TokenError):  # difference 10
        kv.get_computed_blocks(Req("3", [-1] * 20))
    mgr.check_invariants()


def test_cache_salt_separates_tenants():
    kv, mgr = make(10)
    r0 = Req("0", COMMON + [3] * 11, cache_salt="salt1")
    assert admit(kv, r0)[0] == BlockIds(vllm(1, 2, 3, 4))
    r0.all_token_ids += [8] * 5
    assert kv.allocate_slots(r0, 5) == kv.empty_kv_cache_blocks
    assert kv.get_computed_blocks(Req("1", COMMON + [4] * 11, cache_salt="salt1"))[1] == 48
    assert kv.get_computed_blocks(Req("2", COMMON + [4] * 11, cache_salt="salt2"))[1] == 0
    assert kv.get_computed_blocks(Req("3", COMMON + [4] * 11))[1] == 0
    mgr.check_invariants()


def test_shortage_with_a_cache_hit_touches_nothing():
    kv, mgr = make(10)
    admit(kv, Req("0", COMMON), num_new=48)
    r1 = Req("1", COMMON * 2)
    assert admit(kv, r1) == (BlockIds(vllm(4, 5, 6)), 48)
    kv.free(r1)  # its own three blocks are free and cached; r0 still holds the first three
    admit(kv, Req("2", [7] * 32))
    assert mgr.num_free_blocks == 5
    r3 = Req("3", COMMON * 3)
    order = mgr.free_block_order()
    assert admit(kv, r3, num_new=48) == (None, 96)  # 3 new + 3 free hits > 5
    assert mgr.free_block_order() == order and mgr.num_free_blocks == 5
    assert kv.get_block_ids("3") == ([],) and kv.get_computed_blocks(r3)[1] == 96
    mgr.check_invariants()


def test_reset_only_when_no_block_is_in_use():
    kv, mgr = make(10)
    r0 = Req("0", COMMON + [3] * 7)
    assert kv.allocate_slots(r0, 55) == BlockIds(vllm(1, 2, 3, 4))  # no lookup: empty cache
    r0.num_computed_tokens = 55
    r1 = Req("1", COMMON + [4] * 7)
    assert admit(kv, r1) == (BlockIds(vllm(5)), 48)
    assert not kv.reset_prefix_cache() and mgr.num_cached_blocks == 3
    kv.free(r0)
    kv.free(r1)
    assert kv.reset_prefix_cache() and mgr.num_cached_blocks == 0
    assert kv.make_prefix_cache_stats().reset
    mgr.check_invariants()


def test_stats_off_gives_none():
    kv, mgr = make(10, log_stats=False)
    admit(kv, Req("0", list(range(16))))
    kv.reset_prefix_cache()
    assert kv.make_prefix_cache_stats() is None
    mgr.check_invariants()


@pytest.mark.parametrize("blocks_to_cache", [2, 3, 10])
def test_events_store_in_one_event_and_remove_per_block(blocks_to_cache):
    kv, mgr = make(blocks_to_cache)
    tokens = list(range(BS * blocks_to_cache))
    r0 = Req("0", tokens)
    kv.allocate_slots(r0, len(tokens))
    r0.num_computed_tokens = len(tokens)  # the step ran
    (stored,) = kv.take_events()
    assert len(stored.block_hashes) == blocks_to_cache == mgr.num_cached_blocks
    assert len(stored.token_ids) == stored.block_size * blocks_to_cache
    kv.free(r0)
    r1 = Req("1", tokens)
    new, hit = admit(kv, r1)  # hits all but the last block, which is recomputed
    assert hit == BS * (blocks_to_cache - 1) and len(new.block_ids) == 1
    events = kv.take_events()  # the last block was evicted to hold its own recomputation
    assert [type(e) for e in events] == [VllmBlockRemoved, VllmBlockStored]
    assert events[0].block_hashes == events[1].block_hashes == stored.block_hashes[-1:]
    kv.free(r1)
    with pytest.raises(RequestError):  # difference 1: the adapter always uses the hit
        kv.allocate_slots(Req("2", tokens), len(tokens))
    events += kv.take_events()
    assert live_hashes([stored] + events) == set(stored.block_hashes[:-1])
    kv.reset_prefix_cache()
    assert live_hashes(kv.take_events()) == set() and mgr.num_cached_blocks == 0
    mgr.check_invariants()


@pytest.mark.parametrize("blocks_to_cache", [2, 3, 10])
def test_events_carry_the_lora_id(blocks_to_cache):
    kv, mgr = make(blocks_to_cache)
    tokens = list(range(BS * blocks_to_cache))
    r0 = Req("lora", tokens, lora_request=Lora("test_lora", 42))
    kv.allocate_slots(r0, len(tokens))
    r0.num_computed_tokens = len(tokens)
    stored = kv.take_events()[-1]
    assert (stored.lora_id, stored.lora_name, len(stored.block_hashes)) == (42, "test_lora",
                                                                             blocks_to_cache)
    kv.free(r0)
    kv.allocate_slots(Req("plain", tokens), len(tokens))  # a miss: another adapter's keys
    stored = kv.take_events()[-1]
    assert (stored.lora_id, stored.lora_name, len(stored.block_hashes)) == (None, None,
                                                                             blocks_to_cache)
    mgr.check_invariants()


@pytest.mark.parametrize("lookahead, blocks", [(2, 2), (4, 2), (6, 3)])
def test_lookahead_slots_count_toward_the_blocks(lookahead, blocks):
    kv, mgr = make(10, 4)
    r = Req("0", [1, 2, 3])  # vLLM's case has an empty prompt, which prefixkv rejects
    new = kv.allocate_slots(r, 3, num_lookahead_tokens=lookahead)
    assert len(new.block_ids) == blocks  # ceil((3 + lookahead) / 4)
    mgr.check_invariants()


def test_full_sequence_gate_refuses_a_prompt_larger_than_the_pool():
    """vLLM returns None with the gate and, without it, admits a first chunk of a prompt
    whose prefill can never finish; prefixkv refuses it both ways (difference 11)."""
    kv, mgr = make(4)
    r = Req("oversized", list(range(16 * BS)))
    for gate in (True, False):
        with pytest.raises(PromptTooLongError, match="needs at least 16 blocks"):
            kv.allocate_slots(r, BS, full_sequence_must_fit=gate)
    assert mgr.num_free_blocks == 4 and kv.get_block_ids("oversized") == ([],)
    mgr.check_invariants()
