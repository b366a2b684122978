"""A store fetch's start takes the request's host hits before its run up into device
blocks the fetch holds (``store_landing.promote``: their loads in the start's plan).
The re-admission counts them as host hits (``stats.host_hits``) whatever became of the
run: landed on the device, or not (a lost race, a failed check), when the request then
hits those blocks on the device (before store25b-r22 only a run landed on the device
counted them; otherwise they were counted as device hits). Block size 4, A's three
blocks in the store, block 0 in a host slot."""

import pytest

from prefixkv import KVCacheManager, StoreWait
from prefixkv.store import SharedStore
from waiting import LIVE

from .conftest import always
from .test_device_landing import _first_block_in_a_slot
from .test_shared_store import A, computed
from .test_store_fetch import Manual, setup


def started(m):
    """Block 0 put in a slot, then b's start: the fetch and the block it took block 0 up
    into."""
    _first_block_in_a_slot(m)
    assert m.add_request("b", A) == StoreWait("b", 2)
    f = m._waits.waiting["b"]
    assert f.promoted == 1 and len(f.held) == 1
    return f, f.held[0]


def test_a_host_hit_taken_up_counts_when_the_run_lost_the_race(backend, layout):
    """Another request computes block 1 after the fetch's block 0 before the landing:
    the run lands from block 2 in a slot; the re-admission hits block 0 (taken up from
    the slot for it), block 1 (computed) and block 2 (fetched)."""
    m, ex, _ = setup(backend, layout)
    f, up = started(m)
    assert m.add_request("c", A[:8]).num_cached_tokens == 4      # block 0: the fetch's
    m.take_kv_ops()
    ex.run()
    assert m.poll_store() == ["b"] and f.devices is None          # in its slots alone
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12 and adm.block_ids[0] == up.block_id
    assert (m.stats.hits, m.stats.host_hits, m.stats.store_hits) == (4 + 12, 4, 4)
    m.check_invariants()


@pytest.mark.parametrize("bad", [1, 2])
def test_a_host_hit_taken_up_counts_when_the_run_failed_its_check(backend, layout, bad):
    """Block ``bad`` of the store fails its check. Bad 1: nothing after block 0 lands;
    the re-admission hits block 0 on the device, the block taken up from the slot for
    it (counted as a device hit before this). Bad 2: block 1 lands on the device, after
    block 0, which the landing counted already (``-Fetch.promoted``): counted once."""
    puts = computed(KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4,
                                   store=SharedStore(backend, layout, cost=always(), timeout=LIVE)),
                    backend, "w", A)
    backend.client.set(puts[bad].key, b"not a value")
    ex = Manual()
    m = KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4,
                       store=SharedStore(backend, layout, cost=always(), timeout=LIVE, executor=ex))
    f, up = started(m)
    ex.run()
    assert f.run == bad - 1
    assert m.poll_store() == ["b"]
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 4 * bad and adm.block_ids[0] == up.block_id
    assert (m.stats.host_hits, m.stats.store_hits) == (4, 4 * (bad - 1))
    m.check_invariants()
