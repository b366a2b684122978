"""Faults around the asynchronous fetch on a real Redis: executors that shut down while a
fetch is queued or under way, a store closed while a fetch runs. Each fetch must land (or
fail) exactly once, leaving no host slot reserved and no fetch in flight (else
``reset_prefix_cache`` refuses for ever). Block size 4, 8-byte payloads."""

import threading
from concurrent.futures import ThreadPoolExecutor

from prefixkv import KVCacheManager, StoreWait
from prefixkv.store import SharedStore
from waiting import LIVE, PATIENCE

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
