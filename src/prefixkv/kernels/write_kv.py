"""Triton kernel that scatters new tokens' K/V into the paged cache, and its launcher."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import is_fp8, kernel_scales
from .validation import check_write_kv

__all__ = ["write_kv_cache_triton"]


# num_slots (the cache's size) is not specialised: warm-up uses a small cache
@triton.jit(do_not_specialize=["num_slots"])  # type: ignore[untyped-decorator]  # Triton JIT
def _write_kv_kernel(  # type: ignore[no-untyped-def]  # Triton JIT
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_slot, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_db, stride_ds, stride_dh, stride_dd,
    stride_ksc, stride_vsc, block_size, num_slots,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr, DIM_P2: tl.constexpr, FP8_MAX: tl.constexpr,
):
    # One program per token: the whole [num_kv_heads, head_dim] row of K and of V.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token * stride_slot).to(tl.int64)
    # -1: a padding token; any other slot outside the cache is skipped too (checked mode names it).
    if (slot >= 0) & (slot < num_slots):
        block = slot // block_size
        offset = slot % block_size
        h = tl.arange(0, HEADS_P2)[:, None]  # [HEADS_P2, 1]
        d = tl.arange(0, DIM_P2)[None, :]  # [1, DIM_P2]
        mask = (h < NUM_HEADS) & (d < HEAD_DIM)  # [HEADS_P2, DIM_P2]
        k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
        if FP8_MAX > 0:  # fp8 cache: divide by the head's scale, saturate, round to nearest
            k_s = tl.load(k_scale_ptr + h * stride_ksc, mask=h < NUM_HEADS, other=1.0)  # [HEADS_P2, 1]
            v_s = tl.load(v_scale_ptr + h * stride_vsc, mask=h < NUM_HEADS, other=1.0)
            # A scale that is not a finite number > 0 acts as 0: the head stores zeros (fp8.py).
            k_ok = (k_s > 0.0) & (k_s < float("inf"))
            v_ok = (v_s > 0.0) & (v_s < float("inf"))
            k = tl.where(k_ok, tl.clamp(k.to(tl.float32) / k_s, -FP8_MAX, FP8_MAX), 0.0)
            v = tl.where(v_ok, tl.clamp(v.to(tl.float32) / v_s, -FP8_MAX, FP8_MAX), 0.0)
        k = k.to(k_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne" if FP8_MAX > 0 else None)
        v = v.to(v_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne" if FP8_MAX > 0 else None)
        # int64 throughout: block * stride_cb passes 2^31 in caches of more than 2^31 elements.
        k_dst = k_cache_ptr + block * stride_cb + offset * stride_cs + h * stride_ch + d * stride_cd
        v_dst = v_cache_ptr + block * stride_db + offset * stride_ds + h * stride_dh + d * stride_dd
        tl.store(k_dst, k, mask=mask)
        tl.store(v_dst, v, mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    checked: bool = False,
) -> None:
    """Triton path of :func:`prefixkv.kernels.write_kv_cache` (same contract)."""
    check_write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, checked=checked)
    num_blocks, block_size, num_heads, head_dim = k_cache.shape
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    scales, scale_strides = kernel_scales(k_scale, v_scale, key.device)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, slot_mapping.stride(0), *scales,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        *scale_strides, block_size,
        num_blocks * block_size,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        HEADS_P2=triton.next_power_of_2(num_heads), DIM_P2=triton.next_power_of_2(head_dim),
        FP8_MAX=float(torch.finfo(k_cache.dtype).max) if is_fp8(k_cache.dtype) else 0.0,
    )
