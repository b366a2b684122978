"""FetchThreads: the store's default fetch runner. Calls run on its threads, not the
caller's; a call that raises leaves its thread running; ``shutdown`` waits for the calls
handed over before it and for those they hand over (a fetch's parts)."""

import threading
import time

from prefixkv.store import SharedStore
from prefixkv.store.threads import FetchThreads
from waiting import LIVE, PATIENCE

from .conftest import always
from .test_shared_store import A, computed, from_store, manager


def test_calls_run_on_the_threads_and_survive_an_error():
    ex = FetchThreads(2, name="t")
    seen, done = [], threading.Event()

    def boom():
        raise RuntimeError("a call's own failure")

    ex.submit(boom)
    ex.submit(boom)                                   # both threads raised once
    for i in range(4):
        ex.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
    ex.submit(done.set)
    assert done.wait(5)
    ex.shutdown()
    assert sorted(i for i, _ in seen) == [0, 1, 2, 3]
    assert {name for _, name in seen} <= {"t-0", "t-1"}
    assert threading.current_thread().name not in {name for _, name in seen}


def test_shutdown_waits_for_calls_handed_over_by_calls():
    ex = FetchThreads(2)
    order = []

    def part(i):
        time.sleep(0.05)
        order.append(i)

    def fetch():                                      # as StoreLink._run: parts first
        ex.submit(part, 1)
        ex.submit(part, 2)
        time.sleep(0.05)
        order.append(0)

    ex.submit(fetch)
    ex.shutdown()
    assert sorted(order) == [0, 1, 2]
    assert not any(t.is_alive() for t in ex._threads)


def test_a_store_fetches_on_its_threads_and_the_cost_is_fed_there(backend, layout):
    """The default runner is FetchThreads; the fit of the fetch's figures (FetchCost)
    is made by the fetcher, before the manager's thread lands the fetch."""
    shared = SharedStore(backend, layout, cost=always(), timeout=LIVE)
    computed(manager(shared), backend, "a", A)
    m = manager(shared)
    assert isinstance(shared.executor, FetchThreads)
    before, seen = shared.cost.measured_at, len(shared.cost._seen)   # (a's fetch: a miss)
    m.add_request("b", A)
    deadline = time.monotonic() + PATIENCE
    while not m._store.done:                          # ended, not landed yet
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert shared.cost.measured_at > before and len(shared.cost._seen) == seen + 1
    m.poll_store()
    assert m.add_request("b", A).num_cached_tokens == 12
    assert from_store(manager(shared), A) == 12
    shared.close()


def test_shutdown_waits_for_calls_handed_over_by_calls_handed_over_while_it_waits():
    """A chain three deep, each link handing over the next after the shutdown began:
    each is queued behind that round's fences, and a later round waits for it."""
    ex = FetchThreads(3)
    order = []

    def link(depth):
        time.sleep(0.02)
        if depth < 3:
            ex.submit(link, depth + 1)
            ex.submit(link, depth + 1)
        order.append(depth)

    ex.submit(link, 1)
    ex.shutdown()
    assert sorted(order) == [1, 2, 2, 3, 3, 3, 3]
    assert not any(t.is_alive() for t in ex._threads)


def test_shutdown_of_idle_threads_ends_them():
    ex = FetchThreads(2)
    ex.shutdown(wait=False)
    for t in ex._threads:
        t.join(5)
        assert not t.is_alive()


def test_a_second_shutdown_returns():
    ex = FetchThreads(2)
    ex.submit(time.sleep, 0.01)
    ex.shutdown()
    ex.shutdown()                                     # (the threads are gone: no fence is taken)
    ex.shutdown(wait=False)
