"""prefixkv's HiSparse requests on their two pools (``groups.hisparse.state``) checked
against the reference of vLLM 0.33's page life-cycle (hisparse_model.py, itself checked
against vLLM's manager and coordinator by test_vllm_hisparse_reference.py): the same ops
on both, side by side, and after each every block id of the request (host row, indexer,
resident row, hot region), its page sets, both pools' free counts, the copies sent (ids
and blocks), the copies in flight and the blocks other users take must be the model's;
then the state's own invariants. Needs no vLLM."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from prefixkv.errors import RequestError
from prefixkv.groups.hisparse.row import CLEAN, IN_FLIGHT, UNPINNED
from prefixkv.groups.hisparse.state import HiSparseState

from .hisparse_cases import ALL, GATED, GATES, SCENARIOS, STREAMS
from .hisparse_model import BS, MAX_LEN, Model, cdiv, model_state


def state_of(s: HiSparseState, key: int, m: Model) -> dict[str, Any]:
    """What ``model_state`` reads from the model, read from the state."""
    host: list[int] = []
    indexer: list[int] = []
    row: list[int] = []
    hot: list[int] = []
    required = False
    pages: dict[Any, set[int]] = {CLEAN: set(), UNPINNED: set(), IN_FLIGHT: set()}
    valid: set[int] = set()
    if m.host_row:  # (the request holds blocks)
        host, indexer, row, hot, required = s.request(key)
        r = s.row(key)
        pages = {state: set(r.pages(state)) for state in pages}
        lost = {p for p, b in enumerate(row) if not b}
        valid = set(range(r.ready)) | pages[CLEAN] | pages[UNPINNED] | lost
    return {"host_row": host, "indexer": indexer, "row": row, "hot": hot, "hot_required": required,
            "valid": valid, "pending": sorted(pages[IN_FLIGHT]), "pinned_clean": pages[CLEAN],
            "unpinned": pages[UNPINNED], "gpu_free": s.device.num_free, "host_free": s.host.num_free,
            "in_flight": s.spills.in_flight, "work": s.spills.has_work()}


def host_of(m: Model, tid: int) -> int:
    """The host block of the model's copy ``tid``."""
    return m.orphans[tid][1] if tid in m.orphans else m.host_row[m.pending[tid]]


def run(num_blocks: int, host_blocks: int, hot_blocks: int, in_flight: int, prompt: int,
        ops: list[tuple[str, int]], lookahead: int = 0, fit_mask: int = 0) -> Model:
    """``ops`` as test_vllm_hisparse_reference.py runs them, on the model and the state."""
    window = cdiv(min(in_flight, MAX_LEN), BS)
    reprefill = max(lookahead - 1, 0)
    m = Model(num_blocks, host_blocks, hot_blocks, window, reprefill)
    s = HiSparseState(num_blocks, host_blocks, hot_blocks, BS, window, MAX_LEN // BS, reprefill)
    taken: list[Any] = []  # (the device blocks other users hold)
    key = 0
    for i, (op, arg) in enumerate(ops):
        full = prompt if fit_mask >> (i % 16) & 1 else 0  # (a step's gate)
        if op == "step":
            if m.computed == prompt:  # (the prompt is computed: nothing to step)
                continue
            total = min(m.computed + arg, prompt)
            got = s.allocate(key, total, full)
            if got:
                s.advance(key, total)
            assert got == m.step(total, full), (i, op, arg)
        elif op in ("confirm", "halve"):
            sent = s.take_copies()
            assert sent == [(t, m.block_of(t), host_of(m, t)) for t in m.to_send], (i, op, arg)
            m.to_send = []
            chosen = [t for k, t in enumerate(sorted([*m.pending, *m.orphans])) if arg >> (k % 16) & 1]
            enqueued = {t: 1 if op == "confirm" else 2 for t in chosen}
            assert s.report(enqueued, {t: 1 for t in chosen}) == m.report(enqueued, {t: 1 for t in chosen})
        elif op == "free":
            if m.host_row:
                s.free(key)
            m.free()
            key += 1
        elif op == "take":  # (other users of the device pool)
            taken += s.device.take(min(arg, s.device.num_free))
            m.take(len(taken) - len(m.taken))
            assert [b.block_id for b in taken] == m.taken, (i, op, arg)
        else:
            s.device.free(taken)
            m.give_back()
            taken = []
        assert state_of(s, key, m) == model_state(m), (i, op, arg)
        s.check_invariants(taken)
    return m


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenarios_follow_the_reference(name: str) -> None:
    shape, ops, expected = SCENARIOS[name]
    assert expected <= set(run(*shape, ops).seen)


@pytest.mark.parametrize("name", sorted(GATED))
def test_the_gate_and_lookahead_follow_the_reference(name: str) -> None:
    (*shape, lookahead, fit_mask), ops, expected = GATED[name]
    assert expected <= set(run(*shape, ops, lookahead, fit_mask).seen)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**STREAMS, **GATES)
def test_random_streams_follow_the_reference(num_blocks: int, host_blocks: int, hot_blocks: int,
                                             in_flight: int, prompt: int, ops: list[tuple[str, int]],
                                             lookahead: int, fit_mask: int) -> None:
    run(num_blocks, host_blocks, hot_blocks, in_flight, prompt, ops, lookahead, fit_mask)


def test_caller_mistakes_are_refused_with_nothing_changed() -> None:
    s = HiSparseState(16, 12, 1, BS, 4, MAX_LEN // BS)
    assert s.allocate("a", 40)
    before = (s.request("a"), s.device.free_order(), s.host.free_order())
    for call in (lambda: s.free("b"), lambda: s.advance("b", 16), lambda: s.allocate("a", 0),
                 lambda: s.request("b"), lambda: s.fits("a", 0)):
        with pytest.raises(RequestError):
            call()
    assert (s.request("a"), s.device.free_order(), s.host.free_order()) == before
    with pytest.raises(RequestError):
        HiSparseState(1, 12, 1, BS, 4, 8)
    assert ALL  # (the cases' mask, shared)


def test_a_full_pool_keeps_the_pages_pinned_until_the_request_goes() -> None:
    """vLLM's test_hisparse_full_pool_keeps_pages_pinned_until_preemption, on the state
    (its figures: 18 blocks in each pool, max_model_len 160, a 128-token request): the
    copies confirmed, the row reads no host (no hot region), so it keeps every page; the
    next token would need the hot region and does not fit; freed, another request fits."""
    s = HiSparseState(18, 18, 2, BS, cdiv(160, BS), 160 // BS)
    assert s.allocate("first", 128)
    s.advance("first", 128)
    copies = s.take_copies()
    assert len(copies) == 8 and s.report({t: 1 for t, _, _ in copies}, {t: 1 for t, _, _ in copies})
    assert s.device.num_free == 1 and s.request("first")[4]  # (asked for its hot region)
    assert 0 not in s.request("first")[2] and not s.device.unpinned
    assert not s.allocate("first", 129)
    s.free("first")
    assert s.allocate("second", 16)
    s.check_invariants()
