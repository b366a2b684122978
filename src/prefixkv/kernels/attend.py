"""Key tiles of the attention kernel: score (K/V read through the block table by
``gather.py``) and fold into the running (max, sum, output) of the online softmax.

Inlined into each phase loop of ``prefill_kernel._paged_prefill_kernel`` (masked or not by the
``MASKED`` constexpr). Scores live in the exp2 domain: ``s * qk_scale`` with
``qk_scale = softmax_scale * log2(e)`` applied inside the max and as one FMA in the exp2
argument, so the scaled tile is never materialised.

Loops over a phase's keys in :func:`_attend_range`: one tile a pass (score, softmax, PV),
and, with ``QK_AHEAD``, loops whose MMAs run ahead of the softmax, so that the tensor
cores work while the softmax runs (see there).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .gather import _block_ids, _keys, _offsets, _tile_offsets, _values


@triton.jit
def _tanh(x):  # type: ignore[no-untyped-def]  # Triton JIT
    # 1 - 2 / (e^(2x) + 1): saturates to exactly +-1, never NaN.
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _tanh_precise(x):  # type: ignore[no-untyped-def]  # Triton JIT
    # tanh to float32 precision at every |x|: exactly +-1 from |x| ~ 9 on, NaN only for a
    # NaN x. (_tanh cancels near 0 and keeps an absolute ~1.6e-7 there, which a large cap
    # multiplies into the scores: 1e-3 at a cap of 1e4.)
    # |x| < 0.5: x * P(x^2), an odd polynomial fitted to tanh(x) / x (error 3e-10).
    # Else sign(x) (1 - e) / (1 + e) with e = e^(-2|x|) in [0, e^-1]: no cancellation, no
    # overflow (e^(+2|x|) would be inf past |x| ~ 44).
    a = tl.abs(x)
    e = tl.exp2(a * -2.8853900817779268)  # -2 log2(e)
    t = (1.0 - e) / (1.0 + e)
    c = tl.minimum(a, 0.5)  # the polynomial's branch only: no overflow on the other
    x2 = c * c
    p = -0.006611625598863385 * x2 + 0.02127358791183489
    p = p * x2 - 0.05389317323919792
    p = p * x2 + 0.13332899754094918
    p = p * x2 - 0.33333324098601314
    p = p * x2 + 0.9999999996776918
    return tl.where(a < 0.5, x * p, tl.where(x < 0.0, -t, t))


@triton.jit
def _max(a, b):  # type: ignore[no-untyped-def]  # Triton JIT
    return tl.maximum(a, b)


@triton.jit  # type: ignore[untyped-decorator]  # Triton JIT
def _score(  # type: ignore[no-untyped-def]  # Triton JIT
    q, d, d_ok, start_n, phase_hi, k_base, bt_row, last_block, stride_bc, stride_kb, stride_ks, stride_kd,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    MASKED: tl.constexpr, PER_BLOCK_IDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``Q @ K^T`` of the keys ``start_n ..``: ``[BLOCK_M, BLOCK_N]`` fp32, unscaled."""
    k_off = _tile_offsets(start_n, phase_hi, bt_row, last_block, stride_bc, stride_kb, stride_ks,
                          BLOCK_SIZE, BLOCK_N, MASKED, PER_BLOCK_IDS)
    k = _keys(q, d, d_ok, k_off, start_n, phase_hi, k_base, stride_kd, BLOCK_N, HEAD_DIM, DIM_P2, MASKED)
    return tl.dot(q, k, input_precision=DOT_PRECISION)


