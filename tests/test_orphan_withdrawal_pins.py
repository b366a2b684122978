"""A step's offloads withdrawn with their lost ancestor (``SlotOffload._withdraw_orphans``)
keep the step's other pinned slots pinned, among them slots a rewind emptied in the
same step (``forget_under``: pinned, no content, counted in ``num_emptied``). Before
(deadload-r16, found by the late-plan state machine's ``a_hit_goes_in_its_step`` with a
host tier, shrunk by hand): the withdrawal rebuilt the pinned list from the slots with
content, so an emptied slot left every list of the tier, still counted 1 and counted
emptied: never reusable again (a host slot lost for good) and ``check_invariants``
failing ("0 pinned host slots hold no content, counted 1"). Block size 2, seed 0, a
pool of 8 blocks, a host tier of 4 slots; exact ids."""

from prefixkv import Admission, BlockOffloads, KVCacheManager


def test_a_slot_emptied_by_a_rewind_stays_pinned_when_offloads_are_withdrawn():
    m = KVCacheManager(8, 2, seed=0, host_blocks=4)
    m.add_request("a", [1, 2, 3, 4, 5])
    m.take_kv_ops()
    m.free("a")
    m.add_request("b", list(range(100, 113)))  # evicts a's [3, 4]: to slot 0
    assert m.take_kv_ops() == [BlockOffloads((1,), (0,))]
    m.free("b")
    # device hit [1, 2], host hit [3, 4] (slot 0, pinned, loaded into block 1); b's tail
    # block 7 is evicted for the partial block: to slot 1
    assert m.add_request("r", [1, 2, 3, 4, 9]) == Admission("r", (0, 1, 7), 4, 1)
    m.rewind("r", 0)  # [1, 2] leaves: slot 0's content under it goes (pinned, emptied)
    assert m.add_request("z", list(range(30, 40))) == Admission("z", (6, 5, 4, 3, 2), 0, 10)
    # b's blocks 6, 5 went to slots 2, 3, then 4 was lost (every slot pinned): the
    # offloads of its descendants (7, 6, 5) are withdrawn; slot 0 stays pinned
    m.check_invariants()
    assert m.take_kv_ops() == []  # (r's load from slot 0 left with its content)
    m.check_invariants()
    assert m._host.num_free == 4 and m._host.num_emptied == 0  # every slot back, empty
