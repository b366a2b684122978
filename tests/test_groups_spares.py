"""Spare copies in the groups index: two requests that decode the same text each fill a
block with the same prefix; the second is a spare (twin) of the first in its group.
block_size 4; ``FULL`` beside an 8-token window."""

import pytest

from prefixkv import AllBlocksCleared, InvariantError
from prefixkv.groups import (
    GroupBlockRemoved,
    GroupBlockStored,
    HybridKVCacheManager,
    full_attention,
    sliding_window,
)

FULL, SW8 = full_attention(), sliding_window(8)


def twins(num_blocks, **kw):
    """a and b share the prompt 1..6 (b hits block 0) and decode 7, 8: each fills its own
    block 1, a's first (the primary), b's a spare. Events, if on, taken."""
    m = HybridKVCacheManager([FULL, SW8], num_blocks, 4, seed=0, **kw)
    m.add_request("a", [1, 2, 3, 4, 5, 6])
    m.add_request("b", [1, 2, 3, 4, 5, 6])
    assert [t[0] for t in m.get_block_ids("a")] == [t[0] for t in m.get_block_ids("b")]
    for rid in ("a", "b"):
        m.append_tokens(rid, [7, 8])
    m.check_invariants()
    return m


def test_a_spare_is_not_announced_and_takes_over_when_its_primary_is_evicted():
    m = twins(13, enable_events=True)
    stored = [e for e in m.take_events() if isinstance(e, GroupBlockStored)]
    a1, b1 = [t[1] for t in m.get_block_ids("a")], [t[1] for t in m.get_block_ids("b")]
    assert [(e.group_idx, e.block_ids[0]) for e in stored if e.first_block == 1] == list(enumerate(a1))
    hashes = {(e.group_idx, e.block_hashes[0]) for e in stored if e.first_block == 1}
    m.free("a")
    assert m.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    m.add_request("x", list(range(100, 100 + 4 * (m.num_free_blocks // 2))))  # every free block
    assert set(a1) <= {b for t in m.get_block_ids("x") for b in t}  # a's blocks 1 evicted
    removed = [e for e in m.take_events() if isinstance(e, GroupBlockRemoved)]
    assert not hashes & {(e.group_idx, h) for e in removed for h in e.block_hashes}  # b's copy holds it
    assert m.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8  # in b's copy: before, 4
    assert [t[1] for t in m.lookup_block_ids([1, 2, 3, 4, 5, 6, 7, 8, 9])] == b1
    m.check_invariants()
    m.free("x")
    m.free("b")  # the last copy goes cached, then evicted: withdrawn once per group
    m.add_request("y", list(range(200, 200 + 4 * (m.num_free_blocks // 2))))
    removed = [e for e in m.take_events() if isinstance(e, GroupBlockRemoved)]
    assert sorted((e.group_idx, e.block_hashes[0], e.block_ids[0]) for e in removed
                  if (e.group_idx, e.block_hashes[0]) in hashes) == sorted((g, h, b1[g]) for g, h in hashes)
    m.check_invariants()


def test_the_log_overflow_restates_a_spare_that_took_over_under_its_own_block():
    m = twins(13, enable_events=True, max_events=30)
    hashes = {(e.group_idx, e.block_hashes[0]) for e in m.take_events()
              if isinstance(e, GroupBlockStored) and e.first_block == 1}
    m.free("a")
    m.add_request("x", list(range(100, 100 + 4 * (m.num_free_blocks // 2))))
    m.free("x")
    b1 = [t[1] for t in m.get_block_ids("b")]
    for i in range(20):  # 40 events: past max_events, so the next take restates the cache
        m.add_request(f"s{i}", [1000 + i] * 5)
        m.free(f"s{i}")
    out = m.take_events()
    assert out[0] == AllBlocksCleared()
    assert sorted((e.group_idx, e.block_hashes[0], e.block_ids[0]) for e in out[1:]
                  if e.block_ids[0] in b1) == sorted((g, h, b1[g]) for g, h in hashes)


def test_a_spare_released_while_its_primary_is_cached_goes_empty_and_the_primary_takes_its_place():
    m = twins(16)
    a, b = m.get_block_ids("a"), m.get_block_ids("b")
    m.free("a")  # a's blocks 1 (the primaries) cached
    m.add_request("c", [50, 51, 52, 53, 54])
    c = m.get_block_ids("c")
    m.free("c")  # c's blocks 0 cached after them
    assert m.free_block_order()[-4:] == [a[0][1], a[1][1], c[0][0], c[1][0]]
    # b's spares go empty (first out), a's primaries move to their places in the LRU
    # order, after c's (before: b's blocks 1 went empty, a's stayed before c's)
    m.free("b")
    assert m.free_block_order()[:2] == [b[1][1], b[0][1]]
    assert m.free_block_order()[-6:] == [c[0][0], c[1][0], a[0][1], a[1][1], a[0][0], a[1][0]]
    assert m.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    m.check_invariants()


@pytest.mark.parametrize("how", ["unlisted", "unmarked"])
def test_check_invariants_finds_a_spare_the_index_lost(how):
    m = twins(12)
    twins_of = m._index.twins[0]  # (the index's own list: corrupted here on purpose)
    pid, listed = next(iter(twins_of.items()))
    if how == "unlisted":  # content, yet neither its group's entry nor a listed spare
        del twins_of[pid]
        match = "not indexed in its group"
    else:  # listed as a spare, no longer marked one
        listed[0].twin = False
        match = "spare .* does not match the block"
    with pytest.raises(InvariantError, match=match):
        m.check_invariants()


def test_uncaching_a_primary_hands_its_prefix_to_the_spare_and_uncaching_a_spare_empties_it():
    m = twins(13, enable_events=True)
    m.take_events()
    a1, b1 = [t[1] for t in m.get_block_ids("a")], [t[1] for t in m.get_block_ids("b")]
    m.uncache_blocks(a1)  # a's KV there turned out invalid: b's copies hold the prefix
    assert [e for e in m.take_events() if isinstance(e, GroupBlockRemoved)] == []
    assert [t[1] for t in m.lookup_block_ids([1, 2, 3, 4, 5, 6, 7, 8, 9])] == b1
    m.check_invariants()
    m.uncache_blocks(b1)  # the last copies: the prefix goes, withdrawn once per group
    removed = [e for e in m.take_events() if isinstance(e, GroupBlockRemoved)]
    assert sorted((e.group_idx, e.block_ids[0]) for e in removed) == list(enumerate(b1))
    assert m.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4
    m.check_invariants()
    m.free("a")
    m.free("b")  # blocks 1 of both went empty: first out, nothing of them cached
    assert set(m.free_block_order()[:4]) == {*a1, *b1}
    m.check_invariants()


def test_uncaching_a_spare_leaves_the_primary_found():
    m = twins(13)
    a1, b1 = [t[1] for t in m.get_block_ids("a")], [t[1] for t in m.get_block_ids("b")]
    m.uncache_blocks(b1)
    assert [t[1] for t in m.lookup_block_ids([1, 2, 3, 4, 5, 6, 7, 8, 9])] == a1
    m.free("b")
    assert set(m.free_block_order()[:2]) == set(b1)
    m.check_invariants()


def test_a_primary_hands_its_prefix_to_the_first_spare_made():
    # a, b and c decode the same text: b's blocks 1 are spares of a's, then c's. When a's
    # go, b's hold the prefix (vLLM 0.33 finds the copy it cached first); before, c's.
    m = twins(16)
    m.add_request("c", [1, 2, 3, 4, 5, 6])
    m.append_tokens("c", [7, 8])
    a1, b1 = [t[1] for t in m.get_block_ids("a")], [t[1] for t in m.get_block_ids("b")]
    m.uncache_blocks(a1)
    assert [t[1] for t in m.lookup_block_ids([1, 2, 3, 4, 5, 6, 7, 8, 9])] == b1
    m.check_invariants()


def test_uncaching_a_shared_block_takes_the_spares_of_what_was_computed_after_it():
    """a and b share block 0 (twins: b's hit); its KV found invalid, the prefix goes and
    with it block 1's, computed after it: a's primaries and b's spares alike lose it
    (a spare kept would take the primary's place and keep a prefix computed from invalid
    KV cached), withdrawn once per group; freed, all six blocks return empty. (b's spares
    are among the blocks ``uncache`` is given: ``computed_on``.)"""
    m = twins(13, enable_events=True)
    m.take_events()
    assert {r: m.get_block_ids(r) for r in "ab"} == {"a": ((1, 2), (3, 4)), "b": ((1, 5), (3, 6))}
    m.uncache_blocks([1, 3])
    assert [(e.group_idx, e.block_ids) for e in m.take_events() if isinstance(e, GroupBlockRemoved)] == [
        (0, (1,)), (1, (3,)), (0, (2,)), (1, (4,))]
    assert m.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    assert [m._index.nodes[i] for i in (1, 2, 3, 4, 5, 6)] == [None] * 6
    m.check_invariants()
    m.free("a")
    m.free("b")
    assert m.free_block_order()[:6] == [6, 3, 5, 1, 4, 2]
    m.check_invariants()


def test_a_request_freed_before_computing_takes_the_spares_built_on_its_blocks():
    """a's block 0 (1..4) is recorded when scheduled; o and p hit it (at most 4 tokens) and
    each compute block 1 (5..8): p's are spares of o's. a freed with no token computed:
    block 0 never held that KV, so its prefix goes and with it block 1's, o's primaries
    and p's spares alike (a spare kept would take its primary's place, a prefix computed
    on KV never written still cached), withdrawn once per group. (mutants-r30: ``uncache``'s
    spares of a forgotten prefix, the only path that is not given them.)"""
    m = HybridKVCacheManager([FULL, SW8], 16, 4, seed=0, enable_events=True)
    m.add_request("a", [1, 2, 3, 4, 5])
    for rid in ("o", "p"):
        assert m.add_request(rid, [1, 2, 3, 4, 5, 6, 7, 8, 9], max_hit_tokens=4).num_cached_tokens == 4
    assert [m.get_block_ids(rid) for rid in ("o", "p")] == [((1, 5, 6), (3, 7, 8)), ((1, 9, 10), (3, 11, 12))]
    m.take_events()
    m.free("a", num_computed_tokens=0)
    assert [(e.group_idx, e.block_ids) for e in m.take_events() if isinstance(e, GroupBlockRemoved)] == [
        (0, (1,)), (1, (3,)), (0, (5,)), (1, (7,))]
    assert [m._index.nodes[i] for i in (1, 3, 5, 7, 9, 11)] == [None] * 6
    assert m.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    m.check_invariants()


def test_what_a_request_computes_after_its_invalid_first_block_is_never_found():
    """a and b (not reading the cache) compute the same block 0, b's a spare of a's. a's
    block 0 found invalid: b's keeps the prefix found, but what a computes after it (its
    block 1, on KV never right) is never found: a reader hits b's block 0 only.
    (mutants-r30: ``cut_off`` not asking about block 0 found a's block 1: a wrong KV.)"""
    m = HybridKVCacheManager([FULL, SW8], 16, 4, seed=0)
    m.add_request("a", [1, 2, 3, 4, 5, 6])
    m.add_request("b", [1, 2, 3, 4, 5, 6], read_cache=False)
    assert [m.get_block_ids(rid) for rid in ("a", "b")] == [((1, 2), (3, 4)), ((5, 6), (7, 8))]
    m.uncache_blocks([1, 3])
    m.append_tokens("a", [7, 8])
    assert m.lookup_block_ids([1, 2, 3, 4, 5, 6, 7, 8, 9]) == ((5,), (7,))
    m.check_invariants()


def test_check_invariants_finds_an_entry_whose_block_names_another_prefix():
    m = twins(12)
    pid, block = next(iter(m._index.entries[0].items()))  # (corrupted here on purpose)
    block.content_id = pid + 1000
    with pytest.raises(InvariantError, match=f"entry {pid} -> .* does not match the block"):
        m.check_invariants()


def test_check_invariants_finds_a_block_with_a_key_but_no_prefix():
    m = twins(12)
    m.add_request("c", [9, 9])  # (its block holds 2 tokens: no prefix)
    block = m._pool.blocks[m.get_block_ids("c")[0][0]]
    assert block.key is None and m._index.nodes[block.block_id] is None
    block.key = b"x" * 16  # (corrupted here on purpose)
    with pytest.raises(InvariantError, match=f"block {block.block_id}: key .* but prefix None"):
        m.check_invariants()


def test_check_invariants_finds_a_prefix_whose_spares_are_listed_empty():
    m = twins(12)
    pid = next(iter(m._index.twins[0]))
    m._index.twins[0][pid] = []  # (corrupted here on purpose)
    with pytest.raises(InvariantError, match=f"spares \\[\\] of prefix {pid}, which it does not find"):
        m.check_invariants()
