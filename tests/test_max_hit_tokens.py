"""``max_hit_tokens``: an admission (and a lookup) that may use at most so many cached
tokens, on the one-group manager and on the hybrid one (where the capped hit is the
longest prefix every group serves within the cap, not the longest hit cut short); and
the hybrid manager's ``peek``: a hit needs the block after it cached too (vLLM's EAGLE).

block_size is 4 throughout.
"""

import pytest

from prefixkv import KVCacheManager, RequestError
from prefixkv.groups import HybridKVCacheManager, full_attention, mamba, sliding_window

PROMPT = list(range(1, 26))  # 25 tokens: 6 full blocks, a hit of 6 at most


def test_one_group_admission_takes_the_blocks_below_the_cap():
    m = KVCacheManager(32, 4, seed=0)
    assert m.add_request("a", PROMPT).block_ids == (0, 1, 2, 3, 4, 5, 6)
    m.free("a")
    assert m.lookup(PROMPT) == 24
    assert m.lookup(PROMPT, max_hit_tokens=11) == 8
    assert m.lookup_block_ids(PROMPT, max_hit_tokens=11) == (0, 1)
    adm = m.add_request("b", PROMPT, max_hit_tokens=11)
    assert adm is not None and adm.num_cached_tokens == 8
    assert adm.block_ids == (0, 1, 6, 7, 8, 9, 10)  # (the cached blocks 2..5 stay findable)
    assert m.add_request("c", PROMPT, max_hit_tokens=0).num_cached_tokens == 0
    assert m.add_request("d", PROMPT, max_hit_tokens=100).num_cached_tokens == 24
    m.check_invariants()


@pytest.mark.parametrize("bad", [-1, 1.5, "4", True])
def test_one_group_bad_cap_is_refused_before_any_change(bad):
    m = KVCacheManager(16, 4, seed=0)
    with pytest.raises(RequestError, match="max_hit_tokens"):
        m.add_request("a", PROMPT, max_hit_tokens=bad)
    with pytest.raises(RequestError, match="max_hit_tokens"):
        m.lookup(PROMPT, max_hit_tokens=bad)
    with pytest.raises(RequestError, match="max_hit_tokens"):
        m.lookup_block_ids(PROMPT, max_hit_tokens=bad)
    assert m.num_free_blocks == 16
    m.check_invariants()


def hybrid_with_a_hole() -> HybridKVCacheManager:
    """full + a window of 8 (a query at p reads p-7 .. p); "a" holds the prompt and its
    window group's block 2 (positions 8..11) lost its content alone, as an eviction
    takes it (``uncache_blocks`` would forget the prefix and what follows it too:
    tests/test_groups_orphans.py)."""
    m = HybridKVCacheManager([full_attention(), sliding_window(8)], 32, 4, seed=0)
    adm = m.add_request("a", PROMPT)
    assert adm is not None
    m._index.drop_one(m._pool.blocks[adm.group_block_ids[1][2]])
    return m


def test_hybrid_cap_takes_the_longest_hit_the_windows_serve_below_it():
    m = hybrid_with_a_hole()
    # a hit of 6 blocks reads the window's blocks 4, 5; of 5 blocks, 3, 4: both served
    assert [m.lookup(PROMPT, max_hit_tokens=c) for c in (None, 24, 23, 20)] == [24, 24, 20, 20]
    # a hit of 4 would read block 2: the longest served below 16 is 2 blocks (blocks
    # 0, 1), not the 4 of the uncapped hit cut short
    assert m.lookup(PROMPT, max_hit_tokens=16) == 8
    a = m.get_block_ids("a")
    assert m.lookup_block_ids(PROMPT, max_hit_tokens=16) == (a[0][:2], a[1][:2])
    adm = m.add_request("b", PROMPT, max_hit_tokens=19)
    assert adm is not None and adm.num_cached_tokens == 8
    assert [ids[:2] for ids in adm.group_block_ids] == [a[0][:2], a[1][:2]]
    m.check_invariants()


