"""``BlockPool.release`` given a shared run's blocks in no order of the run (neither its
chain order nor the reverse; the managers give whole runs, so only a caller of the pool
does): each block is released alone, in the order given, exactly as after the run was
dissolved first. Block size 4, a miss of 4 full blocks (recorded as one run)."""

import pytest

from prefixkv import KVCacheManager

BS = 4
PROMPT = list(range(4 * BS + 1))


def admitted(events: bool) -> tuple[KVCacheManager, list]:
    m = KVCacheManager(8, BS, enable_events=events)
    m.add_request("a", PROMPT)
    m.take_kv_ops()
    req = m._requests.pop("a")  # (the pool's caller, freeing it by hand below)
    return m, req.blocks


@pytest.mark.parametrize("events", [False, True])
# (the last two link block 0 into the cached tier before the run's blocks come:
# mutants-r22, ``release`` not closing the tier there before releasing them alone)
@pytest.mark.parametrize("order", [[2, 0, 4, 1, 3], [1, 3, 2, 0, 4], [4, 1, 0, 2, 3],
                                   [0, 2, 1, 3, 4], [0, 4, 2, 3, 1]])
def test_a_run_given_out_of_order_frees_as_each_block_alone(events, order):
    m, blocks = admitted(events)
    run = blocks[1].counted
    assert run is not None and run.shared and blocks[1] in run.blocks  # (a shared run)
    m._pool.release([blocks[i] for i in order])
    ref, ref_blocks = admitted(events)
    for b in ref_blocks:
        if b.counted is not None:
            b.counted.dissolve()
    ref._pool.release([ref_blocks[i] for i in order])
    assert m.free_block_order() == ref.free_block_order()
    assert m.num_free_blocks == ref.num_free_blocks == 8
    m.check_invariants()
    assert m.lookup(PROMPT) == ref.lookup(PROMPT) == 4 * BS


@pytest.mark.parametrize("then", ["evict", "claim"])
def test_a_run_given_in_chain_order_frees_as_one_segment_in_that_order(then):
    # (mutants-r22: ``release`` not recording the run's new direction, ``fwd``, survived;
    # the eviction or the claim then took the segment the wrong way round)
    m, blocks = admitted(False)
    assert blocks[1].counted is not None and not blocks[1].counted.fwd  # (as ``store`` set it)
    m._pool.release(blocks)                           # chain order: 0 1 2 3, then 4 empty
    assert m.free_block_order() == [4, 5, 6, 7, 0, 1, 2, 3]
    m.check_invariants()
    if then == "evict":
        z = m.add_request("z", list(range(100, 129)))  # 7 full blocks and 1 token
        assert z.block_ids == (4, 5, 6, 7, 0, 1, 2, 3)
    else:
        a = m.add_request("a", PROMPT)
        assert a.num_cached_tokens == 4 * BS and a.block_ids[:4] == (0, 1, 2, 3)
        assert m.free_block_order() == [5, 6, 7]
    m.check_invariants()
