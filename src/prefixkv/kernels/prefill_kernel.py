"""Triton paged prefix-prefill attention: one kernel for prefill, chunked prefill and decode.

Grid: ``(total_q // BLOCK_Q + batch + 2, num_kv_heads, num_splits)``; a program finds its
request by searching ``cu_seqlens_q`` on the device, so the grid comes from tensor shapes
only. With ``num_splits > 1`` (few programs: long-context decode) each program attends one
slice of its keys and a second kernel merges the slices (``split_kv``).
Metadata values are never trusted: ``cu_seqlens_q``, ``seqused_k`` and block ids are
clamped into the tensors given, in registers (docs/kv_layout.md, "Untrusted metadata").
A tile holds ``BLOCK_Q`` query positions x the ``GROUP_P2`` query heads of one KV head
(GQA packing: the group's heads share every K/V load). Keys are read through the block
table one slot at a time, so any block_size works.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attend import _attend_range, _max
from .split_kv import _split_phases


# Ints that change from call to call are not specialised (Triton would otherwise compile a
# variant for the value 1 and for multiples of 16): the batch, the split count, total_q,
# the block table's width (stride_bt, kv_capacity), the strides that follow total_q (the
# LSE and the split workspaces) and the cache's size (last_block: warm-up uses a small one).
@triton.jit(do_not_specialize=["stride_bt", "stride_lh", "stride_ws", "stride_wr", "stride_xs", "stride_xh",  # type: ignore[untyped-decorator]  # Triton JIT
                               "batch", "num_splits", "total_q", "kv_capacity", "last_block", "split_q",
                               "split_keys"])
def _paged_prefill_kernel(  # type: ignore[no-untyped-def]  # Triton JIT
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, cu_q_ptr, seqused_k_ptr, out_ptr, lse_ptr,
    sinks_ptr, k_scale_ptr, v_scale_ptr, ws_ptr, ws_lse_ptr, row_tok_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt, stride_bc, stride_ot, stride_oh, stride_od, stride_lh, stride_lt,
    stride_ws, stride_wr, stride_wh, stride_wd, stride_xs, stride_xh, stride_xr, split_q, split_keys,
    stride_sink, stride_ksc, stride_vsc, qk_scale, softcap_log2, window_left, window_right,
    batch, num_splits, total_q, kv_capacity, last_block,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr, RETURN_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    PER_BLOCK_IDS: tl.constexpr, QK_AHEAD: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_P2
    SEARCH: tl.constexpr = 64  # cu_seqlens_q entries read per step of the request search
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    # q's rows in batch + 2 segments: | before cu_q[0] | request 0 | ... | request batch-1 | after |
    # Segment s starts at bound[s]: cu_q[s-1] clamped to [0, total_q] and made non-decreasing,
    # so the segments tile q's rows whatever cu_q holds; the two outer ones attend no key.
    # Segment s owns tiles [bound[s] // BLOCK_Q + s, ...): this program's segment is the last
    # one whose first tile is <= pid. batch is a runtime int: the scan reads SEARCH entries a
    # step, carrying the running max; q_start / q_end are the bounds either side of pid.
    seg = pid * 0 - 1
    run = pid * 0  # largest bound so far
    q_start = pid * 0
    q_end = pid * 0 + total_q
    for s0 in range(0, batch + 3, SEARCH):
        s = s0 + tl.arange(0, SEARCH)  # [SEARCH]
        live = s < batch + 3  # bound[batch + 2] = total_q ends the last segment
        bound = tl.load(cu_q_ptr + s - 1, mask=(s >= 1) & (s <= batch + 1), other=0)
        bound = tl.where(s > batch + 1, total_q, tl.minimum(tl.maximum(bound, 0), total_q))
        bound = tl.maximum(tl.associative_scan(bound, 0, _max), run)
        run = tl.max(tl.where(live, bound, 0), 0)
        first_tile = tl.where(s < batch + 2, bound // BLOCK_Q + s, pid + 1)  # [SEARCH]
        before = live & (first_tile <= pid)
        seg += tl.sum(before.to(tl.int32), 0)
        q_start = tl.maximum(q_start, tl.max(tl.where(before, bound, 0), 0))
        q_end = tl.minimum(q_end, tl.min(tl.where(live & ~before, bound, total_q), 0))
    q_len = q_end - q_start
    req = tl.minimum(tl.maximum(seg - 1, 0), tl.maximum(batch - 1, 0))
    tile = pid - (q_start // BLOCK_Q + seg)
    if tile * BLOCK_Q < q_len:
        kv_len = tl.load(seqused_k_ptr + req, mask=(seg >= 1) & (seg <= batch), other=0)
        kv_len = tl.minimum(tl.maximum(kv_len, 0), kv_capacity)  # never past the block-table row
        # | cached prefix: kv_len - q_len | new tokens: q_len |; query i sits at key pos prefix + i
        prefix = kv_len - q_len
        m = tl.arange(0, BLOCK_M)  # [BLOCK_M] tile rows = (query position, head of the group)
        qi = tile * BLOCK_Q + m // GROUP_P2  # [BLOCK_M] query index within the request
        g = m % GROUP_P2
        row_ok = (qi < q_len) & (g < GROUP)
        head = kvh * GROUP + g  # [BLOCK_M] query head
        pos = prefix + qi  # [BLOCK_M] key position of each row's query
        d = tl.arange(0, DIM_P2)
        d_ok = d < HEAD_DIM
        tok = (q_start + qi).to(tl.int64)
        q_off = tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, DIM_P2]

        # Key range of the tile's real rows, and its part that every row attends without a mask.
        p_lo = prefix + tile * BLOCK_Q
        p_hi = prefix + tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len) - 1
        kv_lo = 0
        kv_hi = kv_len
        full_lo = 0
        full_hi = kv_len
        if HAS_RIGHT:
            kv_hi = tl.minimum(kv_len, p_hi + window_right + 1)
            full_hi = tl.minimum(kv_hi, p_lo + window_right + 1)
        if HAS_LEFT:
            kv_lo = tl.maximum(0, p_lo - window_left)
            full_lo = tl.maximum(kv_lo, p_hi - window_left)
        full_lo = tl.minimum(full_lo, tl.maximum(kv_hi, kv_lo))
        full_hi = full_lo + (tl.maximum(full_hi - full_lo, 0) // BLOCK_N) * BLOCK_N
        # Phase i covers keys [pi_lo, pi_hi); a split keeps its slice of each.
        p1_lo, p1_hi, p2_lo, p2_hi, p3_lo, p3_hi = kv_lo, full_lo, full_lo, full_hi, full_hi, kv_hi
        split = 0
        if SPLIT:
            # Per request: a tile of a decode-like request (q_len <= split_q) cuts its keys
            # into up to num_splits slices of at least split_keys keys and writes partials
            # to the workspace; any other tile runs whole in split 0 (the other splits of
            # it return at once, below).
            split = tl.program_id(2)
            splits_here = (q_len <= split_q) & (seg >= 1) & (seg <= batch)  # rows no request owns: whole
            n_split = tl.minimum(tl.maximum((kv_hi - kv_lo) // split_keys, 1), num_splits)
            n_split = tl.where(splits_here, n_split, 1)
            p1_lo, p1_hi, p2_lo, p2_hi, p3_lo, p3_hi = _split_phases(
                kv_lo, full_lo, full_hi, kv_hi, split, n_split, BLOCK_N)

        acc = tl.zeros([BLOCK_M, DIM_P2], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        if HAS_SINKS:
            # The sink is a key of score sinks[head] (exp2 domain: * log2 e) and no value; it
            # starts the running max and sum, in split 0 only so the merge counts it once.
            # Rows no request owns (the outer segments) get none: zeros and LSE -inf as without.
            # A NaN sink is no sink (-inf); a +inf sink takes the whole softmax: such rows
            # ("sunk") run with a neutral start (max 0, sum 1) and end as output 0, LSE +inf.
            sink = tl.load(sinks_ptr + head * stride_sink, mask=row_ok, other=0.0)  # [BLOCK_M]
            sink = tl.where(sink == sink, sink, float("-inf"))
            owned = (split == 0) & (seg >= 1) & (seg <= batch)
            sunk = owned & (sink == float("inf"))
            m_i = tl.where(owned, tl.where(sunk, 0.0, sink * 1.4426950408889634), m_i)
            l_i = tl.where(owned, 1.0, l_i)
        if KV_FP8:
            # A K scale that is not a finite number > 0 acts as 0 (docs/kv_layout.md): every
            # score is q . (cache * 0), computed as (q * 0) . cache so the masks' -inf never
            # meets a zero scale.
            k_s = tl.load(k_scale_ptr + kvh * stride_ksc)
            k_ok = (k_s > 0.0) & (k_s < float("inf"))
            qk_scale = tl.where(k_ok, qk_scale * k_s, qk_scale)
            q = tl.where(k_ok, q, 0.0).to(q.dtype)
        k_base = k_cache_ptr + kvh.to(tl.int64) * stride_kh
        v_base = v_cache_ptr + kvh.to(tl.int64) * stride_vh
        bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
        # Phase 1: left edge of a sliding window, masked (empty without a left edge).
        if HAS_LEFT:
            acc, l_i, m_i = _attend_range(
                acc, l_i, m_i, q, pos, d, d_ok, p1_lo, p1_hi, k_base, v_base, bt_row, last_block, stride_bc,
                stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                qk_scale, softcap_log2, window_left, window_right,
                BLOCK_SIZE, BLOCK_N, HEAD_DIM, DIM_P2, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, DOT_PRECISION,
                PER_BLOCK_IDS, QK_AHEAD)
        # Phase 2: cached prefix (and any keys all rows see), full tiles without a mask.
        acc, l_i, m_i = _attend_range(
            acc, l_i, m_i, q, pos, d, d_ok, p2_lo, p2_hi, k_base, v_base, bt_row, last_block, stride_bc,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
            qk_scale, softcap_log2, window_left, window_right,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, DIM_P2, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, DOT_PRECISION,
            PER_BLOCK_IDS, QK_AHEAD)
        # Phase 3: new tokens on the diagonal, causal (bottom-right aligned), masked.
        acc, l_i, m_i = _attend_range(
            acc, l_i, m_i, q, pos, d, d_ok, p3_lo, p3_hi, k_base, v_base, bt_row, last_block, stride_bc,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
            qk_scale, softcap_log2, window_left, window_right,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, DIM_P2, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, DOT_PRECISION,
            PER_BLOCK_IDS, QK_AHEAD)

        # Rows (or splits) that attended nothing: output 0, LSE -inf.
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        if KV_FP8:
            v_s = tl.load(v_scale_ptr + kvh * stride_vsc)
            acc = acc * tl.where((v_s > 0.0) & (v_s < float("inf")), v_s, 0.0)  # as K's: invalid acts as 0
        o = acc / l_safe[:, None]  # [BLOCK_M, DIM_P2]
        if HAS_SINKS:
            o = tl.where(sunk[:, None], 0.0, o)
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
        if HAS_SINKS:
            lse = tl.where(sunk, float("inf"), lse)
        if SPLIT:
            if splits_here:
                # Workspace row of (request, query): req * split_q + qi; split 0 records its token.
                r = (req * split_q + qi).to(tl.int64)  # [BLOCK_M]
                w_off = (split.to(tl.int64) * stride_ws + r[:, None] * stride_wr + head[:, None] * stride_wh  # type: ignore[attr-defined]  # Triton JIT
                         + d[None, :] * stride_wd)
                tl.store(ws_ptr + w_off, o, mask=row_ok[:, None] & d_ok[None, :])
                tl.store(ws_lse_ptr + split.to(tl.int64) * stride_xs + head * stride_xh + r * stride_xr, lse,  # type: ignore[attr-defined]  # Triton JIT
                         mask=row_ok)
                if split == 0:
                    tl.store(row_tok_ptr + r, tok.to(tl.int32), mask=row_ok)
            elif split == 0:
                _store_rows(out_ptr, lse_ptr, o, lse, tok, head, d, row_ok, d_ok, stride_ot, stride_oh,
                            stride_od, stride_lh, stride_lt, RETURN_LSE)
        else:
            _store_rows(out_ptr, lse_ptr, o, lse, tok, head, d, row_ok, d_ok, stride_ot, stride_oh, stride_od,
                        stride_lh, stride_lt, RETURN_LSE)


@triton.jit  # type: ignore[untyped-decorator]  # Triton JIT
def _store_rows(out_ptr, lse_ptr, o, lse, tok, head, d, row_ok, d_ok, stride_ot, stride_oh, stride_od,  # type: ignore[no-untyped-def]  # Triton JIT
                stride_lh, stride_lt, RETURN_LSE: tl.constexpr):
    """A tile's rows of the output (its dtype) and, with ``RETURN_LSE``, of the LSE."""
    o_off = tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if RETURN_LSE:
        tl.store(lse_ptr + head * stride_lh + tok * stride_lt, lse, mask=row_ok)
