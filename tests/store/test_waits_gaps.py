"""Cases of ``StoreWaits`` no test reached (landing-r21's mutation pass over
``core/store_waits.py``). Block size 4, A's three blocks in the store, 8 device blocks,
fetches run when the test says."""

from prefixkv import StoreWait

from .test_shared_store import A
from .test_store_fetch import setup


def test_a_readmission_the_pool_refuses_gives_the_fetchs_blocks_back_once(backend, layout):
    """A's run landed in blocks 0-2, block 3 taken at the start for the token after it;
    x holds the other four. b's re-admission with 8 lookahead tokens does not fit: the
    fetch gives its blocks back (the run stays cached), its empty block 3 too, and
    forgets them; b, admitted again once x left, walks to the cached run (the fetch's
    blocks are not its own any more) and takes one more block, none given back twice."""
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    f = m._waits.waiting["b"]
    assert [b.block_id for b in f.devices] == [0, 1, 2] and [b.block_id for b in f.tail] == [3]
    ex.run()
    assert m.poll_store() == ["b"]
    m.take_kv_ops()
    assert m.add_request("x", list(range(100, 113)), read_cache=False).block_ids == (4, 5, 6, 7)
    assert m.num_free_blocks == 0
    assert m.add_request("b", A, num_lookahead_tokens=8) is None
    assert m.num_free_blocks == 4 and not f.tail and not f.up and m._waits.holds() == []
    m.check_invariants()
    m.free("x")
    assert m.num_free_blocks == 8
    adm = m.add_request("b", A)
    assert adm.block_ids == (0, 1, 2, 7) and adm.num_cached_tokens == 12
    assert m.num_free_blocks == 4
    m.check_invariants()
    m.free("b")
    assert m.num_free_blocks == 8
    m.check_invariants()
