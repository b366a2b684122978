"""Metadata values no shape check can see (slots, block ids, lengths, cu_seqlens_q).

Default path: no launch reads or writes outside the tensors it was given, and both
backends give the documented result. Every tensor here is a view into a larger one whose
surrounding memory holds NaN (inputs) or a sentinel (outputs), so a stray read shows up
as NaN and a stray write as a changed sentinel (the interpreter does not catch either).
Checked mode (``checked=True``) raises ``MetadataError`` naming the request and value.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.kernels import MetadataError, paged_prefill_attention, write_kv_cache

from .cases import tolerance
from .conftest import PRIMARY_DEVICE, triton_skip_reason

BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(triton_skip_reason() is not None,
                                                    reason=str(triton_skip_reason()))),
]
SENTINEL = 5.0
PAD = 4  # rows of poison / sentinel around every view


def framed(t: torch.Tensor, fill: float, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(whole, view)``: ``view`` equals ``t`` and sits inside ``whole`` between PAD
    slices of ``fill`` along ``dim``."""
    shape = list(t.shape)
    shape[dim] += 2 * PAD
    whole = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    view = whole.narrow(dim, PAD, t.shape[dim])
    view.copy_(t)
    return whole, view


# --- write_kv_cache -------------------------------------------------------------------


def _write_setup(num_tokens=4, num_blocks=3, block_size=4):
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(num_tokens, 2, 8, generator=gen).to(PRIMARY_DEVICE)
    value = torch.randn(num_tokens, 2, 8, generator=gen).to(PRIMARY_DEVICE)
    cache = torch.zeros(num_blocks, block_size, 2, 8, device=PRIMARY_DEVICE)
    (k_whole, k_cache), (v_whole, v_cache) = framed(cache, SENTINEL), framed(cache, SENTINEL)
    return key, value, k_whole, k_cache, v_whole, v_cache


def _frame_untouched(whole: torch.Tensor) -> bool:
    return bool((whole[:PAD] == SENTINEL).all() and (whole[-PAD:] == SENTINEL).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_follows_a_strided_slot_mapping(backend):
    key, value, k_whole, k_cache, v_whole, v_cache = _write_setup()
    interleaved = torch.tensor([5, 0, 2, 0, 11, 0, -1, 0], device=PRIMARY_DEVICE)
    write_kv_cache(key, value, k_cache, v_cache, interleaved[::2], backend=backend)
    flat = k_cache.flatten(0, 1)
    assert torch.equal(flat[5], key[0]) and torch.equal(flat[2], key[1]) and torch.equal(flat[11], key[2])
    assert not flat[0].any(), "slot 0 came from the gaps of the strided view"
    assert torch.equal(v_cache.flatten(0, 1)[11], value[2]) and _frame_untouched(k_whole)


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_skips_slots_outside_the_cache(backend):
    key, value, k_whole, k_cache, v_whole, v_cache = _write_setup()
    capacity = k_cache.shape[0] * k_cache.shape[1]
    slots = torch.tensor([capacity, 3, -2, capacity + 5], device=PRIMARY_DEVICE)
    write_kv_cache(key, value, k_cache, v_cache, slots, backend=backend)
    assert _frame_untouched(k_whole) and _frame_untouched(v_whole)
    flat = k_cache.flatten(0, 1)
    assert torch.equal(flat[3], key[1]) and int(flat.any(-1).any(-1).sum()) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_checked_write_names_the_bad_slot_before_writing(backend):
    key, value, k_whole, k_cache, v_whole, v_cache = _write_setup()
    for bad in (12, -2):
        slots = torch.tensor([3, 0, bad, 1], device=PRIMARY_DEVICE)
        with pytest.raises(MetadataError, match=rf"token 2: slot_mapping\[2\] = {bad} .*\[-1, 12\)"):
            write_kv_cache(key, value, k_cache, v_cache, slots, backend=backend, checked=True)
    assert not k_cache.any() and _frame_untouched(k_whole)
    write_kv_cache(key, value, k_cache, v_cache, torch.tensor([3, 0, -1, 11], device=PRIMARY_DEVICE),
                   backend=backend, checked=True)
    assert torch.equal(k_cache.flatten(0, 1)[11], key[3])


# --- paged_prefill_attention ----------------------------------------------------------

NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS = 6, 4, 2
CAPACITY = MAX_BLOCKS * BLOCK_SIZE


class Call:
    """Two requests over finite caches framed by NaN blocks; q framed by NaN rows, out by
    sentinel rows, the block table by a NaN-block id (-1) in its extra columns."""

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        dev = PRIMARY_DEVICE
        cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, 1, 16, generator=gen)
        _, self.k_cache = framed(cache.to(dev), float("nan"))
        _, self.v_cache = framed(torch.randn_like(cache).to(dev), float("nan"))
        _, self.q = framed(torch.randn(5, 2, 16, generator=gen).to(dev), float("nan"))
        self.out_whole, self.out = framed(torch.full((5, 2, 16), SENTINEL, device=dev), SENTINEL)
        table = torch.tensor([[2, 4], [1, 5]], dtype=torch.int32, device=dev)
        _, self.block_table = framed(table, -1, dim=1)
        self.cu_seqlens_q = torch.tensor([0, 3, 5], dtype=torch.int32, device=dev)
        self.seqused_k = torch.tensor([7, 5], dtype=torch.int32, device=dev)

    def run(self, backend, **changes):
        """``(out, lse)`` of the call with ``changes`` to its tensors; out is self.out."""
        t = {name: getattr(self, name) for name in ("q", "block_table", "cu_seqlens_q", "seqused_k")}
        t.update(changes)
        return paged_prefill_attention(
            t["q"], self.k_cache, self.v_cache, t["block_table"], t["cu_seqlens_q"], t["seqused_k"],
            3, CAPACITY, out=self.out, return_lse=True, backend=backend)

    def framed_out_untouched(self) -> bool:
        return _frame_untouched(self.out_whole)


