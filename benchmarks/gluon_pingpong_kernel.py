"""The Gluon kernel of ``gluon_pingpong.py`` and its launch (a probe; see that module).

FlashAttention-3's ping-pong schedule, sm_90a: 256 query rows a CTA, head_dim 128, bf16,
``TILE``-key tiles in a ring of ``NB`` shared-memory buffers. Three partitions:

- the producer (1 warp): Q once, then each key tile's K and V by TMA (dense: one copy a
  tile; paged: one copy a page, its block id read from the block table);
- two consumers (a warpgroup each, 128 rows each): pass j issues QK^T(j) and PV(j-1) as
  two wgmma groups, waits for the first alone (``warpgroup_mma_wait(1)``), takes the
  softmax of tile j across PV(j-1), then waits for PV(j-1) and rescales the accumulator.
  The two warpgroups take turns to issue their MMAs (``turn`` mbarriers), so one's
  softmax runs while the other's MMAs hold the tensor cores.

Q and O are the library's ``[tokens, heads, D]``, each request's new tokens in a row (all
requests of one length); a consumer's Q is one 3-D TMA box, 32 positions x the query heads
of its KV head, read as 128 rows (row r: position r // group, head r % group).
Causal (a runtime flag): each consumer runs the keys before the CTA's first position
unmasked, then the CTA's diagonal (``2 * WG_ROWS // group`` keys) in a masked loop of its
own; else every row attends every key, no mask. Imported, it clears ``TRITON_INTERPRET``
(Gluon has no interpreter).
"""

from __future__ import annotations

import os

HEAD_DIM, BLOCK_N, WG_ROWS, STAGES = 128, 32, 128, 4
BLOCK_M = 2 * WG_ROWS  # two consumer warpgroups

