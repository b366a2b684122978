"""A block whose KV was never computed is never written to the store, even when the
same content is recorded again in the same block at once: ``free(num_computed_tokens=)``
drops the pending write of every block it makes unfindable. (Found by the trust
machine, seed 39516010170479146492639096883838730110: a request recorded a prompt's last
block, whose content a host slot kept, under the slot's content id ("one content, one
id"), and was aborted before its step ran; the next request recorded the same content
in the same block, under the same lent id, and the aborted request's pending write,
matched by block and content id, went out in that step's plan, before any forward pass
had computed the block: uncomputed KV under the content's key, served to every
replica.) Block size 4, a real Redis."""

from prefixkv import KVCacheManager, StorePut
from prefixkv.store import SharedStore

from .conftest import always

X = [9, 9, 9, 9, 5, 6, 7, 8]            # two full blocks: the last one is always computed


def puts(ops):
    return [op.src for op in ops if isinstance(op, StorePut)]


def test_an_aborted_blocks_pending_write_is_dropped_when_its_content_comes_back(backend, layout):
    shared = SharedStore(backend, layout, cost=always(), timeout=10.0)
    m = KVCacheManager(3, 4, hash_mode="sha256", host_blocks=4, store=shared)
    m.add_request("a", X, read_cache=False)
    m.take_kv_ops()                                  # a's step: computed
    assert puts(m.take_kv_ops()) == [0, 1]           # written
    m.free("a")
    m.add_request("z", list(range(100, 112)), read_cache=False)   # evicts X to the host
    m.take_kv_ops()
    m.free("z")
    m.take_kv_ops()
    assert m.lookup(X) == 4                          # (block 1 is never a hit: the last one)
    adm = m.add_request("b", X)                      # block 1 recorded, the slot's id lent
    assert adm.num_cached_tokens == 4
    b1 = adm.block_ids[1]
    assert not puts(m.take_kv_ops())                 # b's step: scheduled
    m.free("b", num_computed_tokens=4)               # aborted before it ran: block 1 never computed
    adm = m.add_request("c", X)                      # the same content in the same block
    assert adm.block_ids[1] == b1
    assert b1 not in puts(m.take_kv_ops())           # c's step: block 1 not computed yet
    assert puts(m.take_kv_ops()) == [b1]             # the next: computed, written
    m.check_invariants()




def _b_scheduled_under_a_lent_id(backend, layout):
    """As above up to b's step: b holds X, its block 1 recorded under the host slot's
    content id, scheduled; its pending write not gone out yet."""
    shared = SharedStore(backend, layout, cost=always(), timeout=10.0)
    m = KVCacheManager(3, 4, hash_mode="sha256", host_blocks=4, store=shared)
    m.add_request("a", X, read_cache=False)
    m.take_kv_ops()
    assert puts(m.take_kv_ops()) == [0, 1]
    m.free("a")
    m.add_request("z", list(range(100, 112)), read_cache=False)   # evicts X to the host
    m.take_kv_ops()
    m.free("z")
    m.take_kv_ops()
    adm = m.add_request("b", X)
    assert adm.num_cached_tokens == 4
    assert not puts(m.take_kv_ops())                 # b's step: scheduled
    return m, adm.block_ids[1]


def _recomputed_and_written_once(m, b1):
    assert m.extend("b", 4) == ()                    # recorded again at once, same block
    assert b1 not in puts(m.take_kv_ops())           # the step recomputing it: not yet
    assert puts(m.take_kv_ops()) == [b1]             # the next: recomputed, written
    m.check_invariants()


def test_a_rewound_blocks_pending_write_is_dropped_when_its_content_comes_back(backend, layout):
    # (mutants-r22: ``rewind`` without its ``_drop_puts`` survived every test) block 1's
    # KV, computed in b's step, turned out invalid
    m, b1 = _b_scheduled_under_a_lent_id(backend, layout)
    m.rewind("b", 4)
    _recomputed_and_written_once(m, b1)


def test_an_uncached_blocks_pending_write_is_dropped_when_its_content_comes_back(backend, layout):
    # (mutants-r22: ``uncache_blocks`` without its ``_drop_puts`` survived every test)
    # block 1 named invalid (a failed load) before the rewind that recomputes it
    m, b1 = _b_scheduled_under_a_lent_id(backend, layout)
    m.uncache_blocks([b1])
    m.rewind("b", 4)                                 # (its content gone: nothing to drop)
    _recomputed_and_written_once(m, b1)
