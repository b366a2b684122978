"""How a fetched run lands in host slots when a slot already holds other content under
the same token bytes (a block of the same tokens after another parent): the fetcher's
map of the run (``Fetch.keyed``) cannot be merged as it is, and the colliding slot is
keyed by its whole content instead; both contents stay findable, each under its own
parent. Block size 4, 8-byte payloads; fetches run when the test says."""

from prefixkv import BlockLoads, KVCacheManager, StoreWait
from prefixkv.store import SharedStore
from waiting import LIVE

from .conftest import always
from .test_shared_store import computed
from .test_store_fetch import Manual

X = [9, 9, 9, 9, 5, 6, 7, 8, 1]          # in the store: (9 9 9 9) under the root
Y = [1, 2, 3, 4, 9, 9, 9, 9, 0]          # in a host slot: (9 9 9 9) under (1 2 3 4)
Z = list(range(100, 125))                # 7 blocks: pushes Y's last block out of the device
C9 = bytes([9, 0, 0, 0] * 4)             # the token bytes of (9 9 9 9), uint32 little-endian
C5 = bytes([5, 0, 0, 0, 6, 0, 0, 0, 7, 0, 0, 0, 8, 0, 0, 0])


def test_a_run_whose_token_bytes_a_slot_holds_under_another_parent_lands_beside_it(backend, layout):
    computed(KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4,
                            store=SharedStore(backend, layout, cost=always(), timeout=LIVE)),
             backend, "w", X)
    ex = Manual()
    m = KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4,
                       store=SharedStore(backend, layout, cost=always(), timeout=LIVE, executor=ex))
    m.attach_host_memory([[memoryview(bytearray(8))] for _ in range(4)])
    m.add_request("y", Y, read_cache=False)
    m.take_kv_ops()
    m.free("y")
    m.add_request("z", Z, read_cache=False)          # evicts Y's (9 9 9 9) into slot 0
    assert m.take_kv_ops()[0].dst == (0,)
    m.free("z")
    m.take_kv_ops()
    y = m._host.slots[0]
    assert m._host.by_chunk[C9] is y and m.lookup(Y) == 8   # keyed by its token bytes
    assert m.add_request("x", X) == StoreWait("x", 2)  # (9 9 9 9) under the root: a miss
    ex.run()
    f = m._store.done[0]
    a, b = f.slots
    assert f.run == 2 and f.unique and f.keyed == {C9: a, C5: b}
    assert m.poll_store() == ["x"]
    m.check_invariants()
    assert m._host.by_chunk[C9] is y                 # Y's keeps the token bytes' entry
    assert a.key == (0, C9, b"") and m._host.by_key[a.key] is a   # X's: its whole content
    assert m._host.by_chunk[C5] is b
    assert m.lookup(Y) == 8 and m.lookup(X) == 8     # both, each under its own parent
    adm = m.add_request("x", X)
    assert adm.num_cached_tokens == 8
    assert m.take_kv_ops()[-1] == BlockLoads((a.block_id, b.block_id), tuple(adm.block_ids[:2]))
    m.check_invariants()
