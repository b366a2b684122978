"""Split-KV (flash-decoding) for the attention kernel: key-range slices and their merge.

With few query tiles (decode of a handful of long requests) the main grid has too few
programs to fill a GPU, so a third grid axis splits each request's keys into
``num_splits`` contiguous slices. Split ``s`` of a tile attends only its slice and stores
a normalised partial output and its log-sum-exp into fp32 workspaces; the combine kernel
here weighs the partials by ``exp(lse_s - max lse)``. A split that saw no key has
``lse_s = -inf`` and weight 0; a row no split saw gets output 0 and LSE ``-inf``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiling import MAX_SPLITS

__all__ = ["combine_splits", "split_workspaces", "splits_p2"]


@triton.jit
def _split_phases(kv_lo, full_lo, full_hi, kv_hi, split, num_splits, BLOCK_N: tl.constexpr):
    """The three phase ranges of the main kernel cut down to split ``split``'s key slice.

    Slice edges lie on ``full_lo + j * BLOCK_N`` so the unmasked phase keeps whole tiles:
    |<- j0 ... masked | full_lo: unmasked, BLOCK_N steps | full_hi: masked ... j1 ->|
    and every split gets ``per`` of the ``j1 - j0`` tiles (the last ones may get none).
    """
    j0 = (full_lo - kv_lo + BLOCK_N - 1) // BLOCK_N  # tiles left of full_lo (all terms >= 0)
    j1 = (tl.maximum(kv_hi - full_lo, 0) + BLOCK_N - 1) // BLOCK_N  # tiles from full_lo on
    per = (j0 + j1 + num_splits - 1) // num_splits
    lo = full_lo + (split * per - j0) * BLOCK_N
    hi = lo + per * BLOCK_N
    return (tl.maximum(kv_lo, lo), tl.minimum(full_lo, hi),
            tl.maximum(full_lo, lo), tl.minimum(full_hi, hi),
            tl.maximum(full_hi, lo), tl.minimum(kv_hi, hi))


# num_splits and the strides that follow total_q change from call to call: not specialised.
@triton.jit(do_not_specialize=["stride_ps", "stride_qs", "stride_qh", "stride_lh", "num_splits"])
def _combine_splits_kernel(
    part_ptr, part_lse_ptr, out_ptr, lse_ptr,
    stride_ps, stride_pt, stride_ph, stride_pd, stride_qs, stride_qh, stride_qt,
    stride_ot, stride_oh, stride_od, stride_lh, stride_lt, num_splits,
    SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)  # [SPLITS_P2]
    s_ok = s < num_splits
    d = tl.arange(0, DIM_P2)  # [DIM_P2]
    d_ok = d < HEAD_DIM
    lse_s = tl.load(part_lse_ptr + s.to(tl.int64) * stride_qs + head * stride_qh + tok * stride_qt,
                    mask=s_ok, other=float("-inf"))  # [SPLITS_P2], natural log
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key: all weights 0
    # A +inf LSE (a +inf sink, split 0) takes the row: its split weighs 1, not exp(inf - inf).
    w = tl.where(lse_s == float("inf"), 1.0, tl.exp(lse_s - m_safe))  # [SPLITS_P2]
    total = tl.sum(w, 0)
    total_safe = tl.where(total == 0.0, 1.0, total)
    p_off = s.to(tl.int64)[:, None] * stride_ps + tok * stride_pt + head * stride_ph + d[None, :] * stride_pd
    part = tl.load(part_ptr + p_off, mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # [SPLITS_P2, DIM_P2]
    o = tl.sum(part * w[:, None], 0) / total_safe  # [DIM_P2]
    o_off = tok * stride_ot + head * stride_oh + d * stride_od
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=d_ok)
    if RETURN_LSE:
        lse = tl.where(total == 0.0, float("-inf"), m_safe + tl.log(total_safe))
        tl.store(lse_ptr + head * stride_lh + tok * stride_lt, lse)


def splits_p2(num_splits: int) -> int:
    """Rows of the merge's split tile: ``MAX_SPLITS`` for every count the heuristic picks (one
    compiled variant), the next power of two for a larger forced count."""
    return max(MAX_SPLITS, triton.next_power_of_2(num_splits))


def split_workspaces(num_splits: int, total_q: int, num_heads: int, head_dim: int, device):
    """fp32 partial outputs ``[num_splits, total_q, num_heads, head_dim]`` and their LSE
    ``[num_splits, num_heads, total_q]``; every entry of a real row is written by the main
    kernel, so they start uninitialised."""
    part = torch.empty((num_splits, total_q, num_heads, head_dim), dtype=torch.float32, device=device)
    part_lse = torch.empty((num_splits, num_heads, total_q), dtype=torch.float32, device=device)
    return part, part_lse


def combine_splits(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """Merge the splits into ``out`` ``[total_q, num_heads, head_dim]`` (its dtype) and,
    when given, ``lse`` ``[num_heads, total_q]`` fp32. Grid: one program per (token, head)."""
    num_splits, total_q, num_heads, head_dim = part.shape
    lse_arg = lse if lse is not None else part_lse  # never written when RETURN_LSE is off
    _combine_splits_kernel[(total_q, num_heads)](
        part, part_lse, out, lse_arg, *part.stride(), *part_lse.stride(), *out.stride(),
        *(lse.stride() if lse is not None else (0, 0)), num_splits,
        SPLITS_P2=splits_p2(num_splits), HEAD_DIM=head_dim,
        DIM_P2=max(16, triton.next_power_of_2(head_dim)), RETURN_LSE=lse is not None,
    )
