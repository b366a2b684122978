"""An uncached window (``GroupSpec.cached`` False: vLLM's SWA bounded replay, a
``SlidingWindowMLASpec`` that is not ``prefix_cacheable``): never cached nor looked up,
so a hit is the other groups' alone, and a request admitted on one holds vLLM's null
entries below its window and fresh blocks from there, the hit's part included (its
engine recomputes them). Step by step, with exact block ids."""

import pytest

from prefixkv import ConfigError, RequestError
from prefixkv.groups import (
    BlockSizes,
    GroupBlockStored,
    GroupSpec,
    HybridKVCacheManager,
    chunked_local,
    full_attention,
    sliding_window,
)

BS = 4
PROMPT = list(range(1, 21))  # 20 tokens: 4 full blocks can hit (the last token is computed)


@pytest.mark.parametrize("make", [
    lambda: sliding_window(8, cached=0), lambda: sliding_window(8, cached=None),
    lambda: GroupSpec("full_attention", cached=False), lambda: GroupSpec("mamba", cached=False),
    lambda: GroupSpec("chunked_local_attention", 8, cached=False),
])
def test_a_bad_cached_raises_config_error(make):
    with pytest.raises(ConfigError, match="cached"):
        make()


def test_uncached_windows_are_served_at_one_block_size_only():
    with pytest.raises(ConfigError, match="uncached"):
        HybridKVCacheManager([full_attention(), sliding_window(8, cached=False)], 40,
                             BlockSizes.of((4, 8), 4, 8))


def _manager(**kw):
    return HybridKVCacheManager([full_attention(), sliding_window(8, cached=False)], 40, BS, **kw)


def test_the_hit_is_the_other_groups_and_the_window_takes_fresh_blocks_for_its_part():
    m = _manager()
    null = m.null_block_id
    m.add_request("a", PROMPT)
    assert m.get_block_ids("a") == ((1, 2, 3, 4, 5), (6, 7, 8, 9, 10))
    m.free("a")
    # the full group's blocks alone make the hit; the window's were never cached
    assert m.lookup(PROMPT) == 16
    assert m.lookup_block_ids(PROMPT) == ((1, 2, 3, 4), (null, null))
    adm = m.add_request("b", PROMPT)
    assert adm.num_cached_tokens == 16 and adm.num_new_tokens == 4
    # a query at 16 reads 9..16: blocks 0 and 1 are null, blocks 2..4 fresh (2, 3: the hit's)
    assert adm.group_block_ids == ((1, 2, 3, 4, 10), (null, null, 9, 8, 7))
    m.check_invariants()
    m.free("b")
    m.check_invariants()
    assert m.lookup(PROMPT) == 16


def test_a_hit_may_be_adopted_alone_and_the_next_chunk_goes_on_from_it():
    # vLLM's replay-only chunk: the hit is adopted with no new token; the window holds
    # fresh blocks for the part of the hit its engine recomputes
    m = _manager()
    null = m.null_block_id
    m.add_request("a", PROMPT)
    m.free("a")
    adm = m.add_request("b", PROMPT, num_new_tokens=0)
    assert adm.num_cached_tokens == 16 and adm.num_new_tokens == 0
    assert adm.group_block_ids == ((1, 2, 3, 4), (null, null, 10, 9))
    m.check_invariants()
    assert m.extend("b", 4) is not None
    assert m.get_block_ids("b") == ((1, 2, 3, 4, 8), (null, null, 10, 9, 7))
    m.check_invariants()


def test_no_new_token_is_refused_without_a_hit_or_an_uncached_window():
    m = _manager()
    with pytest.raises(RequestError, match="num_new_tokens"):
        m.add_request("b", PROMPT, num_new_tokens=0)  # (no hit yet)
    plain = HybridKVCacheManager([full_attention(), sliding_window(8)], 40, BS)
    plain.add_request("a", PROMPT)
    plain.free("a")
    with pytest.raises(RequestError, match="num_new_tokens"):
        plain.add_request("b", PROMPT, num_new_tokens=0)
    assert plain.num_free_blocks == 39 and not m.num_cached_blocks


