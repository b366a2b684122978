"""``max_hit_tokens`` with a shared store: a capped admission fetches nothing past the
cap, and a capped re-admission after a fetch landed walks the index (the landed run
may reach past the cap) rather than take ``StoreWaits.reuse``'s answer. A real Redis
(conftest), block_size 4."""

from prefixkv import StoreWait

from .test_readmit_reuse import BS, P, landed, manager, stored, taken  # noqa: F401 (a fixture)


def test_a_capped_admission_fetches_nothing_past_the_cap(backend, shared):
    m = manager(shared)
    m.add_request("d", P[:9], read_cache=False)             # blocks 0 and 1 on the device
    m.take_kv_ops()
    m.free("d")
    stored(shared, backend, P)                              # every block in the store
    adm = m.add_request("r", P, max_hit_tokens=2 * BS + 3)  # the device's run reaches the cap
    assert not isinstance(adm, StoreWait) and adm.num_cached_tokens == 2 * BS
    assert m.stats.store_hits == 0
    m.check_invariants()


def test_a_capped_readmission_walks_and_keeps_below_the_cap(backend, shared, taken):  # noqa: F811
    stored(shared, backend, P)
    m = manager(shared)
    landed(m, "r", P)                                       # 5 blocks fetched
    adm = m.add_request("r", P, max_hit_tokens=3 * BS)
    assert taken == [] and adm.num_cached_tokens == 3 * BS
    m.check_invariants()
