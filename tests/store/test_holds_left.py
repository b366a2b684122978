"""A store fetch that holds no device block any more is no longer among
``FetchHolds.holders``: not after its request's re-admission took its blocks, nor after
it gave them back (the pool short at the re-admission). A fetch left there would be
walked by every ``uncache`` and give-up (``store_giveup.py``, ``invalidation.py``) and
kept alive for the manager's life. Block size 4, A's three blocks in the store, fetches
run when the test says (``Manual``)."""

from prefixkv import StoreWait

from .test_shared_store import A
from .test_store_fetch import setup


def _landed(backend, layout):
    """A manager whose fetch for b (A's 3 blocks, on the device) landed; the fetch."""
    m, ex, _ = setup(backend, layout, host_blocks=3)
    assert m.add_request("b", A) == StoreWait("b", 3)
    f = m._waits.waiting["b"]
    assert m._waits.held.holders == {f}               # the run's blocks and the tail
    ex.run()
    assert m.poll_store() == ["b"]
    return m, f


def test_a_fetch_whose_blocks_the_readmission_took_holds_nothing(backend, layout):
    m, _ = _landed(backend, layout)
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12
    assert m._waits.held.holders == set()             # the request holds them now
    assert m._waits.held.holds() == []
    m.check_invariants()


def test_a_fetch_that_gave_its_blocks_back_holds_nothing(backend, layout):
    m, _ = _landed(backend, layout)
    m.take_kv_ops()
    m.add_request("h", list(range(50, 66)), read_cache=False)   # the pool's other 4 blocks
    assert m.add_request("b", A, num_lookahead_tokens=4) is None   # short: given back
    assert m._waits.held.holders == set()             # the run stays cached, unheld
    assert m._waits.held.holds() == []
    m.check_invariants()
    m.free("h")
    assert m.add_request("b", A).num_cached_tokens == 12
    assert m._waits.held.holders == set()
    m.check_invariants()


def test_a_fetch_whose_run_lost_the_race_holds_nothing_once_landed(backend, layout):
    # c computes A while b's fetch runs: the landing finds c's blocks, so the run lands
    # in the host slots alone and the fetch's device blocks go back, all of them
    m, ex, _ = setup(backend, layout, host_blocks=3)
    assert m.add_request("b", A) == StoreWait("b", 3)
    m.add_request("c", A, read_cache=False)
    m.take_kv_ops()
    ex.run()
    assert m.poll_store() == ["b"]
    assert m._waits.held.holders == set()
    assert m._waits.held.holds() == []
    m.check_invariants()
    assert m.add_request("b", A).num_cached_tokens == 12
    m.check_invariants()


def test_a_landed_fetch_that_gave_up_its_whole_run_holds_nothing(backend, layout):
    # the run landed on the device; its first block turns out invalid before b's
    # re-admission: the fetch gives the whole run up (``store_giveup._cut`` at 0)
    m, f = _landed(backend, layout)
    m.take_kv_ops()
    m.uncache_blocks([f.devices[0].block_id])
    assert m._waits.held.holders == set()
    assert m._waits.held.holds() == []
    m.check_invariants()
