"""Pure-torch reference of the kernels: the test oracle and the CPU fallback.

Same signatures, the same argument checks and the same answer to untrusted metadata as
the Triton path (clamped lengths, bad block ids read as the last block, skipped slots, zero rows outside
``cu_seqlens_q``; docs/kv_layout.md). Attention is computed per request in fp32 on a
gathered contiguous copy of its keys and values, so it is slow and reads lengths on the
host; it is written to be obviously right, not fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..core.block import blocks_for
from .call import AttentionCall
from .fp8 import dequantize, quantize
from .validation import check_attention, check_write_kv

if TYPE_CHECKING:
    from .workspace import SplitWorkspace

__all__ = ["write_kv_cache_reference", "paged_prefill_attention_reference"]


def write_kv_cache_reference(
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
    """Reference of :func:`prefixkv.kernels.write_kv_cache` (same contract)."""
    check_write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, checked=checked)
    num_blocks, block_size = k_cache.shape[:2]
    keep = (slot_mapping >= 0) & (slot_mapping < num_blocks * block_size)
    slots = slot_mapping[keep].to(torch.int64)
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = quantize(key[keep], k_scale, k_cache.dtype)
    v_cache[blocks, offsets] = quantize(value[keep], v_scale, v_cache.dtype)


def _mask(q_len: int, kv_len: int, left: int, right: int, device: torch.device) -> torch.Tensor:
    """``[q_len, kv_len]`` bool, True where query i may attend key j.

    Geometry of one request (bottom-right alignment)::

        keys     | cached prefix (kv_len - q_len) | new tokens (q_len) |
        query i  sits at key position  pos(i) = kv_len - q_len + i

    and attends keys j with ``pos(i) - left <= j <= pos(i) + right`` (-1: no bound).
    """
    pos = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    j = torch.arange(kv_len, device=device)[None, :]
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if right >= 0:
        allowed &= j <= pos + right
    if left >= 0:
        allowed &= j >= pos - left
    return allowed


def _row_bounds(cu_seqlens_q: list[int], total_q: int) -> list[int]:
    """``cu_seqlens_q`` as the kernel reads it: each entry clamped to ``[0, total_q]``,
    then raised to the largest entry before it, so requests own disjoint rows of q."""
    bounds, top = [], 0
    for c in cu_seqlens_q:
        top = max(top, min(max(c, 0), total_q))
        bounds.append(top)
    return bounds


def paged_prefill_attention_reference(
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
    checked: bool = False,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    split_workspace: SplitWorkspace | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`prefixkv.kernels.paged_prefill_attention` (same contract; a
    ``split_workspace`` is checked and not used: nothing is split here).

    A sink is one more logit per head in each row's softmax, with no value: the row's
    scores get a last column ``sinks[head]``, the softmax runs over all columns, and the
    sink's column is dropped before multiplying by V. A NaN sink is no sink (``-inf``); a
    ``+inf`` sink takes the whole softmax: output 0, LSE ``+inf``.
    """
    shape = check_attention(AttentionCall(
        q, k_cache, v_cache, block_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap, out=out,
        return_lse=return_lse, sinks=sinks, k_scale=k_scale, v_scale=v_scale, checked=checked,
        split_workspace=split_workspace))
    bs, group = shape.block_size, shape.group
    if out is None:
        out = torch.empty_like(q)
    lse = torch.full((shape.num_heads, shape.total_q), float("-inf"), dtype=torch.float32, device=q.device)
    starts = _row_bounds(cu_seqlens_q.tolist(), shape.total_q)
    out[: starts[0]] = 0  # rows no request owns
    out[starts[-1]:] = 0
    capacity = shape.max_blocks * bs
    if sinks is not None:  # a NaN sink is no sink
        sink = torch.where(torch.isnan(sinks), float("-inf"), sinks.float())
    kv_lens = [min(max(n, 0), capacity) for n in seqused_k.tolist()]
    for i in range(shape.batch):
        q_lo, q_hi, kv_len = starts[i], starts[i + 1], kv_lens[i]
        q_len = q_hi - q_lo
        if q_len <= 0:
            continue
        n_blk = blocks_for(kv_len, bs)
        blocks = block_table[i, :n_blk].to(torch.int64)
        last = shape.num_blocks - 1
        blocks = torch.where((blocks < 0) | (blocks > last), last, blocks)  # as the kernel: the last block
        # Keys below lo lie left of every query's window: never read, as in the kernel (a
        # released block there may hold NaN, and 0 * NaN would leak through p @ v).
        lo = max(0, kv_len - q_len - shape.window_left) if shape.window_left >= 0 else 0
        # [kv_len - lo, num_kv_heads, head_dim] -> [num_heads, kv_len - lo, head_dim]
        k = dequantize(k_cache[blocks].flatten(0, 1)[lo:kv_len], k_scale)  # fp32, scales applied
        v = dequantize(v_cache[blocks].flatten(0, 1)[lo:kv_len], v_scale)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qi = q[q_lo:q_hi].float().transpose(0, 1)  # [num_heads, q_len, head_dim]
        s = qi @ k.transpose(1, 2) * shape.softmax_scale  # [num_heads, q_len, kv_len]
        if shape.softcap > 0:
            s = shape.softcap * torch.tanh(s / shape.softcap)
        allowed = _mask(q_len, kv_len, shape.window_left, shape.window_right, q.device)[:, lo:]
        s = s.masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # [num_heads, q_len, kv_len + 1]: the sink is the last column
            s = torch.cat([s, sink[:, None, None].expand(-1, q_len, 1)], dim=-1)
        row_lse = torch.logsumexp(s, dim=-1)  # [num_heads, q_len]; -inf where nothing is allowed
        safe = torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse))
        p = torch.exp(s - safe[..., None])[..., :kv_len - lo]  # exactly 0 on masked keys, even in empty rows
        if sinks is not None:  # a +inf sink takes the whole row: output 0 (its LSE is +inf already)
            p = torch.where(sink[:, None, None] == float("inf"), 0.0, p)
        out[q_lo:q_hi] = (p @ v).transpose(0, 1).to(out.dtype)
        lse[:, q_lo:q_hi] = row_lse
    return (out, lse) if return_lse else out
