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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["key-in-k_cache", "value-in-v_cache", "key-in-v_cache"])
def test_inputs_that_are_views_of_a_cache_are_refused_before_any_write(backend, which):
    # Before: the Triton path wrote token 0's slot, then read token 1's key from memory
    # token 0 had just overwritten (the torch path copied the inputs first and was right).
    device = _device(backend)
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = (torch.randn(NB, BS, H, D, generator=gen).to(device) for _ in range(2))
    before = k_cache.clone(), v_cache.clone()
    key, value, _ = _tokens(device)
    key, value = key[:BS], value[:BS]
    if which == "key-in-k_cache":
        key = k_cache[0]
    elif which == "value-in-v_cache":
        value = v_cache[2]
    else:
        key = v_cache[1]
    slots = torch.arange(1, BS + 1, device=device)   # block 0 from row 1 on, then block 1
    with pytest.raises(ShapeError, match="shares memory with its input"):
        write_kv_cache(key, value, k_cache, v_cache, slots, backend=backend)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_expanded_key_is_only_read_and_writes_exactly(backend):
    device = _device(backend)
    key, value, slots = _tokens(device)
    key = key[:1].expand(5, -1, -1)
    k_cache, v_cache = torch.zeros(NB, BS, H, D, device=device), torch.zeros(NB, BS, H, D, device=device)
    write_kv_cache(key, value, k_cache, v_cache, slots, backend=backend)
    want_k, want_v = torch.zeros_like(k_cache).cpu(), torch.zeros_like(v_cache).cpu()
    write_kv_cache(key.cpu().contiguous(), value.cpu(), want_k, want_v, slots.cpu(), backend="torch")
    assert torch.equal(k_cache.cpu(), want_k) and torch.equal(v_cache.cpu(), want_v)


def _attention_case(device: str):
    from .cases import make_case

    case = make_case([3, 5, 1], [7, 9, 6], head_dim=16, block_size=4, group=2, device="cpu")
    moved = [t.to(device) if isinstance(t, torch.Tensor) else t for t in case.args]
    return case, moved


@pytest.mark.parametrize(("backend", "splits"), [("torch", None), *(
    pytest.param("triton", s, marks=BACKENDS[1].marks) for s in (None, 2))])
def test_out_may_be_q_itself(backend, splits):
    """Each row's output lands where only its own query was read: in place is exact
    (the reference with a separate out; NaN-poisoned unused blocks), key splits too."""
    device = _device(backend)
    case, args = _attention_case(device)
    want = paged_prefill_attention(*[t.cpu() if isinstance(t, torch.Tensor) else t for t in args],
                                   backend="torch")
    q = args[0]
    if splits is None:
        got = paged_prefill_attention(*args, out=q, backend=backend)
    else:
        from prefixkv.kernels.attention import paged_prefill_attention_triton
        from prefixkv.kernels.tiling import TileConfig

        got = paged_prefill_attention_triton(*args, out=q, config=TileConfig(16, 16, num_splits=splits))
    assert got.data_ptr() == q.data_ptr()
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["q-shifted-a-row", "k_cache", "v_cache", "block_table"])
def test_an_out_that_shares_memory_with_an_input_is_refused_before_any_write(backend, which):
    # Before: an out one row past q overwrote query rows other programs had yet to read
    # (wrong rows on both backends); an out inside a cache overwrote keys being read.
    device = _device(backend)
    case, args = _attention_case(device)
    q, k_cache, v_cache, table = args[:4]
    total_q, heads, dim = q.shape
    n = total_q * heads * dim
    if which == "q-shifted-a-row":
        buf = torch.zeros(total_q + 1, heads, dim, device=device)
        buf[:-1] = q
        args[0], out = buf[:-1], buf[1:]
    elif which == "block_table":
        out = torch.zeros(n + table.numel(), device=device)[:n].view(total_q, heads, dim)
        args[3] = out.view(-1).view(torch.int32)[:table.numel()].view(table.shape)
        args[3].copy_(table)
    else:
        cache = k_cache if which == "k_cache" else v_cache
        out = cache.view(-1)[:n].view(total_q, heads, dim)
    inputs = [t.clone() for t in args[:4]]
    with pytest.raises(ShapeError, match="shares memory with its input"):
        paged_prefill_attention(*args, out=out, backend=backend)
    for t, b in zip(args[:4], inputs, strict=True):
        torch.testing.assert_close(t, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["lse-in-part", "out-in-part", "row_tok-in-q"])
