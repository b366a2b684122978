"""Faults around the asynchronous fetch on a real Redis: executors that shut down while a
fetch is queued or under way, a store closed while a fetch runs. Each fetch must land (or
fail) exactly once, leaving no host slot reserved and no fetch in flight (else
``reset_prefix_cache`` refuses for ever). Block size 4, 8-byte payloads."""

import threading
from concurrent.futures import ThreadPoolExecutor

from prefixkv import KVCacheManager, StoreWait
from prefixkv.store import SharedStore
from waiting import LIVE, PATIENCE, wait_until

from .conftest import always
from .test_shared_store import A, computed


def stored(backend, layout):
    """A store holding A's three blocks, written by another manager."""
    computed(KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4,
                            store=SharedStore(backend, layout, cost=always(), timeout=LIVE)),
             backend, "w", A)


def waiting_manager(backend, layout, executor, **kw):
    shared = SharedStore(backend, layout, cost=always(), timeout=LIVE, executor=executor, **kw)
    return KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4, store=shared), shared


def test_an_executor_shut_down_with_a_fetch_queued_still_lands_it(backend, layout):
    """A ``ThreadPoolExecutor`` shut down (``wait=False``) runs what was queued, but
    refuses what that hands over: the fetch's first call raised at the submission of its
    second part, so the fetch never ended: its slots stayed reserved and it stayed in
    flight for ever."""
    stored(backend, layout)
    ex = ThreadPoolExecutor(1)
    gate = threading.Event()
    ex.submit(gate.wait, PATIENCE)                   # the thread is busy: the fetch queues
    m, _ = waiting_manager(backend, layout, ex, connections=2)
    assert m.add_request("b", A) == StoreWait("b", 3)
    ex.shutdown(wait=False)                          # the engine exits; queued calls still run
    gate.set()
    ex.shutdown(wait=True)                           # (joins: what it ran has ended)
    assert len(m._waits.link.done) == 1
    assert m.poll_store() == ["b"]
    assert m._host.num_landing == 0 and m._waits.in_flight == 0
    assert m.add_request("b", A).num_cached_tokens == 12
    m.check_invariants()
    m.free("b")
    assert m.reset_prefix_cache()


def test_a_store_closed_while_a_fetch_runs_waits_for_all_its_parts(backend, layout, monkeypatch):
    """``SharedStore.close`` drops its threads before it waits for them; a fetch that was
    preparing then handed its later parts to ``store.executor``, which started a new
    set of threads: ``close`` returned with parts still to read, and left threads behind."""
    import prefixkv.store.link as link_module

    stored(backend, layout)
    gate, preparing = threading.Event(), threading.Event()
    prepare = link_module.prepare

    def held(*args):
        preparing.set()
        assert gate.wait(PATIENCE)
        return prepare(*args)

    monkeypatch.setattr(link_module, "prepare", held)
    m, shared = waiting_manager(backend, layout, None, connections=2)
    threads = shared.executor
    assert m.add_request("b", A) == StoreWait("b", 3)
    assert preparing.wait(PATIENCE)
    closing = threading.Thread(target=shared.close)
    closing.start()
    wait_until(lambda: shared._executor is None, "close to begin")
    gate.set()
    closing.join(PATIENCE)
    assert not closing.is_alive()
    assert shared._executor is None                  # no new threads started
    assert all(not t.is_alive() for t in threads._threads)
    assert len(m._waits.link.done) == 1              # every part was read before close returned
    assert m.poll_store() == ["b"] and m._host.num_landing == 0
    assert m.add_request("b", A).num_cached_tokens == 12
    m.check_invariants()
