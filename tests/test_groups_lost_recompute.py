"""A recompute of a request already tainted (its KV from some position on was computed
over lost KV: groups/taint.py) writes lost KV again, also into the blocks another request
shares. Found by the groups state machine (``SlidingOnlyMachine``, slide-r17): its model
let a sharer of such a block read it as sound.

Window of 5, block_size 4; block 0 is the null block.
"""

from hypothesis.stateful import MultipleResults

from test_groups_state_machine import PREFIXES, SlidingOnlyMachine

BS = 4


def _values(got):
    return list(got.values) if isinstance(got, MultipleResults) else [got]


def test_the_machine_taints_who_shares_a_block_a_tainted_recompute_rewrites():
    # r2 (12 tokens + 0) forks r3, r4 and steps to 14 (its window released blocks 1, 2);
    # r5 hits block 2 (positions 4..7) and rewinds past what its window released: its
    # recompute rewrites block 2 with lost KV, r3 and r4 are tainted from 4. Then r3 goes
    # back to 9 (its window holds 5..8): the recompute reads the lost 5..7, so it writes
    # lost KV into 9..11 of block 3, which r2 shares and reads (its window at 13 reads
    # 9..13). Before: the model wrote it but kept r2 sound, and its KV check failed with
    # ('r2', 0, 9); now r2 is tainted from 9, as r3's recompute rewrites it
    m = SlidingOnlyMachine()
    m.setup()
    m.add_known_prefix(0, 0)
    m.abort_before_step_ran()
    r2 = m.add_known_prefix(2, 0)
    r3, r4, r5 = _values(m.fork_chain(r2, 2, set(), [0], PREFIXES[2][:11] + [0, 0, 0, 0]))
    assert (r2, r3, r4, r5) == ("r2", "r3", "r4", "r5")
    assert m.m.get_block_ids(r2) == ((0, 0, 3, 4),) and m.m.get_block_ids(r5) == ((0, 2, 7, 8),)
    m.rewind_past_released(r5, 0, [0, 0])
    assert (m.taint[r2], m.taint[r3], m.taint[r4]) == (None, 4, 4)
    m.rewind_and_recompute(r3, 4)
    assert m.m.get_block_ids(r3) == ((0, 2, 3, 5),)
    assert m.taint[r2] == 9 and m.kv[3][1][0] == "lost"
    m.no_group_reads_kv_it_does_not_hold()  # before: AssertionError ('r2', 0, 9)
    m.hits_hold_sound_kv()
    m.events_predict_lookup()
    m.consistent()