@pytest.mark.parametrize("bad", [-1, 2.0, "3"])
def test_hybrid_bad_cap_is_refused_before_any_change(bad):
    m = hybrid_with_a_hole()
    free = m.num_free_blocks
    for call in (lambda: m.add_request("b", PROMPT, max_hit_tokens=bad),
                 lambda: m.lookup(PROMPT, max_hit_tokens=bad),
                 lambda: m.lookup_block_ids(PROMPT, max_hit_tokens=bad)):
        with pytest.raises(RequestError, match="max_hit_tokens"):
            call()
    assert m.num_free_blocks == free
    m.check_invariants()


def test_hybrid_peek_needs_the_block_after_the_hit_in_every_group():
    m = hybrid_with_a_hole()
    a = m.get_block_ids("a")
    # 6 blocks cached: a hit of 6 would peek at block 6 (not a full block): 5, peeking at 5
    assert m.lookup(PROMPT) == 24 and m.lookup(PROMPT, peek=True) == 20
    # the block peeked at may hold the prompt's last token
    assert m.lookup(PROMPT[:24], peek=True) == 20
    # 21 tokens: a hit of 4 would peek at block 4 (fine) and read the window's block 2
    # (gone): the longest is 1 block (peeking at block 1), where without peeking a hit
    # of 5 reads the window's blocks 3, 4
    assert m.lookup(PROMPT[:21]) == 20 and m.lookup(PROMPT[:21], peek=True) == 4
    assert m.lookup(PROMPT, peek=True, max_hit_tokens=16) == 4
    ids = m.lookup_block_ids(PROMPT, peek=True)
    assert ids == (a[0][:5], (0, 0, 0, a[1][3], a[1][4]))
    adm = m.add_request("b", PROMPT, peek=True)
    assert adm is not None and adm.num_cached_tokens == 20
    assert tuple(t[:5] for t in adm.group_block_ids) == ids
    m.check_invariants()


def test_hybrid_peek_in_some_groups_only():
    m = hybrid_with_a_hole()
    a = m.get_block_ids("a")
    # 21 tokens: peeking in the full-attention group only, a hit of 4 peeks at its block
    # 4 (cached) and reads the window's blocks 2, 3: 2 is gone, so a hit of 2 (the window
    # reads 0, 1; the full group peeks at its block 2)
    assert m.lookup(PROMPT[:21], peek=(True, False)) == 8
    # peeking in the window group only: a hit of 4 reads and peeks at 2..4: 1 block
    assert m.lookup(PROMPT[:21], peek=(False, True)) == 4
    assert m.lookup(PROMPT[:21], peek=(False, False)) == m.lookup(PROMPT[:21]) == 20
    assert m.lookup(PROMPT, peek=(True, False)) == 20
    assert m.lookup_block_ids(PROMPT, peek=(True, False)) == (a[0][:5], (0, 0, 0, a[1][3], a[1][4]))


def test_peek_is_never_a_mamba_groups():
    m = HybridKVCacheManager([full_attention(), mamba()], 32, 4, seed=0)
    assert m.add_request("a", PROMPT) is not None
    assert m.lookup(PROMPT, peek=True) == m.lookup(PROMPT, peek=(True, False))
    with pytest.raises(RequestError, match="peek"):
        m.lookup(PROMPT, peek=(True, True))


def test_hybrid_bad_peek_is_refused_before_any_change():
    m = hybrid_with_a_hole()
    free = m.num_free_blocks
    for call in (lambda: m.add_request("b", PROMPT, peek="yes"),
                 lambda: m.add_request("b", PROMPT, peek=(True,)),
                 lambda: m.lookup(PROMPT, peek=1),
                 lambda: m.lookup(PROMPT, peek=(1, 0)),
                 lambda: m.lookup_block_ids(PROMPT, peek=None)):
        with pytest.raises(RequestError, match="peek"):
            call()
    assert m.num_free_blocks == free
    m.check_invariants()