@triton.jit  # type: ignore[untyped-decorator]  # Triton JIT
def _softmax(  # type: ignore[no-untyped-def]  # Triton JIT
    m_i, s, pos, start_n, phase_hi, qk_scale, softcap_log2, window_left, window_right,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """The online softmax of the scores ``s`` of the keys ``start_n ..``: mask, new running max
    ``m_new``, ``alpha = exp2(m_i - m_new)`` (the rescale of what came before) and
    ``p = exp2(s - m_new)`` ``[BLOCK_M, BLOCK_N]`` fp32. ``SOFTCAP``: 0 none, 1 capped with
    :func:`_tanh`, 2 with :func:`_tanh_precise` (:func:`attention.softcap_mode`)."""
    col = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    if SOFTCAP == 2:  # a large cap (attention.softcap_mode): tanh's precise form
        s = softcap_log2 * _tanh_precise(s * qk_scale)  # qk_scale = softmax_scale / softcap here
        s_scale = 1.0
    elif SOFTCAP:
        s = softcap_log2 * _tanh(s * qk_scale)
        s_scale = 1.0
    else:
        # qk_scale = softmax_scale * log2(e) (> 0): scores in the exp2 domain are s * qk_scale,
        # applied inside the max and as one FMA in the exp2 argument below.
        s_scale = qk_scale
    if MASKED:
        if HAS_RIGHT:
            # One compare a score: each row's limit is the phase end or its right window edge,
            # whichever comes first (window_right <= 2^30: no overflow, validation._window).
            # The column offsets (iota) against each row's limit less the tile's start.
            limit = tl.minimum(pos + window_right + 1, phase_hi) - start_n  # [BLOCK_M]
            allowed = tl.arange(0, BLOCK_N)[None, :] < limit[:, None]  # [BLOCK_M, BLOCK_N]
        else:
            allowed = (col < phase_hi)[None, :]  # broadcast to [BLOCK_M, BLOCK_N] below
        if HAS_LEFT:
            allowed = allowed & (col[None, :] >= pos[:, None] - window_left)
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)  # [BLOCK_M]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # empty rows so far: no -inf - -inf
    alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
    p = tl.exp2(s * s_scale - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
    return p, alpha, m_new


@triton.jit  # type: ignore[untyped-decorator]  # Triton JIT
def _fold(  # type: ignore[no-untyped-def]  # Triton JIT
    acc, l_i, m_i, s, v, pos, start_n, phase_hi, qk_scale, softcap_log2, window_left, window_right,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold the scores ``s`` of the keys ``start_n ..`` into (acc, l_i, m_i): mask, online
    softmax, and ``P @ V``."""
    p, alpha, m_new = _softmax(m_i, s, pos, start_n, phase_hi, qk_scale, softcap_log2, window_left,
                               window_right, BLOCK_N, MASKED, HAS_LEFT, HAS_RIGHT, SOFTCAP)
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

    ``QK_AHEAD``: QK^T runs ahead of the softmax, so that on Hopper the tensor cores work
    while the softmax does. Triton (sm_90) leaves a wgmma running across a pass only when
    its result is carried to the next pass and read there after the pass's first
    ``wait 0``, which ends every wgmma in flight; a dot read before any such wait gets
    one right after it. Two loops follow from that:

    - unmasked (the cached prefix, most of the keys): PV a pass behind the softmax. Pass j
      starts with the one synchronous wgmma (16 columns of zeros, added to l_i as 0)
      whose wait ends PV(j-1) and QK^T(j+1); then QK^T(j+2) and PV(j) (P of tile j, from
      the pass before) are issued and left running while tile j+1's softmax runs::

          pass j: | wait | issue QK^T(j+2), PV(j) | softmax(j+1)  ~  both on the tensor cores |

      so both MMAs of a tile overlap the softmax, and only the rescale of the accumulator
      and the copy of S(j+1) stand between the wait and the tensor cores. Before the loop
      tile 0 is scored and its softmax taken (masked loads: the range may be empty), after
      it the last tile's PV runs.
    - masked (the diagonal and window edges): QK^T(j+1) alone runs ahead, across tile j's
      softmax; PV(j) is waited for at once::

          pass j: | softmax(j)  ~  QK^T(j+1) on the tensor cores | PV(j), wait | issue QK^T(j+2) |

    S is copied (``s_nxt + 0.0``) after the wait rather than renamed: the copy frees the
    registers QK^T(j+2) writes, and a register move at the loop's back edge would read an
    accumulator in flight, which makes ptxas serialise every wgmma of the kernel (C7514,
    sm_90 compile). Both cost one more ``[BLOCK_M, BLOCK_N]`` fp32 tile of registers, and
    the last passes score a tile again (clamped, so no load leaves the phase) and drop it.
    """
    if QK_AHEAD:
        last = lo + tl.maximum(hi - lo - 1, 0) // BLOCK_N * BLOCK_N  # start of the last tile
        second = tl.minimum(lo + BLOCK_N, last)
        # S(0) and S(1) before the loop, from masked loads: the range may be empty.
        s = _score(q, d, d_ok, lo, hi, k_base, bt_row, last_block, stride_bc, stride_kb, stride_ks,
                   stride_kd, BLOCK_SIZE, BLOCK_N, HEAD_DIM, DIM_P2, True, PER_BLOCK_IDS, DOT_PRECISION)
        s_nxt = _score(q, d, d_ok, second, hi, k_base, bt_row, last_block, stride_bc, stride_kb, stride_ks,
                       stride_kd, BLOCK_SIZE, BLOCK_N, HEAD_DIM, DIM_P2, True, PER_BLOCK_IDS, DOT_PRECISION)
        if MASKED:
            for start_n in range(lo, hi, BLOCK_N):
                v_off = _tile_offsets(start_n, hi, bt_row, last_block, stride_bc, stride_vb, stride_vs,
                                      BLOCK_SIZE, BLOCK_N, True, PER_BLOCK_IDS)
                v = _values(q, d, d_ok, v_off, start_n, hi, v_base, stride_vd, BLOCK_N, HEAD_DIM, DIM_P2,
                            True)
                acc, l_i, m_i = _fold(acc, l_i, m_i, s, v, pos, start_n, hi, qk_scale, softcap_log2,
                                      window_left, window_right, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                                      DOT_PRECISION)
                s = s_nxt + 0.0  # the copy after the wait (docstring)
                ahead = tl.minimum(start_n + 2 * BLOCK_N, last)
                s_nxt = _score(q, d, d_ok, ahead, hi, k_base, bt_row, last_block, stride_bc, stride_kb,
                               stride_ks, stride_kd, BLOCK_SIZE, BLOCK_N, HEAD_DIM, DIM_P2, True,
                               PER_BLOCK_IDS, DOT_PRECISION)
        else:
            # Tile 0's softmax before the loop; pass j then takes PV of tile j = lo .. last - 1
            # and the softmax of tile j + 1.
            p, alpha, m_i = _softmax(m_i, s, pos, lo, hi, qk_scale, softcap_log2, window_left, window_right,
                                     BLOCK_N, True, HAS_LEFT, HAS_RIGHT, SOFTCAP)
            l_i = l_i * alpha + tl.sum(p, 1)
            p = p.to(q.dtype)
            zero = tl.zeros([16, 16], dtype=q.dtype)
            z = tl.zeros_like(alpha)[:, None] + tl.zeros([1, 16], dtype=tl.float32)  # [BLOCK_M, 16]
            for start_n in range(lo, last, BLOCK_N):
                # The pass's one synchronous MMA, first: its wait ends PV(j-1) and QK^T(j+1). Its
                # A is the last z (carried, so the dot is not hoisted out of the loop; converted
                # in the pass, so it stays in registers). z is exactly 0, and it is added to l_i,
                # which nothing reads before the pass's end, not to alpha, which PV(j) waits for.
                z = tl.dot(z.to(q.dtype), zero)
                l_i = l_i + tl.max(z, 1)
                s = s_nxt + 0.0  # the copy after the wait (docstring)
                ahead = tl.minimum(start_n + 2 * BLOCK_N, last)
                s_nxt = _score(q, d, d_ok, ahead, hi, k_base, bt_row, last_block, stride_bc, stride_kb,
                               stride_ks, stride_kd, BLOCK_SIZE, BLOCK_N, HEAD_DIM, DIM_P2, False,
                               PER_BLOCK_IDS, DOT_PRECISION)  # QK^T(j+2), left running
                pb = p + 0.0  # P of tile j in registers: a carried P would be staged in shared memory
                v_off = _tile_offsets(start_n, hi, bt_row, last_block, stride_bc, stride_vb, stride_vs,
                                      BLOCK_SIZE, BLOCK_N, False, PER_BLOCK_IDS)
                v = _values(q, d, d_ok, v_off, start_n, hi, v_base, stride_vd, BLOCK_N, HEAD_DIM, DIM_P2,
                            False)
                # PV(j), left running
                acc = tl.dot(pb, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
                p, alpha, m_i = _softmax(m_i, s, pos, start_n + BLOCK_N, hi, qk_scale, softcap_log2,
                                         window_left, window_right, BLOCK_N, False, HAS_LEFT, HAS_RIGHT,
                                         SOFTCAP)
                l_i = l_i * alpha + tl.sum(p, 1)
                p = p.to(q.dtype)
            # The last tile's P @ V (masked: the range may be empty, and then P is 0).
            v_off = _tile_offsets(last, hi, bt_row, last_block, stride_bc, stride_vb, stride_vs,
                                  BLOCK_SIZE, BLOCK_N, True, PER_BLOCK_IDS)
            v = _values(q, d, d_ok, v_off, last, hi, v_base, stride_vd, BLOCK_N, HEAD_DIM, DIM_P2, True)
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
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
