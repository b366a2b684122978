"""A request id that leaves and is admitted again does not inherit its old checkpoint
note (groups/checkpoints.py ``forget``): the note names the old step's end, its
position and entry, and ``record`` would otherwise take it for the new request's step
when that ends at the same count, recording whatever block the new request holds at
that entry as the state at the old position. Hash 4, full attention at 4, Mamba at 8."""

from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba


def test_a_readmitted_id_does_not_record_its_old_checkpoint():
    m = HybridKVCacheManager([full_attention(), mamba()], 16,
                             BlockSizes.of([4, 8], partial=True, checkpoints=True))
    # "a" checkpoints at 12 into Mamba entry 0 in a step ending at 13, and leaves
    assert m.add_request("a", list(range(13))).group_block_ids == ((1, 2, 3, 4), (5, 6))
    m.free("a")
    # "a" again, another prompt: 6 tokens, then 7 more (a step from 6: no checkpoint),
    # ending at 13 as the old step did; its Mamba entry 0 holds the state at 6
    p = list(range(100, 113))
    assert m.add_request("a", p, num_new_tokens=6).group_block_ids == ((6, 4), (7,))
    m.extend("a", 7)
    assert m.get_block_ids("a") == ((6, 4, 8, 9), (7, 10))
    m.check_invariants()
    # nothing holds the state at 12 of this prompt (block 7 holds the state at 6)
    assert m.lookup(p[:12] + [5]) == 0
    m.free("a")
    assert m.lookup(p[:12] + [5]) == 0
    m.check_invariants()
