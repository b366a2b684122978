"""A stale take (a store fetch's start) that evicts a pending run whole hands out the
blocks in the free order, whatever comes before the run in the cached tier: the run's
own list is the answer (``BlockPool._evict``'s ``hole``), the plain blocks before it
moved in front of it in their order and the run's blocks in the cached tier's order
(its tail first), and the state left is the one a plain take leaves. (Two or more
blocks before the run: test_take_split.py and test_evict_spare.py have at most one, and
pass with those blocks inserted reversed.)"""

from __future__ import annotations

import pytest

from prefixkv import KVCacheManager
from test_take_split import after  # (each taken block given back: the state left)

BS = 4


def freed(before: int, empty: int) -> KVCacheManager:
    """A miss of ``before`` blocks ("x"), then one of 8 ("a": a keyed block heading a
    pending run of 7), both freed, x first: x's blocks come before a's in the cached
    tier; ``empty`` blocks never used, in the empty tier."""
    m = KVCacheManager(before + 8 + empty, BS, enable_events=True, seed=7)
    m.add_request("x", list(range(500, 500 + before * BS)))
    m.add_request("a", list(range(8 * BS)))
    m.free("x")
    m.free("a")
    m.take_events()
    return m


@pytest.mark.parametrize("empty", [0, 1, 3])
@pytest.mark.parametrize("before", [1, 2, 3, 4])
def test_a_stale_take_hands_out_the_free_order(before, empty):
    total = before + 8 + empty
    for n in range(total + 1):
        stale, plain = freed(before, empty), freed(before, empty)
        order = stale._pool.free_order()
        (run,) = [r.blocks for r in stale._index.run_counts.pending if len(r.blocks) == 7]
        evicts_run = n >= empty + before + 8  # (a's run whole: its head is after it)
        taken = stale._pool.take(n, True)
        assert [b.block_id for b in taken] == order[:n], (before, empty, n)
        assert all(b.refs == 1 for b in taken)
        if evicts_run and before == 2:  # (x's blocks keyed alone: a's run is the one kept)
            assert taken is run
        assert after(stale, taken) == after(plain, plain._pool.take(n)), (before, empty, n)


@pytest.mark.parametrize("before", [1, 2, 3, 4])
def test_take_split_cut_after_the_host_hits(before):
    """``take_split(u, n)``, the start's own call, gives the same blocks cut after ``u``."""
    for u in range(3):
        stale = freed(before, 1)
        order = stale._pool.free_order()
        n = len(order) - u
        front, rest = stale._pool.take_split(u, n)
        assert ([b.block_id for b in front], [b.block_id for b in rest]) == (order[:u], order[u:])
        after(stale, front + rest)
