"""The order ``BlockPool.free`` and ``free_groups`` put blocks going empty in (the order
``take`` hands them out next), as vLLM 0.33 frees: each ``free_blocks`` call puts its
blocks at the front of the queue, first given first; a hybrid request is freed one
group after another, so the last group's blocks are reused first. Written by
mutants-r22: dropping either reorder survived every manager test."""

from __future__ import annotations

from prefixkv.core.pool import BlockPool
from prefixkv.index.none import NoIndex


def _pool_with_taken(n_blocks, n_taken):
    pool = BlockPool(n_blocks, NoIndex())
    taken = pool.take(n_taken)
    assert [b.block_id for b in taken] == list(range(n_taken))
    return pool, taken


def test_free_hands_out_the_first_given_first():
    pool, b = _pool_with_taken(6, 4)
    pool.free([b[3], b[2], b[1], b[0]])  # a request's blocks, its tail first
    assert pool.free_order() == [3, 2, 1, 0, 4, 5]
    assert [x.block_id for x in pool.take(2)] == [3, 2]


def test_free_groups_hands_out_the_last_groups_blocks_first_each_in_the_order_given():
    pool, b = _pool_with_taken(8, 6)
    tables = [[b[0], b[1], b[2]], [b[3], b[4], b[5]]]
    pool.free_groups([b[2], b[1], b[0], b[5], b[4], b[3]], tables)
    # vLLM: free_blocks(group 0's, to the front), then free_blocks(group 1's, to the front)
    assert pool.free_order() == [5, 4, 3, 2, 1, 0, 6, 7]


def test_free_groups_places_blocks_by_their_group_not_by_when_they_were_given():
    pool, b = _pool_with_taken(8, 6)
    tables = [[b[0], None, b[1]], [b[2], b[3]], [None, b[4], b[5]]]
    pool.free_groups([b[5], b[1], b[3], b[0], b[4], b[2]], tables)  # interleaved
    # groups last to first (2, 1, 0), each group's blocks in the order given
    assert pool.free_order() == [5, 4, 3, 2, 1, 0, 6, 7]


def test_a_block_still_held_stays_out_of_the_order():
    pool, b = _pool_with_taken(6, 4)
    b[1].refs += 1  # another request holds it too
    pool.free_groups([b[1], b[0], b[3], b[2]], [[b[0], b[1]], [b[2], b[3]]])
    assert pool.free_order() == [3, 2, 0, 4, 5]


def test_two_blocks_going_empty_are_reordered_too():
    pool, b = _pool_with_taken(5, 2)
    pool.free([b[1], b[0]])
    assert pool.free_order() == [1, 0, 2, 3, 4]
    pool, b = _pool_with_taken(5, 2)
    pool.free_groups([b[0], b[1]], [[b[0]], [b[1]]])
    assert pool.free_order() == [1, 0, 2, 3, 4]