def test_a_split_workspace_that_shares_memory_is_refused_before_any_write(backend, which):
    from prefixkv.kernels import SplitWorkspace, alloc_split_workspace

    device = _device(backend)
    case, args = _attention_case(device)
    q = args[0]
    ws = alloc_split_workspace(2, 3, q.shape[1], q.shape[2], device, split_q=5, min_keys=1)
    out = None
    if which == "lse-in-part":
        lse = ws.part.view(-1)[:ws.part_lse.numel()].view(ws.part_lse.shape)
        ws = SplitWorkspace(ws.part, lse, ws.row_tok, ws.split_q, ws.min_keys)
    elif which == "out-in-part":
        out = ws.part.view(-1)[:q.numel()].view(q.shape)
    else:
        row_tok = q.view(-1)[:ws.row_tok.numel()].view(torch.int32)
        ws = SplitWorkspace(ws.part, ws.part_lse, row_tok, ws.split_q, ws.min_keys)
    before = q.clone()
    with pytest.raises(ShapeError, match="share"):
        paged_prefill_attention(*args, out=out, split_workspace=ws, backend=backend)
    assert torch.equal(q, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_inputs_are_only_read_and_attend_exactly(backend):
    """q, k_cache and v_cache whose elements repeat (stride 0) are read as the values they
    show: the result equals attention over contiguous copies of them."""
    device = _device(backend)
    case, args = _attention_case(device)
    q, k_cache, v_cache = args[:3]
    heads = q.shape[1]
    args[0] = q[:, :1].expand(-1, heads, -1)                    # one query head repeated
    args[1] = k_cache[:, :1].expand(-1, k_cache.shape[1], -1, -1)  # each block's row 0 repeated
    used = int(args[3][0, 0])                                      # (unused blocks are NaN)
    args[2] = v_cache[used:used + 1].expand(v_cache.shape[0], -1, -1, -1)  # one block everywhere
    dense = [t.contiguous().cpu() if isinstance(t, torch.Tensor) else t for t in args]
    want = paged_prefill_attention(*dense, backend="torch")
    got = paged_prefill_attention(*args, backend=backend)
    assert not want.isnan().any()
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-5)


views = st.tuples(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 6)), min_size=1, max_size=3),
                  st.integers(0, 12))


@settings(max_examples=60, deadline=None)
@given(views, views, st.booleans())
def test_views_that_share_an_element_are_reported(a, b, same_layout):
    """Soundness against brute force: two views of one storage that reach a common
    address are always reported (the analysis may also report views that interleave
    without sharing, beyond the cache layouts tested above)."""
    from prefixkv.kernels.overlap import views_meet

    if same_layout:
        b = (a[0], b[1])
    base = torch.zeros(64)
    made = [base.as_strided([n for n, _ in dims], [s for _, s in dims], off) for dims, off in (a, b)]

    def addresses(dims, off):
        return {off + sum(i * s for i, (_, s) in zip(idx, dims, strict=True))
                for idx in itertools.product(*(range(n) for n, _ in dims))}

    if addresses(*a) & addresses(*b):
        assert views_meet(*made) and views_meet(*reversed(made))
    assert not views_meet(made[0], torch.zeros(64)[:1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_and_v_as_one_tensor_are_only_read_by_attention(backend):
    device = _device(backend)
    case, args = _attention_case(device)
    args[2] = args[1]                                   # V is K: both only read
    want = paged_prefill_attention(*[t.clone().cpu() if isinstance(t, torch.Tensor) else t for t in args],
                                   backend="torch")
    got = paged_prefill_attention(*args, backend=backend)
    assert not want.isnan().any()
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-5)
