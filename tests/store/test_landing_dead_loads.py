"""A store fetch's run landing on the device states the loads of its slots into the
device blocks its start took (``store_landing._on_device``: ``HostTier.load_ids``). A
block the start took may have been a load target earlier in the same step: a landed
run's, whose request was freed before the step ran (its blocks cached, their loads
still in the plan), evicted by the start. That load is dead, and one plan must not
write a block twice (``HostTier.load`` drops such loads; ``load_ids`` does not). Found
by ``test_store_overlap.py``'s state machine (store25-r16, on main at 37f1486): R0 (a
fetch of prompt 1's first block into block 5, slot 3) lands after R1's run, landed in
blocks 3-5 and freed in the same step: the plan's loads are ``src=[2, 1, 0, 3], dst=[3,
4, 5, 5]``. Fixed where the load dies (deadload-r16): the start's eviction of block 5 takes the
dead load out of the plan (``tiers/host_loads.py``), so the landing's load is the
block's only one."""

import uuid

from prefixkv import BlockLoads, StoreWait
from prefixkv.store import SharedStore, StoreLayout
from waiting import wait_until

from .conftest import always
from .test_shared_store import computed, manager

PROMPTS = [list(range(1000 * k + 1, 1000 * k + 14)) for k in range(3)]   # three blocks + 1


def test_a_landing_drops_the_steps_dead_loads_into_its_blocks(backend):
    shared = SharedStore(backend, StoreLayout(f"t-{uuid.uuid4().hex}", "float32", 8),
                         cost=always(), timeout=10.0)
    writer = manager(shared, num_blocks=16)
    for k, p in enumerate(PROMPTS):
        computed(writer, backend, f"w{k}", p)
    m = manager(shared, num_blocks=8, host_blocks=4)
    m.attach_host_memory([[memoryview(bytearray(8))] for _ in range(4)])
    n = [0]

    def admit(k):
        rid = f"r{n[0]}"
        n[0] += 1
        adm = m.add_request(rid, PROMPTS[k])
        if isinstance(adm, StoreWait):
            link = m._store
            wait_until(lambda: len(link.done) >= m._waits.in_flight, "the fetch's end")
            m.poll_store()
            adm = m.add_request(rid, PROMPTS[k])
        m.check_invariants()
        return rid, adm

    m.free(admit(0)[0])
    m.take_kv_ops()
    m.free(admit(2)[0])                  # (its loads stay in the step's plan: dead)
    admit(0)
    admit(0)
    admit(1)                             # its run lands in a block those loads wrote
    (loads,) = [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)]
    assert len(set(loads.dst)) == len(loads.dst), loads
