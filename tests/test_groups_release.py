"""groups/release.py: ``free`` asking whether a longer prefix than the request's exists
(hits past it may need its blocks), and what ``reset_prefix_cache`` drops besides the
cached content (the fork copies and the events the engine has not taken yet). Block
size 4; block 0 is the null block."""

from prefixkv import AllBlocksCleared
from prefixkv.groups import GroupBlockCopy, HybridKVCacheManager, full_attention, sliding_window

FULL, SW8 = full_attention(), sliding_window(8)


def manager(groups=(FULL, SW8), num_blocks=16, **kw):
    return HybridKVCacheManager(list(groups), num_blocks, 4, seed=0, **kw)


def test_free_counts_a_longer_prefix_where_one_is_cached():
    """A window of 8 beside full attention; a has 12 tokens, 3 blocks in each group.
    Freed alone, no hit is longer than 3 blocks: once the window's block 2 goes, the
    hit of 3 blocks is dead and the full group's block 2 is of no use, so it goes next.
    With a longer prefix cached (b: a and 8 more tokens, computed and freed first), a
    hit past a's prefix needs a's last blocks too: vLLM's order, group by group.
    (mutants-r24: ``free`` taking a longer prefix as always there, or as there only with
    two references more than its blocks', survived every hybrid test.)"""
    a = list(range(1, 13))
    for longer in (False, True):
        m = manager((SW8, FULL), 32)
        assert m.add_request("a", a).group_block_ids == ((1, 2, 3), (4, 5, 6))
        if longer:
            m.add_request("b", a + list(range(50, 58)))
            m.free("b")
        m.free("a")
        assert m.free_block_order()[-6:] == ([3, 2, 1, 6, 5, 4] if longer else [3, 6, 2, 5, 1, 4])
        m.check_invariants()


def test_a_reset_drops_the_fork_copies_not_taken_yet():
    """a (10 tokens: two full blocks and a partial one) forked to b: the partial blocks
    are copied on write, one copy per group. Both freed, the copies are still owed
    (``take_kv_ops`` keeps every copy stated); after a reset no request holds a block
    and they write blocks no one holds: none is given. (mutants-r24: the reset that kept
    them survived every hybrid test.)"""
    for reset in (False, True):
        m = manager()
        assert m.add_request("a", list(range(1, 11))).group_block_ids == ((1, 2, 3), (4, 5, 6))
        copies = m.fork("a", "b").copies
        assert copies == (GroupBlockCopy(3, 7, 0), GroupBlockCopy(6, 8, 1))
        m.free("b")
        m.free("a")
        if reset:
            assert m.reset_prefix_cache()
        assert m.take_kv_ops() == ([] if reset else list(copies))
        m.check_invariants()


def test_a_reset_keeps_the_events_not_taken_yet():
    """Four blocks stored (two full blocks in each group) and not taken, then a reset:
    the stream gives the four ``GroupBlockStored`` and then the ``AllBlocksCleared``, as the
    core manager and vLLM 0.33's pool do (both append the clear to what is pending).
    (mutants-r24 found the hybrid dropping them; coord-r24 made it keep them.)"""
    m = manager(enable_events=True)
    m.add_request("a", list(range(1, 10)))
    m.free("a")
    assert m.reset_prefix_cache()
    events = m.take_events()
    assert [type(e).__name__ for e in events] == ["GroupBlockStored"] * 4 + ["AllBlocksCleared"]
    assert events[-1] == AllBlocksCleared()
    m.add_request("c", list(range(1, 10)))
    assert len(m.take_events()) == 4
    m.check_invariants()


def test_uncache_blocks_leaves_the_blocks_no_request_holds():
    """a's blocks, computed and freed, are named invalid: no request holds them, so
    nothing changes (the engine names blocks of a load it ran for a live request;
    ``uncache_blocks``: "a block no request holds is left as it is"). (mutants-r24: the
    mutant that took them too survived every hybrid test.)"""
    m = manager(enable_events=True)
    prompt = list(range(1, 10))
    assert m.add_request("a", prompt).group_block_ids == ((1, 2, 3), (4, 5, 6))
    m.free("a")
    order, events = m.free_block_order(), m.take_events()
    assert m.lookup(prompt) == 8 and len(events) == 4
    m.uncache_blocks(range(1, 7))
    assert m.lookup(prompt) == 8 and m.free_block_order() == order and m.take_events() == []
    m.check_invariants()


def test_with_caching_off_nothing_is_found_and_freed_blocks_are_reused_first():
    """``enable_caching=False`` (vLLM's manager with prefix caching off): a's 12 tokens
    fill 3 blocks per group, none recorded; b, the same tokens, one scheduled, finds
    nothing; b then a freed, their blocks come back to the front of the free order, each
    free's group by group, each tail first, before the blocks freed earlier (vLLM's
    ``prepend_n`` of uncached blocks, one call per group), and c takes them; no event.
    With caching on, b hits 8 tokens and a's cached blocks go behind the never-used ones."""
    a = list(range(1, 13))
    for caching in (True, False):
        m = manager(num_blocks=20, enable_caching=caching, enable_events=True)
        assert m.add_request("a", a).group_block_ids == ((1, 2, 3), (4, 5, 6))
        b = m.add_request("b", a, num_new_tokens=1)
        assert (b.num_cached_tokens, b.group_block_ids) == \
            ((8, ((1, 2, 7), (4, 5, 8))) if caching else (0, ((7,), (8,))))
        m.free("b")
        m.free("a")
        order = m.free_block_order()
        assert order == ([8, 7, *range(9, 20), 3, 6, 2, 5, 1, 4] if caching
                         else [6, 5, 4, 3, 2, 1, 8, 7, *range(9, 20)])
        assert m.add_request("c", list(range(50, 54))).group_block_ids == ((order[0],), (order[1],))
        assert bool(m.take_events()) is caching
        m.check_invariants()


def test_enable_caching_must_be_a_bool():
    import pytest

    from prefixkv.errors import ConfigError

    with pytest.raises(ConfigError, match="enable_caching"):
        manager(enable_caching=1)
