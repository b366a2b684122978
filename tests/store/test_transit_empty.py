"""A store run that landed on the device loaded from its host slots, which are in
transit (keyless) until the plan is drained; then they go empty. When the empty stack is
empty (the fetch took it whole), the transit list becomes the stack itself
(``HostTier._transit_done``): no copy of its entries, each a slot object cold after the
fetch. The list is the fetch's ``slots``: a re-admission of the fetch's request after
the device gave the run back must not read it (``store_reuse.reuse``). Block size 4,
8-byte payloads, fetches run when the test says (``Manual``)."""

from prefixkv import BlockLoads, StoreWait

from .test_shared_store import A
from .test_store_fetch import setup


def test_the_drained_transit_list_becomes_the_empty_stack(backend, layout):
    m, ex, _ = setup(backend, layout, host_blocks=3)   # A's 3 blocks: every slot
    assert m.add_request("b", A) == StoreWait("b", 3)
    f = m._waits.waiting["b"]
    slots = f.slots
    assert m._host._empty == []                     # the fetch took the stack whole
    ex.run()
    assert m.poll_store() == ["b"]
    order = [s.block_id for s in slots]
    m.take_kv_ops()                                 # the loads ran: the slots go empty
    assert m._host._empty is slots                  # the list itself, not a copy
    assert [s.block_id for s in m._host._empty] == order
    m.check_invariants()
    assert m.add_request("b", A).num_cached_tokens == 12
    m.check_invariants()


def test_a_run_given_back_and_evicted_is_found_where_it_went(backend, layout):
    """The run lands on the device, the re-admission finds the pool short (the fetch gives
    the run back, cached), other requests evict it (offloaded into the same slots, under
    the same content ids; the fetch's list is the empty stack by then): the next
    re-admission hits it in the host slots and loads them, as a walk does. (On main
    before this, ``reuse`` answered those slots and the admission took them for the
    fetch's device blocks: slot ids given as device blocks holding other KV, no load.)"""
    m, ex, _ = setup(backend, layout, host_blocks=3)
    m.add_request("b", A)
    ex.run()
    assert m.poll_store() == ["b"]
    m.take_kv_ops()
    m.add_request("h", list(range(50, 66)), read_cache=False)   # the pool's other 4 blocks
    assert m.add_request("b", A, num_lookahead_tokens=4) is None   # short: given back
    m.take_kv_ops()
    m.free("h")
    m.add_request("x", list(range(900, 932)), read_cache=False)   # every block: A's evicted
    m.take_kv_ops()                                 # (offloaded into the three slots)
    m.free("x")
    m.take_kv_ops()
    assert m.lookup(A) == 12                        # in the host slots now
    slots = [s.block_id for s in m._host.slots if s.key is not None]
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12 and m.stats.host_hits == 12
    assert m.take_kv_ops() == [BlockLoads(tuple(sorted(slots)), adm.block_ids[:3])]
    m.check_invariants()
