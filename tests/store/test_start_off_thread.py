"""A store fetch's start leaves the per-block lists it does not need to the fetcher: the
run's extra-key bytes (one entry per block, ``RequestKeys.of_blocks``) and the parts'
lock are made by ``prepare``, on the fetcher's thread (store25a-r21.md); the landing then
reads the bytes the fetcher listed, with multimodal keys after a device hit too. Block
size 4, 8-byte payloads, fetches run when the test says."""

from prefixkv import StoreWait
from prefixkv.extra_keys import ExtraKeys, MultiModalInput

from .test_shared_store import A
from .test_store_fetch import setup


def test_the_start_lists_no_extra_bytes_and_makes_no_lock_the_fetcher_does(backend, layout):
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    f = m._waits.waiting["b"]
    assert f.extras == [] and not hasattr(f, "lock")  # (nothing per block made at the start)
    ex.run()
    assert f.extras == [b""] * 3 and f.left == 0        # listed by ``prepare``, then read
    assert m.poll_store() == ["b"]
    m.check_invariants()
    assert m.add_request("b", A).num_cached_tokens == 12
    m.check_invariants()


def test_a_multimodal_run_after_a_device_hit_lands_under_its_own_blocks_bytes(backend, layout):
    """The fetcher lists the extra bytes of the run's blocks (from block ``first``, not
    from block 0): the run's hashes, heads and landed contents are those of blocks 1..2
    of a prompt whose image covers blocks 1..2 alone."""
    image = ExtraKeys(mm=(MultiModalInput("img", 5, 6),))   # in blocks 1..2
    m, ex, _ = setup(backend, layout, extra=image)
    m.add_request("d", A[:5], read_cache=False)         # block 0 (no image: the same
    m.take_kv_ops()                                      # content) computed on the device
    m.free("d")
    assert m.lookup(A, extra=image) == 4
    assert m.add_request("b", A, extra=image) == StoreWait("b", 2)
    f = m._waits.waiting["b"]
    assert f.first == 1 and f.extras == []
    ex.run()
    keys = m._waits.waiting["b"].req.keys
    assert f.extras == keys.of_blocks(1, 3) and f.extras[0] != keys.base
    assert f.run == 2                                   # the heads it checked were the right ones
    assert m.poll_store() == ["b"] and m.lookup(A, extra=image) == 12 and m.lookup(A) == 4
    m.check_invariants()                                # (the text-only blocks 1, 2: not landed)
    assert m.add_request("b", A, extra=image).num_cached_tokens == 12
    assert m.stats.store_hits == 8
    m.check_invariants()
