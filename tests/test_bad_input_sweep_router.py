"""The reviewer's sweep over the router's public calls (``prefixkv.router.Router``): a
router with requests in flight, a replica's cached blocks indexed and a load report,
given each argument of each call replaced by each value of tests/hostile.py: the call
either succeeds as on a twin router driven alike, or raises a ``PrefixKVError`` and the
router's deep fingerprint (tests/deep_fingerprint.py: index entries, in-flight queues,
loads, clocks) is unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from deep_fingerprint import fingerprint
from hostile import HOSTILE, outcome
from prefixkv.router import Removed, ReplicaLoad, Router, RouterError, Stored

Call = tuple[tuple[Any, ...], dict[str, Any]]


def _router() -> Router:
    """Two replicas; a's copy of a prompt's two blocks indexed, two requests in flight,
    a's load reported (its clock stands still: the fingerprint holds no instant)."""
    r = Router(["a", "b"], block_size=4, clock=lambda: 5.0)
    hashes = r.prompt_hashes(list(range(12)))
    r.apply("a", [Stored(tuple(hashes[:2]), None, "GPU")])
    r.route(list(range(12)))
    r.route(list(range(40, 52)))
    r.report_load("a", ReplicaLoad(0.5, 1, 10))
    return r


CALLS: dict[str, Callable[[], Call]] = {
    "route": lambda: ((list(range(12)),), {"extra": None}),
    "cached_tokens": lambda: ((list(range(12)),), {"extra": None}),
    "prompt_hashes": lambda: ((list(range(12)),), {"extra": None}),
    "finish": lambda: (("a",), {}),
    "forget": lambda: (("a",), {}),
    "lost": lambda: (("a",), {}),
    "drop_load": lambda: (("a",), {}),
    "scored_group": lambda: (("a",), {}),
    "report_load": lambda: (("b", ReplicaLoad(0.25, 0, 0)), {"read_at": 4.0}),
    "apply": lambda: (("a", []), {}),
}


def _variants(name: str) -> list[tuple[str, Callable[[], Call]]]:
    args0, kw0 = CALLS[name]()
    slots = [*range(len(args0)), *kw0]
    out = []
    for slot in slots:
        for label, value in HOSTILE.items():
            def make(slot: int | str = slot, value: Callable[[], Any] = value) -> Call:
                args, kw = CALLS[name]()
                if isinstance(slot, str):
                    return args, {**kw, slot: value()}
                return args[:slot] + (value(),) + args[slot + 1:], kw
            out.append((f"{name} {slot}={label}", make))
    return out


@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_bad_argument_of_a_router_call_is_a_typed_error_before_any_change(name):
    problems = []
    for label, variant in _variants(name):
        def call(router: Router, variant: Callable[[], Call] = variant) -> object:
            args, kw = variant()
            return getattr(router, name)(*args, **kw)
        problem = outcome(_router(), _router(), call, fingerprint)
        problems += [f"{label}: {problem}"] if problem else []
    assert problems == []


@pytest.mark.parametrize("replica", [["a"], {"a": 1}, {"a"}, bytearray(b"a")])
def test_an_unhashable_replica_name_is_a_router_error(replica):
    """``_known`` asked ``replica in self.in_flight`` first: an unhashable name raised
    the dict's TypeError out of every call that takes a replica."""
    ours, twin = _router(), _router()
    for call in (ours.finish, ours.forget, ours.lost, ours.drop_load, ours.scored_group):
        with pytest.raises(RouterError, match="replica"):
            call(replica)
    with pytest.raises(RouterError, match="replica"):
        ours.apply(replica, [])
    with pytest.raises(RouterError, match="replica"):
        ours.report_load(replica, ReplicaLoad(0.25, 0, 0))
    assert fingerprint(ours) == fingerprint(twin)


def _event_variants() -> list[tuple[str, Callable[[], Any]]]:
    """Hand-built ``Stored`` and ``Removed`` events, each field replaced by each value
    of tests/hostile.py (the decoder checks the fields of events from the wire; these
    reach ``Router.apply`` from an engine's glue code)."""
    good: dict[str, tuple[type, dict[str, Any]]] = {
        "Stored": (Stored, dict(hashes=(7, 8), parent=None, medium="GPU", group=0,
                                kind="full_attention", window=None, block_size=4)),
        "Removed": (Removed, dict(hashes=(7,), medium="GPU", group=0)),
    }
    out = []
    for tag, (cls, fields) in good.items():
        for field in fields:
            for label, value in HOSTILE.items():
                def make(cls: type = cls, fields: dict[str, Any] = fields, field: str = field,
                         value: Callable[[], Any] = value) -> Any:
                    return cls(**{**fields, field: value()})
                out.append((f"{tag}.{field}={label}", make))
    return out


def test_every_bad_field_of_a_hand_built_event_is_a_router_error_before_any_change(caplog):
    """``apply`` checked that each event is a ``Stored``, ``Removed`` or ``Cleared`` but not
    its fields: ``hashes=5``, a list ``medium``, an array ``group`` reached the index and
    raised its TypeError (a non-int ``block_size`` also broke the ``%d`` of the mismatch
    warning). Each is a RouterError now, the router unchanged; the rest apply as on a twin."""
    problems = []
    for label, make in _event_variants():
        def call(router: Router, make: Callable[[], Any] = make) -> object:
            return router.apply("a", [Stored((9,), None, "GPU"), make()])
        problem = outcome(_router(), _router(), call, fingerprint)
        problems += [f"{label}: {problem}"] if problem else []
    assert problems == []
    assert "Logging error" not in caplog.text
