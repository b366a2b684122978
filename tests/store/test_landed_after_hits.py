"""A store run landed in host slots alone (the pool short at the fetch's start) whose
first blocks were computed on the device meanwhile lands past them only
(``store_landing.land``: ``lo`` > 0); the slots' ids the landing hands the host tier for
the step's loads are then the landed part's, not the whole run's. The re-admission
loads exactly the landed slots into its blocks after the device hit. Block size 4, A's
three blocks in the store, fetches run when the test says (``Manual``)."""

from prefixkv import BlockLoads, StoreWait

from .test_shared_store import A
from .test_store_fetch import setup


def test_a_run_landing_past_a_block_computed_meanwhile_loads_only_its_landed_slots(backend, layout):
    m, ex, _ = setup(backend, layout, host_blocks=4)
    m.add_request("h", list(range(50, 70)), read_cache=False)   # 5 of the pool's 8 blocks
    m.take_kv_ops()
    assert m.add_request("b", A) == StoreWait("b", 3)
    f = m._waits.waiting["b"]
    assert f.devices is None                          # the pool short: host slots alone
    m.add_request("c", A[:4] + [99], read_cache=False)   # A's first block, on the device
    m.take_kv_ops()
    ex.run()
    assert m.poll_store() == ["b"]
    m.check_invariants()
    m.free("h")
    m.take_kv_ops()
    c_first = m.get_block_ids("c")[0]
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12 and adm.block_ids[0] == c_first
    ops = m.take_kv_ops()
    loads = [op for op in ops if isinstance(op, BlockLoads)]
    assert len(loads) == 1 and len(loads[0].src) == len(loads[0].dst) == 2
    assert loads[0].dst == tuple(adm.block_ids[1:3])
    assert loads[0].src == tuple(s.block_id for s in f.slots[1:3])   # the landed part
    m.check_invariants()
