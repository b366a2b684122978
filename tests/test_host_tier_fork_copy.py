"""A fork's copy and the blocks it names, when its child or its parent goes before the
plan is taken (found wiring the host tier into the engine): a copy into a freed child's
block is dropped (its block may be a load target of the same plan, and copies run after
loads); a copy's source is held by the plan. block_size 4, seed 0."""

from prefixkv import BlockCopy, BlockLoads, KVCacheManager

A = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_a_freed_childs_copy_never_targets_a_block_loaded_in_the_same_plan():
    m = KVCacheManager(5, 4, seed=0, host_blocks=8)
    m.add_request("a", A)
    m.take_kv_ops()
    m.free("a")
    m.add_request("x", [50] * 13)                   # evicts a's blocks into the host
    m.take_kv_ops()
    m.free("x")
    m.add_request("p", [60] * 6)                    # 1 full + 1 partial block
    m.take_kv_ops()
    fork = m.fork("p", "c")                         # after the step's forward pass
    assert fork.copies == (BlockCopy(0, 4),)
    m.free("c")                                     # next step: the child is preempted
    adm = m.add_request("d", A)                     # A's blocks load into fresh blocks
    assert adm.num_cached_tokens == 8 and adm.block_ids[0] == 4
    ops = m.take_kv_ops()
    loads = [op for op in ops if type(op) is BlockLoads]
    assert len(loads) == 1 and (1, 4) in zip(loads[0].src, loads[0].dst, strict=True)
    loaded = set(loads[0].dst)
    assert not [op for op in ops if type(op) is BlockCopy and op.dst in loaded]


def test_a_freed_parents_partial_block_stays_held_until_the_plan_is_taken():
    m = KVCacheManager(4, 4, seed=0)
    m.add_request("p", [1, 2, 3, 4, 5, 6])          # blocks 0 (full), 1 (partial)
    assert m.fork("p", "c").copies == (BlockCopy(1, 2),)
    m.free("p")                                     # 1 is still the copy's source
    assert 1 not in m.free_block_order()
    m.check_invariants()
    assert m.free_block_order() == [3]
    assert m.add_request("x", [7] * 5) is None      # 1 cannot be handed out yet
    assert m.take_kv_ops() == [BlockCopy(1, 2)]
    assert m.free_block_order() == [1, 3]
    assert m.add_request("x", [7] * 5).block_ids == (1, 3)
    m.check_invariants()
