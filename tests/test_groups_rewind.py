"""``HybridKVCacheManager.rewind`` (prefixkv.groups.decode) against what its windows
released and against blocks another request shares: found by risks-r11's group fuzzer
(random call streams, ``check_invariants`` after each call).

block_size is 3; block 0 is the null block.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import RequestError
from prefixkv.groups import HybridKVCacheManager, chunked_local, full_attention, mamba, sliding_window

WINDOWED = (full_attention(), chunked_local(6), sliding_window(7))
SLIDING = (full_attention(), sliding_window(7))


def manager(groups=WINDOWED, num_blocks=24):
    return HybridKVCacheManager(list(groups), num_blocks, 3, seed=0)


def windowed_rewound():
    """A request whose chunk window released blocks 0, 1 at 6, rewound to 3 (a query
    there reads block 0 of the chunk group: vLLM's null entry, left as it is)."""
    m = manager()
    m.add_request("r1", [0, 1, 2, 1, 0, 1])
    m.append_step(["r1"], [1])                           # at 6: chunk 6.. , blocks 0, 1 go
    null = m.null_block_id
    assert m.get_block_ids("r1")[1][:2] == (null, null)
    before = m.get_block_ids("r1")
    m.rewind("r1", 3)
    assert m.get_block_ids("r1") == before
    m.check_invariants()
    return m, before


@pytest.mark.parametrize("call", ["append_step", "append_tokens"])
def test_steps_after_a_rewind_past_released_blocks_keep_them_released(call):
    # before: the one-token fast path set where the last step began to 4, below the
    # step at 6 that released the chunk group's blocks 0, 1, and check_invariants
    # raised "2 blocks released, but a query at 4 still reads block 0"
    m, before = windowed_rewound()
    for t in (1, 0, 1):                                  # 3, 4, 5 recomputed
        if call == "append_step":
            m.append_step(["r1"], [t])
        else:
            m.append_tokens("r1", [t])
        m.check_invariants()
    assert m.get_block_ids("r1") == before and m.num_scheduled_tokens("r1") == 6


def test_release_unread_after_a_rewind_past_released_blocks_keeps_them_released():
    # risks-r11's minimal case: release_unread (vLLM frees what no window reads before it
    # counts) planned the next release, and the next step took the fast path at 3
    m, before = windowed_rewound()
    assert m.release_unread("r1") == 0
    m.append_step(["r1"], [2])
    m.check_invariants()
    assert m.get_block_ids("r1") == before


def forked_rewound(groups=SLIDING):
    """r2 (10 tokens) forked to r7, which shares its full blocks 0..2; r2 rewound to 7:
    positions 7, 8 (tokens 2, 0) lie in block 2, which r7 still reads."""
    m = manager(groups)
    m.add_request("r2", [2, 2, 0, 0, 1, 0, 2, 2, 0, 0])
    assert m.fork("r2", "r7") is not None
    m.rewind("r2", 7)
    m.check_invariants()
    return m


def snapshot(m, *rids):
    return ([(m.get_block_ids(r), m.num_tokens(r), m.num_scheduled_tokens(r)) for r in rids],
            m.num_free_blocks, m.num_cached_blocks)


@pytest.mark.parametrize("groups", [(full_attention(),), SLIDING])
def test_append_tokens_refuses_other_tokens_in_a_block_a_fork_sibling_shares(groups):
    # before: accepted, r2 rewrote r7's block 2 with the KV of tokens 2, 1 (r7 holds 2, 0),
    # and check_invariants raised "request 'r7' group 0: block 2 holds another prefix"
    m = forked_rewound(groups)
    before = snapshot(m, "r2", "r7")
    with pytest.raises(RequestError, match="position 8 .* block 2"):
        m.append_tokens("r2", [2, 1])
    assert snapshot(m, "r2", "r7") == before
    m.check_invariants()
    assert m.append_tokens("r2", [2, 0]) == ((),) * len(groups)   # the same tokens: its KV again
    m.check_invariants()
    assert m.get_block_ids("r2")[0][2] == m.get_block_ids("r7")[0][2]
    m.add_request("r8", [2, 2, 0, 0, 1, 0, 2, 2, 0, 0])             # block 2 is found again
    assert m.get_block_ids("r8")[0][:3] == m.get_block_ids("r7")[0][:3]
    m.check_invariants()


def test_append_step_refuses_other_tokens_in_a_shared_block_before_any_change():
    # the one-token paths (the fast one at 8 after the step at 7) check it as well, and a
    # step refused for one request changes none of the others
    m = forked_rewound()
    m.append_step(["r2"], [2])                           # at 7: as before
    m.check_invariants()
    m.add_request("r9", [5, 6])
    before = snapshot(m, "r2", "r7", "r9")
    with pytest.raises(RequestError, match="position 8"):
        m.append_step(["r9", "r2"], [7, 1])
    with pytest.raises(RequestError, match="position 8"):
        m.append_tokens("r2", [1])
    assert snapshot(m, "r2", "r7", "r9") == before
    assert m.append_step(["r9", "r2"], [7, 0]).short == ()
    m.check_invariants()


def test_a_block_no_other_request_shares_any_more_takes_other_tokens():
    m = forked_rewound()
    m.free("r7")
    assert m.append_tokens("r2", [2, 1, 5]) is not None
    assert m.num_tokens("r2") == 10
    m.check_invariants()


def test_a_second_rewind_keeps_what_the_first_pinned_past_its_tokens():
    # rewound to 7, then to 6 before 7, 8 came back: 6 must be 2 again, and 7, 8 still
    # 2, 0 (forgotten twice: the second rewind's request held only 7 tokens)
    m = forked_rewound()
    m.rewind("r2", 6)
    m.check_invariants()
    for bad in ([2, 2, 1], [0]):
        with pytest.raises(RequestError):
            m.append_tokens("r2", bad)
    m.append_tokens("r2", [2, 2, 0])
    m.check_invariants()


def test_a_request_that_hit_the_blocks_pins_them_too():
    m = manager()
    m.add_request("a", [1, 2, 3, 4, 5, 6, 7])
    m.add_request("b", [1, 2, 3, 4, 5, 6, 9])            # hits a's blocks 0, 1
    assert m.get_block_ids("b")[0][:2] == m.get_block_ids("a")[0][:2]
    m.rewind("a", 4)
    with pytest.raises(RequestError, match="position 5 .* block 1"):
        m.append_tokens("a", [5, 0])
    m.append_tokens("a", [5, 6, 8])
    m.check_invariants()


def test_a_token_before_a_shared_block_is_pinned_too():
    # risks-r11's seed 24: a sliding window of 4 (block_size 1) had released block 4 of
    # the rewound fork, not its sibling's block 5: another token at 4 was taken, and the
    # recompute of 5 (the same token) rewrote the sibling's block 5 with KV that read it
    m = HybridKVCacheManager([sliding_window(4)], 24, 1, seed=0)
    m.add_request("r5", [0, 1, 2, 0, 0, 0, 0, 0])
    m.bound_release("r5", 0)
    assert m.fork("r5", "r6") is not None
    m.release_unread("r6")                               # r6 at 8 reads 5..8: 0..4 go
    null = m.null_block_id
    assert m.get_block_ids("r6")[0][:6] == (null,) * 5 + m.get_block_ids("r5")[0][5:6]
    m.rewind("r6", 4)
    before = snapshot(m, "r5", "r6")
    with pytest.raises(RequestError, match="position 4 .* block 7"):
        m.append_tokens("r6", [2, 0])
    assert snapshot(m, "r5", "r6") == before
    m.append_tokens("r6", [0, 0, 0, 0])
    m.check_invariants()


def test_a_recompute_over_released_window_entries_is_never_cached():
    # wrongkv-r12: 12 tokens, a step at 12 (the 4-token window reads 9..12: its blocks
    # 0..2 go), then back to 6: the recompute of 6..12 reads 3..5 and 6..8 in the window
    # group, released (vLLM's null block), so its KV, in every group, is computed from a
    # wrong context. Before: the recomputed full-attention blocks 3, 4 and window block 8
    # were cached again and a later request with the same prompt hit all 12 tokens
    # (((1, 2, 3, 4, 11), (0, 0, 0, 8, 12)): wrong KV); now it hits the 6 sound ones
    m = manager((full_attention(), sliding_window(4)), 20)
    prompt = list(range(1, 13))
    assert m.add_request("a", prompt).group_block_ids == ((1, 2, 3, 4), (5, 6, 7, 8))
    assert m.append_tokens("a", [13]) == ((9,), (10,))
    null = m.null_block_id
    assert m.get_block_ids("a") == ((1, 2, 3, 4, 9), (null, null, null, 8, 10))
    m.rewind("a", 6)
    assert m.append_tokens("a", prompt[6:] + [13]) == ((), ())
    assert m.get_block_ids("a") == ((1, 2, 3, 4, 9), (null, null, null, 8, 10))
    m.check_invariants()
    assert m.lookup(prompt + [0]) == 6
    assert m.lookup_block_ids(prompt + [0]) == ((1, 2), (null, 6))
    # nor its later blocks (the window's block 2, id 7, free under a prefix the rewind
    # forgot, went empty: taken first)
    assert m.append_tokens("a", [14, 15, 16]) == ((7,), (11,))
    assert m.lookup(prompt + [13, 14, 15, 0]) == 6    # (full attention reads all of it)
    adm = m.add_request("b", prompt + [0])
    assert adm.num_cached_tokens == 6
    assert adm.group_block_ids == ((1, 2, 12, 13, 14), (null, 6, 15, 16, 17))
    m.check_invariants()


def test_requests_sharing_a_block_a_lost_recompute_rewrites_are_not_cached_from_there():
    # sliding window of 7 only. r2 forks a after a's step at 12 (blocks 0, 1 released),
    # then a goes back to 6: its recompute rewrites blocks 2, 3, which r2 shares, over
    # lost KV, and r2's later blocks read them. Before: r2's blocks 5, 6 were cached and
    # a request with r2's 21 tokens hit them all (the window at 21 reads blocks 5, 6
    # only); now r2 is tainted from 6 as well, and so is a fork of a (the hit: the sound
    # blocks 0, 1, released to the pool still cached)
    m = manager((sliding_window(7),), 30)
    prompt = list(range(1, 13))
    m.add_request("a", prompt)
    m.append_tokens("a", [13])
    null = m.null_block_id
    assert m.get_block_ids("a") == ((null, null, 3, 4, 5),)
    assert m.fork("a", "r2") is not None
    m.rewind("a", 6)
    m.check_invariants()
    m.append_tokens("a", prompt[6:] + [13])
    more = [14, 15, 16, 17, 18, 19, 20, 21]
    assert m.append_tokens("r2", more) is not None
    assert m.get_block_ids("r2") == ((null, null, 3, 4, 6, 7, 8),)
    assert m.lookup(prompt + [13] + more + [0]) == 6
    assert m.fork("a", "r3") is not None
    m.append_tokens("r3", more)
    assert m.lookup(prompt + [13] + more + [0]) == 6
    m.check_invariants()


def test_a_mamba_recompute_from_a_state_no_block_holds_is_never_cached():
    # block_size 3. A Mamba group keeps the state where a step ends, in the block of its
    # last position: a rewind to 6 (step 0..6 ended there, block 1 recorded) recomputes
    # from a held state and is cached again; to 7 (no state after 6.. 7) or to 3 (block 0
    # jumped over) it is not (before: cached, a hit served the state of another prefix)
    m = manager((full_attention(), mamba()), 30)
    prompt = list(range(1, 16))
    m.add_request("a", prompt, num_new_tokens=6)
    m.extend("a", 6)                                     # 6..12: block 1 still held
    m.rewind("a", 6)
    m.append_tokens("a", prompt[6:12])
    assert m.lookup(prompt) == 12
    m.rewind("a", 7)
    m.append_tokens("a", prompt[7:15])
    assert m.lookup(prompt + [0]) == 6
    m.check_invariants()
    m2 = manager((full_attention(), mamba()), 30)
    m2.add_request("a", prompt, num_new_tokens=12)
    m2.rewind("a", 3)
    m2.append_tokens("a", prompt[3:15])
    assert m2.lookup(prompt + [0]) == 0
    m2.check_invariants()


def test_reads_released_says_where_a_recompute_would_read_lost_kv():
    # the 4-token window at 12 released blocks 0..2: a step from 9..11 reads 6..8, from
    # 12 on nothing released; from 0 it would write and then read released entries (the
    # null block). An admission whose load ends at 12 is the same below 12
    m = manager((full_attention(), sliding_window(4)), 20)
    m.add_request("a", list(range(1, 13)))
    m.append_tokens("a", [13])
    assert [m.reads_released("a", p) for p in (0, 6, 11, 12, 13)] == [True, True, True, False, False]
    m.add_request("b", list(range(20, 32)), num_new_tokens=1, num_lookahead_tokens=11,
                  num_external_tokens=12)
    assert [m.reads_released("b", p) for p in (0, 1)] == [True, True]
    m.extend("b", 11)                                    # the load landed
    assert m.reads_released("b", 8) and not m.reads_released("b", 12)
    for bad in (-1, 14):
        with pytest.raises(RequestError):
            m.reads_released("a", bad)
    m.check_invariants()


LAYOUTS = [(full_attention(),), SLIDING, (sliding_window(4),), WINDOWED]
OP = st.sampled_from(["fork", "fork", "rewind", "rewind", "append", "append", "step", "free", "unread"])
OPS = st.lists(st.tuples(OP, st.integers(0, 3), st.integers(0, 12),
                         st.lists(st.integers(0, 2), max_size=4)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(layout=st.integers(0, len(LAYOUTS) - 1), bs=st.sampled_from([1, 3]),
       prompt=st.lists(st.integers(0, 2), min_size=3, max_size=12), ops=OPS)
def test_rewinds_beside_forks_keep_every_shared_block_and_refuse_before_any_change(
        layout, bs, prompt, ops):
    # forks share blocks, rewinds forget tokens and appends give any (often other)
    # tokens: a call either goes through with the tables sound (no shared block holds
    # another prefix, no released block still read) or raises RequestError changing
    # nothing
    m = HybridKVCacheManager(list(LAYOUTS[layout]), 40, bs, seed=0)
    m.add_request("r0", prompt)
    live = ["r0"]
    for n, (op, who, k, tokens) in enumerate(ops):
        if not live:
            break
        rid = live[who % len(live)]
        before = snapshot(m, *live)
        try:
            if op == "fork":
                if m.fork(rid, f"r{n + 1}") is not None:
                    live.append(f"r{n + 1}")
            elif op == "rewind":
                m.rewind(rid, min(k, m.num_scheduled_tokens(rid)))
            elif op == "append" and tokens:
                m.append_tokens(rid, tokens)
            elif op == "step":
                m.append_step([rid], tokens[:1] or [0])
            elif op == "free":
                m.free(rid)
                live.remove(rid)
            elif op == "unread":
                m.release_unread(rid)
        except RequestError:
            assert snapshot(m, *live) == before
        m.check_invariants()
