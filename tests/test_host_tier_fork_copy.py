"""Core problem found while wiring the host tier into the engine (reported to the lead,
who owns the core): a fork's copy stays in the plan after its child is freed, and by the
time the plan is taken its target block can be a load target of the same plan. Copies
run after loads, so the copy overwrites the loaded KV. block_size 4, seed 0."""

import pytest

from prefixkv import BlockCopy, BlockLoad, KVCacheManager

A = [1, 2, 3, 4, 5, 6, 7, 8, 9]


@pytest.mark.xfail(strict=True, reason="core: take_kv_ops keeps the copy of a freed fork "
                   "child; its target is reused as a load target of the same plan")
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
    assert BlockLoad(1, 4) in ops
    loaded = {op.dst for op in ops if type(op) is BlockLoad}
    assert not [op for op in ops if type(op) is BlockCopy and op.dst in loaded]
