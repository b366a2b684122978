"""The scenarios of vLLM's own hybrid-cache unit tests, replayed on prefixkv's
``HybridKVCacheManager`` (written afresh here from the facts those tests check:
tests/v1/core/test_prefix_caching.py's hybrid model, test_hybrid_kv_cache_coordinator.py,
test_single_type_kv_cache_manager.py's sliding-window and chunked-local cases).

vLLM's behaviour, as its code states it (vllm/v1/core/single_type_kv_cache_manager.py,
kv_cache_coordinator.py):

- a sliding window of W needs ``ceil((W - 1) / bs)`` contiguous cached blocks ending at
  the hit; scanning from the right, the first such run ends the hit, else the run of
  cached blocks from block 0 is the hit; earlier blocks are the null block;
- chunked local attention of C needs the blocks from the chunk start of the hit on;
  blocks before it are the null block;
- skipped tokens, released by ``remove_skipped_blocks(num_computed)``: ``max(0, n - W + 1)``
  (sliding), ``n // C * C`` (chunked); whole blocks below them become the null block,
  the block ending the longest prefix released first;
- ``HybridKVCacheCoordinator`` iterates the groups (full attention first, groups of one
  spec looked up together) until no group shortens the candidate: a fixed point.

prefixkv's rule (prefixkv.groups.hits) takes one downward pass instead and is checked
against brute force; where vLLM's per-group lookup returns the largest length its group
accepts, the two agree, which the hit tests below replay. Deliberate differences, each
asserted by a ``test_difference_<n>_*`` test here:

1. Chunked local attention whose chunk is not a multiple of block_size: vLLM checks the
   blocks from the chunk start of the *longest candidate* and null-pads below it, so a
   shorter hit can leave a block its first query reads unchecked and null (read from
   vLLM's code, not run: vLLM's tests use chunks that are multiples of the block);
   prefixkv checks every block the hit's query reads.
2. The null block is reserved only when some group releases blocks (vLLM always has
   one); it is block 0 in both, so block ids of these scenarios equal vLLM's.
3. Events: prefixkv's group events always carry the spec kind (and a sliding window's
   W); vLLM's block pool sets ``group_idx`` and leaves the spec fields to its
   self-describing event paths. A group keeps one block per content (a duplicate
   computed alongside stays without content, as in prefixkv's core events).
4. Not offered: EAGLE's dropped block, groups of different block sizes (hash-block
   alignment), Mamba and R-SWA groups, DCP/PCP, KV connectors, the admission cap of
   recycled windows, retention intervals.
"""

from __future__ import annotations

import pytest

from prefixkv.groups import (
    GroupAdmission,
    HybridKVCacheManager,
    chunked_local,
    full_attention,
    longest_hit,
    sliding_window,
)
from vllm_fakes import hidden

BS = 16
COMMON = [i for i in range(3) for _ in range(BS)]  # three full blocks


def manager(groups, num_blocks, bs=BS, **kw):
    return HybridKVCacheManager(groups, num_blocks, bs, hash_mode="sha256", **kw)


def test_hybrid_model_block_ids_hits_and_partial_hits():
    # vLLM's make_kv_cache_config_hybrid_model(16, 21, 2): full, SW(32), SW(32)
    m = manager([full_attention(), sliding_window(2 * BS), sliding_window(2 * BS)], 21)
    assert m.add_request("0", COMMON + [3] * 7) == GroupAdmission(
        "0", ((1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)), 0, 55)
    # a hit of 48: a query at 48 reads 17..48, so the windows skip block 0 (null)
    prompt = COMMON + [3] * 5
    assert m.add_request("1", prompt) == GroupAdmission(
        "1", ((1, 2, 3, 13), (0, 6, 7, 14), (0, 10, 11, 15)), 48, 5)
    assert [s.hit_blocks for s in m.group_stats()] == [3, 2, 2]
    m.free("0")
    m.free("1")
    cases = [
        ([(1, 0), (2, 0)], 3),            # outside every window: no effect
        ([(0, 0)], 0),                    # full attention's first block: a miss
        ([(0, 2), (1, 2), (2, 2)], 2),    # the last block of every group
        ([(0, 2)], 2), ([(1, 2)], 2), ([(2, 2)], 2),
        ([(0, 2), (1, 0), (2, 0)], 0),    # full hits 2 blocks, the windows then need 0
    ]
    for where, blocks in cases:
        with hidden(m, prompt, *where):
            assert m.lookup(prompt) == blocks * BS, where
    assert m.lookup(prompt) == 48


