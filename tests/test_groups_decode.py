"""The hybrid manager's decode step and reserved slots (prefixkv.groups.decode): exact
block ids per group, the exact free-queue order, shortage, typed errors before any change.

block_size is 4; block 0 is the null block (a sliding window of 8 releases blocks).
"""

import pytest

from prefixkv import ConfigError, RequestError, TokenError
from prefixkv.groups import (
    GroupBlockCopy,
    GroupDecodeStep,
    HybridKVCacheManager,
    chunked_local,
    full_attention,
    sliding_window,
)

FULL, SW8 = full_attention(), sliding_window(8)  # a query at p reads p-7 .. p
NOTHING = GroupDecodeStep((), ())


def manager(num_blocks=12, groups=(FULL, SW8), **kw):
    return HybridKVCacheManager(list(groups), num_blocks, 4, seed=0, **kw)


def test_append_step_appends_one_token_each_releases_windows_and_reports_growth():
    m = manager()
    m.add_request("a", list(range(1, 8)))               # 7 tokens: blocks 0, 1
    m.add_request("b", list(range(50, 53)))             # 3 tokens: block 0
    assert (m.get_block_ids("a"), m.get_block_ids("b")) == (((1, 2), (3, 4)), ((5,), (6,)))
    assert m.free_block_order() == [7, 8, 9, 10, 11]
    assert m.append_step(["a", "b"], [8, 53]) == NOTHING  # both fill their last block
    assert m.num_cached_blocks == 6
    # b at 4 and a at 8 open a block in each group, in the order given
    assert m.append_step(["b", "a"], [54, 9]) == GroupDecodeStep(
        (("b", ((7,), (8,))), ("a", ((9,), (10,)))), ())
    assert m.free_block_order() == [11]
    assert m.append_step(["a"], [10]) == m.append_step(["a"], [11]) == NOTHING
    # a's query at 11 reads 4..11: group 1's block 0 goes back, cached
    assert m.append_step(["a"], [12]) == NOTHING
    assert m.get_block_ids("a") == ((1, 2, 9), (0, 4, 10))
    assert m.free_block_order() == [11, 3]
    # a at 12 needs a block per group: 11, then 3 (its own released block, evicted)
    assert m.append_step(["a", "b"], [13, 55]) == GroupDecodeStep((("a", ((11,), (3,))),), ())
    assert m.get_block_ids("a") == ((1, 2, 9, 11), (0, 4, 10, 3))
    assert m.num_tokens("a") == 13 and m.num_tokens("b") == 6
    assert [s.blocks_released for s in m.group_stats()] == [0, 1]
    m.check_invariants()


def test_append_step_leaves_short_requests_unchanged_and_serves_the_others():
    m = manager(num_blocks=9)
    m.add_request("a", [1, 2, 3, 4])                    # block 0 full: needs block 1 next
    m.add_request("b", [5, 6, 7, 8, 9, 10])             # room in block 1
    m.add_request("c", [11, 12, 13, 14])
    assert [m.get_block_ids(r) for r in "abc"] == [((1,), (2,)), ((3, 4), (5, 6)), ((7,), (8,))]
    assert m.free_block_order() == []
    before = (m.get_block_ids("a"), m.get_block_ids("c"), m.num_cached_blocks)
    assert m.append_step(["a", "b", "c"], [1, 2, 3]) == GroupDecodeStep((), ("a", "c"))
    assert (m.get_block_ids("a"), m.get_block_ids("c"), m.num_cached_blocks) == before
    assert (m.num_tokens("a"), m.num_tokens("b"), m.num_tokens("c")) == (4, 7, 4)
    assert m.append_step(["b"], [3]) == NOTHING          # b at 7 fills its block 1
    assert m.append_step(["b"], [4]) == GroupDecodeStep((), ("b",))  # at 8: no block
    m.free("c")                                         # c's full block 0: 7, 8, cached
    assert m.free_block_order() == [7, 8]
    # the first in the list gets the blocks (evicting c's); the second is short
    assert m.append_step(["a", "b"], [1, 4]) == GroupDecodeStep((("a", ((7,), (8,))),), ("b",))
    assert m.num_cached_blocks == 2 + 4                 # a's and b's full blocks
    m.check_invariants()


