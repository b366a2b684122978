"""A finished request's full-attention group finds its whole prefix without being asked
(``free_runs.finder``, ``GroupRequest.losses``): while no ``uncache`` took content from a
held block since the request's admission (``GroupIndex.losses``) and it is not tainted,
its hits were found and every block it computed was recorded. ``check_invariants``
verifies it (``free_runs.unfound``); an ``uncache`` anywhere makes the order ask again.
block_size 4; full attention beside a window of 8 tokens (2 blocks)."""

from __future__ import annotations

import pytest

from prefixkv import InvariantError
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window
from prefixkv.groups.free_order import free_order
from prefixkv.groups.free_runs import finder

BS = 4
SPECS = [full_attention(), sliding_window(8)]
P = list(range(100, 133))  # 8 full blocks + 1 token


def manager(num_blocks: int = 64) -> HybridKVCacheManager:
    return HybridKVCacheManager(SPECS, num_blocks, BS, seed=0)


def asked(m: HybridKVCacheManager, rid: str) -> list[int]:
    """The free order of ``rid`` with every group's index asked (the order before
    ``finder``), as block ids."""
    req, index = m._requests[rid], m._index
    nodes = req.nodes
    longer = bool(nodes) and nodes[-1].refs > index.num_blocks_of(nodes[-1]) + 1
    return [b.block_id for b in free_order(SPECS, BS, req,
                                           lambda g, lo, hi: index.finds(g, nodes[lo:hi]),
                                           longer)]


def freed(m: HybridKVCacheManager, rid: str) -> list[int]:
    """The block ids ``free(rid)`` gives the pool to release, in its order."""
    pool, got = m._pool, []
    release = pool.release

    def spied(blocks):
        blocks = list(blocks)
        got.extend(b.block_id for b in blocks)
        release(blocks)
    pool.release = spied
    try:
        m.free(rid)
    finally:
        del pool.release
    return got


def test_a_request_never_uncached_is_not_asked_about_its_full_group():
    m = manager()
    m.add_request("a", P)
    req = m._requests["a"]
    found = finder(m._index, req)
    assert list(found(0, 0, 8)) == []  # (full attention: known)
    assert list(found(1, 6, 8)) == [True, True]  # (the window: asked)
    m.check_invariants()
    want = asked(m, "a")
    assert freed(m, "a") == want


def test_an_uncache_since_the_admission_makes_the_order_ask_again():
    """b hit a's first 6 blocks, then a's block 2 turned out invalid: the full group
    misses blocks 2.. of b's prefix (forgotten with every descendant), which the order
    asks again (what it lets go first is what it was before ``finder``)."""
    m = manager()
    m.add_request("a", P)
    assert m.add_request("b", P[:24] + [1, 2, 3, 4, 5]).num_cached_tokens == 24
    m.free("a")
    m.uncache_blocks([m.get_block_ids("b")[0][2]])
    req = m._requests["b"]
    assert req.losses != m._index.losses
    assert list(finder(m._index, req)(0, 0, 7)) == [True, True] + [False] * 5
    m.check_invariants()
    want = asked(m, "b")
    assert freed(m, "b") == want


def test_a_fork_counts_as_its_parent_does():
    m = manager()
    m.add_request("a", P)
    m.add_request("x", list(range(500, 509)))
    m.uncache_blocks([m.get_block_ids("x")[0][1]])  # (another request's: a is asked now)
    assert m.fork("a", "f") is not None
    assert m._requests["f"].losses == m._requests["a"].losses != m._index.losses
    m.add_request("c", list(range(700, 733)))  # (admitted since: not asked)
    assert list(finder(m._index, m._requests["c"])(0, 0, 8)) == []
    m.check_invariants()


def test_check_invariants_catches_a_full_group_missing_a_prefix_it_counts_on():
    m = manager()
    m.add_request("a", P)
    req = m._requests["a"]
    del m._index.entries[0][req.nodes[3].pid]  # (a lost entry no uncache counted)
    with pytest.raises(InvariantError, match="group 0 misses 1 of its 8 prefix blocks"):
        m.check_invariants()
