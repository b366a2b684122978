"""Fork copies as a closed set: forks of forks and frees before the plan is taken
(``prefixkv.core.copies``). block_size 2, seed 0; exact block ids, plans and free-queue
order. The engine runs a plan in order: offloads, loads, then the copies."""

from prefixkv import Admission, BlockCopy, BlockLoads, BlockOffloads, Fork, KVCacheManager
from prefixkv.groups import GroupBlockCopy, HybridKVCacheManager, full_attention


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
    assert m.free_block_order() == [1, 2]
    m.check_invariants()
    assert m.take_kv_ops() == []
    m.free("a")
    assert m.free_block_order() == [0, 1, 2]


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
    assert m.free_block_order() == [4, 3, 2, 1]
    assert m.add_request("y", [7, 8, 1]) == Admission("y", (4, 3), 2, 1)
    m.check_invariants()
    assert m.take_kv_ops() == [BlockOffloads((4, 3), (1, 2)), BlockLoads((0,), (4,))]


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