def test_append_step_typed_errors_change_nothing():
    m = manager()
    m.add_request("a", [1, 2, 3])
    m.add_request("p", [1, 2, 3, 4, 5, 6], num_new_tokens=2)  # prefill not done
    before = (m.free_block_order(), m.get_block_ids("a"), m.num_tokens("a"), m.stats)
    bad = [
        (RequestError, lambda: m.append_step(["a", "zz"], [1, 2])),      # unknown
        (RequestError, lambda: m.append_step(["a", "a"], [1, 2])),       # repeated
        (RequestError, lambda: m.append_step(["a"], [1, 2])),            # lengths
        (RequestError, lambda: m.append_step("a", [1])),                 # a str of ids
        (RequestError, lambda: m.append_step(["a", "p"], [1, 2])),       # prefill
        (RequestError, lambda: m.append_step(None, [1])),
        (TokenError, lambda: m.append_step(["a"], [-1])),
        (TokenError, lambda: m.append_step(["a"], [2**32])),
        (TokenError, lambda: m.append_step(["a"], ["x"])),
    ]
    for error, call in bad:
        with pytest.raises(error):
            call()
    assert (m.free_block_order(), m.get_block_ids("a"), m.num_tokens("a"), m.stats) == before
    assert m.append_step([], []) == NOTHING
    m.check_invariants()


def test_append_step_with_a_failing_hash_callable_changes_no_request():
    calls = []

    def fn(data):
        calls.append(data)
        if len(calls) > 3:
            raise RuntimeError("boom")
        return b"h" * 16

    m = HybridKVCacheManager([FULL, SW8], 16, 4, hash_mode=fn, enable_events=True)
    m.add_request("a", [1, 2, 3])                       # fills nothing: no hash yet
    m.add_request("b", [1, 2, 3, 4, 5, 6, 7])           # one full block: hashed
    assert len(calls) == 2                              # the root, b's block 0
    events = m.take_events()
    with pytest.raises(ConfigError):                    # a's fill hashes, b's fails
        m.append_step(["a", "b"], [4, 8])
    assert (m.num_tokens("a"), m.num_tokens("b")) == (3, 7)
    assert m.get_block_ids("a") == ((1,), (2,)) and m.take_events() == []
    assert len(events) == 2
    m.check_invariants()


def test_reserve_covers_slots_in_every_group_and_appending_into_them_takes_no_block():
    m = manager()
    m.add_request("a", list(range(1, 7)))               # 6 tokens: blocks 0, 1
    assert m.reserve("a", 2) == ((), ())                # positions 6, 7: block 1 has room
    assert m.reserve("a", 5) == ((5,), (6,))            # positions up to 10: block 2
    assert m.reserve("a", 3) == ((), ()) and m.reserve("a", 0) == ((), ())
    assert m.get_block_ids("a") == ((1, 2, 5), (3, 4, 6))
    assert m.reserve("a", 100) is None                  # nothing changed
    assert m.get_block_ids("a") == ((1, 2, 5), (3, 4, 6))
    assert m.free_block_order() == [7, 8, 9, 10, 11]
    for t in range(7, 12):                              # positions 6..10: no new block
        assert m.append_tokens("a", [t]) == ((), ())
    assert m.append_step(["a"], [12]) == NOTHING        # position 11 fills block 2
    # the window moved at 11 (reads 4..11): block 0 of group 1 went back
    assert m.get_block_ids("a") == ((1, 2, 5), (0, 4, 6))
    # position 12 opens block 3: empty blocks first, the released one stays cached
    assert m.append_step(["a"], [13]) == GroupDecodeStep((("a", ((7,), (8,))),), ())
    assert m.free_block_order() == [9, 10, 11, 3]
    m.check_invariants()


def test_reserved_blocks_are_copied_by_fork_and_released_by_free():
    m = manager(num_blocks=16)
    m.add_request("a", list(range(1, 6)))               # 5 tokens: blocks 0, 1
    assert m.reserve("a", 4) == ((5,), (6,))            # positions 5..8: block 2
    fork = m.fork("a", "c")
    assert fork.group_block_ids == ((1, 7, 8), (3, 9, 10))
    assert fork.copies == (GroupBlockCopy(2, 7, 0), GroupBlockCopy(5, 8, 0),
                           GroupBlockCopy(4, 9, 1), GroupBlockCopy(6, 10, 1))
    assert m.append_tokens("c", [6, 7, 8, 9]) == ((), ())
    m.free("a")
    # a's reserved blocks (5, 6) and partial ones (2, 4) never got content: reused first,
    # in vLLM 0.33's order (freed group by group, each tail first to the queue's front:
    # 5 2, then 6 4 ahead of them)
    assert m.free_block_order()[:6] == [6, 4, 5, 2, 11, 12]
    m.check_invariants()


def test_reserve_typed_errors():
    m = manager(groups=(FULL, chunked_local(8)))
    m.add_request("a", [1, 2, 3])
    for bad in (-1, 1.5, True, None):
        with pytest.raises(RequestError):
            m.reserve("a", bad)
    with pytest.raises(RequestError):
        m.reserve("zz", 1)
    with pytest.raises(RequestError):
        m.reserve(["x"], 1)
    assert m.get_block_ids("a") == ((1,), (2,))



