"""Pending runs (``index/pending.py``): a miss's run recorded as one record, its blocks'
content written only when something reads one of them alone; evicted, or cut, as one
record, with nothing for the index to drop. Exact block ids, free orders and what the
index is given; ``check_invariants`` after each step (it verifies a pending run as it
is). block_size 4; a prompt of 8 full blocks and one token: the head (block 0) and a run
of blocks 1..7, the last one written, the partial block 8 outside it."""

from prefixkv import Admission, KVCacheManager

A = list(range(100, 132)) + [7]  # 8 full blocks + 1 token
B = list(range(200, 232)) + [7]


def manager(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, seed=0)


def pending_runs(m: KVCacheManager) -> list[list[int]]:
    return sorted([b.block_id for b in r.blocks] for r in m._index.run_counts.pending)


def spy_drops(m: KVCacheManager) -> list[list[int]]:
    """The block ids each call of the index's ``drop`` is given, from now on."""
    index = m._index
    drop = index.drop
    calls: list[list[int]] = []

    def spied(blocks, skip=(), keyless=None):  # (a pending run's blocks are not the index's)
        calls.append([b.block_id for i, b in enumerate(blocks)
                      if not any(lo <= i < hi for lo, hi in skip)])
        drop(blocks, skip, keyless)
    index.drop = spied
    return calls


def test_a_miss_records_its_run_pending_and_a_claim_takes_it_whole_without_writing_it():
    m = manager(40)
    assert m.add_request("a", A) == Admission("a", tuple(range(9)), 0, 33)
    blocks = m._pool.blocks
    assert pending_runs(m) == [[1, 2, 3, 4, 5, 6, 7]]
    assert [blocks[i].key is None for i in range(9)] == [False] + [True] * 6 + [False, True]
    m.check_invariants()
    assert m.lookup(A) == 32 and m.lookup(A[:13]) == 12 and m.lookup(A[:12] + [0] * 21) == 12
    assert pending_runs(m) == [[1, 2, 3, 4, 5, 6, 7]]  # (a lookup writes nothing)
    m.free("a")
    assert m.free_block_order() == [8] + list(range(9, 40)) + [7, 6, 5, 4, 3, 2, 1, 0]
    m.check_invariants()
    assert m.add_request("b", A) == Admission("b", (0, 1, 2, 3, 4, 5, 6, 7, 8), 32, 1)
    assert pending_runs(m) == [[1, 2, 3, 4, 5, 6, 7]]
    m.check_invariants()


def test_an_eviction_of_a_whole_pending_run_gives_the_index_nothing_to_drop():
    m = manager(10)
    m.add_request("a", A)
    m.free("a")
    assert m.free_block_order() == [8, 9, 7, 6, 5, 4, 3, 2, 1, 0]
    drops = spy_drops(m)
    assert m.add_request("b", B) == Admission("b", (8, 9, 7, 6, 5, 4, 3, 2, 1), 0, 33)
    assert drops == [[]]  # the run taken whole: no key of it in the index
    assert pending_runs(m) == [[9, 7, 6, 5, 4, 3, 2]]  # b's run, after its head 8
    assert m.lookup(A) == 4 and m.lookup(B) == 32  # (a's head stays cached)
    m.check_invariants()
    m.free("b")
    # a's head hit; b's run (freed tail first) evicted whole again, its head 8 kept
    assert m.add_request("c", A) == Admission("c", (0, 1, 2, 3, 4, 5, 6, 7, 9), 4, 29)
    assert drops[1:] == [[]]
    assert pending_runs(m) == [[2, 3, 4, 5, 6, 7]]  # c's, after its head 1
    assert m.lookup(B) == 4 and m.lookup(A) == 32
    m.check_invariants()


def test_a_pending_run_cut_at_its_tail_stays_pending_and_found_up_to_the_cut():
    m = manager(10)
    m.add_request("a", A)
    m.free("a")
    drops = spy_drops(m)
    assert m.add_request("b", B[:12] + [7]) == Admission("b", (8, 9, 7, 6), 0, 13)
    assert drops == [[]]  # a's blocks 7, 6 cut off the run: no key of theirs to drop
    assert pending_runs(m) == [[1, 2, 3, 4, 5], [9, 7]]  # a's, cut; b's
    assert m._pool.blocks[5].key is not None and m._pool.blocks[4].key is None
    assert m.lookup(A) == 24
    m.check_invariants()
    m.free("b")
    got = m.add_request("c", A[:24] + [5, 5, 5, 5, 5])
    assert got is not None and got.block_ids[:6] == (0, 1, 2, 3, 4, 5)
    assert got.num_cached_tokens == 24
    m.check_invariants()


def test_a_block_decoded_after_a_pending_run_leaves_it_pending():
    m = manager(40)
    m.add_request("a", A)
    m.append_tokens("a", [8, 9, 10])  # fills block 8, under the run's last (written) block
    assert pending_runs(m) == [[1, 2, 3, 4, 5, 6, 7]]
    assert m.lookup(A[:32] + [7, 8, 9, 10, 0]) == 36
    m.check_invariants()


def test_a_block_decoded_under_a_pending_runs_head_writes_the_run_first():
    """The run's first block is the head's ``child``: a sibling decoded under the head
    displaces it (keyed in the dicts), which needs it written."""
    m = manager(40)
    m.add_request("a", A)
    assert m.add_request("x", A[:4] + [1]) == Admission("x", (0, 9), 4, 1)
    assert pending_runs(m) == [[1, 2, 3, 4, 5, 6, 7]]
    m.append_tokens("x", [2, 3, 4])  # fills x's block 9: a second child of block 0
    assert pending_runs(m) == []
    m.check_invariants()
    assert m.lookup(A) == 32 and m.lookup(A[:4] + [1, 2, 3, 4, 0]) == 8


def test_a_fork_of_a_pending_run_writes_it_and_counts_each_block_alone():
    m = manager(40)
    m.add_request("a", A)
    assert m.fork("a", "f") is not None
    assert pending_runs(m) == []
    assert [m._pool.blocks[i].ref_cnt for i in range(8)] == [2] * 8
    m.check_invariants()
    m.free("a")
    m.free("f")
    assert m.lookup(A) == 32
    m.check_invariants()


def test_uncaching_a_pending_runs_block_forgets_the_blocks_after_it():
    m = manager(40)
    m.add_request("a", A)
    m.uncache_blocks([3])
    m.check_invariants()
    assert m.lookup(A) == 12
    m.free("a")
    m.check_invariants()
    assert m.lookup(A) == 12
