"""prefixkv's HiSparse seam (integrations/vllm/hisparse.py: ``HiSparseSeam``, a
``HiSparseCoordinator`` over ``HiSparseState``) against vLLM 0.33's own coordinator, side by
side on the reference's cases (test_vllm_hisparse_reference.py's ``run``, which drives
vLLM's manager and the model): after each op, the requests' block ids per group, both
pools' free counts, the offload commands (every field of each page transfer), pending
work and whether the request reads only resident pages must be vLLM's. Then what the seam
refuses, by name. Needs vllm installed."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm
from .hisparse_cases import GATED, GATES, SCENARIOS, STREAMS

skip_module_without_vllm()

from prefixkv.integrations.vllm.hisparse import HiSparseSeam, hisparse_state  # noqa: E402
from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV  # noqa: E402

from .hisparse_model import MAX_LEN  # noqa: E402
from .test_vllm_hisparse import hisparse_config, vllm_manager  # noqa: E402
from .test_vllm_hisparse_reference import run  # noqa: E402
from .test_vllm_plugin import request as make_request  # noqa: E402


class SeamCheck:
    """The seam beside vLLM's ``manager`` and ``coordinator``: each op of ``run`` on it too,
    and its answers compared with vLLM's."""

    def __init__(self, manager: Any, coordinator: Any, num_prefill_lookahead: int) -> None:
        self.manager, self.coordinator = manager, coordinator
        cfg = manager.kv_cache_config
        self.seam = HiSparseSeam(hisparse_state(
            cfg, manager.max_model_len, enable_caching=False, num_prefill_lookahead=num_prefill_lookahead,
            max_in_flight_tokens=manager.coordinator.single_type_managers[2].max_admission_blocks_per_request
            * cfg.kv_cache_groups[2].kv_cache_spec.block_size))
        self.state = self.seam.state
        self.taken: list[Any] = []

    def step(self, rid: str, total: int, full: int, got: bool) -> None:
        assert self.state.allocate(rid, total, full) == got
        if got:
            self.seam.advance_scheduled([(rid, total)])

    def report(self, sent: list[Any], enqueued: dict[int, int], completed: dict[int, int]) -> None:
        assert self.seam.build_offload_command().page_transfers == sent
        self.seam.update_spills(enqueued, completed)

    def free(self, rid: str) -> None:
        if self.state.holds(rid):
            self.state.free(rid)

    def take(self, n: int) -> None:
        self.taken += self.state.device.take(n)

    def give_back(self) -> None:
        self.state.device.free(self.taken)
        self.taken = []

    def compare(self, rid: str, computed: int) -> None:
        groups = self.coordinator.managers
        ids = tuple([b.block_id for b in g.req_to_blocks.get(rid, [])] for g in groups)
        ids = (ids[0], ids[1], [b.block_id for b in groups[2].get_residency_row(rid)], ids[3])
        mine = self.state.request(rid)[:4] if self.state.holds(rid) else ([], [], [], [])
        assert mine == ids
        assert self.state.device.num_free == self.manager.block_pool.get_num_free_blocks()
        assert self.state.host.num_free == self.coordinator.host_manager.block_pool.get_num_free_blocks()
        assert self.seam.has_pending_work() == self.coordinator.has_pending_work()
        assert self.seam.has_pending_reclamation() == self.coordinator.has_pending_reclamation()
        for scheduled in (0, 1, 17):
            asked = ((rid, computed, scheduled),)
            assert self.seam.all_context_pages_resident(asked) == \
                self.coordinator.all_context_pages_resident(asked), (asked, mine)
        self.state.check_invariants(self.taken)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_seam_answers_as_vllms_coordinator(name: str) -> None:
    shape, ops, _ = SCENARIOS[name]
    run(*shape, ops, seam=SeamCheck)


@pytest.mark.parametrize("name", sorted(GATED))
def test_the_seam_follows_the_gate_and_lookahead(name: str) -> None:
    (*shape, lookahead, fit_mask), ops, _ = GATED[name]
    run(*shape, ops, lookahead, fit_mask, seam=SeamCheck)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**STREAMS, **GATES)
def test_random_streams_the_seam_answers_as_vllm(num_blocks: int, host_blocks: int, hot_blocks: int,
                                                 in_flight: int, prompt: int, ops: list[tuple[str, int]],
                                                 lookahead: int, fit_mask: int) -> None:
    run(num_blocks, host_blocks, hot_blocks, in_flight, prompt, ops, lookahead, fit_mask, seam=SeamCheck)


SIDE = st.lists(st.one_of(
    st.tuples(st.just("step"), st.integers(0, 2), st.integers(1, 40), st.booleans()),
    st.tuples(st.just("confirm"), st.integers(0, 2**16 - 1), st.just(0), st.booleans()),
    st.tuples(st.just("free"), st.integers(0, 2), st.just(0), st.just(False)),
    st.tuples(st.just("take"), st.integers(1, 8), st.just(0), st.just(False)),
    st.tuples(st.just("give_back"), st.just(0), st.just(0), st.just(False))), min_size=4, max_size=40)


