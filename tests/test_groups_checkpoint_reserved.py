"""A checkpointing step over Mamba entries that ``reserve`` made already puts the
checkpoint block at the entry before the step's end, as a step past the table does
(groups/sized.py ``_take``). Before this fix, with the table covering the step's end:
- its end entry a hole: the checkpoint block was taken and placed nowhere (a reference
  held by no request, never freed: check_invariants failed);
- its end entry the reserved block: the checkpoint block went one entry past the table.
Either way the state at the prompt's last boundary was not cached. Hash 4, full
attention at 4, Mamba at 8; a 21-token prompt (last hash boundary 20), 4 tokens, then
``reserve``, then the other 17 in one step (4 -> 21: the state at 20 into entry 1)."""

import pytest

from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba

P = list(range(21))


@pytest.mark.parametrize("slots", [None, 4, 13, 20, 21, 28])
def test_a_checkpoint_over_reserved_entries_goes_before_the_steps_end(slots):
    # None, 4: the table ends below the step's end; 13, 20: its end entry (2) is the
    # reserved block; 21, 28: entry 3 is, entry 2 a hole
    m = HybridKVCacheManager([full_attention(), mamba()], 30,
                             BlockSizes.of([4, 8], partial=True, checkpoints=True))
    m.add_request("a", P, num_new_tokens=4)
    if slots is not None:
        assert m.reserve("a", slots) is not None
    m.check_invariants()
    m.extend("a", 17)
    m.check_invariants()
    full, table = m.get_block_ids("a")
    assert m.null_block_id not in table[1:3]
    assert len(table) == (4 if slots is not None and slots >= 21 else 3)
    # the checkpoint holds the state at 20 (the prompt's last boundary): found there
    assert m.lookup_block_ids(P[:20] + [1]) == (full[:5], (0, 0, table[1]))
    m.free("a")
    m.check_invariants()
    assert m.num_free_blocks == 29            # every block back (0 is the null block)
    assert m.lookup(P[:20] + [1]) == 20
