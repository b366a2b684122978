"""The loads of a store run landed on the device: the fetcher lists the slots' and the
blocks' ids as tuples, which become the step's loads as they are when they are its first
(``HostTier.load_ids``), so that ``take_kv_ops`` hands them out without copying them
(``BlockLoads`` holds tuples) or freeing a list of them. Loads stated before or after
them in the same step (a host hit, another landing) join them in one ``BlockLoads``, in
the order stated. Block size 4, 8-byte payloads, fetches run when the test says."""

from prefixkv import BlockLoads, StoreWait
from prefixkv.event_log import NullSink
from prefixkv.tiers import HostTier

from .test_shared_store import A
from .test_store_fetch import setup

P = list(range(500, 509))  # two full blocks + 1, in no store


def _loads(ops):
    """The plan's loads (the payloads' ``StoreFetched`` come first: no memory attached)."""
    return [op for op in ops if isinstance(op, BlockLoads)]


def _admit(m, ex, rid, prompt):
    """``rid`` admitted (a store fetch started for it run and landed first: a miss)."""
    while isinstance(adm := m.add_request(rid, prompt), StoreWait):
        ex.run()
        m.poll_store()
    return adm


def _on_host(m, ex):
    """P computed, then evicted into host slots by a request that takes every block."""
    _admit(m, ex, "p", P)
    m.take_kv_ops()
    m.free("p")
    m.add_request("x", list(range(900, 929)), read_cache=False)
    m.take_kv_ops()
    m.free("x")
    m.take_kv_ops()
    assert m.lookup(P) == 8                         # (in host slots)


def _landed(m, ex, rid):
    """``rid``'s fetch of A run and landed on the device: its slots' and blocks' ids."""
    m.add_request(rid, A)
    f = m._waits.waiting[rid]
    slots, devices = [s.block_id for s in f.slots], [b.block_id for b in f.devices]
    ex.run()
    assert m.poll_store() == [rid]
    return slots, devices


def test_the_landed_runs_ids_are_the_plans_own(backend, layout):
    m, ex, _ = setup(backend, layout, host_blocks=8)
    slots, devices = _landed(m, ex, "b")
    src = m._host.load_src
    (op,) = _loads(m.take_kv_ops())
    assert op == BlockLoads(tuple(slots), tuple(devices))
    assert op.src is src                            # the fetcher's tuple, not a copy
    assert m.add_request("b", A).num_cached_tokens == 12
    m.check_invariants()


def test_a_host_hit_after_the_landing_joins_its_loads(backend, layout):
    m, ex, _ = setup(backend, layout, host_blocks=8)
    _on_host(m, ex)
    slots, devices = _landed(m, ex, "b")
    adm = _admit(m, ex, "p", P)                     # two host hits: loads after the run's
    assert adm.num_cached_tokens == 8 and m.stats.host_hits == 8
    (op,) = _loads(m.take_kv_ops())
    assert op.src[:3] == tuple(slots) and op.dst == (*devices, *adm.block_ids[:2])
    assert len(op.src) == 5
    m.check_invariants()


def test_a_landing_after_a_host_hit_joins_the_steps_loads(backend, layout):
    m, ex, _ = setup(backend, layout, host_blocks=8)
    _on_host(m, ex)
    m.add_request("b", A)                           # the fetch starts first
    f = m._waits.waiting["b"]
    slots, devices = [s.block_id for s in f.slots], [b.block_id for b in f.devices]
    adm = _admit(m, ex, "p", P)                     # the host hits' loads first
    ex.run()
    assert m.poll_store() == ["b"]
    (op,) = _loads(m.take_kv_ops())
    assert op.src[2:] == tuple(slots) and op.dst == (*adm.block_ids[:2], *devices)
    m.check_invariants()


def test_two_runs_landed_in_one_step_are_one_load_op():
    host = HostTier(8, NullSink())
    host.load_ids((1, 2), (3, 4))                  # the step's first: kept as they are
    host.load_ids((5,), (6,))                      # another run's: joined in new lists
    host.load_ids([7], [0])                        # (a list, as the fallback lists them)
    assert host.take_loads() == [BlockLoads((1, 2, 5, 7), (3, 4, 6, 0))]
    assert host.num_loaded == 4 and host.load_src == [] and host.load_dst == []
