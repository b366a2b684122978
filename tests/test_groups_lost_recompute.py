"""A recompute of a request already tainted (its KV from some position on was computed
over lost KV: groups/taint.py) writes lost KV again, also into the blocks another request
shares: that request is tainted from the first position rewritten there. Found by the
groups state machine (``SlidingOnlyMachine``, slide-r17): its model let a sharer of such a
block read it as sound; the manager did not taint the sharer either, and cached the blocks
it computed on it (served as hits: the second test).

Window of 5, block_size 4; block 0 is the null block.
"""

from hypothesis.stateful import MultipleResults

from prefixkv.groups import HybridKVCacheManager, sliding_window
from test_groups_state_machine import PREFIXES, SlidingOnlyMachine

BS = 4


def _values(got):
    return list(got.values) if isinstance(got, MultipleResults) else [got]


def test_the_machine_taints_who_shares_a_block_a_tainted_recompute_rewrites():
    # r2 (12 tokens + 0) forks r3, r4 and steps to 14 (its window released blocks 4, 3);
    # r5 hits block 3 (positions 4..7) and rewinds past what its window released: its
    # recompute rewrites block 3 with lost KV, r3 and r4 are tainted from 4. Then r3 goes
    # back to 9 (its window holds 5..8): the recompute reads the lost 5..7, so it writes
    # lost KV into 9..11 of block 2, which r2 shares and reads (its window at 13 reads
    # 9..13). Before: the model wrote it but kept r2 sound, and its KV check failed with
    # ('r2', 0, 9); now r2 is tainted from 9, as r3's recompute rewrites it
    m = SlidingOnlyMachine()
    m.setup()
    m.add_known_prefix(0, 0)
    m.abort_before_step_ran()
    r2 = m.add_known_prefix(2, 0)
    r3, r4, r5 = _values(m.fork_chain(r2, 2, set(), [0], PREFIXES[2][:11] + [0, 0, 0, 0]))
    assert (r2, r3, r4, r5) == ("r2", "r3", "r4", "r5")
    assert m.m.get_block_ids(r2) == ((0, 0, 2, 1),) and m.m.get_block_ids(r5) == ((0, 3, 7, 8),)
    m.rewind_past_released(r5, 0, [0, 0])
    assert (m.taint[r2], m.taint[r3], m.taint[r4]) == (None, 4, 4)
    m.rewind_and_recompute(r3, 4)
    assert m.m.get_block_ids(r3) == ((0, 3, 2, 5),)
    assert m.taint[r2] == 9 and m.kv[2][1][0] == "lost"
    m.no_group_reads_kv_it_does_not_hold()  # before: AssertionError ('r2', 0, 9)
    m.the_manager_never_caches_what_the_model_marks_lost()  # (the manager's r2: untainted)
    m.hits_hold_sound_kv()
    m.events_predict_lookup()
    m.consistent()


def test_a_tainted_recompute_taints_who_shares_a_block_it_rewrites():
    # window of 9. s and t compute the same 13 tokens apart (t's blocks: spares, which
    # keep the prefixes when s's go); r3 forks s; s steps to 18 (its window released
    # blocks 1, 3). r5 hits blocks 1, 3, steps (block 1 released) and goes back to 4: its
    # recompute reads released KV, rewrites block 3, and r3, sharing it, is tainted from 4.
    # r3 then goes back to 9 (its window holds 1..8): its recompute reads the lost 5..7
    # and writes lost KV into 9..11 of block 4, which s shares; s's next tokens read it.
    # Before: s stayed sound, its block 10 (positions 16..19, read lost 10, 11) was
    # cached, and a request with s's 20 tokens hit all of them ((0, 0, 0, 5, 10): wrong
    # KV); now s is tainted from 9, and the hit is t's sound 12
    m = HybridKVCacheManager([sliding_window(9)], 40, BS, seed=0)
    prompt = list(range(1, 13))
    m.add_request("s", prompt[:3])
    m.add_request("t", prompt[:3])
    for rid in ("s", "t"):
        m.append_tokens(rid, prompt[3:] + [20])
    assert m.get_block_ids("s") == ((1, 3, 4, 5),) and m.get_block_ids("t") == ((2, 6, 7, 8),)
    assert m.fork("s", "r3") is not None
    m.append_tokens("s", [21, 22, 23, 24])
    m.append_tokens("s", [25])
    assert m.get_block_ids("s") == ((0, 0, 4, 5, 10),)
    assert m.add_request("r5", prompt[:8] + [30] * 5).num_cached_tokens == 8
    m.append_tokens("r5", [31])
    assert m.get_block_ids("r5") == ((0, 3, 11, 12),) and m.get_block_ids("r3") == ((1, 3, 4, 9),)
    m.rewind("r5", 4)
    m.append_tokens("r5", prompt[4:8] + [30] * 5 + [31])
    m.rewind("r3", 9)
    m.append_tokens("r3", prompt[9:] + [20])
    m.check_invariants()
    m.append_tokens("s", [26, 27])
    m.check_invariants()
    tokens = prompt + [20, 21, 22, 23, 24, 25, 26, 27]
    assert m.lookup(tokens + [0]) == 12  # before: 20
    assert m.lookup_block_ids(tokens + [0]) == ((0, 6, 7),)
