"""Triton path of paged prefix-prefill attention: the launcher (checks, tiles, the split
plan, the grid) of the kernel in ``prefill_kernel.py``.

The launch reads no tensor value on the host: the grid comes from tensor shapes only, and
the kernel clamps every metadata value into the tensors given (docs/kv_layout.md,
"Untrusted metadata"). With more than one key split a second kernel merges the slices
(``split_kv``).
"""

from __future__ import annotations

import torch
import triton

from . import tiling
from .call import AttentionCall
from .fp8 import is_fp8, kernel_scales
from .interpreter import backport_scalar_index
from .prefill_kernel import _paged_prefill_kernel
from .split_kv import combine_splits
from .split_plan import plan_splits
from .tiling import TileConfig, choose_tiles, per_block_ids
from .validation import check_attention
from .workspace import SplitWorkspace

__all__ = ["paged_prefill_attention_triton"]

_LOG2E = 1.4426950408889634
# Caps up to this take tanh's exp form (attend._tanh): within ~1.6e-7 of tanh (~5e-7 with
# a GPU's approximate exp2 and division), so scores within cap * 5e-7 (5e-5 at 100: about
# the float32 rounding of a dot product giving scores of that size); larger caps its
# precise form (attend._tanh_precise), 12 instructions a score more on sm_90
# (docs/kernels.md, "Softcap's tanh").
EXP_TANH_MAX_CAP = 100.0


def softcap_mode(softcap: float) -> int:
    """The kernel's ``SOFTCAP`` constexpr for a validated ``softcap``: 0 off, 1 tanh's exp
    form (caps up to :data:`EXP_TANH_MAX_CAP`: Gemma 2's 50 and 30), 2 its precise form."""
    return 0 if softcap == 0 else 1 if softcap <= EXP_TANH_MAX_CAP else 2


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    config: TileConfig | None = None,
    checked: bool = False,
    split_workspace: SplitWorkspace | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton path of :func:`prefixkv.kernels.paged_prefill_attention` (same contract).

    ``config`` overrides the tile heuristic (tests use it to reach every phase);
    ``config.num_splits`` (None: :func:`choose_num_splits`) forces the number of key splits
    (every tile then splits into that many slices). ``split_workspace`` (see
    :func:`~prefixkv.kernels.split_kv.alloc_split_workspace`) fixes the split count and
    the workspace instead, and splits per request.
    The launch reads no tensor value on the host (no synchronisation); its compiled variant
    depends only on the model's shapes and options, ``max_seqlen_q`` (tile size) and
    whether keys are split (see :mod:`prefixkv.kernels`).
    """
    shape = check_attention(AttentionCall(
        q, k_cache, v_cache, block_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap, out=out,
        return_lse=return_lse, sinks=sinks, k_scale=k_scale, v_scale=v_scale, checked=checked,
        split_workspace=split_workspace))
    if out is None:
        out = torch.empty_like(q)
    cu_seqlens_q, seqused_k = cu_seqlens_q.contiguous(), seqused_k.contiguous()
    lse = None
    if return_lse:
        lse = torch.empty((shape.num_heads, shape.total_q), dtype=torch.float32, device=q.device)
    if shape.total_q == 0:
        return out if lse is None else (out, lse)
    group = shape.group
    group_p2 = triton.next_power_of_2(group)
    if config is None:
        config = choose_tiles(group=group, head_dim=shape.head_dim, max_seqlen_q=max_seqlen_q,
                              on_gpu=tiling.gpu_tiles(q.device), elem_bytes=q.element_size(),
                              window=shape.window_left >= 0, return_lse=return_lse,
                              kv_fp8=is_fp8(k_cache.dtype))
    block_m = max(config.block_m, group_p2)
    block_q = block_m // group_p2
    kv_fp8 = is_fp8(k_cache.dtype)
    scales, scale_strides = kernel_scales(k_scale, v_scale, q.device)
    if shape.softcap > 0:
        qk_scale, softcap_log2 = shape.softmax_scale / shape.softcap, shape.softcap * _LOG2E
    else:
        qk_scale, softcap_log2 = shape.softmax_scale * _LOG2E, 0.0
    plan = plan_splits(shape, config, split_workspace, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                       block_q=block_q, causal=causal, device=q.device)
    num_splits, split_q, split_keys = plan.num_splits, plan.split_q, plan.split_keys
    ws_args, ws_strides = plan.kernel_args(out)
    grid = (shape.total_q // block_q + shape.batch + 2, shape.num_kv_heads, num_splits)
    backport_scalar_index()  # the phase loops' bounds are loaded: triton 3.6's interpreter needs it
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_table, cu_seqlens_q, seqused_k, out, out if lse is None else lse,
        q if sinks is None else sinks, *scales, *ws_args,  # q, out: pointers never read
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_table.stride(),
        *out.stride(), *(lse.stride() if lse is not None else (0, 0)), *ws_strides, split_q, split_keys,
        0 if sinks is None else sinks.stride(0), *scale_strides,
        qk_scale, softcap_log2, shape.window_left, shape.window_right,
        shape.batch, num_splits, shape.total_q, shape.max_blocks * shape.block_size, shape.num_blocks - 1,
        GROUP=group, GROUP_P2=group_p2, HEAD_DIM=shape.head_dim,
        DIM_P2=max(16, triton.next_power_of_2(shape.head_dim)), BLOCK_SIZE=shape.block_size,
        BLOCK_M=block_m, BLOCK_N=config.block_n,
        HAS_LEFT=shape.window_left >= 0, HAS_RIGHT=shape.window_right >= 0,
        SOFTCAP=softcap_mode(shape.softcap), HAS_SINKS=sinks is not None, KV_FP8=kv_fp8,
        RETURN_LSE=return_lse,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None, SPLIT=num_splits > 1,
        PER_BLOCK_IDS=per_block_ids(shape.window_left >= 0, config.block_n, shape.block_size),
        QK_AHEAD=config.qk_ahead,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if plan.ws is not None and num_splits > 1:
        combine_splits(plan.ws, out, lse)
    return out if lse is None else (out, lse)
