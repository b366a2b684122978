"""A run as an admission stores it (``ContentRecorder._record_run``): one count from its
store on, linked for the release that frees its request (tail first), taken by the
eviction as one list, and cut (``Run.truncate``) when the eviction takes its last blocks
alone. Exact block ids and free orders, against a manager that records no runs."""

from prefixkv import KVCacheManager

BS = 2
A = list(range(100, 110))  # 5 full blocks: a head and a run of 4
B = list(range(200, 210))


def pair(num_blocks: int, events: bool = False) -> tuple[KVCacheManager, KVCacheManager]:
    a = KVCacheManager(num_blocks, BS, seed=0, enable_events=events)
    b = KVCacheManager(num_blocks, BS, seed=0, enable_events=events)
    b._index.runs = False
    return a, b


def same(a: KVCacheManager, b: KVCacheManager) -> list[int]:
    assert [x.ref_cnt for x in a._pool.blocks] == [x.ref_cnt for x in b._pool.blocks]
    assert a.free_block_order() == b.free_block_order()
    a.check_invariants()
    b.check_invariants()
    return a.free_block_order()


def test_a_stored_run_is_one_count_and_frees_as_one_segment():
    a, b = pair(8)
    for m in (a, b):
        assert m.add_request("a", A).block_ids == (0, 1, 2, 3, 4)
    run = a._pool.blocks[1].counted
    assert run is not None and run.shared and run.linked and not run.fwd and run.n == 1
    assert [x.block_id for x in run.blocks] == [1, 2, 3, 4]
    assert a._pool.runs.shared == 1 and a._pool.runs.free == 0
    assert a._pool.blocks[0].counted is None  # (the head is counted alone)
    same(a, b)
    for m in (a, b):
        m.free("a")
    assert run.n == 0 and a._pool.runs.free == 1
    assert same(a, b) == [5, 6, 7, 4, 3, 2, 1, 0]


def test_an_eviction_of_a_runs_last_blocks_cuts_it_and_the_rest_stays_found():
    a, b = pair(8)
    for m in (a, b):
        m.add_request("a", A)
        m.free("a")
    run = a._pool.blocks[1].counted
    for m in (a, b):  # 3 empty blocks, then a's last two (children first)
        assert m.add_request("b", B).block_ids == (5, 6, 7, 4, 3)
    assert run.shared and run.n == 0 and [x.block_id for x in run.blocks] == [1, 2]
    assert len(run.data) == 3 * 4 * BS  # (the head's token bytes, then its blocks')
    assert a._pool.blocks[4].counted is a._pool.blocks[6].counted is not run  # (b's run now)
    assert same(a, b) == [2, 1, 0]
    for m in (a, b):  # the head, then the cut run as one segment; a's 4th block is gone
        got = m.add_request("a2", A)
        assert got is None  # (3 hits, 2 new blocks: none free)
        m.free("b")
        got = m.add_request("a2", A)
        assert got.block_ids[:3] == (0, 1, 2) and got.num_cached_tokens == 6
    same(a, b)


def test_a_whole_run_and_the_next_ones_last_blocks_go_in_one_eviction():
    a, b = pair(12)
    for m in (a, b):
        m.add_request("a", A)
        m.add_request("b", B)
        m.free("a")
        m.free("b")
    assert same(a, b) == [10, 11, 4, 3, 2, 1, 0, 9, 8, 7, 6, 5]
    for m in (a, b):  # the 2 empty blocks, a's whole run and head, b's last block
        assert m.add_request("c", list(range(300, 316))).block_ids == (10, 11, 4, 3, 2, 1,
                                                                      0, 9)
    assert a._pool.runs.shared == 2 and a._pool.runs.free == 1  # (c's; b's, cut to 3)
    assert same(a, b) == [8, 7, 6, 5]
    for m in (a, b):
        m.free("c")
        got = m.add_request("b2", B)
        assert got.num_cached_tokens == 8  # b's head and the 3 blocks its run kept
    same(a, b)


def test_deferred_events_keep_the_whole_stored_run_when_it_is_cut_before_they_are_taken():
    a, b = pair(8, events=True)
    for m in (a, b):
        m.add_request("a", A)
        m.free("a")
        m.add_request("b", B)  # (cuts a's run in place before the events are built)
    ea, eb = a.take_events(), b.take_events()
    assert ea == eb
    stored = [e for e in ea if type(e).__name__ == "BlockStored"]
    assert len(stored[0].block_hashes) == 5 and len(stored[0].token_ids) == len(A)
    same(a, b)
