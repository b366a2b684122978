"""``add_request(..., keep_free=n)``: admit only if ``n`` blocks stay free besides what
the admission takes; cached hits other requests hold take nothing, free ones do (vLLM's
``reserved_blocks`` and watermark count the same)."""

import pytest

from prefixkv import KVCacheManager, RequestError
from prefixkv.groups import HybridKVCacheManager, full_attention


@pytest.mark.parametrize("make", [lambda: KVCacheManager(11, 4),
                                  lambda: HybridKVCacheManager([full_attention()], 11, 4)])
def test_keep_free_counts_new_blocks_and_the_free_hits_only(make):
    m = make()
    m.add_request("a", list(range(33)))  # 9 blocks held, 2 free
    b = [*range(32), 99]  # hits a's 8 full blocks, held by a: needs 1 new block
    assert m.add_request("b", b, keep_free=2) is None  # 1 + 2 > 2
    assert m.add_request("b", b, keep_free=1).num_cached_tokens == 32
    m.free("a")
    m.free("b")  # all 11 free, 8 of them cached hits of c
    assert m.add_request("c", b, keep_free=3) is None  # 8 + 1 + 3 > 11
    assert m.add_request("c", b, keep_free=2).num_cached_tokens == 32
    assert m.num_free_blocks == 2
    m.check_invariants()


@pytest.mark.parametrize("make", [lambda: KVCacheManager(11, 4),
                                  lambda: HybridKVCacheManager([full_attention()], 11, 4)])
@pytest.mark.parametrize("bad", [-1, 1.5, "1", None, True])
def test_a_bad_keep_free_is_a_request_error_before_any_change(make, bad):
    m = make()
    m.add_request("a", list(range(9)))
    before = (m.free_block_order(), m.stats)
    with pytest.raises(RequestError):
        m.add_request("b", list(range(9)), keep_free=bad)
    assert (m.free_block_order(), m.stats) == before
    m.check_invariants()


@pytest.mark.parametrize("make", [lambda: KVCacheManager(11, 16),
                                  lambda: HybridKVCacheManager([full_attention()], 11, 16)])
@pytest.mark.parametrize("keep, fits", [(2, True), (10, True), (11, False)])
def test_keep_free_constrains_this_calls_blocks_not_the_whole_prompt(make, keep, fits):
    # vLLM 0.33's test_full_sequence_admission_reserves_device_blocks_for_immediate_chunk:
    # a 128-token prompt (8 blocks) fits the 11 free ones; its first chunk takes 1, with
    # up to 10 more kept free
    m = make()
    adm = m.add_request("r", list(range(128)), num_new_tokens=16, require_full_fit=True, keep_free=keep)
    assert (adm is not None) is fits
