"""prefixkv's HiSparse external loads in its state (``HiSparseState.load`` /
``finish_import``, groups/hisparse/imports.py) checked against the reference
(hisparse_import_model.py, itself checked against vLLM by test_vllm_hisparse_imports.py):
the same ops on both, and after each every block id of the request, its page sets (as
vLLM keeps them: an import's pages valid only once it is done, a whole tail page valid
while its restore is in flight), the pending import, the restores, both pools' free
counts and the copies sent; then the state's invariants. Needs no vLLM."""

from __future__ import annotations

from typing import Any

import pytest

from prefixkv.errors import RequestError
from prefixkv.groups.hisparse.row import CLEAN, IN_FLIGHT, UNPINNED
from prefixkv.groups.hisparse.state import HiSparseState

from .hisparse_import_model import IMPORT_SCENARIOS, ImportModel, import_state, reports, seeded_stream
from .hisparse_model import BS, MAX_LEN, cdiv


def state_of(s: HiSparseState, key: int) -> dict[str, Any]:
    """What ``import_state`` reads from the model, read from the state."""
    held = s.holds(key)
    host, indexer, row, hot, required = s.request(key) if held else ([], [], [], [], False)
    r = s.row(key) if held else None
    flight = {t: p for t, (k, p) in s.spills.flight.items() if k == key}
    pages = {st: set(r.pages(st)) if r else set() for st in (CLEAN, UNPINNED, IN_FLIGHT)}
    first = s.imports.first_page(key, BS)
    whole = {p for t, p in flight.items() if s.imports.restores.get(t, False)}
    valid = {p for p, b in enumerate(row) if not b and p >= first} | pages[CLEAN] | pages[UNPINNED] | whole
    return {"host_row": host, "indexer": indexer, "row": row, "hot": hot, "hot_required": required,
            "valid": valid, "pending": sorted(pages[IN_FLIGHT]), "pinned_clean": pages[CLEAN],
            "unpinned": pages[UNPINNED], "gpu_free": s.device.num_free, "host_free": s.host.num_free,
            "in_flight": s.spills.in_flight, "work": s.spills.has_work(),
            "import": s.imports.pending.get(key, 0),
            "restores": sorted(p for t, p in flight.items() if t in s.imports.restores)}


def run(num_blocks: int, host_blocks: int, hot_blocks: int, in_flight: int, prompt: int,
        ops: list[tuple[str, int]]) -> ImportModel:
    """``ops`` as test_vllm_hisparse_imports.py runs them, on the model and the state."""
    window = cdiv(min(in_flight, MAX_LEN), BS)
    m = ImportModel(num_blocks, host_blocks, hot_blocks, window)
    s = HiSparseState(num_blocks, host_blocks, hot_blocks, BS, window, MAX_LEN // BS)
    taken: list[Any] = []
    key, stepped = 0, False

    def free() -> None:
        nonlocal key
        if s.holds(key):
            s.free(key)
        m.free()
        key += 1

    for i, (op, arg) in enumerate(ops):
        if op == "load":
            if m.host_row:
                free()
            imported = min(abs(arg), prompt)
            got = s.load(key, imported, imported, prompt if arg < 0 else 0)
            assert got == m.load(imported, prompt if arg < 0 else 0), (i, op, arg)
            stepped = False
        elif op == "finish" and m.pending_import and not stepped:
            s.finish_import(key, bool(arg))
            m.finish(bool(arg))
            if arg:
                free()
            else:
                m.computed = min(m.computed, prompt - 1)
        elif op == "step" and m.computed < prompt and (not m.pending_import or arg % 4 == 0):
            total = min(m.computed + arg, prompt)
            got = s.allocate(key, total)
            if got:
                s.advance(key, total)
                stepped = True
            assert got == m.step(total), (i, op, arg)
        elif op in ("confirm", "halve"):
            assert [t for t, _, _ in s.take_copies()] == m.to_send, (i, op, arg)
            m.to_send = []
            assert s.report(*reports(m, op, arg)) == m.report(*reports(m, op, arg))
        elif op == "free":
            free()
        elif op == "take":
            taken += s.device.take(min(arg, s.device.num_free))
            m.take(len(taken) - len(m.taken))
        elif op == "give_back":
            s.device.free(taken)
            m.give_back()
            taken = []
        s.check_invariants(taken)
        assert state_of(s, key) == import_state(m), (i, op, arg)
    return m


@pytest.mark.parametrize(("shape", "ops", "expected"), IMPORT_SCENARIOS.values(), ids=list(IMPORT_SCENARIOS))
def test_import_scenarios_follow_the_reference(shape: Any, ops: Any, expected: set[str]) -> None:
    """Each scenario, with the events it must see (not vacuous)."""
    assert expected <= set(run(*shape, ops).seen)


@pytest.mark.parametrize("seed", range(40))
def test_seeded_import_streams_follow_the_reference(seed: int) -> None:
    shape, ops = seeded_stream(seed)
    run(*shape, ops)


def test_a_load_refuses_caller_mistakes_with_nothing_changed() -> None:
    s = HiSparseState(16, 12, 2, BS, 8, MAX_LEN // BS)
    assert s.load("a", 20, 20)
    before = (s.request("a"), s.device.free_order(), s.host.free_order(), dict(s.imports.pending))
    for call in (lambda: s.load("a", 16, 16), lambda: s.load("b", 0, 16), lambda: s.load("b", 17, 16),
                 lambda: s.need("b", 16, imported=-1)):
        with pytest.raises(RequestError):
            call()
    assert (s.request("a"), s.device.free_order(), s.host.free_order(), dict(s.imports.pending)) == before
    s.finish_import("b", failed=False)  # (no pending load: nothing)
    s.check_invariants()
