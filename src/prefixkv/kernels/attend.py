"""One key tile of the attention kernel: load K/V through the block table, score, and fold
into the running (max, sum, output) of the online softmax.

Inlined into each phase loop of ``attention._paged_prefill_kernel`` (masked or not by the
``MASKED`` constexpr). Scores live in the exp2 domain: ``s * qk_scale`` with
``qk_scale = softmax_scale * log2(e)`` applied inside the max and as one FMA in the exp2
argument, so the scaled tile is never materialised.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):  # type: ignore[no-untyped-def]  # Triton JIT
    # 1 - 2 / (e^(2x) + 1): saturates to exactly +-1, never NaN.
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _max(a, b):  # type: ignore[no-untyped-def]  # Triton JIT
    return tl.maximum(a, b)


@triton.jit  # type: ignore[untyped-decorator]  # Triton JIT
def _attend_tile(  # type: ignore[no-untyped-def]  # Triton JIT
    acc, l_i, m_i, q, pos, d, d_ok, start_n, phase_hi,
    k_base, v_base, bt_row, last_block,
    stride_bc, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
    qk_scale, softcap_log2, window_left, window_right,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, PER_BLOCK_IDS: tl.constexpr,
):
    col = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    col_ok = col < phase_hi if MASKED else col >= 0  # [BLOCK_N]; never load past the phase (or kv_len)
    if PER_BLOCK_IDS:
        # No left window and BLOCK_N % BLOCK_SIZE == 0: tiles start on multiples of BLOCK_N,
        # so a tile is whole blocks: one block id per block, [NB] -> [NB, BLOCK_SIZE] ->
        # [BLOCK_N], instead of one per key.
        NB: tl.constexpr = BLOCK_N // BLOCK_SIZE
        b = start_n // BLOCK_SIZE + tl.arange(0, NB)  # [NB]
        if MASKED:
            blk_b = tl.load(bt_row + b * stride_bc, mask=b * BLOCK_SIZE < phase_hi, other=0)
        else:
            blk_b = tl.load(bt_row + b * stride_bc)
        blk_b = tl.minimum(blk_b.to(tl.uint32), last_block).to(tl.int64)[:, None]  # [NB, 1], clamped as below
        slot = tl.arange(0, BLOCK_SIZE)[None, :]  # [1, BLOCK_SIZE]
        k_off = tl.reshape(blk_b * stride_kb + slot * stride_ks, [BLOCK_N])
        v_off = tl.reshape(blk_b * stride_vb + slot * stride_vs, [BLOCK_N])
    else:
        if MASKED:
            blk = tl.load(bt_row + (col // BLOCK_SIZE) * stride_bc, mask=col_ok, other=0)
        else:
            blk = tl.load(bt_row + (col // BLOCK_SIZE) * stride_bc)
        # A bad id reads a wrong block, never outside the cache: as uint32 a negative id is
        # above last_block, so one unsigned min clamps both ends (to the last block).
        blk = tl.minimum(blk.to(tl.uint32), last_block).to(tl.int64)
        # int64 before the multiply: block * stride passes 2^31 in large caches.
        k_off = blk * stride_kb + (col % BLOCK_SIZE) * stride_ks  # [BLOCK_N]
        v_off = blk * stride_vb + (col % BLOCK_SIZE) * stride_vs  # [BLOCK_N]
    if MASKED or HEAD_DIM != DIM_P2:
        k = tl.load(k_base + k_off[None, :] + d[:, None] * stride_kd,
                    mask=col_ok[None, :] & d_ok[:, None], other=0.0)  # [DIM_P2, BLOCK_N]
        v = tl.load(v_base + v_off[:, None] + d[None, :] * stride_vd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, DIM_P2]
    else:
        k = tl.load(k_base + k_off[None, :] + d[:, None] * stride_kd)
        v = tl.load(v_base + v_off[:, None] + d[None, :] * stride_vd)
    # fp8 caches: widen to q's dtype in registers; their scales are folded into qk_scale and the output.
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
    if SOFTCAP:
        s = softcap_log2 * _tanh(s * qk_scale)  # qk_scale = softmax_scale / softcap here
        s_scale = 1.0
    else:
        # qk_scale = softmax_scale * log2(e) (> 0): scores in the exp2 domain are s * qk_scale,
        # applied inside the max and as one FMA in the exp2 argument below.
        s_scale = qk_scale
    if MASKED:
        allowed = col_ok[None, :]  # broadcast to [BLOCK_M, BLOCK_N] below
        if HAS_RIGHT:
            allowed = allowed & (col[None, :] <= pos[:, None] + window_right)
        if HAS_LEFT:
            allowed = allowed & (col[None, :] >= pos[:, None] - window_left)
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)  # [BLOCK_M]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # empty rows so far: no -inf - -inf
    alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
    p = tl.exp2(s * s_scale - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new
