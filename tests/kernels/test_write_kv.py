"""write_kv_cache: the Triton kernel against the reference, padding slots, argument errors."""

from __future__ import annotations

import pytest
import torch

from prefixkv.kernels import DtypeError, ShapeError, write_kv_cache, write_kv_cache_reference

from .conftest import PRIMARY_DEVICE

SENTINEL = 7.0


def _caches(num_blocks, block_size, heads, dim, dtype, device):
    k = torch.full((num_blocks, block_size, heads, dim), SENTINEL, dtype=dtype, device=device)
    return k, k.clone()


@pytest.mark.parametrize("block_size, heads, dim", [(5, 2, 64), (16, 3, 80), (32, 1, 128)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_triton_write_matches_reference(needs_triton, device, block_size, heads, dim, slot_dtype):
    gen = torch.Generator().manual_seed(block_size + dim)
    num_blocks, num_tokens = 6, 11
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    key = torch.randn(num_tokens, heads, dim, generator=gen).to(device)
    value = torch.randn(num_tokens, heads, dim, generator=gen).to(device)
    got_k, got_v = _caches(num_blocks, block_size, heads, dim, torch.float32, device)
    want_k, want_v = _caches(num_blocks, block_size, heads, dim, torch.float32, device)
    slots = slots.to(slot_dtype).to(device)
    write_kv_cache(key, value, got_k, got_v, slots, backend="triton")
    write_kv_cache_reference(key, value, want_k, want_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    # Exactly the 9 real tokens' rows changed; every other slot kept its old value.
    assert int((got_k != SENTINEL).any(-1).any(-1).sum()) == num_tokens - 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_write_half_precision_copies_bits(needs_triton, device, dtype):
    key = torch.randn(4, 2, 64).to(dtype).to(device)
    value = torch.randn(4, 2, 64).to(dtype).to(device)
    k_cache, v_cache = _caches(2, 5, 2, 64, dtype, device)
    write_kv_cache(key, value, k_cache, v_cache, torch.tensor([9, 0, -1, 4], device=device), backend="triton")
    assert torch.equal(k_cache[1, 4], key[0]) and torch.equal(v_cache[0, 4], value[3])
    assert torch.equal(k_cache[0, 1], torch.full_like(k_cache[0, 1], SENTINEL))


def test_triton_write_of_no_tokens_is_a_no_op(needs_triton, device):
    k_cache, v_cache = _caches(2, 4, 1, 8, torch.float32, device)
    empty = torch.empty(0, 1, 8, device=device)
    write_kv_cache(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=device),
                   backend="triton")
    assert (k_cache == SENTINEL).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_write_rejects_bad_arguments_before_writing(needs_triton, backend):
    k_cache, v_cache = _caches(2, 4, 2, 8, torch.float32, PRIMARY_DEVICE)
    key = torch.randn(3, 2, 8, device=PRIMARY_DEVICE)
    slots = torch.tensor([0, 1, 2], device=PRIMARY_DEVICE)
    with pytest.raises(ShapeError, match=r"\[num_tokens, 2, 8\]"):
        write_kv_cache(key[:, :1], key, k_cache, v_cache, slots, backend=backend)
    with pytest.raises(ShapeError, match="slot_mapping"):
        write_kv_cache(key, key, k_cache, v_cache, slots[:2], backend=backend)
    with pytest.raises(ShapeError, match="value has 2"):
        write_kv_cache(key, key[:2], k_cache, v_cache, slots, backend=backend)
    with pytest.raises(DtypeError, match="float16"):
        write_kv_cache(key.half(), key.half(), k_cache, v_cache, slots, backend=backend)
    with pytest.raises(DtypeError, match="slot_mapping"):
        write_kv_cache(key, key, k_cache, v_cache, slots.float(), backend=backend)
    assert (k_cache == SENTINEL).all() and (v_cache == SENTINEL).all()
