"""A store fetch's start whose eviction takes a pending run whole hands out the run's own
list, and the pool keeps the list the eviction made for the other blocks (``_spare``) for
the next such start instead of making a new one (``BlockPool._evict``). Whatever the
spare's length (longer, shorter or equal to the next eviction's), every take hands out
the blocks, in the order, and leaves the free order, events and lookups that a pool with
no spare does."""

from __future__ import annotations

import itertools

import pytest

from prefixkv import KVCacheManager

BS = 4


def take_and_give_back(m: KVCacheManager, rid: str, k: int, u: int, n: int,
                       spare: bool, lists: list) -> tuple:
    """A miss of ``k`` blocks admitted and freed (a keyed block heading a pending run),
    then ``take_split(u, n)`` as a store start takes its blocks, each given back; the ids
    taken and the state left. ``spare``: keep the pool's spare list (else dropped first).
    ``lists``: each list handed out, with its ids then (a fetch keeps its list)."""
    m.add_request(rid, list(range(1000 * len(rid), 1000 * len(rid) + k * BS)))
    m.free(rid)
    if not spare:
        m._pool._spare = []
    front, rest = m._pool.take_split(u, n)
    out = ([b.block_id for b in front], [b.block_id for b in rest], len(m._pool._spare))
    lists += [(front, out[0]), (rest, out[1])]
    for b in front + rest:
        b.counted = None
    m._pool.release((front + rest)[::-1])
    m.check_invariants()
    return out, m._pool.free_order(), m.take_events()


@pytest.mark.parametrize("sizes", list(itertools.permutations([(8, 1, 7), (8, 1, 8),
                                                               (5, 1, 11), (11, 0, 10)], 3)))
def test_a_kept_spare_changes_nothing_a_start_hands_out(sizes):
    ms = [KVCacheManager(12, BS, enable_events=True, seed=7) for _ in range(2)]
    spares, lists = [], []
    for j, (k, u, n) in enumerate(sizes * 2):
        rid = "r" * (j + 1)
        got = [take_and_give_back(m, rid, k, u, n, spare, lists)
               for m, spare in zip(ms, (True, False), strict=True)]
        assert got[0][1:] == got[1][1:], (j, k, u, n)
        assert got[0][0][:2] == got[1][0][:2], (j, k, u, n)
        spares.append(got[0][0][2])
    assert any(spares), spares  # (the spare was kept, and reused)
    for handed, ids in lists:  # (none of them written since: no list is both handed out
        assert [b.block_id for b in handed] == ids  # and the spare)
