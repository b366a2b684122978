"""Split-KV (flash-decoding): forced splits against the torch reference, and the heuristic.

``TileConfig(num_splits=...)`` forces the split path on shapes small enough for the
interpreter; make_case poisons unused blocks with NaN, so a split reading past its
request's keys fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

from prefixkv.kernels import paged_prefill_attention_reference
from prefixkv.kernels.tiling import TileConfig, choose_num_splits, sm_count

from .cases import check, make_case, tolerance
from .conftest import PRIMARY_DEVICE

pytestmark = pytest.mark.usefixtures("needs_triton")

# (q_lens, kv_lens): decode over long and short keys, small q_len with and without prefix,
# and a batch with an empty request, a request without keys and short/long ones.
GEOMETRIES = {
    "decode": ([1, 1], [97, 33]),
    "small-q-prefix": ([3, 2], [70, 41]),
    "no-prefix": ([4], [4]),
    "mixed-empty": ([1, 0, 1, 2, 1], [0, 9, 3, 150, 61]),
}


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("num_splits", [2, 3, 4])
def test_forced_splits_match_reference(geometry, num_splits):
    q_lens, kv_lens = GEOMETRIES[geometry]
    block_size, group = (5, 4) if num_splits % 2 else (16, 1)
    case = make_case(q_lens, kv_lens, num_kv_heads=2, group=group, head_dim=32, block_size=block_size,
                     device=PRIMARY_DEVICE, seed=num_splits)
    check(case, torch.float32, config=TileConfig(16, 16, num_splits=num_splits))


@pytest.mark.parametrize("options", [
    dict(window_size=(21, 0)),  # the window's left edge falls inside some splits only
    dict(softcap=30.0, window_size=(40, 0)),
    dict(causal=False, window_size=(9, 4)),
    dict(softcap=2.5),
], ids=str)
def test_splits_with_window_and_softcap(options):
    case = make_case([1, 3], [90, 47], num_kv_heads=1, group=8, head_dim=32, block_size=5,
                     device=PRIMARY_DEVICE, seed=7)
    check(case, torch.float32, config=TileConfig(16, 16, num_splits=3), **options)


def test_more_splits_than_key_tiles():
    """Splits past the last key tile see nothing: weight 0, never NaN.

    5 splits: 20 keys are 3 key tiles of 16 (split 3 and 4 see nothing), 35 with 2 new
    tokens are 4 (split 4 sees nothing), 0 keys none. More splits would only add programs
    (the interpreter runs each: 9 splits took twice the CPU time for the same cases)."""
    case = make_case([1, 2, 1], [20, 35, 0], num_kv_heads=2, group=4, head_dim=32, block_size=16,
                     device=PRIMARY_DEVICE, seed=3)
    check(case, torch.float32, config=TileConfig(16, 16, num_splits=5))


def test_fp16_without_lse():
    from prefixkv.kernels.attention import paged_prefill_attention_triton

    case = make_case([1, 1], [130, 17], num_kv_heads=2, group=4, head_dim=64, block_size=16,
                     dtype=torch.float16, device=PRIMARY_DEVICE, seed=11)
    got = paged_prefill_attention_triton(*case.args, config=TileConfig(16, 32, num_splits=4))
    want = paged_prefill_attention_reference(*case.args)
    assert got.dtype == torch.float16 and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **tolerance(torch.float16))


def test_row_without_keys_gives_zero_and_minus_inf():
    from prefixkv.kernels.attention import paged_prefill_attention_triton

    case = make_case([1, 1], [0, 40], num_kv_heads=1, group=2, head_dim=32, device=PRIMARY_DEVICE, seed=5)
    out, lse = paged_prefill_attention_triton(*case.args, return_lse=True,
                                              config=TileConfig(16, 16, num_splits=3))
    assert torch.equal(out[0].float(), torch.zeros_like(out[0].float()))
    assert torch.isneginf(lse[:, 0]).all() and torch.isfinite(lse[:, 1]).all()


def test_heuristic_splits_long_decode_in_the_launcher():
    """No forced count: 1 request x 1024 keys x 1 KV head takes 4 splits (1024 // 256)."""
    assert choose_num_splits(batch=1, num_kv_heads=1, max_seqlen_q=1, max_seqlen_k=1024, num_sms=132) == 4
    case = make_case([1], [1024], num_kv_heads=1, group=4, head_dim=32, block_size=16,
                     device=PRIMARY_DEVICE, seed=2)
    check(case, torch.float32)


def test_heuristic_choices():
    pick = dict(num_sms=132)
    # SPEC prefill (8 x 2048 new over 8192 cached, 8 KV heads): the unsplit path.
    assert choose_num_splits(batch=8, num_kv_heads=8, max_seqlen_q=2048, max_seqlen_k=10240, **pick) == 1
    # 1 x 32k decode, 8 KV heads: 8 programs -> 17 splits, 136 programs.
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seqlen_q=1, max_seqlen_k=32768, **pick) == 17
    assert choose_num_splits(batch=4, num_kv_heads=8, max_seqlen_q=1, max_seqlen_k=32768, **pick) == 5
    # Enough programs already, short keys, or a prefill-sized q side: no split.
    assert choose_num_splits(batch=64, num_kv_heads=8, max_seqlen_q=1, max_seqlen_k=8192, **pick) == 1
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seqlen_q=1, max_seqlen_k=300, **pick) == 1
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seqlen_q=64, max_seqlen_k=32768, **pick) == 1
    assert choose_num_splits(batch=1, num_kv_heads=1, max_seqlen_q=1, max_seqlen_k=1 << 20, **pick) == 64
    assert sm_count(torch.device("cpu")) == 132


@pytest.mark.parametrize("num_splits", [0, -1, 2000])
def test_tile_config_rejects_bad_split_counts(num_splits):
    with pytest.raises(ValueError, match="num_splits"):
        TileConfig(16, 16, num_splits=num_splits)


def test_heuristic_fills_every_resident_cta_and_counts_query_tiles():
    pick = dict(num_sms=132, max_seqlen_k=32768)
    # 2 CTAs of the decode tile fit per SM: 264 slots for 8 programs -> 33 splits.
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seqlen_q=1, ctas_per_sm=2, **pick) == 33
    # Speculative decoding verifies 8 tokens per request; a tile holds 4 query positions (16
    # rows / a group of 4), so each request has 2 tiles: 64 programs -> 5 splits, not 9.
    assert choose_num_splits(batch=4, num_kv_heads=8, max_seqlen_q=8, block_q=4, ctas_per_sm=2, **pick) == 5
    assert choose_num_splits(batch=4, num_kv_heads=8, max_seqlen_q=8, block_q=8, ctas_per_sm=2, **pick) == 9
    # Enough programs for every slot: no split.
    assert choose_num_splits(batch=33, num_kv_heads=8, max_seqlen_q=1, ctas_per_sm=1, **pick) == 1
    assert choose_num_splits(batch=17, num_kv_heads=8, max_seqlen_q=1, ctas_per_sm=2, **pick) == 2


def test_launcher_splits_with_several_query_tiles_per_request():
    """q_len > BLOCK_Q with splits: every tile of the request gets its own key slices."""
    case = make_case([7, 5], [300, 260], num_kv_heads=1, group=4, head_dim=32, block_size=16,
                     device=PRIMARY_DEVICE, seed=13)
    check(case, torch.float32, config=TileConfig(16, 32, num_splits=3))  # BLOCK_Q = 4: 2 tiles per request
