"""paged_prefill_attention: the Triton kernel (interpreter on CPU) against the torch reference.

Every case poisons unused blocks, unused slots and block-table padding with NaN, so a
read outside a request's keys turns the comparison into a failure.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.kernels import paged_prefill_attention, paged_prefill_attention_reference
from prefixkv.kernels.tiling import TileConfig

from .cases import check, make_case, tolerance
from .conftest import BF16_DOT, PRIMARY_DEVICE

pytestmark = pytest.mark.usefixtures("needs_triton")


# (q_lens, kv_lens): decode, prefill without prefix, prefix prefill, odd lengths, mixed batches
GEOMETRIES = {
    "decode": ([1, 1, 1], [54, 97, 1]),
    "prefill-no-prefix": ([37], [37]),
    "prefix-prefill": ([13, 6], [54, 97]),
    "mixed": ([1, 19, 0, 3], [33, 19, 5, 70]),
}


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("block_size, group", [(5, 1), (16, 4), (32, 8)])
def test_matches_reference(device, geometry, block_size, group):
    q_lens, kv_lens = GEOMETRIES[geometry]
    case = make_case(q_lens, kv_lens, num_kv_heads=2, group=group, block_size=block_size, device=device,
                     seed=block_size * group)
    check(case, torch.float32)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims(device, head_dim):
    case = make_case([5, 1], [21, 40], num_kv_heads=1, group=2, head_dim=head_dim, block_size=16,
                     device=device, seed=head_dim)
    check(case, torch.float32)


@pytest.mark.parametrize(
    "options",
    [
        dict(window_size=(7, 0)),  # sliding window smaller than a tile
        dict(window_size=(40, -1)),  # causal=True forces right = 0
        dict(softcap=2.5),
        dict(softcap=30.0, window_size=(20, 0)),
        dict(causal=False),
        dict(causal=False, window_size=(9, 4)),
        dict(softmax_scale=0.05),
    ],
    ids=str,
)
def test_window_softcap_and_masking_options(device, options):
    # block_n=16 with 97 keys: the window's left edge, unmasked full tiles and the causal
    # diagonal each take several steps.
    case = make_case([9, 1], [97, 54], num_kv_heads=2, group=4, block_size=5, device=device, seed=3)
    check(case, torch.float32, config=TileConfig(block_m=32, block_n=16), **options)


@pytest.mark.parametrize("group", [3, 6])
def test_group_that_is_not_a_power_of_two(device, group):
    case = make_case([4, 1], [30, 17], num_kv_heads=2, group=group, block_size=7, device=device, seed=group)
    check(case, torch.float32)


def test_mqa_with_many_query_heads(device):
    case = make_case([3, 1], [20, 9], num_kv_heads=1, group=16, head_dim=64, block_size=16, device=device)
    check(case, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device, dtype):
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip(BF16_DOT)
    case = make_case([11, 1], [75, 33], num_kv_heads=2, group=4, block_size=16, dtype=dtype, device=device)
    check(case, dtype)


def test_rows_without_keys_give_zeros_not_nan(device):
    # q_len > kv_len: the first queries sit before key 0 and attend nothing.
    case = make_case([6, 2], [3, 9], num_kv_heads=1, group=2, block_size=5, device=device)
    out, lse = paged_prefill_attention(*case.args, return_lse=True, backend="triton")
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[:3], torch.zeros_like(out[:3])) and torch.isneginf(lse[:, :3]).all()
    check(case, torch.float32, window_size=(2, 0))


def test_strided_q_out_and_block_table(device):
    # q sliced out of a fused qkv tensor; out and block_table are views with odd strides.
    case = make_case([7, 2], [40, 23], num_kv_heads=2, group=2, block_size=16, device=device)
    qkv = torch.randn(case.q.shape[0], 8, 64, device=device)
    qkv[:, 2:6] = case.q
    case.q = qkv[:, 2:6]
    wide = torch.zeros(2, 2 * case.block_table.shape[1], dtype=torch.int32, device=device)
    wide[:, ::2] = case.block_table
    case.block_table = wide[:, ::2]
    out_buf = torch.full((case.q.shape[0], 4, 128), float("nan"), device=device)
    out = paged_prefill_attention(*case.args, out=out_buf[:, :, :64], backend="triton")
    assert out.data_ptr() == out_buf.data_ptr()
    torch.testing.assert_close(out, paged_prefill_attention_reference(*case.args), **tolerance(torch.float32))
    assert out_buf[:, :, 64:].isnan().all(), "wrote outside out"


def test_empty_batch(device):
    case = make_case([0, 0], [4, 0], device=device)
    out, lse = paged_prefill_attention(*case.args, return_lse=True, backend="triton")
    assert out.shape == (0, 2, 64) and lse.shape == (2, 0)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    block_size=st.sampled_from([5, 7, 16, 32]),
    group=st.sampled_from([1, 2, 4, 8]),
    window=st.sampled_from([None, (0, 0), (5, 0), (33, 0)]),
    softcap=st.sampled_from([0.0, 4.0]),
)
def test_random_batches(data, batch, block_size, group, window, softcap):
    q_lens = [data.draw(st.integers(0, 24)) for _ in range(batch)]
    kv_lens = [q + data.draw(st.sampled_from([0, 1, 17, 54, 97])) for q in q_lens]
    seed = data.draw(st.integers(0, 2**16))
    case = make_case(q_lens, kv_lens, num_kv_heads=1, group=group, block_size=block_size, seed=seed,
                     device=PRIMARY_DEVICE)
    check(case, torch.float32, window_size=window, softcap=softcap)
