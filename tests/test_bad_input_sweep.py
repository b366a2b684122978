"""Every argument of every public call of ``KVCacheManager`` and ``HybridKVCacheManager``,
one at a time, replaced by a bad value (wrong types, negative and huge counts, unknown
ids, a live id as a new one, bad token ids, NaN, objects): the call either succeeds or
raises a ``PrefixKVError`` (a ``ValueError``), and then changed nothing.

"Changed nothing" is checked against a twin: two managers built and driven alike
(sha256: equal hashes), the bad call made on one; then both must agree on every
observable (free-block order, each request's blocks and counts, stats, the events and
the plan drained next), and ``check_invariants()`` holds. A call that succeeds is made
on the twin too."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from prefixkv import KVCacheManager, PrefixKVError, RequestError
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window

BAD: list[Any] = [None, -1, 0, 1.5, math.nan, 2**70, -(2**70), True, "x", b"ab", [], [-1], [2**32],
                  [1.5], ["x"], [None], [True], {"a": 1}, {1, 2}, object(), "live", "chunked", "gone"]


def _core() -> KVCacheManager:
    return KVCacheManager(16, 4, hash_mode="sha256", enable_events=True, vocab_size=1000)


def _hybrid() -> HybridKVCacheManager:
    return HybridKVCacheManager([full_attention(), sliding_window(8)], 24, 4, hash_mode="sha256",
                                enable_events=True, vocab_size=1000)


def _drive(m: Any) -> Any:
    """A manager in a state with something of everything: a live decoding request, a
    request whose prompt is scheduled in chunks, cached blocks of a freed one."""
    m.add_request("gone", list(range(9)))
    m.free("gone")
    m.add_request("live", list(range(10)))
    m.append_tokens("live", [7])
    m.add_request("chunked", list(range(20, 33)), num_new_tokens=4)
    m.take_events()
    m.take_stats()
    m.take_kv_ops()
    return m


def _observed(m: Any) -> tuple[Any, ...]:
    live = {}
    for rid in ("live", "chunked", "new", "child", 7, ("t",)):
        try:
            live[rid] = (m.get_block_ids(rid), m.num_tokens(rid), m.num_scheduled_tokens(rid))
        except RequestError:
            pass
    return (m.free_block_order(), m.num_free_blocks, m.num_cached_blocks, live, m.take_stats(),
            m.take_events(), m.take_kv_ops())


# call name -> (positional args, keyword args) of a valid call on a driven manager
CALLS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "add_request": (("new", list(range(14))), {"extra": None, "num_new_tokens": 5, "resumed": False,
                                               "read_cache": True, "num_lookahead_tokens": 1,
                                               "require_full_fit": False, "keep_free": 1}),
    "extend": (("chunked", 4), {}),
    "append_tokens": (("live", [3, 4]), {}),
    "append_step": ((["live"], [3]), {}),
    "reserve": (("live", 2), {}),
    "fork": (("live", "child"), {}),
    "free": (("live",), {"num_computed_tokens": 11}),
    "preempt": (("live",), {"num_computed_tokens": 8}),
    "lookup": ((list(range(9)),), {"extra": None}),
    "lookup_block_ids": ((list(range(9)),), {"extra": None}),
    "cached_block_id": ((list(range(9)), 8), {"extra": None}),
    "cached_block_ids": ((list(range(9)), 8), {"extra": None}),
    "prepare": ((list(range(9)),), {"extra": None}),
    "get_block_ids": (("live",), {}),
    "num_tokens": (("live",), {}),
    "num_scheduled_tokens": (("live",), {}),
    "shared_prefixes": ((["live", "chunked"],), {}),
    "uncache_blocks": (([0, 1],), {}),
    "ref_cnt": ((1,), {}),
    "held_content": ((1,), {}),
    "held_contents": (([1, 2],), {}),
    "num_blocks_to_allocate": (("live", 16), {}),
    "num_blocks_released": (("live",), {}),
    "release_unread": (("live",), {}),
    "bound_release": (("live", 8), {}),
    "rewind": (("live", 9), {}),
}
HYBRID_ONLY_MISSING = {"shared_prefixes", "cached_block_id"}
HYBRID_ONLY = {"num_blocks_to_allocate", "num_blocks_released", "release_unread", "bound_release", "rewind",
               "cached_block_ids"}
# keywords only the hybrid manager's call takes (a valid value each)
HYBRID_KW: dict[str, dict[str, Any]] = {"add_request": {"num_external_tokens": 4}}


def _variants(name: str, hybrid: bool) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """The call with each argument in turn replaced by each bad value."""
    args, kw = CALLS[name]
    if hybrid:
        kw = {**kw, **HYBRID_KW.get(name, {})}
    out = []
    for i in range(len(args)):
        out += [(f"{name} arg{i}={v!r}", args[:i] + (v,) + args[i + 1:], kw) for v in BAD]
    for k in kw:
        out += [(f"{name} {k}={v!r}", args, {**kw, k: v}) for v in BAD]
    return out


def _sweep(make: Callable[[], Any], name: str) -> list[str]:
    problems = []
    for label, args, kw in _variants(name, make is _hybrid):
        ours, twin = _drive(make()), _drive(make())
        try:
            getattr(ours, name)(*args, **kw)
        except PrefixKVError:
            if _observed(ours) != _observed(twin):
                problems.append(f"{label}: raised, but the state changed")
        except Exception as e:  # noqa: BLE001 (the point: which untyped errors escape)
            problems.append(f"{label}: {type(e).__name__}: {e}")
        else:
            getattr(twin, name)(*args, **kw)  # a valid call: the twin follows
            if _observed(ours) != _observed(twin):
                problems.append(f"{label}: succeeded, but not as its twin did")
        try:
            ours.check_invariants()
        except Exception as e:  # noqa: BLE001
            problems.append(f"{label}: invariants broken: {e}")
    return problems


@pytest.mark.parametrize("name", sorted(set(CALLS) - HYBRID_ONLY))
def test_every_bad_argument_of_the_core_manager_is_a_typed_error_before_any_change(name):
    assert _sweep(_core, name) == []


@pytest.mark.parametrize("name", sorted(set(CALLS) - HYBRID_ONLY_MISSING))
def test_every_bad_argument_of_the_hybrid_manager_is_a_typed_error_before_any_change(name):
    assert _sweep(_hybrid, name) == []


@pytest.mark.parametrize("pending", [None, 1, "x", [], object()])
def test_a_non_bool_pending_is_a_typed_error_before_the_plan_is_taken(pending):
    """``take_kv_ops(pending=...)`` is a switch: anything but True or False is a caller's
    mistake, refused with the plan left in place (as ``add_request``'s switches are)."""
    ours, twin = _drive(_core()), _drive(_core())
    ours.add_request("new", list(range(14)))
    twin.add_request("new", list(range(14)))
    with pytest.raises(PrefixKVError, match="pending"):
        ours.take_kv_ops(pending=pending)
    assert _observed(ours) == _observed(twin)
