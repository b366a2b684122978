"""``BlockPool.take_split(u, n)`` (a store fetch's start: the host hits' blocks, then the
run's and the tail's) hands out what ``take(u + n, True)`` does, the same blocks in the
same order, cut after ``u``, and leaves the pool, the index and the events as that take
does; when the empty tier covers the first ``u``, the rest is the eviction's list as it
came: a pending run evicted whole gives its own list, no entry of it moved."""

from __future__ import annotations

import pytest

from prefixkv import KVCacheManager

BS = 4


def pooled(num_blocks: int) -> KVCacheManager:
    """A miss of 8 blocks (a keyed first block heading a pending run of 7) freed: 8
    cached blocks, the run's 7 least recently used (its tail first), the rest empty."""
    m = KVCacheManager(num_blocks, BS, enable_events=True, seed=7)  # (equal hashes)
    m.add_request("a", list(range(8 * BS)))
    m.free("a")
    m.take_events()
    return m


def after(m: KVCacheManager, taken: list) -> tuple:
    """The state a take left: each taken block given back (its stale count cleared
    first, as the start's caller does), the free order, the events, the lookup."""
    for b in taken:
        b.counted = None
    m._pool.release(taken[::-1])
    m.check_invariants()
    return m._pool.free_order(), m.take_events(), m.lookup(list(range(8 * BS)))


@pytest.mark.parametrize("num_blocks", [8, 9, 12])
def test_take_split_is_take_cut_after_u(num_blocks):
    for u in range(num_blocks + 1):
        for n in range(num_blocks - u + 1):
            one, two = pooled(num_blocks), pooled(num_blocks)
            whole = one._pool.take(u + n, True)
            front, rest = two._pool.take_split(u, n)
            ids = [b.block_id for b in whole]
            assert ([b.block_id for b in front], [b.block_id for b in rest]) == (ids[:u], ids[u:])
            assert all(b.refs == 1 for b in front + rest)
            assert after(one, whole) == after(two, front + rest), (u, n)


def test_the_run_evicted_whole_is_the_rest_as_it_came():
    """One empty block left (the host hit's), the pending run next: the rest is the
    run's own list (taken whole, reversed in place: its tail was freed first)."""
    m = pooled(9)
    (run,) = [r for r in m._index.run_counts.pending]
    own = run.blocks
    front, rest = m._pool.take_split(1, 7)
    assert rest is own
    assert len(front) == 1 and front[0].counted is None
    after(m, front + rest)


@pytest.mark.parametrize(("num_blocks", "u"), [(16, 8), (20, 10)])
def test_the_run_evicted_whole_is_the_rest_as_it_came_when_the_empty_tier_covers_u(num_blocks, u):
    """The empty tier holds ``u`` blocks (16: exactly; 20: two more), then the pending
    run: the rest is still the run's own list, its tail freed first (``take(u + 7, True)``
    would have copied it after the ``u`` empty ones: it takes more empty blocks than it
    evicts)."""
    m = pooled(num_blocks)
    (run,) = [r for r in m._index.run_counts.pending]
    own, ids = run.blocks, [b.block_id for b in reversed(run.blocks)]
    front, rest = m._pool.take_split(u, 7 + num_blocks - 8 - u)
    assert rest is own
    assert [b.block_id for b in front] == list(range(8, 8 + u))  # (the miss held 0..7)
    assert [b.block_id for b in rest] == list(range(8 + u, num_blocks)) + ids
    after(m, front + rest)


def test_two_pending_runs_evicted_whole_in_one_take_are_both_given() -> None:
    """Two misses of 8 blocks freed, "a" first: the empty blocks 16, 17, then a's run
    (7..1, its tail first), a's head 0, b's run 15..9. A take of 17 evicts both runs
    whole, each kept ``stale``: the first's list is the answer's, the second's blocks
    copied into it in their place (mutants-r23: the second kept run taking the first's
    place as that list lost the first's blocks)."""
    m = KVCacheManager(18, BS, enable_events=True, seed=7)
    for rid, first in (("a", 0), ("b", 100)):
        m.add_request(rid, list(range(first, first + 8 * BS)))
        m.free(rid)
    m.take_events()
    runs = [r.blocks for r in m._index.run_counts.pending]
    assert [[b.block_id for b in r] for r in runs] == [list(range(1, 8)), list(range(9, 16))]
    taken = m._pool.take(17, True)
    assert [b.block_id for b in taken] == [16, 17, *range(7, -1, -1), *range(15, 8, -1)]
    assert taken is runs[0]                       # (a's own list: not copied)
    assert all(b.refs == 1 for b in taken)
    assert all(b.counted is not None for b in taken[2:9] + taken[10:])  # (each run's, n 1)
    free, events, found = after(m, taken)
    assert [e.block_ids for e in events] == [[*range(7, -1, -1), *range(15, 8, -1)]]
    assert free == [b.block_id for b in taken] + [8] and found == 0
