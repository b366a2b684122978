"""The shapes engines really launch, against the torch reference (the audit of r8).

head_dim 112 (not a power of two, padded to 128 in registers), GQA groups of 1 to 32
query heads per KV head, block sizes 1 to 128 (vLLM allows them; 64 and 128 are wider
than the interpreter's 32-key tile, 1 makes every key its own block), decodes whose
context ends exactly on a block or tile edge, a request with no cached token beside one
with a long prefix, last blocks partly filled, windows whose left edge falls inside a
block, caches in the HND layout (``[num_blocks, heads, block_size, head_dim]`` memory seen
through a transposed view) and K/V written from slices of a fused qkv projection. Unused
memory is NaN (``cases.make_case``), so a read outside a request's keys fails the test;
the drawn batches also see their block table through a window of a larger table whose
other entries name a NaN block, so a read past a row's blocks (into the next row, which
holds valid ids) fails too.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.kernels import (
    alloc_split_workspace,
    build_paged_batch,
    paged_prefill_attention_reference,
    write_kv_cache,
    write_kv_cache_reference,
)
from prefixkv.kernels.tiling import TileConfig

from .cases import check, make_case, tolerance
from .conftest import BF16_DOT, PRIMARY_DEVICE

pytestmark = pytest.mark.usefixtures("needs_triton")


def _batch(block_size: int) -> tuple[list[int], list[int]]:
    """``(q_lens, kv_lens)``: a decode ending on a block (and tile) edge, a prefill with no
    cached token, a chunk after a prefix whose last block is partly filled."""
    return [1, 33, 5], [2 * block_size, 33, 3 * block_size + 6]


@pytest.mark.parametrize("head_dim, group, block_size", [
    (112, 4, 1), (80, 32, 8), (96, 8, 64), (128, 1, 128), (64, 32, 32),
], ids=lambda v: str(v))
def test_head_dims_groups_and_block_sizes(head_dim, group, block_size):
    q_lens, kv_lens = _batch(block_size)
    case = make_case(q_lens, kv_lens, num_kv_heads=1, group=group, head_dim=head_dim, block_size=block_size,
                     device=PRIMARY_DEVICE, seed=head_dim + group + block_size)
    check(case, torch.float32)


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_windows_that_start_inside_a_block_with_sinks_and_softcap(block_size):
    q_lens, kv_lens = _batch(block_size)
    case = make_case(q_lens, kv_lens, num_kv_heads=2, group=4, head_dim=80, block_size=block_size,
                     device=PRIMARY_DEVICE, seed=block_size)
    sinks = torch.tensor([0.5, -1.0, 2.0, float("-inf"), 0.0, 1.0, -0.5, 3.0], device=PRIMARY_DEVICE)
    check(case, torch.float32, window_size=(block_size + 3, 0), sinks=sinks, softcap=8.0)


@pytest.mark.parametrize("config, block_size", [
    (TileConfig(block_m=128, block_n=64, qk_ahead=True), 128),  # a tile inside one block
    (TileConfig(block_m=128, block_n=128), 64),  # two blocks a tile
    (TileConfig(block_m=16, block_n=128), 1),  # the decode tile, 128 blocks a tile
], ids=["qk-ahead-bs128", "128x128-bs64", "decode-bs1"])
def test_gpu_tiles_over_engine_block_sizes(config, block_size):
    case = make_case([1, 40, 2], [block_size + 1, 200, 128], num_kv_heads=1, group=4, head_dim=64,
                     block_size=block_size, device=PRIMARY_DEVICE, seed=7)
    check(case, torch.float32, config=config)


def test_hnd_caches_attend_and_write_like_nhd():
    """The same KV in NHD memory and in HND memory (heads before slots, viewed as NHD):
    the kernels follow the strides, so both give the reference's answer."""
    case = make_case(*_batch(16), num_kv_heads=2, group=4, head_dim=112, block_size=16,
                     device=PRIMARY_DEVICE, seed=5)
    hnd = [c.transpose(1, 2).contiguous().transpose(1, 2) for c in (case.k_cache, case.v_cache)]
    assert hnd[0].stride()[1:3] == (112, 16 * 112)  # slot stride head_dim, head stride a block's slots
    case.k_cache, case.v_cache = hnd
    check(case, torch.float32)