def _int32(values):
    return torch.tensor(values, dtype=torch.int32, device=PRIMARY_DEVICE)


def _same(got, want):
    torch.testing.assert_close(got[0], want[0], **tolerance(torch.float32))
    torch.testing.assert_close(got[1], want[1], **tolerance(torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_seqused_k_past_the_row_capacity_is_clamped_to_it(backend):
    call = Call()
    got = [t.clone() for t in call.run(backend, seqused_k=_int32([CAPACITY + 3, 5]))]
    assert not got[0].isnan().any(), "read the next column of the block table"
    _same(got, call.run(backend, seqused_k=_int32([CAPACITY, 5])))
    _same(call.run(backend, seqused_k=_int32([7, -3])), call.run(backend, seqused_k=_int32([7, 0])))
    assert call.framed_out_untouched()


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_ids_outside_the_cache_read_the_last_block(backend):
    call = Call()
    bad = call.block_table.clone()
    bad[0, 0], bad[1, 1] = -3, NUM_BLOCKS
    got = [t.clone() for t in call.run(backend, block_table=bad)]
    assert not got[0].isnan().any(), "read a block outside the cache"
    clamped = call.block_table.clone()
    clamped[0, 0], clamped[1, 1] = NUM_BLOCKS - 1, NUM_BLOCKS - 1
    _same(got, call.run(backend, block_table=clamped))
    assert call.framed_out_untouched()


def _covered(cu: list[int], total_q: int) -> list[int]:
    """cu_seqlens_q as the kernels read it: clamped to [0, total_q], then non-decreasing."""
    bounds, top = [], 0
    for c in cu:
        top = max(top, min(max(c, 0), total_q))
        bounds.append(top)
    return bounds


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cu", [[1, 3, 5], [0, 3, 4], [0, 4, 2], [-2, 3, 5], [0, 3, 9], [2, 1, 4]], ids=str)
def test_rows_outside_cu_seqlens_q_are_zero_and_covered_rows_are_right(backend, cu):
    call = Call()
    out, lse = (t.clone() for t in call.run(backend, cu_seqlens_q=_int32(cu)))
    assert call.framed_out_untouched(), "wrote outside out"
    assert not out.isnan().any(), "read outside q"
    bounds = _covered(cu, 5)
    lo, hi = bounds[0], bounds[-1]
    assert not out[:lo].any() and not out[hi:].any()
    assert torch.isneginf(lse[:, :lo]).all() and torch.isneginf(lse[:, hi:]).all()
    # Covered rows: the same requests called alone on exactly their rows.
    want_cu = _int32([b - lo for b in bounds])
    want, want_lse = paged_prefill_attention(
        call.q[lo:hi], call.k_cache, call.v_cache, call.block_table, want_cu, call.seqused_k, 3, CAPACITY,
        return_lse=True, backend="torch")
    _same((out[lo:hi], lse[:, lo:hi]), (want, want_lse))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_of_an_empty_batch_are_zero(backend):
    call = Call()
    got = paged_prefill_attention(
        call.q, call.k_cache, call.v_cache, call.block_table[:0], _int32([0]), _int32([]), 3, CAPACITY,
        out=call.out, return_lse=True, backend=backend)
    assert not got[0].any() and torch.isneginf(got[1]).all() and call.framed_out_untouched()


# (tensor to replace, its bad value, message) for checked mode
CHECKED = {
    "seqused_k over capacity": ("seqused_k", [7, 9], r"request 1: seqused_k\[1\] = 9 outside \[0, 8\]"),
    "negative seqused_k": ("seqused_k", [-1, 5], r"request 0: seqused_k\[0\] = -1"),
    "negative block id": ("block_table", [[2, 4], [-1, 5]],
                          r"request 1: block_table\[1, 0\] = -1 outside \[0, 6\)"),
    "block id past the cache": ("block_table", [[2, 6], [1, 5]], r"request 0: block_table\[0, 1\] = 6"),
    "first cu_seqlens_q": ("cu_seqlens_q", [1, 3, 5], r"cu_seqlens_q\[0\] = 1, must be 0"),
    "decreasing cu_seqlens_q": ("cu_seqlens_q", [0, 4, 3],
                                r"request 1: cu_seqlens_q\[2\] = 3 < cu_seqlens_q\[1\] = 4"),
    "last cu_seqlens_q": ("cu_seqlens_q", [0, 3, 4], r"cu_seqlens_q\[2\] = 4, must be total_q = 5"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CHECKED)
def test_checked_attention_names_the_request_and_value_before_writing(backend, name):
    call = Call()
    tensor, value, match = CHECKED[name]
    t = {n: getattr(call, n) for n in ("block_table", "cu_seqlens_q", "seqused_k")}
    t[tensor] = _int32(value)
    with pytest.raises(MetadataError, match=match):
        paged_prefill_attention(call.q, call.k_cache, call.v_cache, t["block_table"], t["cu_seqlens_q"],
                                t["seqused_k"], 3, CAPACITY, out=call.out, backend=backend, checked=True)
    assert (call.out_whole == SENTINEL).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_checked_attention_reads_only_the_blocks_in_use(backend):
    # Padding past ceil(seqused_k / block_size) may hold anything, checked or not.
    call = Call()
    padded = _int32([[2, -7], [1, 5]])
    got = paged_prefill_attention(call.q, call.k_cache, call.v_cache, padded, call.cu_seqlens_q,
                                  _int32([4, 5]), 3, CAPACITY, backend=backend, checked=True)
    assert not got.isnan().any()


@pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
@settings(max_examples=20, deadline=None)
@given(
    cu=st.lists(st.integers(-3, 9), min_size=3, max_size=3),
    seqused=st.lists(st.integers(-3, 12), min_size=2, max_size=2),
    ids=st.lists(st.integers(-3, NUM_BLOCKS + 2), min_size=4, max_size=4),
    splits=st.sampled_from([None, 3]),
)
def test_any_metadata_stays_inside_and_backends_agree(cu, seqused, ids, splits):
    from prefixkv.kernels.attention import paged_prefill_attention_triton
    from prefixkv.kernels.tiling import TileConfig

    call = Call()
    call.block_table.copy_(_int32(ids).view(2, 2))  # in place: the framing columns stay around it
    meta = (call.block_table, _int32(cu), _int32(seqused))
    args = (call.q, call.k_cache, call.v_cache, *meta, 3, CAPACITY)
    config = TileConfig(16, 16, num_splits=splits) if splits else None
    got = paged_prefill_attention_triton(*args, out=call.out, return_lse=True, config=config)
    assert call.framed_out_untouched() and not got[0].isnan().any()
    _same(got, paged_prefill_attention(*args, return_lse=True, backend="torch"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_checked_write_refuses_a_slot_given_twice_before_writing(backend):
    """Two tokens into one slot leave the cache with either one (the Triton programs race;
    the reference keeps the last): checked mode names the second token. Padding (-1) may
    repeat. Before, checked mode let it through."""
    key, value, k_whole, k_cache, v_whole, v_cache = _write_setup()
    slots = torch.tensor([3, 7, -1, 7], device=PRIMARY_DEVICE)
    with pytest.raises(MetadataError, match=r"token 3: slot_mapping\[3\] = 7 is token 1's slot too"):
        write_kv_cache(key, value, k_cache, v_cache, slots, backend=backend, checked=True)
    assert not k_cache.any() and _frame_untouched(k_whole)
    write_kv_cache(key, value, k_cache, v_cache, torch.tensor([-1, 7, -1, 2], device=PRIMARY_DEVICE),
                   backend=backend, checked=True)
    assert torch.equal(k_cache.flatten(0, 1)[7], key[1]) and torch.equal(k_cache.flatten(0, 1)[2], key[3])
