"""Split-KV (flash-decoding) for the attention kernel: key-range slices and their merge.

With few query tiles (decode of a handful of long requests) the main grid has too few
programs to fill a GPU, so a third grid axis splits each request's keys into
``num_splits`` contiguous slices. Split ``s`` of a tile attends only its slice and stores
a normalised partial output and its log-sum-exp into fp32 workspaces; the combine kernel
here weighs the partials by ``exp(lse_s - max lse)``. A split that saw no key has
``lse_s = -inf`` and weight 0; a row no split saw gets output 0 and LSE ``-inf``.

Per request: only tiles of requests with at most ``split_q`` new tokens split, each into
``min(num_splits, its keys // min_keys)`` slices, and their partials go to workspace row
``request * split_q + query``; every other tile runs whole in split 0 and writes the
output itself. So a long decode is split inside a batch that also holds prefills, and
the merge visits only the rows that split (``row_tok``: each row's token, -1 for none).
With a :class:`SplitWorkspace` made once, the split axis and the workspace are fixed:
the launch is the same for every step and CUDA graphs can capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiling import MAX_SPLITS
from .workspace import SplitWorkspace

__all__ = ["combine_splits", "splits_p2"]


@triton.jit  # type: ignore[untyped-decorator]  # Triton JIT
def _split_phases(kv_lo, full_lo, full_hi, kv_hi, split, num_splits, BLOCK_N: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton JIT
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


# num_splits and the workspace's strides change from call to call: not specialised.
@triton.jit(do_not_specialize=["stride_ps", "stride_pr", "stride_qs", "stride_qh", "stride_lh", "num_splits"])  # type: ignore[untyped-decorator]  # Triton JIT
def _combine_splits_kernel(  # type: ignore[no-untyped-def]  # Triton JIT
    part_ptr, part_lse_ptr, row_tok_ptr, out_ptr, lse_ptr,
    stride_ps, stride_pr, stride_ph, stride_pd, stride_qs, stride_qh, stride_qr,
    stride_ot, stride_oh, stride_od, stride_lh, stride_lt, num_splits,
    SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # a workspace row; its token is row_tok[row] (-1: none)
    head = tl.program_id(1)
    tok = tl.load(row_tok_ptr + row).to(tl.int64)
    if tok >= 0:
        s = tl.arange(0, SPLITS_P2)  # [SPLITS_P2]
        s_ok = s < num_splits
        d = tl.arange(0, DIM_P2)  # [DIM_P2]
        d_ok = d < HEAD_DIM
        lse_s = tl.load(part_lse_ptr + s.to(tl.int64) * stride_qs + head * stride_qh + row * stride_qr,
                        mask=s_ok, other=float("-inf"))  # [SPLITS_P2], natural log
        m = tl.max(lse_s, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key: all weights 0
        # A +inf LSE (a +inf sink, split 0) takes the row: its split weighs 1, not exp(inf - inf).
        w = tl.where(lse_s == float("inf"), 1.0, tl.exp(lse_s - m_safe))  # [SPLITS_P2]
        total = tl.sum(w, 0)
        total_safe = tl.where(total == 0.0, 1.0, total)
        p_off = (s.to(tl.int64)[:, None] * stride_ps + row * stride_pr + head * stride_ph
                 + d[None, :] * stride_pd)
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
    p2: int = triton.next_power_of_2(num_splits)
    return max(MAX_SPLITS, p2)


def combine_splits(ws: SplitWorkspace, out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """Merge the splits of every workspace row that has a token into ``out`` ``[total_q,
    num_heads, head_dim]`` (its dtype) and, when given, ``lse`` ``[num_heads, total_q]``
    fp32. Grid: one program per (workspace row, head); rows without a token return."""
    num_splits, rows, num_heads, head_dim = ws.part.shape
    lse_arg = lse if lse is not None else ws.part_lse  # never written when RETURN_LSE is off
    _combine_splits_kernel[(rows, num_heads)](
        ws.part, ws.part_lse, ws.row_tok, out, lse_arg, *ws.part.stride(), *ws.part_lse.stride(),
        *out.stride(),
        *(lse.stride() if lse is not None else (0, 0)), num_splits,
        SPLITS_P2=splits_p2(num_splits), HEAD_DIM=head_dim,
        DIM_P2=max(16, triton.next_power_of_2(head_dim)), RETURN_LSE=lse is not None,
    )