def test_write_from_slices_of_a_fused_qkv_with_padding_in_hnd_and_nhd():
    """vLLM hands the cache write ``key`` and ``value`` as column slices of one
    ``[tokens, (heads + 2 * kv_heads) * head_dim]`` projection, and pads the batch with -1
    slots; every real token lands in its slot, nothing else changes, in either layout."""
    heads, kv_heads, dim, block_size = 8, 2, 112, 16
    step = build_paged_batch([[3, 0], [5, 1]], [13, 0], [6, 17], block_size)
    slots = torch.cat([step.slot_mapping, torch.full((3,), -1)]).to(PRIMARY_DEVICE)  # 3 padding tokens
    qkv = torch.randn(slots.shape[0], (heads + 2 * kv_heads) * dim, device=PRIMARY_DEVICE)
    key = qkv[:, heads * dim:(heads + kv_heads) * dim].view(-1, kv_heads, dim)
    value = qkv[:, (heads + kv_heads) * dim:].view(-1, kv_heads, dim)
    assert not key.is_contiguous() and key.stride(0) == qkv.shape[1]
    for layout in ("nhd", "hnd"):
        caches = []
        for backend in ("triton", "torch"):
            shape = (6, block_size, kv_heads, dim) if layout == "nhd" else (6, kv_heads, block_size, dim)
            k, v = (torch.full(shape, float("nan"), device=PRIMARY_DEVICE) for _ in range(2))
            if layout == "hnd":
                k, v = k.transpose(1, 2), v.transpose(1, 2)
            write = write_kv_cache if backend == "triton" else write_kv_cache_reference
            write(key, value, k, v, slots, **({"backend": "triton"} if backend == "triton" else {}))
            caches.append((k, v))
        (k, v), (k_ref, v_ref) = caches
        assert torch.equal(k.nan_to_num(7.0), k_ref.nan_to_num(7.0))
        assert torch.equal(v.nan_to_num(7.0), v_ref.nan_to_num(7.0))
        real = step.slot_mapping.tolist()
        for t, slot in enumerate(real):
            assert torch.equal(k[slot // block_size, slot % block_size], key[t]), (layout, t)
            assert torch.equal(v[slot // block_size, slot % block_size], value[t]), (layout, t)
        written = (~k.isnan()).all(-1).all(-1).sum().item()
        assert written == len(real), f"{layout}: {written} slots written for {len(real)} real tokens"


TILES = [None, TileConfig(block_m=64, block_n=64, qk_ahead=True), TileConfig(block_m=128, block_n=128),
         TileConfig(block_m=16, block_n=128), TileConfig(block_m=32, block_n=16)]


def _table_in_poison(table: torch.Tensor, poison: int) -> torch.Tensor:
    """``table`` as a view into a table one row and three columns larger on each side,
    whose other entries are ``poison``."""
    rows, width = table.shape
    big = torch.full((rows + 2, width + 6), poison, dtype=table.dtype, device=table.device)
    big[1:-1, 3:-3] = table
    return big[1:-1, 3:-3]


@settings(max_examples=25, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 3, 16, 64, 128]), group=st.sampled_from([1, 4, 32]),
       head_dim=st.sampled_from([16, 40, 112]), tile=st.sampled_from(range(len(TILES))),
       splits=st.sampled_from([None, 3, "workspace"]), hnd=st.booleans())
def test_drawn_engine_batches(data, block_size, group, head_dim, tile, splits, hnd):
    q_lens = data.draw(st.lists(st.sampled_from([0, 1, 1, 2, 9]), min_size=1, max_size=2))
    kv_lens = [q + data.draw(st.sampled_from([0, 1, block_size, block_size + 1, 32])) for q in q_lens]
    case = make_case(q_lens, kv_lens, num_kv_heads=1, group=group, head_dim=head_dim, block_size=block_size,
                     device=PRIMARY_DEVICE, seed=data.draw(st.integers(0, 2**16)), extra_columns=0)
    used = set(case.block_table.flatten().tolist())
    poison = next(b for b in range(case.k_cache.shape[0]) if b not in used)  # a NaN block
    case.block_table = _table_in_poison(case.block_table, poison)
    if hnd:
        case.k_cache, case.v_cache = (c.transpose(1, 2).contiguous().transpose(1, 2)
                                      for c in (case.k_cache, case.v_cache))
    options = data.draw(st.fixed_dictionaries({}, optional={
        "window_size": st.sampled_from([(0, 0), (3, 0), (block_size + 3, 0), (40, 0)]),
        "softcap": st.just(8.0), "causal": st.just(False)}))
    if data.draw(st.booleans()):
        sinks = torch.randn(group, generator=torch.Generator().manual_seed(group))
        options["sinks"] = sinks.to(PRIMARY_DEVICE)
    config = TILES[tile]
    if config is not None and config.block_m < group:
        config = None  # a tile holds the whole group at least (the launcher widens it otherwise)
    if splits == "workspace":
        options["split_workspace"] = alloc_split_workspace(
            4, len(q_lens), group, head_dim, PRIMARY_DEVICE, split_q=2, min_keys=16)
    elif splits is not None:
        config = TileConfig(block_m=max(16, group), block_n=32, num_splits=splits) if config is None else (
            TileConfig(config.block_m, config.block_n, qk_ahead=config.qk_ahead, num_splits=splits))
    check(case, torch.float32, config=config, **options)



GPU_ONLY = (f"{BF16_DOT}; and the interpreter rounds fp32 -> fp8 unlike the GPU (test_fp8.py): fp8 "
            "runs on CUDA only")


@pytest.mark.skipif(PRIMARY_DEVICE != "cuda", reason=GPU_ONLY)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("head_dim, group, block_size", [
    (112, 8, 16), (80, 4, 64), (256, 32, 1), (128, 4, 128),
], ids=lambda v: str(v))
def test_gpu_precisions_over_engine_shapes(cache_dtype, head_dim, group, block_size):
    """The compiled tiles in bf16, and an fp8 cache with per-head K scales and a per-tensor V
    scale under bf16 queries; without the LSE, long prefills of head_dim 65-128 over the
    bf16 cache take the 256 x 128 tile (600 new tokens)."""
    from prefixkv.kernels.attention import paged_prefill_attention_triton
    from prefixkv.kernels.fp8 import quantize

    case = make_case([1, 600, 5], [2 * block_size, 600, 3 * block_size + 700], num_kv_heads=2, group=group,
                     head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16, device="cuda",
                     seed=head_dim)
    options = {}
    if cache_dtype != torch.bfloat16:
        k_scale, v_scale = torch.tensor([0.01, 0.02], device="cuda"), torch.tensor(0.015, device="cuda")
        case.k_cache = quantize(case.k_cache, k_scale, cache_dtype)
        case.v_cache = quantize(case.v_cache, v_scale, cache_dtype)
        options = dict(k_scale=k_scale, v_scale=v_scale)
    check(case, torch.bfloat16, **options)  # with the LSE
    got = paged_prefill_attention_triton(*case.args, **options)
    want = paged_prefill_attention_reference(*case.args, **options)
    torch.testing.assert_close(got.float(), want.float(), **tolerance(torch.bfloat16))