def test_admission_reserves_lookahead_in_every_group_and_can_require_a_full_fit():
    m = manager()                                       # 11 usable blocks
    adm = m.add_request("a", list(range(1, 7)), num_lookahead_tokens=3)  # covers 0..8
    assert adm.group_block_ids == ((1, 2, 3), (4, 5, 6))
    assert m.append_tokens("a", [7, 8, 9]) == ((), ())  # into the reserved slots
    m.check_invariants()
    # the whole prompt (5 blocks a group) does not fit in the 5 free blocks: None
    prompt = list(range(20, 39))
    assert m.add_request("b", prompt, num_new_tokens=4, require_full_fit=True) is None
    assert m.free_block_order() == [7, 8, 9, 10, 11] and m.stats.requests == 1
    assert m.add_request("b", prompt, num_new_tokens=4).group_block_ids == ((7,), (8,))
    m.check_invariants()


def test_num_blocks_to_allocate_is_net_of_the_steps_release():
    m = manager(num_blocks=9)
    m.add_request("a", list(range(1, 17)))              # 16 tokens: 4 blocks a group
    assert m.num_free_blocks == 0
    assert m.num_blocks_to_allocate("a", 16) == 0
    # a step at 16 reads 9..16: blocks 0, 1 of the window go back, 2 new blocks a group
    assert m.num_blocks_to_allocate("a", 17) == 2 - 2
    assert m.num_blocks_to_allocate("a", 21) == 4 - 2
    assert m.append_tokens("a", [17]) == ((6,), (5,))   # fits through its own release
    for bad in (-1, 1.5):
        with pytest.raises(RequestError, match="num_slots"):
            m.num_blocks_to_allocate("a", bad)
    with pytest.raises(RequestError):
        m.num_blocks_to_allocate("nobody", 4)
    with pytest.raises(RequestError, match="num_lookahead_tokens"):
        m.add_request("b", [1, 2], num_lookahead_tokens=-1)
    with pytest.raises(RequestError, match="require_full_fit"):
        m.add_request("b", [1, 2], require_full_fit=1)
    m.check_invariants()


def test_release_unread_releases_what_the_next_step_would_and_nothing_more():
    m = manager(num_blocks=11)
    m.add_request("a", list(range(1, 17)))              # 16 tokens: 4 blocks a group
    assert m.add_request("b", list(range(1, 6))).num_cached_tokens == 4  # a's block 0, 1 new a group
    assert m.num_free_blocks == 0
    before = m.get_block_ids("a")
    # the next step at 16 reads 9..16: the window's blocks 0, 1 go; block 0 is b's too
    assert m.num_blocks_released("a") == 1
    assert m.release_unread("a") == 1
    assert m.num_free_blocks == 1
    null = m.null_block_id
    assert m.get_block_ids("a") == (before[0], (null, null, *before[1][2:]))
    assert m.num_blocks_released("a") == m.release_unread("a") == 0   # nothing more to go
    m.check_invariants()
    assert m.append_tokens("a", [17]) is None           # 2 new blocks, 1 free: short
    m.free("b")
    assert m.append_tokens("a", [17]) is not None       # the step itself, as before
    m.check_invariants()
    for call in (m.release_unread, m.num_blocks_released):
        with pytest.raises(RequestError):
            call("nobody")


def test_bound_release_keeps_what_a_query_at_the_bound_reads_until_lifted():
    # 16 tokens scheduled: a step at 16 reads 9..16 of the 8-token window (blocks 0, 1
    # would go). Bound at 8 (a step in flight starts there, reading 1..8): only what no
    # query at 8 reads may go, i.e. nothing; the bound lifted, blocks 0, 1 go
    m = manager(num_blocks=12)
    m.add_request("a", list(range(1, 17)))
    before = m.get_block_ids("a")
    m.bound_release("a", 8)
    assert m.num_blocks_released("a") == m.release_unread("a") == 0
    assert m.append_tokens("a", [17]) is not None       # grows, releasing nothing
    assert m.get_block_ids("a")[1][:4] == before[1]
    m.check_invariants()
    with pytest.raises(RequestError):
        m.bound_release("a", -1)
    m.bound_release("a", None)
    assert m.release_unread("a") == 2
    null = m.null_block_id
    assert m.get_block_ids("a")[1][:2] == (null, null)
    m.check_invariants()
    with pytest.raises(RequestError):
        m.bound_release("nobody", 0)


