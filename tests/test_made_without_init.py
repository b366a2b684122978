"""``Request``, ``Run`` and ``StoredRun`` have no ``__init__`` (a class called with one
enters the interpreter again from C: benchmarks/results/events-r22.md): every slot of
each, made by its factory or set in place by the admission path, holds its value (a slot
never set raises AttributeError when read), and the factories and the admission path
agree on them."""

from __future__ import annotations

from array import array

import pytest

from prefixkv import KVCacheManager
from prefixkv.core.block import Block
from prefixkv.core.request import PLAIN_KEYS, Request, new_request
from prefixkv.core.run import Run, RunCounts, new_run
from prefixkv.index.announce import StoredRun, stored_run


def _slots(obj: object) -> dict[str, object]:
    return {name: getattr(obj, name) for cls in type(obj).__mro__
            for name in getattr(cls, "__slots__", ())}


@pytest.mark.parametrize("cls", [Request, Run, StoredRun])
def test_the_class_has_no_init_of_its_own(cls: type) -> None:
    assert all("__init__" not in c.__dict__ for c in cls.__mro__[:-1])


def test_the_factories_set_every_slot() -> None:
    req = new_request("r", array("I", [1, 2, 3]), PLAIN_KEYS)
    assert _slots(req) == {"request_id": "r", "tokens": array("I", [1, 2, 3]),
                           "keys": PLAIN_KEYS, "blocks": [], "num_cached": 0,
                           "num_scheduled": 0, "num_reserved": 0, "prompt_chunks": None,
                           "prompt": None, "prompt_hashes": None}
    counts, blocks = RunCounts(), [Block(4), Block(5)]
    run = new_run(blocks, b"ab", b"x", 3, 2, counts, 9)
    assert _slots(run) == {"blocks": blocks, "data": b"ab", "extra": b"x", "ok": 3, "seen": 2,
                           "n": 0, "shared": False, "fwd": False, "linked": False,
                           "counts": counts, "pending": False, "pcid": 9, "cid0": 0}
    sr = stored_run(None, None, blocks, [b"a", b"b"], [b"", b""], None, 2, 16,  # type: ignore[arg-type]
                    {1: Block(6)})
    assert _slots(sr)["count"] == 1 and _slots(sr)["first"] == 2 and _slots(sr)["bs"] == 16
    assert stored_run(None, None, blocks, [], [], None, 0, 16, None).count == 1  # type: ignore[arg-type]
    assert stored_run(None, None, [Block(i) for i in range(3)], [], [], None, 0, 16,  # type: ignore[arg-type]
                      {1: Block(6)}).count == 2  # (split around the spare)


def test_the_admission_path_sets_every_slot_as_the_factories_do() -> None:
    m = KVCacheManager(64, 4, seed=0, enable_events=True)
    m.add_request("a", m.prepare(list(range(1, 23))))  # 5 full blocks: a run of 4 after the first
    req = m._requests["a"]
    got = _slots(req)
    assert got["request_id"] == "a" and got["num_cached"] == 0
    assert got["num_scheduled"] == got["num_reserved"] == 22 and len(got["blocks"]) == 6
    assert got["prompt_chunks"] is got["prompt"] is got["prompt_hashes"] is None
    head = req.blocks[0]
    run = head.starts
    assert type(run) is Run
    want = _slots(new_run(req.blocks[1:5], run.data, run.extra, run.ok, run.seen, run.counts,
                          run.pcid))
    want.update(n=1, shared=True, linked=True, pending=run.pending, cid0=run.cid0)
    assert _slots(run) == want
    (sr,) = m._events._events  # type: ignore[union-attr]
    assert type(sr) is StoredRun
    made = stored_run(sr.hasher, sr.parent, sr.blocks, sr.chunks, sr.extras, sr.extra, sr.first,
                      sr.bs, sr.spares)
    assert _slots(sr) == _slots(made) and sr.blocks == req.blocks[:5] and sr.count == 1
    m.free("a")
    m.add_request("b", m.prepare(list(range(1, 23))))  # a hit on the run: claimed whole
    assert m.get_block_ids("b")[:5] == tuple(b.block_id for b in req.blocks[:5])
    assert m.take_events() is not None
