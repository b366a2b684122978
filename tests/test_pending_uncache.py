"""``uncache`` with pending runs (``index/pending.py``): it writes the runs it reads (those
of the named blocks, those they head, and those its walk of descendants reaches through
their heads), not every live run: another request's pending run stays pending, as one
record. Exact block ids; ``check_invariants`` after each step. block_size 4; a prompt of
8 full blocks and one token: the head (block 0) and a run of blocks 1..7."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import Admission, KVCacheManager
from test_pending_truth import CHAINS, UNITS, ops, run_steps

A = list(range(100, 132)) + [7]  # 8 full blocks + 1 token: blocks 0..8, run 1..7
B = list(range(200, 232)) + [7]  # admitted second: blocks 9..17, run 10..16
X = A[:32] + list(range(300, 316)) + [7]  # A's 8 blocks hit, 4 new: head 18, run 19..21


def manager() -> KVCacheManager:
    return KVCacheManager(64, 4, seed=0)


def pending_runs(m: KVCacheManager) -> list[list[int]]:
    return sorted([b.block_id for b in r.blocks] for r in m._index.run_counts.pending)


def test_uncaching_a_runs_block_leaves_another_requests_run_pending():
    m = manager()
    m.add_request("a", A)
    m.add_request("b", B)
    assert pending_runs(m) == [[1, 2, 3, 4, 5, 6, 7], [10, 11, 12, 13, 14, 15, 16]]
    m.uncache_blocks([3])
    assert pending_runs(m) == [[10, 11, 12, 13, 14, 15, 16]]  # b's: untouched
    m.check_invariants()
    assert m.lookup(A) == 12 and m.lookup(B) == 32
    m.free("a")
    m.free("b")
    m.check_invariants()
    assert m.lookup(A) == 12 and m.lookup(B) == 32
    assert m.add_request("c", B) == Admission("c", tuple(range(9, 18)), 32, 1)


def test_uncaching_a_runs_head_writes_that_run_alone():
    m = manager()
    m.add_request("a", A)
    m.add_request("b", B)
    m.uncache_blocks([0])  # a's head: its run goes with it
    assert pending_runs(m) == [[10, 11, 12, 13, 14, 15, 16]]
    m.check_invariants()
    assert m.lookup(A) == 0 and m.lookup(B) == 32


def test_a_pending_run_under_a_pending_runs_block_goes_with_it():
    """x's run is headed by x's first new block, the chained child of a's run's last
    block: the walk of a's forgotten blocks reaches that head and writes x's run, which
    goes too; b's stays pending."""
    m = manager()
    m.add_request("a", A)
    m.add_request("b", B)
    assert m.add_request("x", X) == Admission(
        "x", tuple(range(8)) + (18, 19, 20, 21, 22), 32, 17)
    assert pending_runs(m) == [[1, 2, 3, 4, 5, 6, 7], [10, 11, 12, 13, 14, 15, 16],
                               [19, 20, 21]]
    m.uncache_blocks([2])
    assert pending_runs(m) == [[10, 11, 12, 13, 14, 15, 16]]
    m.check_invariants()
    assert m.lookup(A) == 8 and m.lookup(X) == 8 and m.lookup(B) == 32
    for rid in ("a", "x", "b"):
        m.free(rid)
    m.check_invariants()
    assert m.lookup(A) == 8 and m.lookup(X) == 8 and m.lookup(B) == 32


def test_a_pending_run_cached_under_a_named_block_goes_with_it():
    """x's run is cached (x freed) under a's run, still held by a: uncaching a's block 5
    forgets x's run, written by the walk, its free blocks emptied; b's stays pending."""
    m = manager()
    m.add_request("a", A)
    m.add_request("b", B)
    m.add_request("x", X)
    m.free("x")
    m.uncache_blocks([5])
    assert pending_runs(m) == [[10, 11, 12, 13, 14, 15, 16]]
    m.check_invariants()
    assert m.lookup(X) == 20 and m.lookup(B) == 32
    assert all(m._pool.blocks[i].key is None for i in (18, 19, 20, 21))


def test_uncaching_a_run_held_twice_keeps_its_block_as_a_spare():
    m = manager()
    m.add_request("a", A)
    m.add_request("b", B)
    assert m.add_request("c", A) == Admission("c", tuple(range(8)) + (18,), 32, 1)
    assert pending_runs(m) == [[1, 2, 3, 4, 5, 6, 7], [10, 11, 12, 13, 14, 15, 16]]
    m.uncache_blocks([4])
    assert pending_runs(m) == [[10, 11, 12, 13, 14, 15, 16]]
    m.check_invariants()
    assert m.lookup(A) == 16 and m.lookup(B) == 32


# requests with prompts of their own (unit lists part early) or extending one another
# (``CHAINS``' prefixes: a run pending under another's run), most kept live, each a run
# pending; no multimodal input (its lookup writes every run)
many = st.lists(st.tuples(st.just("admit"),
                          st.one_of(st.lists(st.integers(0, len(UNITS) - 1), min_size=4,
                                             max_size=10), st.integers(0, len(CHAINS) - 1)),
                          st.integers(3, 12), st.lists(st.integers(1, 8), max_size=2),
                          st.sampled_from([0, 0, 0, 1, 2]), st.none(), st.none(),
                          st.sampled_from([True, True, False])),
                min_size=8, max_size=16)
uncaches = st.tuples(st.just("uncache"), st.lists(st.integers(0, 191), min_size=1, max_size=3))


@settings(deadline=None, max_examples=40)
@given(many, st.lists(st.one_of(uncaches, uncaches, ops), min_size=4, max_size=30),
       st.sampled_from([160, 192]), st.booleans())
def test_uncache_among_many_live_runs_agrees_with_no_runs(live, steps, num_blocks, events):
    """``test_pending_truth``'s differential (runs pending vs none; every hit the KV it
    was computed for) after 8-16 requests kept live, each with its own runs pending, with
    uncaches weighted up: those of other requests' runs stay pending. With events (lazy:
    runs are recorded pending too, events-r16) and without."""
    run_steps(live + steps, num_blocks, events)


def test_a_spare_leaves_another_requests_run_pending():
    """x re-sends A block-aligned: its last block is computed again (the hit stops one
    short), and holds what a's block 7 holds: a spare of it. x's claim cut a's run
    before block 7 (``split_pending``: the part claimed stays pending, block 7 is written
    alone), so the spare writes no run: neither a's part nor b's (before: every pending
    run; then, events-r16, a's whole run, cut by writing it)."""
    m = manager()
    m.add_request("a", A)
    m.add_request("b", B)
    assert m.add_request("x", A[:32]) == Admission("x", tuple(range(7)) + (18,), 28, 4)
    assert pending_runs(m) == [[1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15, 16]]
    assert m._pool.blocks[18].twin
    m.check_invariants()
    assert m.lookup(A) == 32 and m.lookup(B) == 32
    for rid in ("a", "x", "b"):
        m.free(rid)
        m.check_invariants()
    assert m.lookup(A) == 32 and m.lookup(B) == 32