def test_rewind_forgets_the_tokens_after_it_and_the_step_recomputing_them_moves_windows_at_its_start():
    # 12 tokens scheduled in one chunk: blocks 0..2 a group, cached. Back to 4 (blocks 1, 2
    # invalid): a step recomputing 4..13 starts at 4, whose query reads 0..4 in the 8-token
    # window: nothing is released, and blocks 1, 2 are cached anew with their tokens
    m = manager(num_blocks=12)
    prompt = list(range(1, 13))
    m.add_request("a", prompt)
    before = m.get_block_ids("a")
    assert m.num_cached_blocks == 6
    m.rewind("a", 4)
    assert (m.num_tokens("a"), m.num_scheduled_tokens("a")) == (4, 4)
    assert m.get_block_ids("a") == before and m.num_cached_blocks == 2   # slots kept, content gone
    assert m.lookup(prompt + [0]) == 4
    m.check_invariants()
    assert m.append_tokens("a", prompt[4:] + [13]) == ((7,), (8,))
    assert m.get_block_ids("a") == (before[0] + (7,), before[1] + (8,))
    assert m.lookup(prompt + [0]) == 12
    m.check_invariants()
    # the next step starts at 13 and reads 6..13: the window's block 0 goes
    assert m.append_tokens("a", [14]) == ((), ())
    assert m.get_block_ids("a")[1][0] == m.null_block_id
    m.check_invariants()


def test_rewind_leaves_released_entries_released_and_checks_its_count():
    m = manager(num_blocks=12)
    m.add_request("a", list(range(1, 17)))
    m.append_tokens("a", [17])                          # at 16: the window's blocks 0, 1 go
    null = m.null_block_id
    assert m.get_block_ids("a")[1][:2] == (null, null)
    before = m.get_block_ids("a")
    for bad in (-1, 18, 2.0, None):
        with pytest.raises(RequestError):
            m.rewind("a", bad)
    with pytest.raises(RequestError):
        m.rewind("nobody", 0)
    assert m.get_block_ids("a") == before and m.num_tokens("a") == 17
    m.rewind("a", 12)                                   # 12..16 recomputed: reads 5..
    assert m.get_block_ids("a") == before
    assert m.append_tokens("a", [13, 14, 15, 16, 17]) == ((), ())
    assert m.get_block_ids("a")[1][:3] == (null, null, before[1][2])
    m.check_invariants()


def test_an_admission_with_external_tokens_takes_no_window_block_below_its_first_query():
    # 12 of 16 tokens loaded from elsewhere: the first query sits at 12 and reads 5..12 of
    # the 8-token window, so the window's block 0 is a released entry (never written,
    # never cached) and the admission takes 4 + 3 blocks
    m = manager(num_blocks=16)
    null = m.null_block_id
    adm = m.add_request("a", list(range(1, 17)), num_external_tokens=12)
    assert adm.group_block_ids == ((1, 2, 3, 4), (null, 5, 6, 7))
    assert (m.num_free_blocks, m.num_cached_blocks) == (8, 7)
    assert m.lookup(list(range(1, 17)) + [0]) == 16
    m.check_invariants()
    # one token scheduled, slots reserved to 12 (vLLM's asynchronous load): 3 + 2 blocks;
    # when the load lands (scheduled then), its blocks are cached but the released one
    adm = m.add_request("b", list(range(50, 66)), num_new_tokens=1, num_lookahead_tokens=11,
                        num_external_tokens=12)
    assert adm.group_block_ids == ((8, 9, 10), (null, 11, 12))
    assert (m.num_free_blocks, m.num_cached_blocks) == (3, 7)
    m.check_invariants()
    assert m.extend("b", 11) == ((), ())
    assert m.num_cached_blocks == 7 + 3 + 2
    assert m.lookup(list(range(50, 66))) == 12
    m.check_invariants()
    with pytest.raises(RequestError):
        m.add_request("c", [1, 2], num_external_tokens=-1)


def test_a_fork_of_a_request_rewound_into_its_released_window_shares_the_released_entries():
    # found by a random-order fuzz: a request rewound to before blocks its window had
    # released keeps those null entries past its scheduled tokens, and fork copied every
    # entry from there on: AttributeError on the null entry, after the pool had handed
    # out the copies' blocks (3 blocks leaked: ref 1, held by no request)
    m = HybridKVCacheManager([sliding_window(4)], 10, 3, hash_mode="sha256")
    m.add_request("a", [0, 1, 2, 2, 2, 2, 0])
    m.append_tokens("a", [])
    null = m.null_block_id
    assert m.get_block_ids("a") == ((null, 2, 3),)
    m.rewind("a", 0)
    free = m.num_free_blocks
    got = m.fork("a", "b")
    m.check_invariants()
    ((released, *copied),) = m.get_block_ids("b")
    assert released == null and [c.src for c in got.copies] == [2, 3]
    assert [c.dst for c in got.copies] == copied and m.num_free_blocks == free - 2
    m.free("a")
    m.free("b")
    m.check_invariants()