os.environ.pop("TRITON_INTERPRET", None)  # Gluon has no interpreter: before triton is imported

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# The TMA load's name moved: async_copy_global_to_shared (3.6-3.8), async_load (3.9, the old
# name raises).
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, bars, block_table, tok0, kv_row0, kv_head,
              n_tiles):
    q_bar, k_ready, v_ready, empty, turn = bars
    NB: gl.constexpr = k_bufs.type.shape[0]
    TILE: gl.constexpr = k_bufs.type.shape[1]
    D: gl.constexpr = k_bufs.type.shape[2]
    # paged: a box is one page of one KV head (constexprs do not reach a worker partition as
    # such: its arguments arrive as values, so the page size comes from the descriptor)
    PAGE: gl.constexpr = k_desc.block_type.shape[0]
    PAGED: gl.constexpr = PAGE < TILE
    # Q: [tokens, heads, D], a box the query heads of this KV head at POS positions (a consumer's)
    POS: gl.constexpr = q_desc.block_type.shape[0]
    G: gl.constexpr = q_desc.block_type.shape[1]
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma_load(q_desc, [tok0, kv_head * G, 0], q_bar, q_smem.index(0))
    tma_load(q_desc, [tok0 + POS, kv_head * G, 0], q_bar, q_smem.index(1))
    for j in range(n_tiles):
        s = j % NB
        mbarrier.wait(empty.index(s), ((j // NB) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), TILE * D * 2)
        mbarrier.expect(v_ready.index(s), TILE * D * 2)
        if PAGED:  # the cache as [num_blocks * PAGE, kv_heads * D]: a page of a head is a box
            for p in gl.static_range(TILE // PAGE):
                at = [gl.load(block_table + j * (TILE // PAGE) + p) * PAGE, kv_head * D]
                tma_load(k_desc, at, k_ready.index(s), k_bufs.index(s).slice(p * PAGE, PAGE))
                tma_load(v_desc, at, v_ready.index(s), v_bufs.index(s).slice(p * PAGE, PAGE))
        else:
            tma_load(k_desc, [kv_row0 + j * TILE, 0], k_ready.index(s), k_bufs.index(s))
            tma_load(v_desc, [kv_row0 + j * TILE, 0], v_ready.index(s), v_bufs.index(s))


@gluon.jit
def _softmax(sc, m_i, l_i, qk_scale):
    """Online softmax of a score tile: the row maxima kept scaled, so the scale and the
    max's subtraction are one FFMA a score."""
    m_new = gl.maximum(m_i, gl.max(sc, 1) * qk_scale)
    p = gl.exp2(sc * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _pass(j, MASKED: gl.constexpr, wg: gl.constexpr, q, k_bufs, v_bufs, bars, acc, p, m_i, l_i, qk_scale,
          qpos):
    """Pass j >= 1 of a consumer: QK^T(j) and PV(j-1) issued in its turn, the softmax of
    tile j across PV(j-1); ``MASKED``: keys past a row's position (``qpos``) left out."""
    q_bar, k_ready, v_ready, empty, turn = bars
    NB: gl.constexpr = k_bufs.type.shape[0]
    TILE: gl.constexpr = k_bufs.type.shape[1]
    ROWS: gl.constexpr = acc.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, TILE, 16])
    rows_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    s = j % NB
    prev = (j + NB - 1) % NB
    mbarrier.wait(k_ready.index(s), (j // NB) & 1)
    mbarrier.wait(v_ready.index(prev), ((j - 1) // NB) & 1)
    mbarrier.wait(turn.index(wg), (j & 1) ^ (1 - wg))  # my turn on the tensor cores
    zero_s = gl.zeros([ROWS, TILE], gl.float32, s_layout)
    qk = warpgroup_mma(q, k_bufs.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    acc = warpgroup_mma(p, v_bufs.index(prev), acc, is_async=True)  # PV(j-1): a second group
    mbarrier.arrive(turn.index(1 - wg), count=1)  # the other warpgroup's turn
    sc = warpgroup_mma_wait(1, deps=[qk])  # QK^T(j) done; PV(j-1) may run on
    if MASKED:
        sc = _mask(sc, j * TILE, qpos)
    pj, m_i, l_i, alpha = _softmax(sc, m_i, l_i, qk_scale)
    acc = warpgroup_mma_wait(0, deps=[acc])  # PV(j-1) done: its K/V buffers may go
    mbarrier.arrive(empty.index(prev), count=1)
    acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
    return acc, gl.convert_layout(pj.to(gl.bfloat16), p.type.layout), m_i, l_i


@gluon.jit
def _mask(sc, key0, qpos):
    """Scores of keys past their row's position (``qpos``, one a row) to -inf."""
    keys = key0 + gl.arange(0, sc.type.shape[1], gl.SliceLayout(0, sc.type.layout))
    return gl.where(keys[None, :] <= qpos[:, None], sc, float("-inf"))


@gluon.jit
def _consumer(wg: gl.constexpr, q_smem, k_bufs, v_bufs, bars, o_base, tok_stride, n_full, n_tiles, qpos0,
              group, qk_scale):
    """One consumer warpgroup: its rows ``wg * ROWS ..`` of the CTA (row r: position r //
    group, query head r % group of the KV head's; O at ``o_base``, ``tok_stride`` elements a
    token); tiles 1 .. n_full - 1 unmasked, n_full .. n_tiles - 1 masked (row r's key limit:
    ``qpos0 + r // group``)."""
    q_bar, k_ready, v_ready, empty, turn = bars
    NB: gl.constexpr = k_bufs.type.shape[0]
    TILE: gl.constexpr = k_bufs.type.shape[1]
    D: gl.constexpr = k_bufs.type.shape[2]
    ROWS: gl.constexpr = q_smem.type.shape[1] * q_smem.type.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, TILE, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q = q_smem.index(wg).reshape([ROWS, D])
    qpos = qpos0 + (wg * ROWS + gl.arange(0, ROWS, rows_s)) // group
    m_i = gl.full([ROWS], float("-inf"), gl.float32, rows_s)
    l_i = gl.full([ROWS], 0.0, gl.float32, rows_s)
    acc = gl.zeros([ROWS, D], gl.float32, o_layout)
    mbarrier.wait(q_bar, 0)
    # tile 0: QK^T alone, masked (it holds key 0, which every row attends)
    mbarrier.wait(k_ready.index(0), 0)
    mbarrier.wait(turn.index(wg), 1 - wg)
    qk = warpgroup_mma(q, k_bufs.index(0).permute((1, 0)), gl.zeros([ROWS, TILE], gl.float32, s_layout),
                       use_acc=False, is_async=True)
    mbarrier.arrive(turn.index(1 - wg), count=1)
    sc = _mask(warpgroup_mma_wait(0, deps=[qk]), 0, qpos)
    pj, m_i, l_i, alpha = _softmax(sc, m_i, l_i, qk_scale)
    p = gl.convert_layout(pj.to(gl.bfloat16), p_layout)
    for j in range(1, n_full):
        acc, p, m_i, l_i = _pass(j, False, wg, q, k_bufs, v_bufs, bars, acc, p, m_i, l_i, qk_scale, qpos)
    for j in range(gl.maximum(n_full, 1), n_tiles):
        acc, p, m_i, l_i = _pass(j, True, wg, q, k_bufs, v_bufs, bars, acc, p, m_i, l_i, qk_scale, qpos)
    last = (n_tiles + NB - 1) % NB
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // NB) & 1)
    acc = warpgroup_mma(p, v_bufs.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive(empty.index(last), count=1)
    out = acc / gl.convert_layout(l_i, rows_o)[:, None]
    r = wg * ROWS + gl.arange(0, ROWS, rows_o)
    c = gl.arange(0, D, gl.SliceLayout(0, o_layout))
    at = (r // group) * tok_stride + (r % group) * D  # row r: its token and query head
    gl.store(o_base + at[:, None] + c[None, :], out.to(gl.bfloat16))


@gluon.jit
def _consumer0(q_smem, k_bufs, v_bufs, bars, o_base, tok_stride, n_full, n_tiles, qpos0, group, qk_scale):
    _consumer(0, q_smem, k_bufs, v_bufs, bars, o_base, tok_stride, n_full, n_tiles, qpos0, group, qk_scale)


@gluon.jit
def _consumer1(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, bars, block_table, o_base, tok_stride, tok0,
               kv_row0, kv_head, n_full, n_tiles, qpos0, group, qk_scale):
    _consumer(1, q_smem, k_bufs, v_bufs, bars, o_base, tok_stride, n_full, n_tiles, qpos0, group, qk_scale)


@gluon.jit
def _producer_w(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, bars, block_table, o_base, tok_stride, tok0,
                kv_row0, kv_head, n_full, n_tiles, qpos0, group, qk_scale):
    _producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, bars, block_table, tok0, kv_row0, kv_head,
              n_tiles)


@gluon.jit
def attn_pingpong(q_desc, k_desc, v_desc, o_ptr, block_table, n_keys, qk_scale, causal, prefix, group, q_len,
                  heads, TILE: gl.constexpr, NB: gl.constexpr):
    POS: gl.constexpr = q_desc.block_type.shape[0]  # positions a consumer warpgroup
    G: gl.constexpr = q_desc.block_type.shape[1]  # query heads a KV head (= group)
    D: gl.constexpr = q_desc.block_type.shape[2]
    # grid (query tiles, KV heads, requests): Q/O [tokens, heads, D] (a request's q_len new
    # tokens in a row), dense K/V rows [request, KV head, key], the block table [request,
    # n_keys // page]. A CTA: 2 * POS positions x the G query heads of its KV head.
    kv_head = gl.program_id(1)
    seq = gl.program_id(2) * gl.num_programs(1) + kv_head
    p0 = gl.program_id(0) * 2 * POS
    tok0 = gl.program_id(2) * q_len + p0
    o_base = o_ptr + (tok0 * heads + kv_head * G) * D
    kv_row0 = seq * n_keys
    # causal: the CTA's positions p0 .. see the keys before prefix + p0 whole and the next
    # 2 * POS keys masked (the diagonal); else every key, none masked
    n_full = n_keys // TILE
    n_tiles = n_full
    qpos0 = n_keys
    if causal != 0:
        n_full = (prefix + p0) // TILE
        n_tiles = n_full + (2 * POS + TILE - 1) // TILE
        qpos0 = prefix + p0
    block_table += gl.program_id(2) * (n_keys // k_desc.block_type.shape[0])
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, POS, G, D], q_desc.layout)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, D], gl.bfloat16)
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [NB, TILE, D], kv_layout)
    v_bufs = gl.allocate_shared_memory(gl.bfloat16, [NB, TILE, D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NB):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a buffer
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()
    bars = (q_bar, k_ready, v_ready, empty, turn)
    tok_stride = heads * D
    args = (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, bars, block_table, o_base, tok_stride, tok0,
            kv_row0, kv_head, n_full, n_tiles, qpos0, group, qk_scale)
    gl.warp_specialize([
        (_consumer0, (q_smem, k_bufs, v_bufs, bars, o_base, tok_stride, n_full, n_tiles, qpos0, group,
                      qk_scale)),
        (_consumer1, args),
        (_producer_w, args),
    ], [4, 1], [240, 24])


def descriptors(q, k, v, page: int | None = None, block_n: int = BLOCK_N, group: int = 4):
    """Host TMA descriptors: Q ``[tokens, heads, D]`` (the library's), a box ``[WG_ROWS //
    group, group, D]``: a consumer's positions x the query heads of one KV head; K/V dense
    ``[rows, D]`` (rows: [request, KV head, key]), or paged (``page``: the block size):
    prefixkv's ``[num_blocks, block_size, kv_heads, D]`` cache seen as ``[num_blocks *
    block_size, kv_heads * D]``, a box ``[block_size, D]``: one page of one KV head at
    ``[block * block_size, kv_head * D]``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def desc(t, shape, box):
        lay = gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)
        strides = [1]
        for n in reversed(shape[1:]):
            strides.insert(0, strides[0] * n)
        return TensorDescriptor(t, shape, strides, box, lay)

    tokens, heads, dim = q.shape
    q_desc = desc(q, [tokens, heads, dim], [WG_ROWS // group, group, dim])
    if page is None:
        return q_desc, desc(k, list(k.shape), [block_n, dim]), desc(v, list(v.shape), [block_n, dim])
    shape = [k.shape[0] * k.shape[1], k.shape[2] * k.shape[3]]
    return q_desc, desc(k, shape, [page, dim]), desc(v, shape, [page, dim])


def launch_args(q, k, v, o, block_table, *, kv_heads: int, batch: int, n_keys: int, sm_scale: float,
                page: int | None = None, causal: bool = False, block_n: int = BLOCK_N, stages: int = STAGES):
    """``(grid, args, kwargs)`` of one launch. ``q``/``o``: ``[batch * q_len, heads, D]``
    (each request's q_len new tokens in a row; query head h reads KV head h // (heads //
    kv_heads)); K/V: dense ``[batch * kv_heads * n_keys, D]`` or the paged cache;
    ``block_table``: ``[batch, n_keys // page]`` int32. ``causal``: the q_len tokens are
    the last of the ``n_keys`` positions, each attending the keys up to its own; else every
    query attends every key."""
    tokens, heads, _ = q.shape
    group, q_len = heads // kv_heads, tokens // batch
    if group == 0 or heads % kv_heads or WG_ROWS % group:
        raise ValueError(f"{heads} query heads over {kv_heads} KV heads: the heads of a KV head must divide "
                         f"{WG_ROWS}")
    if tokens % batch or q_len % (BLOCK_M // group):
        raise ValueError(f"{tokens} tokens of {batch} requests: a request's tokens must fill tiles of "
                         f"{BLOCK_M // group} positions")
    if n_keys % block_n:
        raise ValueError(f"n_keys must be a multiple of {block_n}, got {n_keys}")
    if stages < 2:  # a pass frees tile j - 1 only after it has issued QK^T(j)
        raise ValueError(f"the K/V ring needs at least 2 buffers, got {stages}")
    if page is not None and (block_n % page or page >= block_n):  # the producer tells by page < tile
        raise ValueError(f"the block size ({page}) must divide the {block_n}-key tile and be smaller")
    prefix = n_keys - q_len
    if causal and (prefix < 0 or prefix % block_n or BLOCK_M // group % block_n):
        raise ValueError(f"causal: {q_len} new tokens after a prefix of {prefix} keys do not fall on "
                         f"{block_n}-key tiles")
    grid = (q_len // (BLOCK_M // group), kv_heads, batch)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 of log2(e) x
    args = (*descriptors(q, k, v, page, block_n, group), o, block_table, n_keys, qk_scale, int(causal),
            prefix, group, q_len, heads)
    return grid, args, dict(TILE=block_n, NB=stages, num_warps=4, maxnreg=168)


def run(q, k, v, table, **kw):
    """Launch the kernel (CUDA, sm_90): the output ``[rows, D]``."""
    o = q.new_empty(q.shape)
    grid, args, kwargs = launch_args(q, k, v, o, table, **kw)
    attn_pingpong[grid](*args, **kwargs)
    return o
