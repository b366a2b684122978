"""prefixkv's HiSparse plug-in manager with caching on (integrations/vllm/hisparse_cache.py)
beside vLLM 0.33's own, on what the random streams of test_vllm_hisparse_cache.py do not
reach: a request that skips reading the cache, a miss (vLLM's empty blocks object), and
the lookups' statistics. Exact values, both managers alike (mutants-r29). Needs vllm."""

from __future__ import annotations

from typing import Any

import pytest

from . import skip_module_without_vllm

skip_module_without_vllm()

from vllm.v1.hisparse.coordinator import get_hisparse_coordinator  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from .hisparse_model import BS, MAX_LEN  # noqa: E402
from .test_vllm_block_sizes_reference import _request  # noqa: E402
from .test_vllm_hisparse import hisparse_config, vllm_manager  # noqa: E402
from .test_vllm_hisparse_manager import _plugin_manager  # noqa: E402


@pytest.fixture(autouse=True)
def _none_hash() -> None:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def _computed(m: Any) -> tuple[Any, Any, list[int]]:
    """A 64-token request computed, its 4 copies to host sent: the seam, the request and
    the copies' ids."""
    seam = get_hisparse_coordinator(m)
    first = _request("first", list(range(64)), BS)
    m.allocate_slots(first, 64)
    seam.advance_scheduled([("first", 64)])
    first.num_computed_tokens = 64
    return seam, first, [t.transfer_id for t in seam.build_offload_command().page_transfers]


def _published(m: Any) -> None:
    """A 64-token request computed, its 4 copies confirmed, freed finished."""
    seam, first, sent = _computed(m)
    seam.update_spills(dict.fromkeys(sent, 1), dict.fromkeys(sent, 1))
    first.status = RequestStatus.FINISHED_STOPPED
    m.free(first)


@pytest.mark.parametrize("side", ["vllm", "prefixkv"])
def test_a_skipping_request_a_miss_and_a_hit_with_their_statistics(side: str) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    cfg, kw = hisparse_config(32, 16), {"max_model_len": MAX_LEN, "enable_caching": True, "log_stats": True}
    m = vllm_manager(cfg, **kw) if side == "vllm" else _plugin_manager(cfg, **kw)
    _published(m)
    skip = Request(request_id="skip", prompt_token_ids=list(range(64)),
                   sampling_params=SamplingParams(max_tokens=4, skip_reading_prefix_cache=True),
                   pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256))
    miss, probe = _request("miss", list(range(1000, 1064)), BS), _request("probe", list(range(64)), BS)
    answers = []
    for req in (skip, miss, probe):
        blocks, hit, boundary = m.get_computed_blocks(req)
        m.record_prefix_cache_stats(req, hit)
        answers.append((blocks.get_block_ids(), hit, boundary, blocks is m.empty_kv_cache_blocks))
    assert answers == [(([], [], [], []), 0, 0, True), (([], [], [], []), 0, 0, True),
                       (([1, 2, 3], [1, 2, 3], [], []), 48, 0, False)]
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 128, 48)


@pytest.mark.parametrize(("fit", "reserved", "admitted"), [
    (False, 0, True), (True, 0, False), (False, 5, True), (False, 6, False)])
@pytest.mark.parametrize("side", ["vllm", "prefixkv"])
def test_a_hit_short_of_device_blocks_is_not_admitted(side: str, fit: bool, reserved: int,
                                                      admitted: bool) -> None:
    """14 device blocks, 13 free after the publication: a 128-token request with a 64-token
    hit and 16 new tokens takes 8 (its host page, indexer page, row page and a 2-block hot
    region, and more past the hit); its whole sequence (``full_sequence_must_fit``) does
    not fit, nor the step beside 6 ``reserved_blocks`` (5 leave it room). Nothing taken
    when refused; both managers alike."""
    cfg, kw = hisparse_config(14, 16), {"max_model_len": MAX_LEN, "enable_caching": True}
    m = vllm_manager(cfg, **kw) if side == "vllm" else _plugin_manager(cfg, **kw)
    _published(m)
    probe = _request("probe", list(range(64)) + list(range(500, 500 + MAX_LEN - 64)), BS)
    blocks, hit, _ = m.get_computed_blocks(probe)
    assert hit == 64 and m.block_pool.get_num_free_blocks() == 13
    got = m.allocate_slots(probe, 16, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                           full_sequence_must_fit=fit, reserved_blocks=reserved)
    if admitted:
        assert got.get_block_ids() == ([5], [9], [10], [11, 12]) and m.block_pool.get_num_free_blocks() == 5
    else:
        assert got is None and m.block_pool.get_num_free_blocks() == 13
        assert m.get_block_ids("probe") == ([], [], [], [])


