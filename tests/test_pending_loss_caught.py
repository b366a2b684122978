"""``store_giveup.give_up`` reads a block of a pending run (no key yet) as holding its
content: ``uncache`` writes every run it takes content from, so a run still pending lost
none. A future path that took content and left a run pending would make a store fetch
keep blocks whose content is gone. Each way such a path could leave the run is caught by
``check_invariants`` (the index's checks: ``content_check.check_index`` for the head,
``run_check.check_runs`` for the run): each is simulated here on a manager whose run is
pending, the way a path that forgot to write it would leave it (block size 4, a prompt of
8 full blocks and a token: the head, block 0, and the run of blocks 1..7)."""

from __future__ import annotations

import pytest

from prefixkv import KVCacheManager
from prefixkv.errors import InvariantError

A = list(range(100, 132)) + [7]


def pending_run(free: bool) -> KVCacheManager:
    m = KVCacheManager(40, 4, seed=0)
    m.add_request("a", A)
    if free:
        m.free("a")
    runs = list(m._index.run_counts.pending)  # type: ignore[attr-defined]
    assert [[b.block_id for b in r.blocks] for r in runs] == [list(range(1, 8))]
    m.check_invariants()
    return m


def test_the_head_s_content_taken_alone_is_caught():
    """The eviction step run on the head alone, its run left pending (a path that takes
    the head before its children, or forgets ``_settle_near``)."""
    m = pending_run(free=True)
    head = m._pool.blocks[0]
    m._index.drop_one(head)  # type: ignore[attr-defined]
    m._pool.emptied([head])
    with pytest.raises(InvariantError, match="is not its head's run and child"):
        m.check_invariants()


def test_a_head_whose_child_is_rewritten_is_caught():
    """New content chained under the head without writing its run (a store under it that
    skipped ``_settle_near``): the run is no longer reached through the head."""
    m = pending_run(free=False)
    head = m._pool.blocks[0]
    head.child = m._pool.blocks[30]
    with pytest.raises(InvariantError, match="is not its head's run and child"):
        m.check_invariants()


def test_a_run_marked_broken_but_left_pending_is_caught():
    """A loss that marks the run broken (``ok`` -1, what ``Run.broken`` sets) without
    writing it first (``broken`` dissolves it, which writes it)."""
    m = pending_run(free=False)
    run = next(iter(m._index.run_counts.pending))  # type: ignore[attr-defined]
    run.ok = -1
    with pytest.raises(InvariantError, match="is not ok"):
        m.check_invariants()


def test_a_pending_run_taken_off_the_index_s_list_is_caught():
    """A path that forgets a run as pending without writing it (its blocks keep no key:
    their content is nowhere)."""
    m = pending_run(free=False)
    run = next(iter(m._index.run_counts.pending))  # type: ignore[attr-defined]
    m._index.run_counts.pending.pop(run)  # type: ignore[attr-defined]
    with pytest.raises(InvariantError, match="not among its index's pending runs"):
        m.check_invariants()


def test_a_middle_block_s_content_given_a_key_of_its_own_is_caught():
    """A path that writes one block of the run (a key) and leaves the run pending."""
    m = pending_run(free=False)
    b = m._pool.blocks[3]
    b.key = b"x" * 16
    with pytest.raises(InvariantError, match="has a key"):
        m.check_invariants()