@pytest.mark.parametrize("groups", [
    [full_attention(), sliding_window(32)],
    [full_attention(), sliding_window(32), sliding_window(64)],      # two windows
    [sliding_window(32), full_attention(), sliding_window(48), full_attention()],  # interleaved
    [full_attention(), full_attention()],                             # two full groups
    [sliding_window(32), sliding_window(64)],                         # no full group
    [full_attention(), chunked_local(32)],
    [chunked_local(32), sliding_window(32), full_attention()],
])
def test_combinations_hit_the_common_prefix_in_every_group(groups):
    m = manager(groups, 10 * len(groups) + 1)
    assert m.add_request("0", COMMON + [3] * 7).num_cached_tokens == 0
    adm = m.add_request("1", COMMON + [4] * 5)
    assert adm.num_cached_tokens == 48 and len(adm.group_block_ids) == len(groups)
    assert all(len(ids) == 4 for ids in adm.group_block_ids)
    m.free("0")
    m.free("1")
    m.check_invariants()


def test_several_sliding_windows_hit_and_a_window_block_lost_shortens_the_hit():
    # test_hybrid_kv_cache_coordinator.py: full + SW(512) + SW(256), 6 blocks
    m = manager([full_attention(), sliding_window(512), sliding_window(256)], 100)
    six = [i for i in range(6) for _ in range(BS)]
    m.add_request("0", six)
    m.free("0")
    adm = m.add_request("1", six)
    assert adm.num_cached_tokens == 80 and [len(t) for t in adm.group_block_ids] == [6, 6, 6]
    m.free("1")
    # full + SW(64) + SW(32), 5 blocks: hit 64; without SW(32)'s block 2, hit 32
    m = manager([full_attention(), sliding_window(64), sliding_window(32)], 50)
    five = [i for i in range(5) for _ in range(BS)]
    m.add_request("0", five)
    m.free("0")
    assert m.lookup(five) == 64
    with hidden(m, five, (2, 2)):
        assert m.lookup(five) == 32


def vllm_cases_hit(spec, bs, cases, tail=0):
    """Our hit, in blocks, for each of vLLM's cached patterns (``max_length`` =
    ``len(pattern) * bs + tail``), through ``longest_hit`` and through a manager whose
    cached blocks are exactly the pattern."""
    out = []
    for cached in cases:
        limit = (len(cached) * bs + tail) // bs
        rule = longest_hit([spec], bs, limit, lambda g, j, cached=cached: cached[j])
        prompt = list(range(1, len(cached) * bs + tail + 2))  # max_length = n - 1
        m = manager([spec], len(cached) + 3, bs)
        m.add_request("a", prompt[:len(cached) * bs] + [0])
        m.free("a")
        with hidden(m, prompt, *[(0, j) for j, c in enumerate(cached) if not c]):
            assert m.lookup(prompt) == rule * bs
        out.append(rule)
    return out


def test_sliding_window_possible_cached_prefix():
    # test_single_type_kv_cache_manager.py: block size 2, window 4
    T, F = True, False
    cases = [[F] * 10, [T], [T, F], [T, T], [T, T, F], [T, T, T], [T, T, T, F],
             [T, T, F, T, F, F, T, T, F, T, T, T], [T, T, F, T, F, F, T, T, F, F, F],
             [T, T, F, T, F, F, T, T, F, F, F, T]]
    assert vllm_cases_hit(sliding_window(4), 2, cases) == [0, 1, 1, 2, 2, 3, 3, 12, 8, 8]


@pytest.mark.parametrize("lead", [True, False])
def test_chunked_local_attention_possible_cached_prefix(lead):
    # test_single_type_kv_cache_manager.py: block size 2, chunk 4 (a multiple of it);
    # (pattern, tail tokens past its blocks, vLLM's hit in blocks); R: 8 blocks that
    # vLLM draws at random, here all cached or all missing
    T, F, R = True, False, [lead] * 8
    cases = [([T], 0, 1), ([T], 1, 1), ([T, F], 0, 2), ([T, F], 1, 2), ([T, T], 0, 2),
             ([T, T], 1, 2), ([T, T, F], 0, 2), ([T, T, F], 1, 2), ([T, T, T], 0, 3),
             ([T, T, T], 1, 3), ([T, T, T, F], 0, 4), ([T, T, T, F], 1, 4),
             (R + [T], 1, 9), (R + [F], 1, 8), (R + [T, T], 1, 10), (R + [T, F], 0, 10),
             (R + [T, F], 1, 10), (R + [F, T], 0, 10), (R + [F, T], 1, 10),
             (R + [F, F], 0, 10), (R + [F, F], 1, 10)]
    for cached, tail, want in cases:
        assert vllm_cases_hit(chunked_local(4), 2, [cached], tail) == [want], (cached, tail)


