"""How the scheduler's thread makes a store fetch: ``new_fetch`` and ``store_wait`` (the
start's, without the class call's machine code) give the objects ``Fetch(...)`` and
``StoreWait(...)`` give, every field; the slots' views of attached memory are one
callable per ``attach`` (``FetchMemory.views``), shared by the fetches it starts, and the
next ``attach``'s memory is the next one's."""

from __future__ import annotations

import dataclasses

import pytest

from prefixkv import StoreWait
from prefixkv.core.store_memory import FetchMemory
from prefixkv.core.store_waits import store_wait
from prefixkv.store.fetch import Fetch, new_fetch


def fields(f: Fetch) -> dict[str, object]:
    return {name: getattr(f, name) for name in Fetch.__slots__ if hasattr(f, name)}


def test_new_fetch_sets_every_field_fetch_sets() -> None:
    def views(slots):
        return []

    def extras_of(a, b):
        return []

    args = ("r", object(), 2, b"p" * 32, [b"c"] * 4, [b""] * 4, ["s0", "s1"], [], 12.5, True,
            views, extras_of)
    made, called = new_fetch(*args), Fetch(*args)
    assert type(made) is Fetch
    a, b = fields(made), fields(called)
    a.pop("started"), b.pop("started")  # (the clock at each call)
    assert a == b and sorted(a) == sorted(set(Fetch.__slots__) - {"keys", "heads", "states",
                                                                 "lock", "started"})
    assert made.hits is not called.hits and made.held is not called.held  # (lists of its own)
    short = new_fetch(*args[:10])
    assert short.views is None and short.extras_of is None


def test_attached_memory_gives_one_views_callable_until_attached_again() -> None:
    mem = FetchMemory(8, 2)
    first = bytearray(16)
    mem.attach([[memoryview(first)[:8]], [memoryview(first)[8:]]], 0)
    (staged, views), (_, again) = mem.views(), mem.views()
    assert staged is False and views is again
    assert views([type("S", (), {"block_id": 1})()])[0][0].obj is first
    later = bytearray(16)
    mem.attach([[memoryview(later)[:8]], [memoryview(later)[8:]]], 0)
    _, now = mem.views()
    assert now is not views and now([type("S", (), {"block_id": 0})()])[0][0].obj is later
    assert views([type("S", (), {"block_id": 0})()])[0][0].obj is first  # (a fetch's own)


def test_store_wait_is_the_result_storewait_gives() -> None:
    """``store_wait`` (the start's answer, without the class call) equals
    ``StoreWait(...)``: every field written, frozen, hashed alike."""
    made, called = store_wait(("r", 1), 7), StoreWait(("r", 1), 7)
    assert type(made) is StoreWait and made == called and hash(made) == hash(called)
    assert {f.name for f in dataclasses.fields(StoreWait)} == {"request_id", "num_blocks"}
    assert repr(made) == repr(called)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.num_blocks = 8  # type: ignore[misc]
