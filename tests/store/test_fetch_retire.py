"""A re-admission that takes its store fetch's blocks hands the fetch's per-block lists
to the fetcher threads to free (``StoreLink.retire``): the scheduler's thread drops
none of them (store-r17.md: ~18 us at a 2048-block hit). The next fetch's start frees
them on its thread; without one, at most ``RETIRED_MAX`` fetches are kept."""

from prefixkv import KVCacheManager, StoreWait
from prefixkv.store import SharedStore
from prefixkv.store import link as link_module
from waiting import LIVE

from .conftest import always
from .test_shared_store import computed
from .test_store_fetch import Manual

PROMPTS = [list(range(1 + 100 * i, 14 + 100 * i)) for i in range(4)]   # three full blocks + 1


def _setup(backend, layout, n):
    """A store holding the first ``n`` prompts' blocks, and a manager (room for all of
    them at once) whose fetches run when the test says."""
    writer = KVCacheManager(8 * n, 4, hash_mode="sha256", host_blocks=4 * n,
                            store=SharedStore(backend, layout, cost=always(), timeout=LIVE))
    for i, p in enumerate(PROMPTS[:n]):
        computed(writer, backend, f"w{i}", p)
    ex = Manual()
    shared = SharedStore(backend, layout, cost=always(), timeout=LIVE, executor=ex)
    m = KVCacheManager(8 * n, 4, hash_mode="sha256", host_blocks=4 * n, store=shared)
    return m, ex


def test_the_readmission_leaves_the_fetch_to_the_next_fetchs_thread(backend, layout):
    m, ex = _setup(backend, layout, 2)
    assert m.add_request("a", PROMPTS[0]) == StoreWait("a", 3)
    f = m._waits.waiting["a"]
    slots, devices = f.slots, f.devices
    ex.run()
    assert m.poll_store() == ["a"]
    adm = m.add_request("a", PROMPTS[0])
    assert adm.num_cached_tokens == 12
    assert [(g, lists) for g, lists in m._store.retired] == [(f, (devices,))]
    assert f.devices is None and f.blocks is None and not f.held   # the request's now
    assert f.slots is slots                          # (its lists: not dropped here)
    m.check_invariants()
    assert m.add_request("b", PROMPTS[1]) == StoreWait("b", 3)
    assert len(m._store.retired) == 1                # freed when the fetch runs: on its thread
    ex.run()
    assert not m._store.retired
    assert m.poll_store() == ["b"]
    assert m.add_request("b", PROMPTS[1]).num_cached_tokens == 12
    m.check_invariants()
    m.free("a")
    m.free("b")
    m.check_invariants()


def test_without_a_fetch_started_at_most_retired_max_are_kept(backend, layout, monkeypatch):
    monkeypatch.setattr(link_module, "RETIRED_MAX", 2)
    m, ex = _setup(backend, layout, 4)
    waits = []
    for i, p in enumerate(PROMPTS):
        assert m.add_request(i, p) == StoreWait(i, 3)
        waits.append(m._waits.waiting[i])
    ex.run()
    assert sorted(m.poll_store()) == [0, 1, 2, 3]
    for i, p in enumerate(PROMPTS):
        assert m.add_request(i, p).num_cached_tokens == 12
        assert [g for g, _ in m._store.retired] == waits[max(0, i - 1):i + 1]   # the oldest freed
    m.check_invariants()
