"""The phase loop whose QK^T runs a tile ahead (``TileConfig.qk_ahead``) against the reference.

The loop scores tiles j and j+1 before it starts, carries the next tile's scores from
pass to pass, and in its last two passes scores a clamped tile it then drops; these cases
give each phase no tile, one, two, three and many, with and without masks, through both
block-id paths (one id per key: block_size 5; one per block: block_n a multiple of 16),
split-KV, a sliding window's left edge, softcap, sinks and an fp8 cache. Unused blocks and
slots are NaN (``make_case``), so a tile read past its phase shows as NaN.
"""

from __future__ import annotations

import pytest
import torch

from prefixkv.kernels.attention import paged_prefill_attention_triton
from prefixkv.kernels.fp8 import quantize
from prefixkv.kernels.reference import paged_prefill_attention_reference
from prefixkv.kernels.tiling import TileConfig

from .cases import check, make_case, tolerance
from .conftest import PRIMARY_DEVICE

pytestmark = pytest.mark.usefixtures("needs_triton")

AHEAD = TileConfig(block_m=16, block_n=16, qk_ahead=True)


@pytest.mark.parametrize("q_lens, kv_lens", [
    ([1, 1, 1, 1, 1], [1, 16, 33, 48, 97]),  # decode: 0, 1, 2, 3 and 6 unmasked tiles
    ([3, 17], [3, 80]),  # no prefix; a prefix of 63 keys
    ([0, 5, 2], [7, 5, 40]),  # an empty request, q_len = kv_len, q_len > 0 with prefix
], ids=["decode", "prefill", "mixed"])
@pytest.mark.parametrize("block_size", [5, 16])
def test_matches_reference_for_every_tile_count(q_lens, kv_lens, block_size):
    case = make_case(q_lens, kv_lens, num_kv_heads=2, group=2, block_size=block_size, device=PRIMARY_DEVICE,
                     seed=block_size + len(q_lens))
    check(case, torch.float32, config=AHEAD)


@pytest.mark.parametrize("options", [
    dict(window_size=(7, 0)),  # a left edge: phase 1 runs ahead too
    dict(window_size=(30, 0), softcap=3.0),
    dict(causal=False),
], ids=["window", "window-softcap", "noncausal"])
def test_masked_phases_and_options(options):
    case = make_case([9, 1], [97, 54], num_kv_heads=2, group=4, block_size=5, device=PRIMARY_DEVICE, seed=7)
    check(case, torch.float32, config=TileConfig(block_m=32, block_n=16, qk_ahead=True), **options)


def test_split_kv_slices_each_run_ahead():
    case = make_case([1, 1, 4], [130, 17, 90], num_kv_heads=1, group=4, block_size=16, device=PRIMARY_DEVICE,
                     seed=11)
    check(case, torch.float32, config=TileConfig(block_m=16, block_n=16, num_splits=3, qk_ahead=True))


def test_sinks_and_fp8_cache():
    case = make_case([6, 1], [70, 33], num_kv_heads=2, group=2, head_dim=32, block_size=16,
                     device=PRIMARY_DEVICE, seed=5)
    scales = tuple(torch.tensor(s, device=PRIMARY_DEVICE) for s in ([0.02, 0.05], [0.03, 0.04]))
    case.k_cache = quantize(case.k_cache, scales[0], torch.float8_e4m3fn)
    case.v_cache = quantize(case.v_cache, scales[1], torch.float8_e4m3fn)
    case.q = case.q.half()
    sinks = torch.tensor([0.5, -1.0, 2.0, -0.25], device=PRIMARY_DEVICE)
    kw = dict(k_scale=scales[0], v_scale=scales[1], sinks=sinks)
    got, got_lse = paged_prefill_attention_triton(*case.args, return_lse=True, config=AHEAD, **kw)
    want, want_lse = paged_prefill_attention_reference(*case.args, return_lse=True, **kw)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **tolerance(torch.float16))
    torch.testing.assert_close(got_lse, want_lse, **tolerance(torch.float16))


def test_same_result_as_the_loop_without_it():
    """Ahead or not, the same products in the same order: equal up to fp32 rounding."""
    case = make_case([12, 1], [75, 40], num_kv_heads=2, group=2, block_size=16, device=PRIMARY_DEVICE, seed=2)
    plain = paged_prefill_attention_triton(*case.args, config=TileConfig(16, 16))
    ahead = paged_prefill_attention_triton(*case.args, config=AHEAD)
    torch.testing.assert_close(ahead, plain, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("config", [TileConfig(256, 128, 8, 3), TileConfig(128, 64, 8, 3, qk_ahead=True)],
                         ids=["prefill-tile", "qk-ahead"])
def test_long_prefill_tiles_of_both_triton_versions(config):
    """``PREFILL_TILE`` and the ``qk_ahead`` tile triton 3.7+ took until H100 run 3 (fp32
    here: the interpreter; shapes that fill a tile)."""
    case = make_case([40, 3], [200, 70], num_kv_heads=1, group=4, head_dim=32, block_size=16,
                     device=PRIMARY_DEVICE, seed=9)
    check(case, torch.float32, config=config)