def side_by_side(num_blocks: int, host_blocks: int, hot_blocks: int, in_flight: int,
                 ops: list[tuple[str, int, int, bool]]) -> set[str]:
    """Three requests (of 40 to 128 tokens) side by side on vLLM's manager and the seam,
    beyond the reference's one at a time: a step of request ``a`` by ``n`` tokens (the
    whole request asked to fit when ``flag``), confirming the copies of ``a``'s mask (one
    worker, or two with one completing when ``flag``), freeing request ``a`` (a new one
    takes its place), other users taking and giving back blocks. After each op every live
    request's answers are compared (``SeamCheck.compare``). What happened, returned."""
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    manager = vllm_manager(hisparse_config(num_blocks, host_blocks, hot_blocks=hot_blocks),
                           max_model_len=MAX_LEN, max_in_flight_tokens=in_flight)
    coordinator = get_hisparse_coordinator(manager)
    check = SeamCheck(manager, coordinator, 0)
    reqs = [make_request(f"q{k}", list(range(40 + 44 * k))) for k in range(3)]
    taken: list[Any] = []
    seen: set[str] = set()
    for i, (op, a, n, flag) in enumerate(ops):
        if op == "step" and reqs[a].num_computed_tokens < reqs[a].num_tokens:
            req = reqs[a]
            total = min(req.num_computed_tokens + n, req.num_tokens)
            got = manager.allocate_slots(req, total - req.num_computed_tokens, full_sequence_must_fit=flag)
            if got is not None:
                coordinator.advance_scheduled([(req.request_id, total)])
                req.num_computed_tokens = total
            check.step(req.request_id, total, req.num_tokens if flag else 0, got is not None)
            seen.add("stepped" if got is not None else "refused")
        elif op == "confirm":
            sent = coordinator.build_offload_command().page_transfers
            chosen = [t for k, t in enumerate(sorted(coordinator.pending_spills)) if a >> (k % 16) & 1]
            enqueued = {t: 2 if flag else 1 for t in chosen}
            coordinator.update_spills(enqueued, {t: 1 for t in chosen})
            check.report(sent, enqueued, {t: 1 for t in chosen})
        elif op == "free":
            manager.free(reqs[a])
            check.free(reqs[a].request_id)
            reqs[a] = make_request(f"q{a}-{i}", list(range(40 + 44 * a)))
        elif op == "take":
            got_blocks = manager.block_pool.get_new_blocks(min(a, manager.block_pool.get_num_free_blocks()))
            check.take(len(got_blocks))
            taken += got_blocks
        elif op == "give_back":
            manager.block_pool.free_blocks(taken)
            check.give_back()
            taken = []
        for req in reqs:
            check.compare(req.request_id, req.num_computed_tokens)
        if check.state.device.unpinned:
            seen.add("unpinned")
        if sum(check.state.holds(r.request_id) for r in reqs) > 1:
            seen.add("side by side")
    return seen


def test_requests_side_by_side_answer_as_vllm() -> None:
    every = 2**16 - 1
    seen = side_by_side(24, 16, 1, 32, [
        ("step", 0, 32, False), ("step", 1, 32, False), ("step", 0, 8, False), ("confirm", every, 0, False),
        ("step", 1, 40, False), ("step", 2, 48, True), ("confirm", every, 0, False), ("take", 6, 0, False),
        ("step", 2, 48, False), ("free", 1, 0, False), ("give_back", 0, 0, False), ("step", 1, 64, False),
        ("confirm", 0b1011, 0, True), ("free", 0, 0, False), ("confirm", every, 0, False)])
    assert {"stepped", "unpinned", "side by side"} <= seen, seen


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(12, 40), host_blocks=st.integers(6, 24), hot_blocks=st.integers(1, 3),
       in_flight=st.sampled_from([16, 32, 64, MAX_LEN]), ops=SIDE)
def test_random_requests_side_by_side_answer_as_vllm(
        num_blocks: int, host_blocks: int, hot_blocks: int, in_flight: int,
        ops: list[tuple[str, int, int, bool]]) -> None:
    side_by_side(num_blocks, host_blocks, hot_blocks, in_flight, ops)


@pytest.mark.parametrize("name", ["get_host_block_pool", "free", "resident_managers", "hot_managers",
                                  "host_manager"])
def test_what_the_seam_does_not_serve_is_refused_by_name(name: str) -> None:
    seam = HiSparseSeam(hisparse_state(hisparse_config(), 128, enable_caching=False))
    with pytest.raises(UnsupportedByPrefixKV, match=name):
        attr = getattr(seam, name)
        attr()  # (refused unbound: a manager binds the seam to its group views)


def test_a_call_may_be_replaced_but_no_state_set() -> None:
    """A test's monkeypatch replaces a call of the seam (vLLM's scheduler tests mock
    ``has_pending_reclamation``); setting vLLM's state is refused by name."""
    seam = HiSparseSeam(hisparse_state(hisparse_config(), 128, enable_caching=False))
    seam.has_pending_reclamation = lambda: True  # type: ignore[method-assign]
    assert seam.has_pending_reclamation()
    with pytest.raises(UnsupportedByPrefixKV, match="setting request_states"):
        seam.request_states = {}
    seam.max_spill_pages = 1  # (a property vLLM's tests set: served)
    assert seam.state.spills.max_pages == 1


@pytest.mark.parametrize("case", ["two-resident", "host-pool", "sizes"])
def test_a_layout_outside_the_scope_is_refused_by_name(case: str) -> None:
    cfg = hisparse_config(resident_groups=2 if case == "two-resident" else 1,
                          host_blocks=None if case == "host-pool" else 16)
    if case == "sizes":
        from dataclasses import replace
        cfg.kv_cache_groups[1].kv_cache_spec = replace(cfg.kv_cache_groups[1].kv_cache_spec, block_size=32)
    with pytest.raises(UnsupportedByPrefixKV, match="HiSparse"):
        hisparse_state(cfg, 128, enable_caching=True)
