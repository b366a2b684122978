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
from hypothesis import strategies as st

from . import skip_module_without_vllm
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
        ops: list[tuple[str, int]]) -> Model:
    """``ops`` on vLLM's manager and on the model side by side, their states compared
    after each; the model at the end."""
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    manager = vllm_manager(hisparse_config(num_blocks, host_blocks, hot_blocks=hot_blocks),
                           max_model_len=MAX_LEN, max_in_flight_tokens=in_flight)
    coordinator = get_hisparse_coordinator(manager)
    req = make_request("r", list(range(prompt)))
    m = Model(num_blocks, host_blocks, hot_blocks, cdiv(min(in_flight, MAX_LEN), BS))
    taken: list[Any] = []
    for i, (op, arg) in enumerate(ops):
        if op == "step":
            total = min(m.computed + arg, prompt)
            if total == m.computed:
                continue
            got = manager.allocate_slots(req, total - m.computed)
            if got is not None:
                coordinator.advance_scheduled([(req.request_id, total)])
                req.num_computed_tokens = total
            assert (got is not None) == m.step(total), (i, op, arg)
        elif op == "confirm":  # every transfer sent; those of ``arg``'s bits confirmed
            sent = coordinator.build_offload_command().page_transfers
            assert [(t.transfer_id, t.resident_block_ids) for t in sent] == [
                (t, (m.block_of(t),)) for t in m.to_send], (i, op, arg)
            m.to_send = []
            chosen = [t for k, t in enumerate(sorted([*m.pending, *m.orphans])) if arg >> (k % 16) & 1]
            coordinator.update_spills({t: 1 for t in chosen}, {t: 1 for t in chosen})
            m.confirm(chosen)
        elif op == "free":
            manager.free(req)
            m.free()
            req = make_request(f"r{i}", list(range(prompt)))
        elif op == "take":
            n = min(arg, manager.block_pool.get_num_free_blocks())
            got = manager.block_pool.get_new_blocks(n)
            assert [b.block_id for b in got] == m.take(n), (i, op, arg)
            taken += got
        else:
            manager.block_pool.free_blocks(taken)
            taken = []
            m.give_back()
        assert vllm_state(manager, coordinator, req.request_id) == model_state(m), (i, op, arg)
    return m


ALL = 2**16 - 1
# (pool, host pool, hot blocks, max_in_flight_tokens, prompt), ops, what must happen
SCENARIOS = {
    "others-take-unpinned-pages": ((16, 12, 1, 16, 96), [
        ("step", 16), ("step", 16), ("step", 32), ("confirm", ALL), ("take", 12), ("give_back", 0),
        ("step", 32), ("confirm", ALL)], {"asked for hot", "unpinned", "lost"}),
    "own-growth-takes-unpinned-pages": ((12, 12, 1, 16, 96), [
        ("step", 16), ("step", 16), ("step", 32), ("confirm", ALL), ("step", 32), ("confirm", ALL)],
        {"unpinned", "lost"}),
    # pages clean before the hot region are unpinned at once when it comes, tail first:
    # the pool hands out page 2's block first
    "unpins-tail-first": ((24, 12, 1, 64, 128), [
        ("step", 48), ("confirm", ALL), ("step", 16), ("step", 16), ("take", 13)], {"unpinned", "lost"}),
    # the pool's free count at the watermark (3 of 32) asks for nothing; below it, it asks
    "pool-at-watermark": ((32, 12, 1, MAX_LEN, 128), [
        ("step", 96), ("take", 14), ("step", 16), ("step", 16)], {"asked for hot"}),
    # freed with a page in flight (its blocks wait for the copy), one unpinned (stays in
    # the pool, no one's), clean ones (unpinned now) and dirty ones; then a new request
    "free-mid-flight": ((16, 12, 1, 16, 96), [
        ("step", 16), ("step", 16), ("step", 32), ("confirm", 0b0111), ("step", 16), ("confirm", 0b10),
        ("free", 0), ("step", 48), ("confirm", ALL), ("take", 12), ("step", 16), ("confirm", ALL)],
        {"unpinned", "freed in flight"}),
    "host-pool-full": ((32, 3, 1, MAX_LEN, 64), [("step", 48), ("step", 32), ("step", 16)], {"host full"}),
    "pool-below-watermark": ((12, 12, 2, MAX_LEN, 96), [
        ("step", 64), ("step", 16), ("confirm", 5), ("step", 16), ("take", 1), ("give_back", 0),
        ("step", 16), ("confirm", ALL)], {"asked for hot", "gpu full"}),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenarios_follow_the_reference(name: str) -> None:
    shape, ops, expected = SCENARIOS[name]
    m = run(*shape, ops)
    assert expected <= set(m.seen), m.seen


STEP = st.tuples(st.just("step"), st.integers(1, 40))
CONFIRM = st.tuples(st.just("confirm"), st.integers(0, ALL))
OPS = st.lists(st.one_of(STEP, CONFIRM, STEP, CONFIRM, st.tuples(st.just("take"), st.integers(1, 12)),
                         st.tuples(st.just("give_back"), st.just(0)), st.tuples(st.just("free"), st.just(0))),
               min_size=4, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(10, 32), host_blocks=st.integers(4, 12), hot_blocks=st.integers(1, 3),
       in_flight=st.sampled_from([16, 32, 64, MAX_LEN]), prompt=st.integers(40, MAX_LEN), ops=OPS)
def test_random_streams_follow_the_reference(num_blocks: int, host_blocks: int, hot_blocks: int,
                                             in_flight: int, prompt: int, ops: list[tuple[str, int]]) -> None:
    run(num_blocks, host_blocks, hot_blocks, in_flight, prompt, ops)
