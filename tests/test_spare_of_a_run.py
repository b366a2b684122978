"""A spare whose last reference goes while the block holding its content is free in a
shared run's segment of the cached tier: that block moves to the most recently used
place, so the run is no longer one segment and must be counted block by block from then
on (``PoolRelease._spare_freed`` dissolves it). Written by mutants-r22: without the
dissolve, no test failed; here ``check_invariants`` raises at once, and the eviction would
walk the run's list past the blocks freed between."""

from prefixkv import KVCacheManager

P = list(range(1, 18))   # 4 full blocks and 1 token at block size 4


def test_a_spare_freed_moves_its_block_out_of_a_free_runs_segment():
    m = KVCacheManager(16, 4)
    assert m.add_request("a", P).block_ids == (0, 1, 2, 3, 4)   # blocks 1-3: a run after 0
    assert m.add_request("b", P[:9], read_cache=False).block_ids == (5, 6, 7)  # 5, 6: spares of 0, 1
    assert m.add_request("x", list(range(50, 59))).block_ids == (8, 9, 10)
    m.take_kv_ops()
    m.free("a")   # cached tier: 3 2 1 0 (the run, tail first)
    m.free("x")   # then 9 8
    m.free("b")   # 6 and 5 go empty; 1, then 0, move to the most recently used place
    m.check_invariants()
    assert m.free_block_order() == [7, 6, 5, 10, 4, 11, 12, 13, 14, 15, 3, 2, 9, 8, 1, 0]
    c = m.add_request("c", list(range(100, 157)))   # 14 full blocks and 1 token: evicts
    assert c.block_ids == (7, 6, 5, 10, 4, 11, 12, 13, 14, 15, 3, 2, 9, 8, 1)  # in that order
    m.check_invariants()
    m.free("c")
    m.check_invariants()
    assert m.lookup(P) == 4   # block 0 alone is left
