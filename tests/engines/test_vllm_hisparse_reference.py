"""A reference of vLLM 0.33's HiSparse page life-cycle, checked against vLLM's own
``KVCacheManager`` and ``HiSparseCoordinator`` (from the wheel), step by step on random
streams. prefixkv refuses HiSparse (docs/integration.md, "HiSparse"); this reference is
the specification a prefixkv HiSparse must meet. It tests no prefixkv code.

The model and its rules: tests/engines/hisparse_model.py. Needs vllm installed."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from . import skip_module_without_vllm
from .hisparse_cases import GATED, GATES, SCENARIOS, STREAMS
from .hisparse_model import BS, MAX_LEN, Model, cdiv, model_state

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_hisparse import hisparse_config, vllm_manager  # noqa: E402
from .test_vllm_plugin import request as make_request  # noqa: E402


def vllm_state(manager: Any, coordinator: Any, rid: str) -> dict[str, Any]:
    """What the model predicts, read from vLLM's manager and coordinator."""
    host, indexer, resident, hot = coordinator.managers
    state = coordinator.request_states.get(rid)
    return {"host_row": [b.block_id for b in host.req_to_blocks.get(rid, [])],
            "indexer": [b.block_id for b in indexer.req_to_blocks.get(rid, [])],
            "row": [b.block_id for b in resident.get_residency_row(rid)],
            "hot": [b.block_id for b in hot.req_to_blocks.get(rid, [])],
            "hot_required": rid in hot.hot_required,
            "valid": set(state.valid_pages) if state else set(),
            "pending": sorted(state.pending_pages) if state else [],
            "pinned_clean": set(state.pinned_clean) if state else set(),
            "unpinned": set(state.unpinned_pages) if state else set(),
            "gpu_free": manager.block_pool.get_num_free_blocks(),
            "host_free": coordinator.host_manager.block_pool.get_num_free_blocks(),
            "in_flight": len(coordinator.pending_spills), "work": coordinator.has_pending_work()}


def run(num_blocks: int, host_blocks: int, hot_blocks: int, in_flight: int, prompt: int,
        ops: list[tuple[str, int]], lookahead: int = 0, fit_mask: int = 0, seam: Any = None) -> Model:
    """``ops`` on vLLM's manager and on the model side by side, their states compared
    after each; the model at the end. ``lookahead``: vLLM's ``num_prefill_lookahead``;
    ``fit_mask``: the ``i``-th op, a step, asks that the whole request fit
    (``full_sequence_must_fit``) when bit ``i % 16`` is set. ``seam``: a class whose
    instance, made with vLLM's manager, sees each op too and checks prefixkv's answers
    against vLLM's (test_vllm_hisparse_seam.py)."""
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    manager = vllm_manager(hisparse_config(num_blocks, host_blocks, hot_blocks=hot_blocks),
                           max_model_len=MAX_LEN, max_in_flight_tokens=in_flight,
                           num_prefill_lookahead=lookahead)
    coordinator = get_hisparse_coordinator(manager)
    req = make_request("r", list(range(prompt)))
    m = Model(num_blocks, host_blocks, hot_blocks, cdiv(min(in_flight, MAX_LEN), BS), max(lookahead - 1, 0))
    taken: list[Any] = []
    check = seam(manager, coordinator, num_prefill_lookahead=lookahead) if seam else None
    for i, (op, arg) in enumerate(ops):
        if op == "step":
            total = min(m.computed + arg, prompt)
            if total == m.computed:
                continue
            fit = bool(fit_mask >> (i % 16) & 1)
            got = manager.allocate_slots(req, total - m.computed, full_sequence_must_fit=fit)
            if got is not None:
                coordinator.advance_scheduled([(req.request_id, total)])
                req.num_computed_tokens = total
            assert (got is not None) == m.step(total, prompt if fit else 0), (i, op, arg)
            if check:
                check.step(req.request_id, total, prompt if fit else 0, got is not None)
        elif op in ("confirm", "halve"):  # every transfer sent; those of ``arg``'s bits
            # reported by one worker ("confirm"), or enqueued by two, one completing
            sent = coordinator.build_offload_command().page_transfers
            assert [(t.transfer_id, t.resident_block_ids) for t in sent] == [
                (t, (m.block_of(t),)) for t in m.to_send], (i, op, arg)
            m.to_send = []
            chosen = [t for k, t in enumerate(sorted([*m.pending, *m.orphans])) if arg >> (k % 16) & 1]
            enqueued = {t: 1 if op == "confirm" else 2 for t in chosen}
            coordinator.update_spills(enqueued, {t: 1 for t in chosen})
            m.report(enqueued, {t: 1 for t in chosen})
            if check:
                check.report(sent, enqueued, {t: 1 for t in chosen})
        elif op == "free":
            manager.free(req)
            m.free()
            if check:
                check.free(req.request_id)
            req = make_request(f"r{i}", list(range(prompt)))
        elif op == "take":
            n = min(arg, manager.block_pool.get_num_free_blocks())
            got = manager.block_pool.get_new_blocks(n)
            assert [b.block_id for b in got] == m.take(n), (i, op, arg)
            taken += got
            if check:
                check.take(n)
        else:
            manager.block_pool.free_blocks(taken)
            taken = []
            m.give_back()
            if check:
                check.give_back()
        assert vllm_state(manager, coordinator, req.request_id) == model_state(m), (i, op, arg)
        if check:
            check.compare(req.request_id, m.computed)
    return m


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenarios_follow_the_reference(name: str) -> None:
    shape, ops, expected = SCENARIOS[name]
    m = run(*shape, ops)
    assert expected <= set(m.seen), m.seen


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**STREAMS)
def test_random_streams_follow_the_reference(num_blocks: int, host_blocks: int, hot_blocks: int,
                                             in_flight: int, prompt: int, ops: list[tuple[str, int]]) -> None:
    run(num_blocks, host_blocks, hot_blocks, in_flight, prompt, ops)


@pytest.mark.parametrize("name", sorted(GATED))
def test_the_full_sequence_gate_and_lookahead_follow_the_reference(name: str) -> None:
    (*shape, lookahead, fit_mask), ops, expected = GATED[name]
    m = run(*shape, ops, lookahead, fit_mask)
    assert expected <= set(m.seen), m.seen


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**STREAMS, **GATES)
def test_random_streams_with_the_gate_and_lookahead_follow_the_reference(
        num_blocks: int, host_blocks: int, hot_blocks: int, in_flight: int, prompt: int,
        ops: list[tuple[str, int]], lookahead: int, fit_mask: int) -> None:
    run(num_blocks, host_blocks, hot_blocks, in_flight, prompt, ops, lookahead, fit_mask)
