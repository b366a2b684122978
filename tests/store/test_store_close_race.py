"""``SharedStore.close()`` racing an admission, on a real Redis: the admission took the
store's fetch threads, then ``close`` stopped them before its fetch was handed over.
That fetch must not sit behind the stop signal (never run: its request waits out the
deadline and its host slots stay reserved for good); it is refused, and the admission
ends at once as a miss with its slots free."""

import threading

from prefixkv import StoreWait
from prefixkv.store import SharedStore
from prefixkv.store.threads import FetchThreads

from .conftest import always
from .test_shared_store import A, computed, manager

TIMEOUT = 0.3  # the store's fetch deadline: a fetch that never runs is given up after it


class ClosedUnderfoot(SharedStore):
    """A store whose ``close`` runs (to its end) between an admission's taking of the
    fetch threads and its handing the fetch over: the interleaving of a ``close`` on
    another thread, forced."""

    race = False

    @property
    def executor(self):
        ex = SharedStore.executor.fget(self)
        if self.race:
            self.race = False
            self.close()
        return ex


def test_a_fetch_handed_over_after_shutdown_is_refused_not_queued():
    ex = FetchThreads(2)
    ex.shutdown()
    ran = threading.Event()
    try:
        ex.submit(ran.set)
    except RuntimeError:
        pass
    else:  # before: queued behind the stop signals, run by no thread, and no error
        assert ran.wait(5), "a call accepted after shutdown never ran"


def test_close_racing_an_admission_ends_its_wait_as_a_miss(backend, layout):
    shared = ClosedUnderfoot(backend, layout, cost=always(), timeout=TIMEOUT)
    computed(manager(shared), backend, "a", A)       # the store holds A's 3 blocks
    m = manager(shared)
    free = m._host.num_free
    errors = m.stats.store_errors
    shared.race = True
    adm = m.add_request("b", A)
    # before: a StoreWait whose fetch never ran; after its deadline the request computed,
    # but its 3 host slots stayed reserved (no thread was left to return them)
    assert not isinstance(adm, StoreWait)
    assert adm.num_cached_tokens == 0
    assert m._host.num_free == free
    assert (m.stats.store_errors, m._waits.in_flight, m._waits.reserved) == (errors + 1, 0, 0)
    m.check_invariants()
    shared.close()
