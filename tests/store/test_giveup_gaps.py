"""Cases of a store fetch's give-up (``core/store_giveup.py``) no test reached
(landing-r21's mutation pass): once the run landed, a block found invalid is given back
at once, with every block after it, the fetch's landed part (``on_device``, ``cids``)
cut to the blocks before it; a held device hit found invalid after the landing takes
the whole run with it. Block size 4, A's three blocks in the store."""

from prefixkv import StoreWait

from .test_shared_store import A
from .test_store_fetch import setup
from .test_trust_scenarios import computed_and_fetching


def test_a_landed_runs_last_block_found_invalid_is_given_back_and_the_rest_kept(
        backend, layout):
    """A's run landed in device blocks 0-2 (no device hit before it); block 2 is named
    invalid before b comes back: the fetch keeps blocks 0-1 (two of its three content
    ids: the re-admission's store hits), gives block 2 back at once."""
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    f = m._waits.waiting["b"]
    d0, d1, d2 = f.devices
    ex.run()
    assert m.poll_store() == ["b"]
    m.take_kv_ops()
    planned = f.cids
    assert len(planned) == 3 and f.on_device == 3
    m.uncache_blocks([d2.block_id])
    m.check_invariants()
    assert f.on_device == 2 and f.cids == planned[:2]
    assert m._waits.held.holds() == [d0, d1] and d2.ref_cnt == 0
    adm = m.add_request("b", A)
    assert adm.block_ids[:2] == (d0.block_id, d1.block_id) and adm.num_cached_tokens == 8
    assert m.stats.store_hits == 8
    m.check_invariants()


def test_a_held_hit_found_invalid_after_the_landing_takes_the_run_with_it(backend, layout):
    """q's fetch holds r's blocks (A's first two) and landed A's third block after them;
    r's second block is then named invalid: the fetch keeps r's first block alone,
    gives the second (r's still) and the landed block back at once."""
    m, ex, e, r = computed_and_fetching(backend, layout)
    f = m._waits.waiting["q"]
    b0, b1 = f.held
    ex.run()
    assert m.poll_store() == ["q"]
    e.run()
    (d,) = f.devices
    m.uncache_blocks([b1.block_id])
    m.check_invariants()
    assert f.held == [b0] and f.devices is None and f.on_device == 0 and not f.cids
    assert m._waits.held.holds() == [b0]
    assert (b0.ref_cnt, b1.ref_cnt, d.ref_cnt) == (2, 1, 0)      # (r's, and the fetch's)
    m.rewind("r", 4)
    q = m.add_request("q", A)
    assert q.num_cached_tokens == 4 and q.block_ids[0] == b0.block_id
    m.check_invariants()


def test_a_shorter_landed_runs_block_found_invalid_gives_back_only_landed_blocks(
        backend, layout):
    """The store holds A's blocks 0-1 of the three fetched: they land in device blocks
    0-1, block 2 goes back empty at the landing. Block 1 named invalid: the fetch gives
    it back and keeps block 0; block 2, the pool's already, is not given back again."""
    m, ex, _ = setup(backend, layout, A[:9])          # (the writer computes blocks 0-1)
    assert m.add_request("b", A) == StoreWait("b", 3)
    f = m._waits.waiting["b"]
    d0, d1, d2 = f.devices
    ex.run()
    assert m.poll_store() == ["b"] and f.on_device == 2 and d2.ref_cnt == 0
    m.uncache_blocks([d1.block_id])
    m.check_invariants()
    assert m._waits.held.holds() == [d0, *f.tail] and (d1.ref_cnt, d2.ref_cnt) == (0, 0)
    assert m.add_request("b", A).num_cached_tokens == 4
    m.check_invariants()


def test_a_fetch_in_flight_that_keeps_a_valid_hit_goes_on_waiting(backend, layout):
    """q's fetch (not run yet) holds r's two blocks; r's second is named invalid: the
    fetch keeps the first and q goes on waiting (only a fetch left with no valid hit
    ends its request's wait)."""
    m, ex, _, r = computed_and_fetching(backend, layout)
    f = m._waits.waiting["q"]
    m.uncache_blocks([r.block_ids[1]])
    assert len(f.held) == 1 and not f.expired
    assert m.poll_store() == []
    ex.run()
    assert m.poll_store() == ["q"]
    m.check_invariants()
