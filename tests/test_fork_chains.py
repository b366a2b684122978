"""Fork copies as a closed set: forks of forks and frees before the plan is taken
(``prefixkv.core.copies``). block_size 2, seed 0; exact block ids, plans and free-queue
order. The engine runs a plan in order: offloads, loads, then the copies."""

from collections import Counter

from prefixkv import (
    Admission,
    BlockCopy,
    BlockLoads,
    BlockOffloads,
    BlockRemoved,
    BlockStored,
    Fork,
    KVCacheManager,
)
from prefixkv.groups import GroupBlockCopy, HybridKVCacheManager, full_attention
from prefixkv.hashing import chain as hash_chain
from prefixkv.hashing import encode_tokens, make_hash_fn, token_bytes


def chain(num_blocks: int = 3, **kw) -> KVCacheManager:
    """a (one token, block 0, computed in an earlier step) -> b (block 1) -> c (block 2),
    forked in one step: the plan owes 0 -> 1, then 1 -> 2."""
    m = KVCacheManager(num_blocks, 2, seed=0, **kw)
    m.add_request("a", [0])
    m.take_kv_ops()
    assert m.fork("a", "b") == Fork("b", (1,), (BlockCopy(0, 1),))
    assert m.fork("b", "c") == Fork("c", (2,), (BlockCopy(1, 2),))
    m.check_invariants()
    return m


def test_freeing_the_middle_of_a_fork_chain_keeps_the_copy_that_feeds_the_next():
    m = chain()
    m.free("b")                       # a beam pruned in the same step
    assert m.free_block_order() == []  # 1 is held: the source of 1 -> 2
    m.check_invariants()
    assert m.take_kv_ops() == [BlockCopy(0, 1), BlockCopy(1, 2)]
    assert m.free_block_order() == [1]
    m.check_invariants()


def test_freeing_a_chain_tail_first_drops_each_copy_and_its_sources_pin():
    m = chain()
    m.free("c")                       # 2 goes back: 1 -> 2 dropped, 1 held by b alone
    assert m.free_block_order() == [2]
    m.free("b")                       # 1 goes back: 0 -> 1 dropped, 0 held by a alone
    assert m.free_block_order() == [1, 2]
    m.check_invariants()
    assert m.take_kv_ops() == []


def test_freeing_the_middle_then_the_tail_drops_the_whole_chain():
    m = chain()
    m.free("b")
    m.free("c")                       # 2 goes, then 1 (only the plan held it), then 0 -> 1
    assert m.free_block_order() == [2, 1]  # (1 went back first: a source before the request)
    m.check_invariants()
    assert m.take_kv_ops() == []
    m.free("a")
    assert m.free_block_order() == [0, 2, 1]


def test_a_freed_parent_and_middle_still_feed_the_last_child():
    m = chain(4)
    m.free("a")
    m.free("b")
    assert m.free_block_order() == [3]  # 0 and 1 are the sources of the copies owed to c
    m.check_invariants()
    assert m.add_request("x", [5, 6, 7, 8, 9]) is None  # 3 blocks: only one is free
    assert m.take_kv_ops() == [BlockCopy(0, 1), BlockCopy(1, 2)]
    assert m.free_block_order() == [1, 0, 3]
    m.check_invariants()


def forked_and_filled() -> KVCacheManager:
    """a (block 0) -> b (block 1, owed 0 -> 1), then b's token fills block 1 ([0, 5]:
    full, findable), all in one step."""
    m = KVCacheManager(4, 2, seed=0)
    m.add_request("a", [0])
    m.take_kv_ops()
    assert m.fork("a", "b").copies == (BlockCopy(0, 1),)
    assert m.append_tokens("b", [5]) == ()
    return m


def test_a_freed_childs_findable_block_keeps_its_copy_for_a_request_that_hits_it():
    m = forked_and_filled()
    m.free("b")                           # its tokens count as computed: 1 stays findable
    assert m.free_block_order() == [2, 3]  # held by the plan, for the copy into it
    assert m.add_request("d", [0, 5, 7]) == Admission("d", (1, 2), 2, 1)
    m.check_invariants()
    assert m.take_kv_ops() == [BlockCopy(0, 1)]  # d reads block 1's first slot from it
    m.free("d")
    assert m.free_block_order() == [2, 3, 1]
    m.check_invariants()


