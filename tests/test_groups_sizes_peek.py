"""EAGLE's hits (``peek``) on a hybrid manager of groups of DIFFERENT block sizes
(docs/groups.md, "EAGLE"): vLLM 0.33's own EAGLE cases worked by hand here, and the
refusals; tests/test_groups_sizes_machine.py drives such managers call for call beside
tests/sized_model.py's reference (itself checked against vLLM's manager)."""

import pytest

from prefixkv import ConfigError
from prefixkv.groups import BlockSizes, HybridKVCacheManager, chunked_local, full_attention, sliding_window

NULL = 0  # (the null block: a window releases)


def blocks_of(n, b):
    """A prompt of ``n`` runs of ``b`` equal tokens (vLLM's tests' ``i for i in range(n)
    for _ in range(b)``)."""
    return [i for i in range(n) for _ in range(b)]


def test_a_flagged_window_caches_the_block_after_the_boundary_and_its_hit_drops_it():
    # vLLM's test_eagle_swa_boundary_caches_post_boundary_block: full attention at 32
    # beside an 8-token window at 8, the window flagged (hash 8, lcm 32). A prompt of
    # 40: the window caches block 3 (before the boundary) and block 4 (after it)
    specs, peek = [full_attention(), sliding_window(8)], (False, True)
    m = HybridKVCacheManager(specs, 100, BlockSizes.of([32, 8], peek=peek))
    prompt = blocks_of(5, 8)
    a = m.add_request("a", prompt).group_block_ids
    m.free("a")
    assert m.lookup(prompt + [999], peek=peek) == 32  # (block 4 matched, then dropped)
    assert m.lookup_block_ids(prompt + [999], peek=peek) == ((a[0][0],), (NULL, NULL, NULL, a[1][3]))
    assert m.lookup(prompt + [999]) == 32  # (no peek: blocks 3 and 0 of the groups)
    m.check_invariants()
    # not flagged, the window caches block 3 only: a peeking hit finds nothing
    plain = HybridKVCacheManager(specs, 100, BlockSizes.of([32, 8]))
    plain.add_request("a", prompt)
    plain.free("a")
    assert (plain.lookup(prompt + [999], peek=peek), plain.lookup(prompt + [999])) == (0, 32)


def test_a_flagged_window_finds_its_hit_at_an_aligned_boundary():
    # vLLM's test_eagle_swa_alignment_caches_extra_block: 16 window blocks of 8 (4 spans
    # of 32); the full group's hit within 127 tokens is 96, the window's run of 2 blocks
    # (11 and 12: the tail and the block after the boundary) confirms it
    specs, peek = [full_attention(), sliding_window(8)], (False, True)
    m = HybridKVCacheManager(specs, 100, BlockSizes.of([32, 8], peek=peek))
    prompt = blocks_of(16, 8)
    m.add_request("a", prompt)
    m.free("a")
    assert m.lookup(prompt, peek=peek) == 96
    got = m.lookup_block_ids(prompt, peek=peek)
    assert [len(g) for g in got] == [3, 12] and got[1][:11] == (NULL,) * 11
    m.check_invariants()


def test_groups_of_a_flagged_groups_spec_cache_for_its_hits_too():
    # vLLM's test_eagle_grouped_swa_siblings_use_same_cache_mask: two windows of one spec,
    # the second flagged: the first caches as flagged too, so the hit at 64 (blocks 7 and
    # the peeked 8 of both windows) is found
    specs = [full_attention(), sliding_window(8), sliding_window(8)]
    sizes = BlockSizes.of([32, 8, 8], peek=(False, False, True))
    m = HybridKVCacheManager(specs, 100, sizes)
    assert m.sizes.peek == (False, True, True)
    prompt = blocks_of(9, 8)
    a = m.add_request("a", prompt).group_block_ids
    m.free("a")
    assert m.lookup(prompt + [999], peek=(False, False, True)) == 64
    assert m.lookup_block_ids(prompt + [999], peek=(False, False, True))[1:] == (
        (NULL,) * 7 + (a[1][7],), (NULL,) * 7 + (a[2][7],))
    m.check_invariants()


def test_a_flagged_full_group_drops_a_block_and_falls_to_the_aligned_boundary_below():
    # full attention at 4 (flagged) beside full attention at 12: lcm 12. A prompt of 30,
    # computed whole: the flagged group caches up to 24 + 4 = 28, the other up to 24. A
    # peeking hit within 29: the flagged run of 7 blocks (28 tokens) less one is 24
    specs, peek = [full_attention(), full_attention()], (True, False)
    m = HybridKVCacheManager(specs, 40, BlockSizes.of([4, 12], peek=peek))
    prompt = list(range(30))
    a = m.add_request("a", prompt).group_block_ids
    assert m.lookup(prompt, peek=peek) == 24
    assert m.lookup_block_ids(prompt, peek=peek) == (a[0][:6], a[1][:2])
    m.free("a")
    # the prompt's first 27 tokens: the peeked block (24..27) is not all there: 12
    assert m.lookup(prompt[:27], peek=peek) == 12
    m.check_invariants()


@pytest.mark.parametrize("peek", [(True,), (True, 1), "ab", 3])
def test_peek_flags_are_one_bool_per_group(peek):
    with pytest.raises(ConfigError, match="peek must be one bool per group"):
        BlockSizes.of([8, 16], peek=peek)


@pytest.mark.parametrize("specs, sizes, match", [
    # vLLM would cache a partial entry of a block not full yet, its key until it fills
    ([sliding_window(6), full_attention()], BlockSizes.of([4, 8], peek=(False, True)),
     "full attention of the hash block's size"),
    ([full_attention(), chunked_local(16)], BlockSizes.of([8, 16], peek=(False, True)),
     "got a chunked_local_attention group"),
])
def test_peeking_groups_it_does_not_serve_are_refused_at_construction(specs, sizes, match):
    with pytest.raises(ConfigError, match=match):
        HybridKVCacheManager(specs, 64, sizes)


@pytest.mark.parametrize("specs, sizes", [
    ([full_attention(), sliding_window(6), sliding_window(40)], [8, 8, 16]),  # (three sets)
    ([sliding_window(6), sliding_window(20)], [8, 16]),  # (two sets, no full attention)
    ([full_attention(), chunked_local(16)], [8, 16]),
])
def test_a_peeking_lookup_vllm_does_not_find_in_one_pass_is_refused(specs, sizes):
    m = HybridKVCacheManager(specs, 64, BlockSizes.of(sizes))
    m.add_request("a", list(range(40)))
    for call in (lambda: m.lookup(list(range(40)), peek=True),
                 lambda: m.add_request("b", list(range(40)), peek=True)):
        with pytest.raises(ConfigError, match="two \\(spec, size\\) sets at most"):
            call()
    assert m.lookup(list(range(40))) == 32
    m.check_invariants()
