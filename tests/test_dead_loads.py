"""A load of the step's plan leaves the plan when its device block loses the content the
load brings: evicted (handed out again: a miss's block, a decode's new block, a fork's
copy destination), or made unfindable (``uncache_blocks``, ``rewind``). A request freed,
aborted or preempted before its step ran leaves its loaded hits findable (their KV is the
load's): the load stays until then. Before (deadload-r16), the dead load stayed in the plan
and wrote the block before the forward pass that computes it: harmless only while an
engine runs every load first, and one plan wrote a block twice when the block became a
load target again (``CopyPlan.check``'s guard).

Block size 2, seed 0, a host tier of 4 slots: ``base`` leaves [7, 8] in host slot 0 and
x's four blocks cached (tail first: 0, 3, 2, 1). Exact block ids and plans."""

import pytest

from prefixkv import Admission, BlockCopy, BlockLoads, BlockOffloads, Fork, KVCacheManager

# with events the index evicts block by block (``DroppingIndex.drop``), without them in
# one batch through the tier's ``demote``: both drop the dead loads
pytestmark = pytest.mark.parametrize("events", [False, True])


def base(events: bool) -> KVCacheManager:
    m = KVCacheManager(4, 2, seed=0, host_blocks=4, enable_events=events)
    m.add_request("h", [7, 8, 9])
    m.take_kv_ops()
    m.free("h")
    m.add_request("x", [20, 21, 22, 23, 24, 25, 26, 27])  # [7, 8] goes to host slot 0
    assert m.take_kv_ops() == [BlockOffloads((0,), (0,))]
    m.free("x")
    assert m.free_block_order() == [0, 3, 2, 1]
    return m


def loaded(m: KVCacheManager) -> Admission | None:
    """y hits [7, 8] in host slot 0: its load into device block 0 (x's evicted tail)."""
    adm = m.add_request("y", [7, 8, 1])
    assert adm == Admission("y", (0, 3), 2, 1), adm
    return adm


def test_a_freed_requests_loaded_hit_stays_findable_with_its_load(events):
    m = base(events)
    loaded(m)
    m.free("y")                                   # counted as computed: block 0 keeps [7, 8]
    assert m.lookup([7, 8, 5]) == 2 and m.lookup_block_ids([7, 8, 5]) == (0,)
    assert m.add_request("w", [7, 8, 5]) == Admission("w", (0, 3), 2, 1)  # hits it
    m.check_invariants()
    assert m.take_kv_ops() == [BlockOffloads((0, 3), (1, 2)), BlockLoads((0,), (0,))]


def test_a_freed_requests_loaded_block_evicted_for_a_miss_loses_its_load(events):
    m = base(events)
    loaded(m)
    m.free("y")
    assert m.add_request("z", [30, 31, 32, 33, 34, 35, 36]) == Admission("z", (3, 2, 1, 0), 0, 7)
    m.check_invariants()
    # (x's tail went to slots 1, 2, then its first block was lost with every slot pinned:
    # the offloads of its descendants are withdrawn, tests/test_host_chain.py)
    assert m.take_kv_ops() == []                  # before: BlockLoads((0,), (0,)) into z's block


def test_a_loaded_block_evicted_while_a_held_spare_takes_its_content_over_loses_its_load(events):
    m = base(events)
    loaded(m)
    # w computes [7, 8] too (not reading the cache): block 2, a spare of y's block 0
    assert m.add_request("w", [7, 8, 2], read_cache=False) == Admission("w", (2, 1), 0, 3)
    m.free("y")
    assert m.add_request("z", [30, 31, 32]) == Admission("z", (3, 0), 0, 3)  # 0 evicted:
    assert m.lookup_block_ids([7, 8, 5]) == (2,)  # its content stays, in the spare
    m.check_invariants()
    assert m.take_kv_ops() == []                  # before: BlockLoads((0,), (0,)) into z's 0


def test_an_aborted_requests_loaded_block_taken_by_a_decode_loses_its_load(events):
    m = base(events)
    m.add_request("a", [0, 1])
    m.take_kv_ops()
    assert m.add_request("y", [7, 8, 1]) == Admission("y", (3, 2), 2, 1)
    m.free("y", num_computed_tokens=0)            # aborted: its hit stays findable
    assert m.add_request("z", [30, 31, 32]) == Admission("z", (2, 1), 0, 3)
    assert m.free_block_order() == [3]
    assert m.append_tokens("a", [5]) == (3,)      # a's new block: 3 evicted (``take_one``)
    m.check_invariants()
    assert m.take_kv_ops() == [BlockOffloads((3, 2, 1), (2, 3, 1))]  # before: a load into 3


def test_a_preempted_requests_loaded_block_as_a_forks_copy_destination_loses_its_load(events):
    m = base(events)
    m.add_request("a", [0])
    m.take_kv_ops()
    assert m.add_request("y", [7, 8, 1]) == Admission("y", (3, 2), 2, 1)
    assert m.preempt("y", num_computed_tokens=0) == (7, 8, 1)
    assert m.add_request("z", [30, 31, 32]) == Admission("z", (2, 1), 0, 3)
    assert m.fork("a", "b") == Fork("b", (3,), (BlockCopy(0, 3),))  # 3: the load's target
    m.check_invariants()
    assert m.take_kv_ops() == [BlockOffloads((3, 2, 1), (2, 3, 1)), BlockCopy(0, 3)]


def test_a_loaded_block_uncached_in_its_step_loses_its_load_before_it_goes_back(events):
    m = base(events)
    loaded(m)
    m.uncache_blocks([0])                         # y's hit declared invalid: no content
    assert m._host.load_dst == []                 # at once, while y still holds it
    m.free("y")
    # 3 and 0 empty, reused first, y's tail first (vLLM 0.33's free order)
    assert m.free_block_order() == [3, 0, 2, 1]
    assert m.add_request("z", [30, 31, 32]) == Admission("z", (3, 0), 0, 3)
    m.check_invariants()
    assert m.take_kv_ops() == [BlockOffloads((0, 3), (1, 2))]  # before: a load into z's 0


def test_a_loaded_block_rewound_in_its_step_is_computed_without_its_load(events):
    m = base(events)
    loaded(m)
    m.rewind("y", 0)                              # y recomputes from its first token
    assert m.extend("y", 3) == ()
    m.check_invariants()
    assert m.take_kv_ops() == [BlockOffloads((0, 3), (1, 2))]  # before: a load into 0


def test_a_reset_drops_the_steps_loads(events):
    m = base(events)
    loaded(m)
    m.free("y")
    assert m.reset_prefix_cache()
    assert m.free_block_order() == [3, 2, 1, 0]   # kept (y's partial 3 first, 0 last)
    # z takes every block, 0 (the load's target) too
    assert m.add_request("z", [30, 31, 32, 33, 34, 35, 36]) == Admission("z", (3, 2, 1, 0), 0, 7)
    m.check_invariants()
    assert m.take_kv_ops() == []