def test_an_aborted_childs_block_is_unfindable_and_goes_back_without_its_copy():
    m = forked_and_filled()
    m.free("b", num_computed_tokens=1)    # the step never ran: block 1 holds no KV
    assert m.free_block_order() == [1, 2, 3]
    assert m.lookup([0, 5, 7]) == 0
    assert m.take_kv_ops() == []
    m.check_invariants()


def forked_under_a_prefix(**kw) -> KVCacheManager:
    """p ([1, 2, 3, 4, 5]: blocks 0, 1 full, 2 partial; computed in an earlier step) forks
    c (0, 1, 3; owed 2 -> 3), in a pool of 16."""
    m = KVCacheManager(16, 2, seed=0, **kw)
    m.add_request("p", [1, 2, 3, 4, 5])
    m.take_kv_ops()
    assert m.fork("p", "c") == Fork("c", (0, 1, 3), (BlockCopy(2, 3),))
    return m


def test_a_block_held_for_its_content_holds_its_prefix_until_the_plan_is_taken():
    m = forked_under_a_prefix()
    assert m.append_tokens("c", [6]) == ()  # 3: [5, 6], findable under 1's content
    m.free("c")                             # its tokens count as computed: 3 held
    m.free("p")
    x = m.add_request("x", list(range(10, 35)))  # 13 blocks
    m.check_invariants()  # (before: x evicted 1, and 3 was found under a content gone)
    assert x is None
    assert m.free_block_order() == list(range(4, 16))  # 3 held with 1 and 0; 2 the source
    assert m.lookup([1, 2, 3, 4, 5, 6, 0]) == 6
    assert m.take_kv_ops() == [BlockCopy(2, 3)]
    assert m.free_block_order() == [2, *range(4, 16), 3, 1, 0]  # a child before its parent
    assert m.add_request("x", list(range(10, 37))).block_ids[-1] == 3  # 14: 3 evicted first
    assert m.lookup([1, 2, 3, 4, 5, 6, 0]) == 4
    m.check_invariants()


def test_a_router_mirroring_the_events_counts_no_block_that_lookup_cannot_reach():
    m = forked_under_a_prefix(hash_mode="sha256", enable_events=True)
    m.append_tokens("c", [6])
    m.free("c")
    m.free("p")
    m.add_request("x", list(range(10, 7 + 2 * m.num_free_blocks)))  # all free blocks but one
    m.take_kv_ops()
    m.free("x")
    m.add_request("y", [1, 2, 3, 4, 9])  # [1, 2, 3, 4] cached, or computed again
    m.take_kv_ops()
    mirror: Counter[bytes] = Counter()
    for ev in m.take_events():
        assert isinstance(ev, (BlockStored, BlockRemoved)), ev
        mirror.update({h: 1 if isinstance(ev, BlockStored) else -1 for h in ev.block_hashes})
    fn, root = make_hash_fn("sha256", 0)
    hashes, _ = hash_chain(fn, root, token_bytes(encode_tokens([1, 2, 3, 4, 5, 6])), [b""] * 3)
    seen = next((i for i, h in enumerate(hashes) if mirror[h] <= 0), 3)
    # (before: x evicted 1 while 3 stayed, announced; y stored 1's hash again: the
    # router counted 3 blocks, lookup found 2)
    assert m.lookup([1, 2, 3, 4, 5, 6, 0]) == 2 * seen == 6
    m.check_invariants()


def test_a_source_filled_by_its_freed_parent_goes_back_before_the_blocks_under_it():
    m = forked_under_a_prefix()
    assert m.append_tokens("p", [6]) == ()  # 2: [5, 6], findable; still the source of 2 -> 3
    m.free("p")                             # 2 held by the plan
    m.free("c")                             # 3 goes back empty: 2 -> 3 dropped, 2 unpinned
    x = m.add_request("x", list(range(10, 38)))  # 14 blocks: 13 empty, and the LRU one
    m.check_invariants()  # (before: 2 went back after 1 and 0, x evicted 1: 2 cut off)
    assert x.block_ids == (3, *range(4, 16), 2)
    assert m.lookup([1, 2, 3, 4, 5, 6, 0]) == 4
    assert m.take_kv_ops() == []


