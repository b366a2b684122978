"""The limits of a hit on prefixkv's HiSparse plug-in manager with caching on
(integrations/vllm/hisparse_cache.py) beside vLLM 0.33's own: the default hit length (one
token short of the request), the watermark kept for a waiting request only beside
scheduled ones, a whole sequence that fits to the last block, the hash lengths and pool
size vLLM's block objects read, and a copy in flight's reference. Exact values, both
managers alike (mutants-r30: each test kills a mutant the side-by-side streams let
survive). Needs vllm."""

from __future__ import annotations

from typing import Any

import pytest

from . import skip_module_without_vllm

skip_module_without_vllm()

from .hisparse_model import BS, MAX_LEN  # noqa: E402
from .test_vllm_block_sizes_reference import _request  # noqa: E402
from .test_vllm_hisparse import hisparse_config, vllm_manager  # noqa: E402
from .test_vllm_hisparse_cache_edges import _computed, _none_hash, _published  # noqa: E402,F401
from .test_vllm_hisparse_manager import _plugin_manager  # noqa: E402

SIDES = pytest.mark.parametrize("side", ["vllm", "prefixkv"])


def _manager(side: str, num_blocks: int, **kw: Any) -> Any:
    cfg, kw = hisparse_config(num_blocks, 16), {"max_model_len": MAX_LEN, "enable_caching": True, **kw}
    m = vllm_manager(cfg, **kw) if side == "vllm" else _plugin_manager(cfg, **kw)
    _published(m)
    return m


@SIDES
def test_a_hit_reaches_the_last_whole_page_before_the_last_token(side: str) -> None:
    """64 tokens published (4 pages): a 65-token request over them hits all 64 (its last
    token is left to compute), a 64-token one 48. The device blocks' hashes name the
    tokens up to their page's end (what vLLM reads as ``_block_hash_num_tokens``), and
    the pool holds its 32 blocks."""
    m = _manager(side, 32)
    hits = [m.get_computed_blocks(_request(f"p{n}", list(range(64)) + [7] * (n - 64), BS))[1:]
            for n in (65, 64)]
    assert hits == [(64, 0), (48, 0)]
    assert [(b.block_id, b._block_hash_num_tokens) for b in m.block_pool.blocks[:6]] == [
        (0, None), (1, 16), (2, 32), (3, 48), (4, 64), (5, None)]
    assert len(m.block_pool.blocks) == 32


@pytest.mark.parametrize(("scheduled", "ids"), [
    (False, ([5, 6, 7], [9, 10, 11], [12, 13, 8], [7, 6])), (True, None)])
@SIDES
def test_the_watermark_is_kept_for_a_waiting_request_beside_scheduled_ones(side: str, scheduled: bool,
                                                                          ids: Any) -> None:
    """14 device blocks (13 free after the publication), a watermark of 2: a waiting
    128-token request with the 64-token hit and 48 new tokens takes 12 of them alone
    (``has_scheduled_reqs`` false) but is not admitted beside scheduled requests, which
    keep the watermark free (12 + 2 > 13)."""
    m = _manager(side, 14, watermark=0.2)
    probe = _request("probe", list(range(64)) + list(range(500, 500 + MAX_LEN - 64)), BS)
    blocks, hit, _ = m.get_computed_blocks(probe)
    got = m.allocate_slots(probe, 48, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                           has_scheduled_reqs=scheduled)
    assert (hit, None if got is None else got.get_block_ids()) == (64, ids)
    assert m.block_pool.get_num_free_blocks() == (13 if got is None else 1)


@pytest.mark.parametrize(("num_blocks", "admitted"), [(13, True), (12, False)])
@SIDES
def test_a_whole_sequence_that_fits_to_its_last_block_is_admitted(side: str, num_blocks: int,
                                                                 admitted: bool) -> None:
    """``full_sequence_must_fit``: a 112-token request with the 64-token hit needs 12
    device blocks for its whole sequence; 12 free (13 blocks) admit it, 11 do not."""
    m = _manager(side, num_blocks)
    probe = _request("probe", list(range(64)) + list(range(500, 548)), BS)
    blocks, hit, _ = m.get_computed_blocks(probe)
    free = m.block_pool.get_num_free_blocks()
    got = m.allocate_slots(probe, 16, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                           full_sequence_must_fit=True)
    assert (hit, free, got is not None) == (64, num_blocks - 1, admitted)
    if admitted:
        assert got.get_block_ids() == ([5], [9], [10], [11, 12])


@SIDES
def test_a_copy_in_flight_counts_a_reference_on_its_device_block(side: str) -> None:
    """A 64-token request computed, its 4 copies to host sent: each resident block (5-8)
    counts the row's reference and the copy's (vLLM's ``ref_cnt`` 2), the indexer's (1-4)
    one; once confirmed, one again."""
    cfg, kw = hisparse_config(32, 16), {"max_model_len": MAX_LEN, "enable_caching": True}
    m = vllm_manager(cfg, **kw) if side == "vllm" else _plugin_manager(cfg, **kw)
    seam, _, sent = _computed(m)
    assert m.get_block_ids("first") == ([1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [])
    assert [b.ref_cnt for b in m.block_pool.blocks[:10]] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 0]
    seam.update_spills(dict.fromkeys(sent, 1), dict.fromkeys(sent, 1))
    assert [b.ref_cnt for b in m.block_pool.blocks[:10]] == [0, 1, 1, 1, 1, 1, 1, 1, 1, 0]
