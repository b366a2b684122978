"""An eviction notes where pending runs' blocks sit in its list (``Keyless``) only when a
tier below reads their content (``RunCounts.spans``); without one the index skips those
blocks by their missing key (``DroppingIndex.drop``), and unkeys the others, events on or
off. block_size 4; a prompt of 8 full blocks and one token: the head (block 0) and a
pending run of blocks 1..7 (``index/pending.py``)."""

from __future__ import annotations

from prefixkv import Admission, BlockRemoved, BlockStored, KVCacheManager

A = list(range(100, 132)) + [7]  # 8 full blocks + 1 token
B = list(range(200, 232)) + [7]
C = list(range(300, 308)) + [7]  # 2 full blocks + 1 token


def spy_drops(m: KVCacheManager) -> list[tuple[list[int], list[int], object]]:
    """Each call of the index's ``drop`` from now on: the ids given, those with a key (the
    index's to drop), and the ``keyless`` given."""
    index = m._index
    drop = index.drop
    calls: list[tuple[list[int], list[int], object]] = []

    def spied(blocks, keyless=None):
        calls.append(([b.block_id for b in blocks],
                      [b.block_id for b in blocks if b.key is not None], keyless))
        drop(blocks, keyless)
    index.drop = spied
    return calls


def test_without_a_tier_pending_runs_evicted_whole_and_cut_build_no_spans():
    m = KVCacheManager(12, 4, seed=0)
    assert m.add_request("c", C) == Admission("c", (0, 1, 2), 0, 9)
    m.free("c")  # c's blocks cached: its two full ones keyed
    m.add_request("a", A)  # a: head 2, pending run 3..9, partial 10 (freed tail first)
    m.free("a")
    assert m.free_block_order() == [10, 11, 1, 0, 9, 8, 7, 6, 5, 4, 3, 2]
    assert m._index.run_counts.spans is False
    drops = spy_drops(m)
    # the empty tier, c's keyed blocks (unkeyed), then a's run cut at its tail (skipped)
    got = m.add_request("b", B[:28] + [7])
    assert got == Admission("b", (10, 11, 1, 0, 9, 8, 7, 6), 0, 29)
    assert drops == [([1, 0, 9, 8, 7, 6], [1, 0], None)]
    m.check_invariants()
    assert m.lookup(C) == 0 and m.lookup(A) == 16 and m.lookup(B) == 28
    m.free("b")
    # b's run (pending) taken whole, a's cut run whole, a's keyed head 2, 11: one list
    got = m.add_request("d", list(range(400, 440)) + [7])
    assert got == Admission("d", (6, 5, 4, 3, 2, 7, 8, 9, 0, 1, 11), 0, 41)
    assert drops[1:] == [([5, 4, 3, 2, 7, 8, 9, 0, 1, 11], [2], None)]
    m.check_invariants()
    assert m.lookup(C) == 0 and m.lookup(A) == 0 and m.lookup(B) == 4


def test_with_events_on_a_pending_runs_blocks_are_announced_gone_without_spans():
    m = KVCacheManager(10, 4, seed=0, enable_events=True)
    m.add_request("a", A)
    m.free("a")
    stored = {i: h for e in m.take_events() if isinstance(e, BlockStored)
              for i, h in zip(e.block_ids, e.block_hashes, strict=True)}
    drops = spy_drops(m)
    assert m.add_request("b", B) == Admission("b", (8, 9, 7, 6, 5, 4, 3, 2, 1), 0, 33)
    assert [(ids, k) for ids, _, k in drops] == [([7, 6, 5, 4, 3, 2, 1], None)]
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert [list(e.block_ids) for e in removed] == [[7, 6, 5, 4, 3, 2, 1]]
    assert list(removed[0].block_hashes) == [stored[i] for i in (7, 6, 5, 4, 3, 2, 1)]
    m.check_invariants()
    assert m.lookup(A) == 4 and m.lookup(B) == 32


def test_with_a_tier_below_an_eviction_notes_the_pending_spans_for_it():
    """A tier below (a store's fetches land pending runs there: ``pend_counts``) reads
    the spans; here a tier-less index told to note them, so the spans are checked."""
    assert KVCacheManager(10, 4, seed=0, host_blocks=16)._index.run_counts.spans is True
    m = KVCacheManager(10, 4, seed=0)
    m.add_request("a", A)
    m.free("a")
    m._index.run_counts.spans = True
    run = m._pool.blocks[1].counted
    assert run is not None and run.pending and [b.block_id for b in run.blocks] == list(range(1, 8))
    chunks, cid0 = [run.chunk(i) for i in range(8)], run.cid0
    drops = spy_drops(m)
    assert m.add_request("b", B[:12] + [7]) == Admission("b", (8, 9, 7, 6), 0, 13)
    (ids, keyed, keyless), = drops
    assert ids == [7, 6] and keyed == [] and keyless is not None
    # a's run cut at its tail, last first: its blocks 7 and 6 (chunks 7 and 6)
    assert keyless.content(0) == (cid0 + 5, chunks[7], run.extra, cid0 + 6)
    assert keyless.content(1) == (cid0 + 4, chunks[6], run.extra, cid0 + 5)
    m.check_invariants()
    assert m.lookup(A) == 24