def test_the_window_announces_nothing_and_its_released_blocks_hold_no_prefix():
    m = _manager(enable_events=True)
    m.add_request("a", PROMPT)
    stored = [e for e in m.take_events() if isinstance(e, GroupBlockStored)]
    assert [e.group_idx for e in stored] == [0] * 5
    for n in range(20, 30):  # decode: the window releases its blocks as it goes
        m.append_tokens("a", [n])
        m.check_invariants()
    assert all(e.group_idx == 0 for e in m.take_events() if isinstance(e, GroupBlockStored))
    assert m.get_block_ids("a")[1][:5] == (m.null_block_id,) * 5
    assert m.num_cached_blocks == 7  # (blocks 0..6 of the full group)


@pytest.mark.parametrize("num_blocks, fits", [(18, True), (17, False)])
def test_a_full_fit_counts_the_window_blocks_of_the_hit(num_blocks, fits):
    # b (40 tokens) hits a's 5 full blocks (20 tokens); a query at 20 reads 13..20, so
    # the window's cut is 3. The whole prompt needs, as vLLM's full_sequence_must_fit
    # counts: 10 - 5 fresh full blocks, and 10 - 3 window blocks (the hit's 2 included):
    # 12 fresh beside the 5 held hits, 17 of the pool's usable blocks
    m = HybridKVCacheManager([full_attention(), sliding_window(8, cached=False)], num_blocks, BS)
    m.add_request("a", PROMPT)
    m.free("a")
    adm = m.add_request("b", PROMPT + list(range(50, 70)), num_new_tokens=1, require_full_fit=True)
    assert (adm is not None) == fits
    if fits:
        assert adm.num_cached_tokens == 20
    m.check_invariants()


def test_chunked_and_full_groups_beside_an_uncached_window_keep_their_rule():
    m = HybridKVCacheManager([sliding_window(4, cached=False), chunked_local(8), full_attention()], 60, BS)
    m.add_request("a", PROMPT)
    m.free("a")
    ids = m.lookup_block_ids(PROMPT)
    assert m.lookup(PROMPT) == 16 and len(ids[2]) == 4 and ids[0] == (m.null_block_id,) * 3
    m.add_request("b", PROMPT)
    m.check_invariants()


@pytest.mark.parametrize("cached", [True, False])
def test_a_recompute_below_the_replayed_positions_reads_lost_kv(cached):
    # b hits a's 12 tokens; a query at 12 reads 7..12 of the 6-token window. Cached, the
    # window holds the hit's blocks 1, 2 (positions 4..11) as a computed them; uncached,
    # fresh blocks its engine rebuilt from 7 on only: a recompute from 9 reads 4..9,
    # whose 4..6 hold nothing, so what it computes is never cached (taint.py)
    m = HybridKVCacheManager([full_attention(), sliding_window(6, cached=cached)], 40, BS)
    m.add_request("a", PROMPT[:12])
    m.free("a")
    assert m.add_request("b", PROMPT[:16]).num_cached_tokens == 12
    assert m.reads_released("b", 9) == m.reads_released("b", 11) == (not cached)
    assert m.reads_released("b", 8)  # (3..8: block 0 is the null entry in both)
    m.rewind("b", 9)
    m.append_tokens("b", PROMPT[9:16])
    m.check_invariants()
    m.free("b")
    assert m.lookup(PROMPT[:16] + [0]) == (16 if cached else 8)


def test_what_a_load_wrote_in_the_window_is_sound():
    # a connector loads all 4 tokens (no hit) into every group, the window included:
    # vLLM then recomputes the last one, whose query reads 1..3, which the load wrote.
    # Before: prefixkv took the window as rebuilt from first_needed(4) = 2 only, and
    # kept the recompute uncached
    m = HybridKVCacheManager([full_attention(), sliding_window(3, cached=False)], 40, BS)
    m.add_request("r", PROMPT[:5], num_new_tokens=4, num_external_tokens=4, read_cache=False)
    assert not m.reads_released("r", 3)
    m.rewind("r", 3)
    m.append_tokens("r", PROMPT[3:5])
    m.check_invariants()
    m.free("r")
    assert m.lookup(PROMPT[:8]) == 4
