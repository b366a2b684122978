"""The merge of cascade attention's two passes on the Triton path, in place: one launch.

For each row ``r`` of the prefix pass (the packed q rows of the groups' members) and each
head, the own-part result of its token ``tok = rows[r]``, already in ``out``/``lse``, and
the prefix pass's ``pre[r]``/``pre_lse[r]`` are weighed by ``exp(lse - max)`` into
``out[tok]`` and ``lse[tok]`` (as :func:`~prefixkv.kernels.merge_attention`: a row
neither pass saw gets 0 and ``-inf``, a ``+inf`` LSE takes the row). Each program reads
and writes only its own token's row (rows are distinct), so no gather, copy or scatter
of the rows is needed around it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["merge_rows"]


# The LSE tensors' head strides are their row counts: they change with the batch.
@triton.jit(do_not_specialize=["stride_lh", "stride_ph2"])  # type: ignore[untyped-decorator]  # Triton JIT
def _merge_rows_kernel(  # type: ignore[no-untyped-def]  # Triton JIT
    out_ptr, lse_ptr, pre_ptr, pre_lse_ptr, rows_ptr,
    stride_ot, stride_oh, stride_od, stride_lh, stride_lt,
    stride_pt, stride_ph, stride_pd, stride_ph2, stride_pt2,
    HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)  # a packed row of the prefix pass
    head = tl.program_id(1).to(tl.int64)
    tok = tl.load(rows_ptr + r).to(tl.int64)  # its token (row of out)
    d = tl.arange(0, DIM_P2)  # [DIM_P2]
    d_ok = d < HEAD_DIM
    lse_a = tl.load(lse_ptr + head * stride_lh + tok * stride_lt)  # own part, natural log
    lse_b = tl.load(pre_lse_ptr + head * stride_ph2 + r * stride_pt2)  # shared prefix
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # neither saw a key: both weights 0
    # A +inf LSE (a +inf sink, own part) takes the row: it weighs 1, not exp(inf - inf).
    w_a = tl.where(lse_a == float("inf"), 1.0, tl.exp(lse_a - m_safe))
    w_b = tl.where(lse_b == float("inf"), 1.0, tl.exp(lse_b - m_safe))
    total = w_a + w_b
    total_safe = tl.where(total == 0.0, 1.0, total)
    o_off = tok * stride_ot + head * stride_oh + d * stride_od
    o_a = tl.load(out_ptr + o_off, mask=d_ok, other=0.0).to(tl.float32)  # [DIM_P2]
    o_b = tl.load(pre_ptr + r * stride_pt + head * stride_ph + d * stride_pd, mask=d_ok,
                  other=0.0).to(tl.float32)  # [DIM_P2]
    o = (o_a * w_a + o_b * w_b) / total_safe
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=d_ok)
    tl.store(lse_ptr + head * stride_lh + tok * stride_lt,
             tl.where(total == 0.0, float("-inf"), m_safe + tl.log(total_safe)))


def merge_rows(out: torch.Tensor, lse: torch.Tensor, pre: torch.Tensor, pre_lse: torch.Tensor,
               rows: torch.Tensor) -> None:
    """Merge the prefix pass into the own part, in place (module docstring).

    ``out``: ``[total_q, num_heads, head_dim]`` and ``lse`` ``[num_heads, total_q]`` fp32,
    the own-part pass's results; ``pre``: ``[num_rows, num_heads, head_dim]`` and
    ``pre_lse`` ``[num_heads, num_rows]`` fp32, the prefix pass's; ``rows``: ``[num_rows]``
    int64 distinct tokens of ``out``. Validated by the caller (``cascade_attention``).
    """
    num_rows, num_heads, head_dim = pre.shape
    if num_rows == 0:
        return
    _merge_rows_kernel[(num_rows, num_heads)](
        out, lse, pre, pre_lse, rows, *out.stride(), *lse.stride(), *pre.stride(), *pre_lse.stride(),
        HEAD_DIM=head_dim, DIM_P2=max(16, triton.next_power_of_2(head_dim)),
    )
