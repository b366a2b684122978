"""Key tiles read through the block table: the block ids of a tile's keys, their offsets
in a cache, and the K and V tiles loaded at them (fp8 widened to q's dtype in registers).

Inlined into the phase loops of ``attend._attend_range``. Every id is clamped into the
cache (an id outside ``[0, num_blocks)`` reads the last block: docs/kv_layout.md,
"Untrusted metadata"), and offsets are int64 (block * stride passes 2^31 in large caches).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
        # Key positions are >= 0: divided as uint32, with no signed rounding fix-up (60 SASS
        # instructions fewer a pass of the unmasked loop on triton 3.6, sm_90 compile).
        page = (col.to(tl.uint32) // BLOCK_SIZE).to(tl.int32)
        if MASKED:
            blk = tl.load(bt_row + page * stride_bc, mask=col < phase_hi, other=0)
        else:
            blk = tl.load(bt_row + page * stride_bc)
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
        slot = ((start_n + tl.arange(0, BLOCK_N)).to(tl.uint32) % BLOCK_SIZE).to(tl.int32)  # as in _block_ids
        off = blk * stride_b + slot * stride_s
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
