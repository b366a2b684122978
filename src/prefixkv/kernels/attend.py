"""Key tiles of the attention kernel: load K/V through the block table, score, and fold
into the running (max, sum, output) of the online softmax.

Inlined into each phase loop of ``attention._paged_prefill_kernel`` (masked or not by the
``MASKED`` constexpr). Scores live in the exp2 domain: ``s * qk_scale`` with
``qk_scale = softmax_scale * log2(e)`` applied inside the max and as one FMA in the exp2
argument, so the scaled tile is never materialised.

Two loops over a phase's keys: :func:`_attend_range` one tile a pass (score, softmax, PV),
and, with ``QK_AHEAD``, one whose QK^T runs a tile ahead of the softmax, so that the tensor
cores compute the next tile's scores while this tile's softmax runs (see there).
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
def _block_ids(  # type: ignore[no-untyped-def]  # Triton JIT
    start_n, phase_hi, bt_row, last_block, stride_bc,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PER_BLOCK_IDS: tl.constexpr,
):
    """Block ids (int64, clamped into the cache) of the keys ``start_n ..``, read from the
    block-table row ``bt_row``: ``[BLOCK_N // BLOCK_SIZE, 1]`` with ``PER_BLOCK_IDS``, else
    ``[BLOCK_N]``."""
    if PER_BLOCK_IDS:
        # No left window and BLOCK_N % BLOCK_SIZE == 0: tiles start on multiples of BLOCK_N,
        # so a tile is whole blocks: one block id per block, [NB] -> [NB, BLOCK_SIZE] ->
        # [BLOCK_N], instead of one per key.
        NB: tl.constexpr = BLOCK_N // BLOCK_SIZE
        b = start_n // BLOCK_SIZE + tl.arange(0, NB)  # [NB]
        if MASKED:
            blk = tl.load(bt_row + b * stride_bc, mask=b * BLOCK_SIZE < phase_hi, other=0)
        else:
            blk = tl.load(bt_row + b * stride_bc)
        ids = tl.minimum(blk.to(tl.uint32), last_block).to(tl.int64)[:, None]  # [NB, 1], clamped as below
    else:
        col = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        if MASKED:
            blk = tl.load(bt_row + (col // BLOCK_SIZE) * stride_bc, mask=col < phase_hi, other=0)
        else:
            blk = tl.load(bt_row + (col // BLOCK_SIZE) * stride_bc)
        # A bad id reads a wrong block, never outside the cache: as uint32 a negative id is
        # above last_block, so one unsigned min clamps both ends (to the last block).
        ids = tl.minimum(blk.to(tl.uint32), last_block).to(tl.int64)
    return ids


@triton.jit  # type: ignore[untyped-decorator]  # Triton JIT
def _offsets(  # type: ignore[no-untyped-def]  # Triton JIT
    blk, start_n, stride_b, stride_s, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PER_BLOCK_IDS: tl.constexpr,
):
    """Offsets ``[BLOCK_N]`` (int64) of the keys ``start_n ..`` in a cache of block stride
    ``stride_b`` and slot stride ``stride_s``, from their :func:`_block_ids`."""
    # int64 before the multiply: block * stride passes 2^31 in large caches.
    if PER_BLOCK_IDS:
        slot = tl.arange(0, BLOCK_SIZE)[None, :]  # [1, BLOCK_SIZE]
        off = tl.reshape(blk * stride_b + slot * stride_s, [BLOCK_N])
    else:
        off = blk * stride_b + ((start_n + tl.arange(0, BLOCK_N)) % BLOCK_SIZE) * stride_s
    return off


@triton.jit  # type: ignore[untyped-decorator]  # Triton JIT
def _tile_offsets(  # type: ignore[no-untyped-def]  # Triton JIT
    start_n, phase_hi, bt_row, last_block, stride_bc, stride_b, stride_s,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PER_BLOCK_IDS: tl.constexpr,
):
    """:func:`_offsets` of the keys ``start_n ..``, reading their block ids."""
    blk = _block_ids(start_n, phase_hi, bt_row, last_block, stride_bc, BLOCK_SIZE, BLOCK_N, MASKED,
                     PER_BLOCK_IDS)
    return _offsets(blk, start_n, stride_b, stride_s, BLOCK_SIZE, BLOCK_N, PER_BLOCK_IDS)


@triton.jit  # type: ignore[untyped-decorator]  # Triton JIT
def _keys(  # type: ignore[no-untyped-def]  # Triton JIT
    q, d, d_ok, k_off, start_n, phase_hi, k_base, stride_kd,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, MASKED: tl.constexpr,
):
    """K^T of the keys ``start_n ..`` at ``k_off``: ``[DIM_P2, BLOCK_N]`` in q's dtype."""
    if MASKED:
        col_ok = start_n + tl.arange(0, BLOCK_N) < phase_hi  # never load past the phase (or kv_len)
        k = tl.load(k_base + k_off[None, :] + d[:, None] * stride_kd,
                    mask=col_ok[None, :] & d_ok[:, None], other=0.0)  # [DIM_P2, BLOCK_N]
    elif HEAD_DIM != DIM_P2:  # whole tiles, padded head_dim: mask the dims only
        k = tl.load(k_base + k_off[None, :] + d[:, None] * stride_kd, mask=d_ok[:, None], other=0.0)
    else:
        k = tl.load(k_base + k_off[None, :] + d[:, None] * stride_kd)
    # fp8 caches: widen to q's dtype in registers; their scales are folded into qk_scale and the output.
    return k.to(q.dtype)


@triton.jit  # type: ignore[untyped-decorator]  # Triton JIT
def _values(  # type: ignore[no-untyped-def]  # Triton JIT
    q, d, d_ok, v_off, start_n, phase_hi, v_base, stride_vd,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, MASKED: tl.constexpr,
):
    """V of the keys ``start_n ..`` at ``v_off``: ``[BLOCK_N, DIM_P2]`` in q's dtype."""
    if MASKED:
        col_ok = start_n + tl.arange(0, BLOCK_N) < phase_hi
        v = tl.load(v_base + v_off[:, None] + d[None, :] * stride_vd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, DIM_P2]
    elif HEAD_DIM != DIM_P2:
        v = tl.load(v_base + v_off[:, None] + d[None, :] * stride_vd, mask=d_ok[None, :], other=0.0)
    else:
        v = tl.load(v_base + v_off[:, None] + d[None, :] * stride_vd)
    return v.to(q.dtype)  # fp8 caches: widened in registers, as K


@triton.jit  # type: ignore[untyped-decorator]  # Triton JIT
def _fold(  # type: ignore[no-untyped-def]  # Triton JIT
    acc, l_i, m_i, s, v, pos, start_n, phase_hi, qk_scale, softcap_log2, window_left, window_right,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold the scores ``s`` of the keys ``start_n ..`` into (acc, l_i, m_i): mask, online
    softmax, and ``P @ V``."""
    col = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    if SOFTCAP:
        s = softcap_log2 * _tanh(s * qk_scale)  # qk_scale = softmax_scale / softcap here
        s_scale = 1.0
    else:
        # qk_scale = softmax_scale * log2(e) (> 0): scores in the exp2 domain are s * qk_scale,
        # applied inside the max and as one FMA in the exp2 argument below.
        s_scale = qk_scale
    if MASKED:
        allowed = (col < phase_hi)[None, :]  # broadcast to [BLOCK_M, BLOCK_N] below
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


@triton.jit  # type: ignore[untyped-decorator]  # Triton JIT
def _attend_range(  # type: ignore[no-untyped-def]  # Triton JIT
    acc, l_i, m_i, q, pos, d, d_ok, lo, hi, k_base, v_base, bt_row, last_block,
    stride_bc, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
    qk_scale, softcap_log2, window_left, window_right,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, PER_BLOCK_IDS: tl.constexpr, QK_AHEAD: tl.constexpr,
):
    """Attend the keys ``[lo, hi)`` in tiles of ``BLOCK_N`` (``lo`` a tile start; with
    ``MASKED`` False every tile must be whole and inside the cache).

    ``QK_AHEAD``: the scores of tile j+1 are issued before the softmax of tile j and carried
    to the next pass, so on Hopper the wgmma of QK^T(j+1) runs while tile j's softmax does
    (Triton keeps a dot asynchronous when its result is only carried to the next pass and
    read there after the pass's first wait, the one that follows PV(j)):

        pass j: | softmax(j)  ~  QK^T(j+1) on the tensor cores | PV(j), wait | issue QK^T(j+2) |

    Costs one more ``[BLOCK_M, BLOCK_N]`` fp32 tile of registers, and the last two passes
    score a tile again (the last one: clamped, so no load leaves the phase) and drop it.
    """
    if QK_AHEAD:
        last = lo + tl.maximum(hi - lo - 1, 0) // BLOCK_N * BLOCK_N  # start of the last tile
        # Masked loads before the loop: the range may be empty.
        second = tl.minimum(lo + BLOCK_N, last)
        k_off = _tile_offsets(lo, hi, bt_row, last_block, stride_bc, stride_kb, stride_ks,
                              BLOCK_SIZE, BLOCK_N, True, PER_BLOCK_IDS)
        k = _keys(q, d, d_ok, k_off, lo, hi, k_base, stride_kd, BLOCK_N, HEAD_DIM, DIM_P2, True)
        s_cur = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32, unscaled
        k_off = _tile_offsets(second, hi, bt_row, last_block, stride_bc, stride_kb, stride_ks,
                              BLOCK_SIZE, BLOCK_N, True, PER_BLOCK_IDS)
        k = _keys(q, d, d_ok, k_off, second, hi, k_base, stride_kd, BLOCK_N, HEAD_DIM, DIM_P2, True)
        s_nxt = tl.dot(q, k, input_precision=DOT_PRECISION)
        for start_n in range(lo, hi, BLOCK_N):
            v_off = _tile_offsets(start_n, hi, bt_row, last_block, stride_bc, stride_vb, stride_vs,
                                  BLOCK_SIZE, BLOCK_N, MASKED, PER_BLOCK_IDS)
            v = _values(q, d, d_ok, v_off, start_n, hi, v_base, stride_vd, BLOCK_N, HEAD_DIM, DIM_P2, MASKED)
            acc, l_i, m_i = _fold(acc, l_i, m_i, s_cur, v, pos, start_n, hi, qk_scale, softcap_log2,
                                  window_left, window_right, BLOCK_N, MASKED, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                                  DOT_PRECISION)
            # A copy after the pass's wait, not a rename: Triton keeps QK^T(j+2) asynchronous only
            # when the scores it carries are read after that wait, and it pipelines no load of
            # a loop that passes a dot's result through two passes untouched (sm_90 compile).
            s_cur = s_nxt + 0.0
            ahead = tl.minimum(start_n + 2 * BLOCK_N, last)
            k_off = _tile_offsets(ahead, hi, bt_row, last_block, stride_bc, stride_kb, stride_ks,
                                  BLOCK_SIZE, BLOCK_N, MASKED, PER_BLOCK_IDS)
            k = _keys(q, d, d_ok, k_off, ahead, hi, k_base, stride_kd, BLOCK_N, HEAD_DIM, DIM_P2, MASKED)
            s_nxt = tl.dot(q, k, input_precision=DOT_PRECISION)
    else:
        for start_n in range(lo, hi, BLOCK_N):
            # One block-id read serves K and V.
            blk = _block_ids(start_n, hi, bt_row, last_block, stride_bc, BLOCK_SIZE, BLOCK_N, MASKED,
                             PER_BLOCK_IDS)
            k_off = _offsets(blk, start_n, stride_kb, stride_ks, BLOCK_SIZE, BLOCK_N, PER_BLOCK_IDS)
            v_off = _offsets(blk, start_n, stride_vb, stride_vs, BLOCK_SIZE, BLOCK_N, PER_BLOCK_IDS)
            # K and V load before the score, as they always did (V loaded after the softmax made
            # the fp8 decode tile spill 112 B: sm_90 compile).
            k = _keys(q, d, d_ok, k_off, start_n, hi, k_base, stride_kd, BLOCK_N, HEAD_DIM, DIM_P2, MASKED)
            v = _values(q, d, d_ok, v_off, start_n, hi, v_base, stride_vd, BLOCK_N, HEAD_DIM, DIM_P2, MASKED)
            s = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32, unscaled
            acc, l_i, m_i = _fold(acc, l_i, m_i, s, v, pos, start_n, hi, qk_scale, softcap_log2, window_left,
                                  window_right, BLOCK_N, MASKED, HAS_LEFT, HAS_RIGHT, SOFTCAP, DOT_PRECISION)
    return acc, l_i, m_i