def test_difference_1_a_chunk_that_is_not_a_multiple_of_the_block_is_checked_whole():
    # chunk 6, block 4: a hit of 4 blocks (16 tokens) has its first query at 16, which
    # reads 12..16: block 3. vLLM scans from the chunk start of the longest candidate
    # (max_length 20: position 18, block 4) and null-pads blocks 0..3, so with blocks 3
    # and 4 missing it would report 16 tokens; prefixkv reports 12.
    cached = [True, True, True, False, False]
    assert longest_hit([chunked_local(6)], 4, 5, lambda g, j: cached[j]) == 3
    assert vllm_cases_hit(chunked_local(6), 4, [cached]) == [3]


def test_remove_skipped_blocks_sliding_window_and_chunked_local():
    # test_single_type_kv_cache_manager.py, block size 2: the blocks released when the
    # next step starts at n (vLLM's num_computed_tokens)
    sw = [sliding_window(4).num_unread(n, 2) for n in (0, 4, 5, 6, 7, 11)]
    assert sw == [0, 0, 1, 1, 2, 4]
    cl = [chunked_local(4).num_unread(n, 2) for n in (0, 4, 6, 12)]
    assert cl == [0, 2, 2, 6]
    # the same through the manager: a window of 4 releases as decode advances, the
    # block ending the longest prefix first (vLLM frees [1003, 1002] in that order)
    m = manager([sliding_window(4)], 16, bs=2)
    m.add_request("a", [1, 2, 3, 4])
    ids = []
    for t in range(5, 13):
        m.append_tokens("a", [t])
        ids.append(m.get_block_ids("a")[0])
    assert [i.count(0) for i in ids] == [0, 1, 1, 2, 2, 3, 3, 4]
    # vLLM's steps start at 7, then 11: blocks 0, 1, then 2, 3 go together, block 3
    # (ending the longer prefix) ahead of block 2 in the free queue
    m2 = manager([sliding_window(4)], 16, bs=2)
    m2.add_request("a", list(range(1, 8)))      # positions 0..6: blocks 1..4
    m2.append_tokens("a", [8, 9, 10, 11])       # at 7: reads 4..10, blocks 0, 1 go
    assert m2.get_block_ids("a") == ((0, 0, 3, 4, 5, 6),)
    assert m2.free_block_order()[-2:] == [2, 1]
    m2.append_tokens("a", [12])                 # at 11: reads 8..11, blocks 2, 3 go
    assert m2.get_block_ids("a") == ((0, 0, 0, 0, 5, 6),)
    assert m2.free_block_order()[-4:] == [2, 1, 4, 3]
    m2.check_invariants()


def test_null_padded_hit_blocks_take_no_allocation_and_free_hits_count_once():
    # test_get_num_blocks_to_allocate / test_evictable_cached_blocks_not_double_allocated:
    # a hit whose leading blocks are skipped takes only its window's blocks, and a hit
    # block waiting in the free queue counts once toward what the pool must supply
    m = manager([sliding_window(4)], 12, bs=2)
    prompt = list(range(1, 22))                 # 10 full blocks
    m.add_request("a", prompt)
    m.free("a")
    assert m.num_free_blocks == 11
    adm = m.add_request("b", prompt)            # hit 20 tokens: window 4 needs blocks 8, 9
    assert adm.num_cached_tokens == 20 and adm.group_block_ids[0][:8] == (0,) * 8
    assert m.num_free_blocks == 11 - 3          # 2 hits taken off the queue + 1 new block
    m.free("b")
    m.check_invariants()


def test_difference_2_the_null_block_exists_only_when_a_group_releases():
    assert manager([full_attention(), full_attention()], 4).null_block_id is None
    assert manager([full_attention(), sliding_window(8)], 4).null_block_id == 0
    assert manager([chunked_local(8)], 4).null_block_id == 0


def test_difference_3_events_always_carry_the_spec():
    m = manager([full_attention(), sliding_window(32), chunked_local(64)], 16,
                enable_events=True)
    m.add_request("a", COMMON[:BS] + [1])
    assert [(e.group_idx, e.spec_kind, e.spec_tokens) for e in m.take_events()] == [
        (0, "full_attention", 0), (1, "sliding_window", 32), (2, "chunked_local_attention", 64)]


def test_difference_4_unsupported_layouts_are_not_expressible():
    from prefixkv import ConfigError
    from prefixkv.groups import GroupSpec

    for kind in ("mamba", "sink_full_attention", "mla_attention"):
        with pytest.raises(ConfigError):
            GroupSpec(kind)
