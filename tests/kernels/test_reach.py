"""Shapes whose int32 arithmetic in the kernels would wrap (``kernels/reach.py``).

Found by this audit (kern-r9): a slot-major cache viewed as ``[num_blocks, block_size,
heads, dim]`` (slot stride past 2^31 / block_size) made the Triton path read outside the
cache (a segfault in the interpreter), and ``window_size=(-1, 2**31 - 1)`` wrapped
``pos + right`` so the Triton path attended no key where the torch one attended all;
``(2**63, 0)`` reached Triton as a uint64 (every row zero), ``(2**64, 0)`` raised a bare
OverflowError on both backends. Large tensors are ``torch.empty`` views that are never
touched: the checks read shapes and strides only.
"""

from __future__ import annotations

import pytest
import torch

from prefixkv.kernels import (
    ShapeError,
    UnsupportedError,
    build_paged_batch,
    paged_prefill_attention,
    write_kv_cache,
)

from .conftest import BACKENDS, PRIMARY_DEVICE


def _slot_major_cache(block_size: int = 16, dim: int = 64) -> torch.Tensor:
    """``[num_blocks, block_size, 1, dim]`` fp16 view of slot-major storage whose slot
    stride times ``block_size - 1`` just passes 2^31 elements (never touched)."""
    num_blocks = 2**31 // ((block_size - 1) * dim) + 8
    base = torch.empty(block_size, num_blocks, 1, dim, dtype=torch.float16, device=PRIMARY_DEVICE)
    return base.permute(1, 0, 2, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cache_whose_block_offsets_pass_int32_is_refused(backend):
    k_cache, v_cache = _slot_major_cache(), _slot_major_cache()
    num_blocks = k_cache.shape[0]
    step = build_paged_batch([[num_blocks - 1, 3]], [20], [4], 16, device=PRIMARY_DEVICE)
    q = torch.zeros(4, 2, 64, dtype=torch.float16, device=PRIMARY_DEVICE)
    with pytest.raises(ShapeError, match=r"k_cache .* offsets inside one block reach \d+ elements"):
        paged_prefill_attention(q, k_cache, v_cache, step.block_table, step.cu_seqlens_q, step.seqused_k,
                                step.max_seqlen_q, step.max_seqlen_k, backend=backend)
    key = torch.zeros(4, 1, 64, dtype=torch.float16, device=PRIMARY_DEVICE)
    with pytest.raises(ShapeError, match="offsets inside one block"):
        write_kv_cache(key, key.clone(), k_cache, v_cache, step.slot_mapping, backend=backend)


def _wide_rows(rows: int, heads: int, dim: int) -> torch.Tensor:
    """``[rows, heads, dim]`` fp16 whose head stride is 2^30, so that head 2's offset is
    2^31 (never touched)."""
    storage = torch.empty((heads - 1) * 2**30 + rows * dim, dtype=torch.float16, device=PRIMARY_DEVICE)
    return storage.as_strided((rows, heads, dim), (dim, 2**30, 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_whose_head_offsets_pass_int32_are_refused(backend):
    k_cache = torch.zeros(4, 4, 1, 8, dtype=torch.float16, device=PRIMARY_DEVICE)
    step = build_paged_batch([[1, 2]], [4], [3], 4, device=PRIMARY_DEVICE)
    q = _wide_rows(3, 3, 8)
    args = (k_cache, k_cache.clone(), step.block_table, step.cu_seqlens_q, step.seqused_k, step.max_seqlen_q,
            step.max_seqlen_k)
    with pytest.raises(ShapeError, match=r"^q of shape .* offsets inside one token"):
        paged_prefill_attention(q, *args, backend=backend)
    plain = torch.zeros(3, 3, 8, dtype=torch.float16, device=PRIMARY_DEVICE)
    with pytest.raises(ShapeError, match=r"^out of shape .* offsets inside one token"):
        paged_prefill_attention(plain, *args, out=_wide_rows(3, 3, 8), backend=backend)
    with pytest.raises(ShapeError, match=r"^key of shape .* offsets inside one token"):
        cache = torch.zeros(4, 4, 3, 8, dtype=torch.float16, device=PRIMARY_DEVICE)
        write_kv_cache(_wide_rows(3, 3, 8), plain, cache, cache.clone(), step.slot_mapping, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_lse_whose_head_offsets_pass_int32_is_refused(backend):
    k_cache = torch.zeros(1, 1, 1, 8, dtype=torch.float16, device=PRIMARY_DEVICE)
    total_q = 2**31 // 3 + 1  # (4 - 1) heads x total_q rows >= 2^31
    q = torch.zeros(1, 1, 8, dtype=torch.float16, device=PRIMARY_DEVICE).expand(total_q, 4, 8)
    cu = torch.tensor([0, total_q], dtype=torch.int32, device=PRIMARY_DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=PRIMARY_DEVICE)
    used = torch.ones(1, dtype=torch.int32, device=PRIMARY_DEVICE)
    with pytest.raises(ShapeError, match=r"return_lse with 4 heads"):
        paged_prefill_attention(q, k_cache, k_cache.clone(), table, cu, used, total_q, 1, causal=False,
                                return_lse=True, backend=backend)


def _small_batch():
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(6, 4, 1, 16, generator=gen).to(PRIMARY_DEVICE)
    v_cache = torch.randn(6, 4, 1, 16, generator=gen).to(PRIMARY_DEVICE)
    k_cache[0], v_cache[0] = float("nan"), float("nan")  # block 0 is never in the table
    step = build_paged_batch([[1, 2, 3]], [7], [3], 4, device=PRIMARY_DEVICE)
    q = torch.randn(3, 2, 16, generator=gen).to(PRIMARY_DEVICE)
    return (q, k_cache, v_cache, step.block_table, step.cu_seqlens_q, step.seqused_k, step.max_seqlen_q,
            step.max_seqlen_k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window, causal", [
    ((-1, 2**31 - 1), False),  # pos + right wrapped in int32: no key attended
    ((2**31 - 1, 2**31 - 1), False),
    ((2**63, 0), True),  # a uint64 in Triton: every row zero
    ((2**64, -1), False),  # OverflowError on both backends
])
def test_a_window_wider_than_any_row_attends_every_key(backend, window, causal):
    args = _small_batch()
    got = paged_prefill_attention(*args, window_size=window, causal=causal, backend=backend)
    want = paged_prefill_attention(*args, causal=causal, backend="torch")
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_whose_positions_pass_int32_is_refused(backend):
    k_cache = torch.empty(1, 2**20, 1, 8, device=PRIMARY_DEVICE)  # never touched
    table = torch.zeros(1, 2**11, dtype=torch.int32, device=PRIMARY_DEVICE)  # 2^31 keys a row
    q = torch.zeros(2, 1, 8, device=PRIMARY_DEVICE)
    cu = torch.tensor([0, 2], dtype=torch.int32, device=PRIMARY_DEVICE)
    used = torch.full((1,), 2, dtype=torch.int32, device=PRIMARY_DEVICE)
    args = (q, k_cache, k_cache, table, cu, used, 2, 2)
    with pytest.raises(UnsupportedError, match=r"capacity \+ total_q \+ window must stay below 2\^31"):
        paged_prefill_attention(*args, window_size=(4095, 0), backend=backend)