def host_chain() -> KVCacheManager:
    """Block 0's [7, 8] in host slot 0; a (block 0) -> b (4) -> c (3) forked in one step,
    evicting (offloading) two of x's blocks."""
    m = KVCacheManager(5, 2, seed=0, host_blocks=4)
    m.add_request("h", [7, 8, 9])
    m.take_kv_ops()
    m.free("h")
    m.add_request("x", [20, 21, 22, 23, 24, 25, 26, 27, 28])  # evicts [7, 8] to the host
    assert m.take_kv_ops() == [BlockOffloads((0,), (0,))]
    m.free("x")
    assert m.add_request("a", [0]) == Admission("a", (0,), 0, 1)
    m.take_kv_ops()
    assert m.fork("a", "b").copies == (BlockCopy(0, 4),)
    assert m.fork("b", "c").copies == (BlockCopy(4, 3),)
    return m


def test_a_host_load_in_the_step_never_takes_the_freed_middle_of_a_chain():
    m = host_chain()
    m.free("b")
    assert m.free_block_order() == [2, 1]  # 4 is held: the source of 4 -> 3
    assert m.add_request("y", [7, 8, 1]) == Admission("y", (2, 1), 2, 1)  # a host hit
    m.check_invariants()
    # x's last three blocks (4, 3, 2) went to slots 1-3 in this step, then its first block
    # (1) was evicted with every slot pinned: its content is lost, so the offloads of its
    # descendants are withdrawn (nothing could ever find them: tests/test_host_chain.py)
    assert m.take_kv_ops() == [BlockLoads((0,), (2,)), BlockCopy(0, 4), BlockCopy(4, 3)]
    assert m.lookup([20, 21, 22, 23, 24, 25, 26, 27, 28]) == 0


def test_a_host_load_in_the_step_may_take_a_freed_chains_blocks_without_their_copies():
    m = host_chain()
    m.free("b")
    m.free("c")                             # 3 goes, then 4: both copies dropped
    assert m.free_block_order() == [3, 4, 2, 1]  # (4 went back first: a source)
    assert m.add_request("y", [7, 8, 1]) == Admission("y", (3, 4), 2, 1)
    m.check_invariants()
    assert m.take_kv_ops() == [BlockOffloads((4, 3), (1, 2)), BlockLoads((0,), (3,))]


def test_a_fork_never_copies_into_a_block_a_load_of_the_plan_writes():
    """Found by the late-plan state machine with a host tier: a host hit's load target,
    its request dropped before its step ran and the block evicted in the same step,
    became a fork's copy destination with the dead load still in the plan."""
    m = KVCacheManager(4, 2, seed=0, host_blocks=4)
    m.add_request("h", [7, 8, 9])
    m.take_kv_ops()
    m.free("h")
    m.add_request("x", [20, 21, 22, 23, 24, 25, 26, 27])  # [7, 8] to host slot 0
    m.take_kv_ops()
    m.free("x")
    m.add_request("a", [0])
    m.take_kv_ops()
    assert m.add_request("y", [7, 8, 1]) == Admission("y", (3, 2), 2, 1)  # loads slot 0 -> 3
    m.free("y", num_computed_tokens=2)  # dropped before its step ran: 3 goes back
    assert m.add_request("z", [30, 31, 32]) == Admission("z", (2, 1), 0, 3)
    assert m.fork("a", "b").copies == (BlockCopy(0, 3),)  # 3: the load's target
    m.check_invariants()
    ops = m.take_kv_ops()
    assert not any(isinstance(op, BlockLoads) and 3 in op.dst for op in ops), ops


def test_the_hybrid_manager_keeps_a_chains_copies_in_order():
    m = HybridKVCacheManager([full_attention()], 3, 2, seed=0)
    m.add_request("a", [0])
    m.take_kv_ops()
    m.fork("a", "b")
    m.fork("b", "c")
    m.free("b")
    m.check_invariants()
    assert m.take_kv_ops() == [GroupBlockCopy(0, 1, 0), GroupBlockCopy(1, 2, 0)]


def test_a_hybrid_reset_drops_the_copies_no_request_needs_any_more():
    m = HybridKVCacheManager([full_attention()], 4, 2, seed=0)
    m.add_request("a", [0])
    m.take_kv_ops()
    m.fork("a", "b")
    m.free("a")
    m.free("b")
    assert m.reset_prefix_cache()
    assert m.take_kv_ops() == []
    m.check_invariants()
