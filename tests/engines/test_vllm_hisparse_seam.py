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

from . import skip_module_without_vllm
from .hisparse_cases import GATED, GATES, SCENARIOS, STREAMS

skip_module_without_vllm()

from prefixkv.integrations.vllm.hisparse import HiSparseSeam, hisparse_state  # noqa: E402
from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV  # noqa: E402

from .test_vllm_hisparse import hisparse_config  # noqa: E402
from .test_vllm_hisparse_reference import run  # noqa: E402


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


@pytest.mark.parametrize("name", ["take_residency_updates", "build_row_mirrors", "finish_host_import",
                                  "get_host_block_pool", "has_pending_reclamation", "take_host_block_copies",
                                  "release_completed_host_copies", "free", "pending_spills",
                                  "request_states", "resident_managers"])
def test_what_the_seam_does_not_serve_is_refused_by_name(name: str) -> None:
    seam = HiSparseSeam(hisparse_state(hisparse_config(), 128, enable_caching=False))
    with pytest.raises(UnsupportedByPrefixKV, match=name):
        attr = getattr(seam, name)
        attr()


@pytest.mark.parametrize("case", ["caching", "two-resident", "host-pool", "sizes"])
def test_a_layout_outside_the_scope_is_refused_by_name(case: str) -> None:
    cfg = hisparse_config(resident_groups=2 if case == "two-resident" else 1,
                          host_blocks=None if case == "host-pool" else 16)
    if case == "sizes":
        from dataclasses import replace
        cfg.kv_cache_groups[1].kv_cache_spec = replace(cfg.kv_cache_groups[1].kv_cache_spec, block_size=32)
    with pytest.raises(UnsupportedByPrefixKV, match="HiSparse"):
        hisparse_state(cfg, 128, enable_caching=case == "caching")
