"""The read-only count of blocks a HiSparse request needs with hit blocks or a new
request's computed tokens (integrations/vllm/hisparse_counts.py), against vLLM 0.33's own
manager side by side, caching off (a host prefix a connector or a test passes in; the
caching-on manager's counts are compared in test_vllm_hisparse_cache.py's streams):
another user takes host blocks and gives some back, a request may run already, then the
coordinator's count and each group's must be vLLM's, and nothing changes. Then what is
refused. Needs vllm installed."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

skip_module_without_vllm()

from vllm.v1.hisparse.coordinator import get_hisparse_coordinator  # noqa: E402

from prefixkv.errors import RequestError  # noqa: E402

from .hisparse_model import BS  # noqa: E402
from .test_vllm_block_sizes_reference import _request  # noqa: E402
from .test_vllm_hisparse import hisparse_config, vllm_manager  # noqa: E402
from .test_vllm_hisparse_cache import _none_hash  # noqa: E402, F401
from .test_vllm_hisparse_manager import _plugin_manager  # noqa: E402


def _answers(m: Any, hit: list[Any], num: int, total: int, local: int, cap: bool) -> list[int]:
    """The coordinator's count then each group's for a new request with host hit ``hit``."""
    c, blocks = m.coordinator, (hit, [], [], [])
    out = [c.get_num_blocks_to_allocate(request_id="new", num_tokens=num, new_computed_blocks=blocks,
                                        num_encoder_tokens=0, total_computed_tokens=total,
                                        num_local_computed_tokens=local, num_tokens_main_model=num,
                                        apply_admission_cap=cap)]
    return out + [g.get_num_blocks_to_allocate("new", num, blocks[i], total, local, num, cap)
                  for i, g in enumerate(c.single_type_managers)]


@settings(max_examples=50, deadline=None)
@given(host_blocks=st.integers(3, 12), take=st.integers(1, 6), give=st.integers(0, 6), hits=st.integers(0, 3),
       local=st.integers(0, 70), ext=st.integers(0, 40), more=st.integers(0, 40), cap=st.booleans(),
       running=st.integers(0, 40))
def test_host_prefix_counts_answer_as_vllm(host_blocks: int, take: int, give: int, hits: int, local: int,
                                          ext: int, more: int, cap: bool, running: int) -> None:
    """Another user takes ``take`` host blocks and gives back ``give`` of them (free hit
    blocks count as taken); the hit is the first ``hits`` of them (fewer than the local
    tokens' pages); a request of ``running`` tokens runs beside it (0: none). The counts,
    with external tokens when ``ext``, are vLLM's; nothing changed."""
    cfg = hisparse_config(24, host_blocks)
    answers = []
    for m in (vllm_manager(cfg), _plugin_manager(cfg)):
        pool = get_hisparse_coordinator(m).get_host_block_pool()
        got = pool.get_new_blocks(min(take, pool.get_num_free_blocks()))
        pool.free_blocks(got[:give])
        if running:
            m.allocate_slots(_request("run", list(range(running)), BS), running)
        hit = got[:min(hits, -(-local // BS))]
        before = m.block_pool.get_num_free_blocks(), pool.get_num_free_blocks()
        num = max(local + ext + more, 1)
        answers.append(_answers(m, hit, num, local + ext, local, cap))
        assert (m.block_pool.get_num_free_blocks(), pool.get_num_free_blocks()) == before
        assert not any("new" in h.hot_required for h in get_hisparse_coordinator(m).hot_managers)
    assert answers[1] == answers[0]


def test_exact_counts_of_a_host_hit() -> None:
    """A host pool of 3 blocks (2 free), one taken as the hit; a new request of 32 tokens
    with 16 computed on it: no host shortage (0), the indexer's 2 pages, the row's page
    past the hit, the hot region (2): 5, as vLLM's. With 15 computed (a partial hit) the
    source group wants its copy too: 2 host blocks, 1 free: the device pool's size and
    one more (33) for the source group. A host pool of one block, the hit given back: the
    hit's block counts as taken, 2 wanted, 1 free: 33 again."""
    for host in (3, 2):
        cfg = hisparse_config(32, host)
        for m in (vllm_manager(cfg), _plugin_manager(cfg)):
            pool = get_hisparse_coordinator(m).get_host_block_pool()
            hit = pool.get_new_blocks(1)
            if host == 2:
                pool.free_blocks(hit)
                assert _answers(m, hit, 32, 16, 16, False) == [38, 33, 2, 1, 2], type(m).__name__
                continue
            assert _answers(m, hit, 32, 16, 16, False) == [5, 0, 2, 1, 2], type(m).__name__
            assert _answers(m, hit, 32, 15, 15, False) == [38, 33, 2, 1, 2], type(m).__name__


def test_counts_refuse_blocks_not_the_managers() -> None:
    """Another manager's block, an int, or a hit in the resident group: RequestError."""
    cfg = hisparse_config(32, 8)
    ours, other = _plugin_manager(cfg), _plugin_manager(cfg)
    foreign = get_hisparse_coordinator(other).get_host_block_pool().get_new_blocks(1)
    views = ours.coordinator.single_type_managers
    for group, blocks in ((0, foreign), (0, [1]), (2, [ours.block_pool.blocks[1]])):
        with pytest.raises(RequestError, match="not this manager's"):
            views[group].get_num_blocks_to_allocate("new", 32, blocks, 16, 16, 32)
