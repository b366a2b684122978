"""``preempt`` of a request waiting on the store (``StoreWait``): the wait ends as ``free``
ends it (the request holds nothing; its fetch still lands, as cached host content), and
the prompt comes back for ``add_request(..., resumed=True)``, which hits what landed.
Bad input raises before anything changes. Block size 4, 8-byte payloads; fetches run
when the test says."""

import pytest

from prefixkv import KVCacheManager, RequestError, StoreWait

from .test_shared_store import A
from .test_store_fetch import setup


def test_preempt_of_a_waiting_request_returns_its_prompt_and_ends_the_wait(backend, layout):
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    assert m.preempt("b") == tuple(A)
    m.check_invariants()
    assert m.num_free_blocks == 4 and m.stats.requests == 0   # (its fetch's blocks, until it lands)
    with pytest.raises(RequestError):                # it waits no more, and is not live
        m.free("b")
    ex.run()
    assert m.poll_store() == []                      # landed, nobody to tell
    assert m.num_free_blocks == 8
    m.check_invariants()
    adm = m.add_request("b", list(A), resumed=True)  # the engine re-admits it later
    assert adm is not None and not isinstance(adm, StoreWait)
    assert adm.num_cached_tokens == 12               # what the fetch landed, loaded
    assert m.stats.preempted_requests == 1
    m.free("b")
    m.take_kv_ops()
    m.check_invariants()


def test_preempt_of_a_waiting_request_before_its_fetch_ran_leaves_no_slot_held(backend, layout):
    """Preempted, re-admitted while the first fetch still runs: the second admission
    waits on a fetch of its own (the first one's slots stay reserved until it lands),
    and every reserved slot is accounted for and free again once both landed."""
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    m.preempt("b")
    got = m.add_request("b", A, resumed=True)
    assert got is None or isinstance(got, StoreWait)   # (4 slots: 3 reserved already)
    m.check_invariants()
    ex.run()
    ended = m.poll_store()
    assert ended == (["b"] if got is not None else [])
    m.check_invariants()
    adm = m.add_request("b", A, resumed=True)
    assert adm is not None and not isinstance(adm, StoreWait) and adm.num_cached_tokens == 12
    m.free("b")
    m.take_kv_ops()
    m.check_invariants()
    assert m._host.num_landing == 0 and m.num_free_blocks == 8


def test_preempt_of_a_waiting_request_checks_num_computed_tokens_first(backend, layout):
    """Nothing of a waiting request was scheduled: only 0 tokens can have been computed
    (``free`` says the same); the wait goes on after the error."""
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    for call in (m.preempt, m.free):
        with pytest.raises(RequestError, match="num_computed_tokens"):
            call("b", num_computed_tokens=4)
        assert m.add_request("b", A) == StoreWait("b", 3)   # waiting still
    assert m.preempt("b", num_computed_tokens=0) == tuple(A)
    ex.run()
    m.poll_store()
    m.check_invariants()


def test_free_and_preempt_of_an_unhashable_id_raise_request_error_while_one_waits(backend, layout):
    """With a request waiting, the waits' own lookup saw the id first: an unhashable one
    raised TypeError there instead of RequestError."""
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    for call in (m.free, m.preempt):
        with pytest.raises(RequestError, match="hashable"):
            call(["b"])
    assert m.add_request("b", A) == StoreWait("b", 3)
    ex.run()
    m.poll_store()


def test_a_manager_without_a_store_preempts_as_before():
    m = KVCacheManager(4, 4)
    m.add_request("a", [1, 2, 3, 4, 5])
    assert m.preempt("a") == (1, 2, 3, 4, 5)
    with pytest.raises(RequestError):
        m.preempt("a")
