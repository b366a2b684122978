"""The landing of a store fetch asks what the device and host hold now up to the run's
first block (``store_landing.land``): the start's hits may have moved meanwhile, and the
run's first content may have come by another way. Each test moves one of them between
the start and the landing (another request admitted in between, as an engine's step
would) and checks that the landing sees it, whether it walks the index or concludes
from the start's hits that nothing moved: a run landed on the device beside a copy of
its own content breaks the index (``check_invariants``) and the block ids a lookup
gives. Block size 4; A's three blocks in the store.

(A landing that took the start's hits, found still holding their contents, instead of
its walk was tried in session 18: each test fails with the hits taken unchecked; with
the checks, the walk's probes, they saved nothing measurable: store-r18.md.)"""

from .test_device_landing import _first_block_in_a_slot
from .test_shared_store import A
from .test_store_fetch import setup


def test_a_host_hit_the_start_took_up_is_shared_meanwhile_not_loaded_again(backend, layout):
    """Block 0 in a slot (the start's host hit): the start takes it up into a device
    block the fetch holds; before the landing another request hits that block on the
    device (not the slot: no second copy of it), and the run lands after it on the
    device. (Before store25b-r21 the landing took the slot up: that request loaded it
    into a block of its own, and the run then landed in its slots alone.)"""
    m, ex, _ = setup(backend, layout)
    _first_block_in_a_slot(m)
    assert m.add_request("b", A).num_blocks == 2
    f = m._waits.waiting["b"]
    (up,) = f.held
    assert f.promoted == 1
    c = m.add_request("c", A[:5])                    # block 0: the fetch's block, shared
    assert c.num_cached_tokens == 4 and c.block_ids[0] == up.block_id
    m.check_invariants()
    ex.run()
    assert m.poll_store() == ["b"]
    m.check_invariants()
    assert f.on_device == 2                          # the run on the device, after it
    assert m.lookup_block_ids(A) == (up.block_id, *(b.block_id for b in f.devices))
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12 and adm.block_ids[0] == up.block_id
    m.check_invariants()
    for rid in ("b", "c"):
        m.free(rid)
    m.check_invariants()


def test_the_runs_first_content_computed_meanwhile_is_not_landed_twice(backend, layout):
    """Block 0 on the device (the start's held hit), blocks 1-2 fetched; before the
    landing another request computes block 1 after that hit: the run lands from block 2
    on, in a slot, and the device keeps block 1 where that request computed it."""
    m, ex, _ = setup(backend, layout)
    m.add_request("d", A[:5], read_cache=False)
    m.take_kv_ops()
    m.free("d")                                      # block 0 cached on the device
    assert m.add_request("b", A).num_blocks == 2
    f = m._waits.waiting["b"]
    (b0,) = f.held
    assert f.promoted == 0 and len(f.devices) == 2
    c = m.add_request("c", A[:8])                    # hits block 0, computes block 1
    assert c.num_cached_tokens == 4
    c1 = m._get("c").blocks[1]
    m.take_kv_ops()
    m.check_invariants()
    ex.run()
    assert m.poll_store() == ["b"]
    m.check_invariants()
    assert f.devices is None                         # the run did not land on the device
    assert m.lookup_block_ids(A) == (b0.block_id, c1.block_id)
    assert m.lookup(A) == 12                         # block 2 in a slot
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12 and adm.block_ids[:2] == (b0.block_id, c1.block_id)
    m.check_invariants()
    for rid in ("b", "c"):
        m.free(rid)
    m.check_invariants()


def test_a_run_whose_first_content_reached_a_slot_meanwhile_lands_past_it(backend, layout):
    """Block 0 on the device (the start's held hit), blocks 1-2 fetched; before the
    landing block 1 is computed by another request, then evicted into a host slot: the
    run lands from block 2 on, the slot keeps block 1."""
    m, ex, _ = setup(backend, layout, host_blocks=6)
    m.add_request("d", A[:5], read_cache=False)
    m.take_kv_ops()
    m.free("d")                                      # block 0 cached on the device
    assert m.add_request("b", A).num_blocks == 2
    f = m._waits.waiting["b"]
    (b0,) = f.held
    m.add_request("c", A[:8])                        # hits block 0, computes block 1
    m.take_kv_ops()
    m.take_kv_ops()
    m.free("c")
    m.add_request("z", list(range(100, 113)), read_cache=False)   # evicts block 1 to a slot
    m.take_kv_ops()
    m.take_kv_ops()
    m.free("z")
    m.take_kv_ops()
    assert m.lookup(A[:9]) == 8 and m.lookup_block_ids(A[:9]) == (b0.block_id,)
    m.check_invariants()
    ex.run()
    assert m.poll_store() == ["b"]
    m.check_invariants()
    assert f.devices is None and m.lookup(A) == 12
    assert m.lookup_block_ids(A) == (b0.block_id,)
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12
    m.check_invariants()
    m.free("b")
    m.check_invariants()