def test_a_malformed_hit_or_one_for_a_request_with_computed_tokens_is_refused_with_nothing_changed() -> None:
    from prefixkv.errors import RequestError
    from prefixkv.integrations.vllm import UnsupportedByPrefixKV

    m = _plugin_manager(hisparse_config(32, 16), max_model_len=MAX_LEN, enable_caching=True)
    _published(m)
    probe = _request("probe", list(range(64)), BS)
    blocks, hit, _ = m.get_computed_blocks(probe)
    assert hit == 48
    before = (m.block_pool.get_num_free_blocks(), m.get_block_ids("probe"))
    with pytest.raises(RequestError, match="a hit of 40 tokens"):
        m.allocate_slots(probe, 16, num_new_computed_tokens=40, new_computed_blocks=blocks)
    with pytest.raises(RequestError, match="num_new_tokens"):
        m.allocate_slots(probe, -1, num_new_computed_tokens=48, new_computed_blocks=blocks)
    probe.num_computed_tokens = 16
    with pytest.raises(UnsupportedByPrefixKV, match="a hit for a request holding blocks or computed tokens"):
        m.allocate_slots(probe, 16, num_new_computed_tokens=48, new_computed_blocks=blocks)
    with pytest.raises(RequestError, match="num_computed_tokens"):
        m.cache_blocks(probe, -1)
    assert (m.block_pool.get_num_free_blocks(), m.get_block_ids("probe")) == before
    m.state.check_invariants()


@pytest.mark.parametrize("side", ["vllm", "prefixkv"])
def test_a_host_hit_past_an_indexer_hit_of_no_page_is_allocated_afresh(side: str) -> None:
    """The indexer's page 0 evicted, the 3 host pages still published: the lookup answers
    the host blocks, 0 tokens and the host hit's end (48). vLLM's scheduler hands them to
    ``allocate_slots`` with 0 computed tokens, which allocates afresh (host blocks 5-8).
    prefixkv raised RequestError there before mutants-r29 (a hit of no page)."""
    cfg, kw = hisparse_config(32, 16), {"max_model_len": MAX_LEN, "enable_caching": True}
    m = vllm_manager(cfg, **kw) if side == "vllm" else _plugin_manager(cfg, **kw)
    _published(m)
    probe = _request("probe", list(range(64)), BS)
    m.evict_blocks({m.get_computed_blocks(probe)[0].get_block_ids()[1][0]})
    blocks, hit, boundary = m.get_computed_blocks(probe)
    assert (blocks.get_block_ids(), hit, boundary) == (([1, 2, 3], [], [], []), 0, 48)
    got = m.allocate_slots(probe, 64, num_new_computed_tokens=hit, new_computed_blocks=blocks)
    ids = m.get_block_ids("probe")
    assert got.get_block_ids() == ids and ids[0] == [5, 6, 7, 8] and ids[3] == []
    assert [len(g) for g in ids] == [4, 4, 4, 0] and m.block_pool.get_num_free_blocks() == 23
    # (the device ids differ: vLLM's evict_blocks leaves block 1 where it was in the free
    # order, prefixkv's reuses it first: [1, 9, 10, 11] against [9, 10, 11, 12])


@pytest.mark.parametrize("side", ["vllm", "prefixkv"])
def test_a_delayed_caching_wish_and_a_reset_counted_in_the_statistics(side: str) -> None:
    """``delay_cache_blocks``: no indexer page is cached until ``cache_blocks`` (32
    tokens: two pages); a request holding nothing is passed over; the reset is counted."""
    cfg, kw = hisparse_config(32, 16), {"max_model_len": MAX_LEN, "enable_caching": True, "log_stats": True}
    m = vllm_manager(cfg, **kw) if side == "vllm" else _plugin_manager(cfg, **kw)
    get_hisparse_coordinator(m)
    req = _request("r", list(range(64)), BS)
    m.allocate_slots(req, 64, delay_cache_blocks=True)
    assert [b.block_hash is not None for b in m.get_blocks("r").blocks[1]] == [False] * 4
    m.cache_blocks(req, 32)
    m.cache_blocks(_request("other", list(range(64)), BS), 32)
    assert [b.block_hash is not None for b in m.get_blocks("r").blocks[1]] == [True, True, False, False]
    req.status = RequestStatus.FINISHED_STOPPED
    m.free(req)
    assert m.reset_prefix_cache() and m.make_prefix_cache_stats().reset
