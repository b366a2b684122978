"""A landed store run given up in its landing step (``uncache_blocks`` on one of its
blocks, before its request comes back) returns its blocks to the pool empty while their
loads are still in the step's one ``BlockLoads``. Found by this scenario (dupload-r15):
another admission in the same step took two of them as its host hits' load targets, and
the plan's ``BlockLoads`` wrote blocks 1 and 7 twice (``src=(2, 3, 4, 1, 0), dst=(0, 1,
7, 1, 7)``): an engine free to run the pairs in any order could serve the host hit the
store run's KV. The dead loads are dropped now (deadload-r16: when the blocks lose
their content, in ``uncache``); ``CopyPlan.check`` names a block the plan's loads write
twice."""

from prefixkv import BlockLoads, StoreWait

from .test_shared_store import A
from .test_store_fetch import setup
from .test_trust_scenarios import Engine

P = list(range(200, 209))                      # two full blocks + 1
Y = list(range(300, 329))                      # seven full blocks + 1


def _step(m, e, rid, prompt):
    adm = m.add_request(rid, prompt, read_cache=False)
    e.run()
    e.compute(prompt, adm.block_ids)
    m.free(rid)
    e.run()


def _given_up(backend, layout):
    """b's store run landed on the device (blocks ``devices``), its blocks 1, 2 given up
    in the landing step: they go back, empty, with their loads stated."""
    m, ex, _ = setup(backend, layout, host_blocks=12)
    e = Engine(m)
    _step(m, e, "p", P)                        # P computed, then offloaded by y's blocks
    _step(m, e, "y", Y)
    assert m.add_request("b", A) == StoreWait("b", 3)
    ex.run()
    assert m.poll_store() == ["b"]
    devices = [b.block_id for b in m._waits.waiting["b"].devices]
    m.uncache_blocks([devices[1]])             # the run's blocks 1, 2 go back, empty
    return m, ex, e, devices


def test_a_given_up_landed_blocks_pending_loads_are_not_run_into_a_host_hits_blocks(backend, layout):
    m, ex, e, devices = _given_up(backend, layout)
    c = m.add_request("c", P)
    assert c.num_cached_tokens == 8            # host hits
    assert set(c.block_ids[:2]) == set(devices[1:]), c   # the given-up blocks
    m.check_invariants()
    ops = m.take_kv_ops()
    (loads,) = [op for op in ops if isinstance(op, BlockLoads)]
    assert len(set(loads.dst)) == len(loads.dst), loads
    e.run(ops)
    for k, b in enumerate(c.block_ids[:2]):
        assert e.dev[b] == tuple(P[:(k + 1) * 4]), (k, b, e.dev[b])
    m.check_invariants()
    got = m.add_request("b", A)
    while isinstance(got, StoreWait):
        ex.run()
        m.poll_store()
        got = m.add_request("b", A)
    e.run()
    e.check_a_hits(got)
    m.check_invariants()


def test_a_given_up_landed_runs_blocks_computed_by_a_miss_carry_no_load(backend, layout):
    """The same give-up; a miss takes the given-up blocks to compute them (deadload-r16):
    the run's loads into them left the plan when they lost their content, not when they
    were handed out again (before: the plan still loaded them before the forward pass
    that computes them)."""
    m, _, e, devices = _given_up(backend, layout)
    z = m.add_request("z", list(range(500, 509)), read_cache=False)
    assert set(z.block_ids[:2]) == set(devices[1:]), z   # computed by z
    m.check_invariants()
    ops = m.take_kv_ops()
    (loads,) = [op for op in ops if isinstance(op, BlockLoads)]
    assert loads.dst == (devices[0],), loads   # the run's kept block alone
    e.run(ops)
    e.compute(list(range(500, 509)), z.block_ids)
    m.check_invariants()
