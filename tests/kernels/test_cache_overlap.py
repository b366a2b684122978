"""write_kv_cache into caches whose slots share memory, and attention into such an out,
are refused before any write on both backends; K and V views that interleave without
sharing an element still work."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.kernels import ShapeError, paged_prefill_attention, write_kv_cache
from prefixkv.kernels.overlap import caches_overlap, strides_overlap

from .conftest import PRIMARY_DEVICE, triton_skip_reason

NB, BS, H, D = 3, 4, 2, 8
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(triton_skip_reason() is not None,
                                                                    reason=str(triton_skip_reason())))]


def _device(backend: str) -> str:
    return PRIMARY_DEVICE if backend == "triton" else "cpu"


def _tokens(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(5, H, D, generator=gen).to(device) for _ in range(2))
    return key, value, torch.tensor([0, 5, 6, 11, 3], device=device)


def _expanded(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return base[:1].expand(NB, -1, -1, -1), torch.zeros_like(base)


def _same(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return base, base


def _half_block_apart(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = torch.zeros(base.numel() + BS * H * D, device=base.device)
    return flat[: base.numel()].view(base.shape), flat[BS * H * D // 2:][: base.numel()].view(base.shape)


def _transposed_twin(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # v_cache is the same memory laid out with heads and rows swapped: other strides, same bytes.
    return base, base.view(NB, H, BS, D).transpose(1, 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make", [_expanded, _same, _half_block_apart, _transposed_twin],
                         ids=["expanded", "v-is-k", "half-block-apart", "other-strides"])
def test_caches_that_share_slots_are_refused_before_any_write(backend, make):
    device = _device(backend)
    k_cache, v_cache = make(torch.zeros(NB, BS, H, D, device=device))
    key, value, slots = _tokens(device)
    with pytest.raises(ShapeError, match="twice"):
        write_kv_cache(key, value, k_cache, v_cache, slots, backend=backend)
    assert not k_cache.any() and not v_cache.any()


def _interleaved(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.zeros(NB, 2, BS, H, D, device=device)  # FlashInfer: [num_blocks, 2, ...]
    return kv[:, 0], kv[:, 1]


def _stacked(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.zeros(2, NB, BS, H, D, device=device)  # FlashAttention: [2, num_blocks, ...]
    return kv[0], kv[1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make", [_interleaved, _stacked], ids=["interleaved", "stacked"])
def test_views_of_one_kv_tensor_that_share_no_slot_still_write(backend, make):
    device = _device(backend)
    k_cache, v_cache = make(device)
    key, value, slots = _tokens(device)
    write_kv_cache(key, value, k_cache, v_cache, slots, backend=backend)
    want_k, want_v = torch.zeros(NB, BS, H, D, device=device), torch.zeros(NB, BS, H, D, device=device)
    write_kv_cache(key, value, want_k, want_v, slots, backend="torch" if device == "cpu" else backend)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


dims = st.lists(st.tuples(st.integers(1, 3), st.integers(0, 7)), min_size=1, max_size=3)


@settings(max_examples=25, deadline=None)
@given(dims)
def test_no_overlap_reported_means_every_index_has_its_own_address(shape):
    # Soundness against brute force: when strides_overlap says no, all offsets differ.
    if strides_overlap(shape):
        return
    offsets = [sum(i * s for i, (_, s) in zip(idx, shape, strict=True))
               for idx in itertools.product(*(range(n) for n, _ in shape))]
    assert len(set(offsets)) == len(offsets)


def test_dense_layouts_are_not_reported():
    assert not strides_overlap(list(zip((NB, BS, H, D), torch.zeros(NB, BS, H, D).stride(), strict=True)))
    assert strides_overlap([(2, 0), (3, 1)]) and strides_overlap([(4, 1), (2, 3)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_out_whose_rows_share_memory_is_refused_before_any_write(backend):
    # Before: the Triton path wrote every row onto one, the torch path raised a bare RuntimeError.
    device = _device(backend)
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = (torch.randn(NB, BS, H, D, generator=gen).to(device) for _ in range(2))
    q = torch.randn(3, H, D, generator=gen).to(device)
    table = torch.tensor([[0, 1], [2, 2]], dtype=torch.int32, device=device)
    cu, used = (torch.tensor(v, dtype=torch.int32, device=device) for v in ([0, 2, 3], [5, 3]))
    out = torch.zeros(1, H, D, device=device).expand(3, -1, -1)
    with pytest.raises(ShapeError, match="overlapping"):
        paged_prefill_attention(q, k_cache, v_cache, table, cu, used, 2, 5, out=out, backend=backend)
    assert not out.any()


def test_meta_caches_have_no_memory_to_share():
    # Every meta tensor's data pointer is 0: two distinct meta caches are not one memory.
    k_cache, v_cache = torch.empty(NB, BS, H, D, device="meta"), torch.empty(NB, BS, H, D, device="meta")
    assert caches_overlap(k_cache, v_cache) is None
    assert caches_overlap(k_cache[:1].expand(NB, -1, -1, -1), v_cache) is not None


def test_a_verdict_is_kept_per_layout_not_per_memory() -> None:
    """The verdicts are remembered; memory seen before under another layout (the same data
    pointers, other strides or offsets) is judged again."""
    kv = torch.zeros(NB, 2, BS, H, D)
    k, v = kv[:, 0], kv[:, 1]
    assert caches_overlap(k, v) is None and caches_overlap(k, v) is None
    assert caches_overlap(k, k) is not None  # v at k's address
    flat = kv.view(-1)
    half = NB * BS * H * D  # v as the second half of one buffer, then starting inside k
    apart = flat[:half].view(NB, BS, H, D), flat[half:2 * half].view(NB, BS, H, D)
    inside = flat[:half].view(NB, BS, H, D), flat[half // 2:half // 2 + half].view(NB, BS, H, D)
    assert caches_overlap(*apart) is None
    assert caches_overlap(*inside) is not None
    assert caches_overlap(*apart) is None
