"""Whether tensors share memory: a write through one element would land on another.

``write_kv_cache`` scatters into ``k_cache`` and ``v_cache`` through their strides. A
cache made by ``expand`` (a stride 0), or ``v_cache`` passed as the same memory as
``k_cache``, makes distinct slots one address: the write then silently loses tokens (or
every K to its V). Views that interleave without sharing an element stay allowed, such
as K and V as ``kv[:, 0]`` and ``kv[:, 1]`` of one ``[num_blocks, 2, block_size, heads,
head_dim]`` tensor (FlashInfer's layout). Only strides and data pointers are read.

Every call that writes asks the same of all its tensors (``check_apart``): a written
tensor shares no element with another tensor of the call, or a write could change what
the call has yet to read (a key that is a view of its own cache, an ``out`` that
overlaps ``q`` by a row, a block copy whose K and V caches are one tensor).
"""

from __future__ import annotations

import torch

from .errors import ShapeError

__all__ = ["strides_overlap", "caches_overlap", "views_meet", "check_apart", "check_reads_apart"]


def strides_overlap(dims: list[tuple[int, int]]) -> bool:
    """Whether some two index tuples of a view with these ``(size, stride)`` dims (strides
    >= 0, in elements) may reach one address.

    Sufficient test for no overlap: sorted by stride, each dim's stride passes the reach
    of all smaller ones (``sum((size - 1) * stride) + 1``). Layouts that interleave
    dims finer than that are reported as overlapping; no cache layout does.
    """
    reach = 1
    for size, stride in sorted((d for d in dims if d[0] > 1), key=lambda d: d[1]):
        if stride < reach:
            return True
        reach += (size - 1) * stride
    return False


# Verdicts by layout: an engine writes into the same caches every layer of every step, and
# the analysis (~10 us) would triple ``write_kv_cache``'s checks. The key holds everything
# the verdict reads, so memory reused with another layout is analysed again.
_VERDICTS: dict[tuple[object, ...], str | None] = {}
_MAX_VERDICTS = 256


def caches_overlap(k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """Why a write into ``k_cache`` and ``v_cache`` (same shape and dtype) could write one
    address twice, or None when it cannot."""
    key = (k_cache.device, k_cache.dtype, k_cache.shape, k_cache.stride(), v_cache.stride(),
           k_cache.data_ptr(), v_cache.data_ptr(), k_cache.storage_offset(),
           v_cache.storage_offset())  # (with the data pointers: where each storage begins)
    try:
        return _VERDICTS[key]
    except KeyError:
        pass
    if len(_VERDICTS) >= _MAX_VERDICTS:
        _VERDICTS.clear()
    verdict = _VERDICTS[key] = _analyse(k_cache, v_cache)
    return verdict


def _analyse(k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if strides_overlap(list(zip(t.shape, t.stride(), strict=True))):
            return f"{name} has overlapping strides {t.stride()} for shape {tuple(t.shape)} (expanded?)"
    if views_meet(k_cache, v_cache):
        return "v_cache shares memory with k_cache (writing V would overwrite K)"
    return None


def views_meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether some element of ``a`` and some element of ``b`` may lie at one address:
    never False when they do (it may be True for views that interleave finely without
    sharing). One layout at two offsets is one view with a dim of size 2 whose stride is
    their distance (``strides_overlap``: so K and V as ``kv[:, 0]`` and ``kv[:, 1]`` do
    not meet); views of one storage with other layouts meet when their byte ranges do.
    Views of different storages never meet; nor do empty or meta tensors (no memory).
    """
    if (a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()  # first: ~0.2 us
            or a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta"):
        return False
    size, delta = a.element_size(), b.data_ptr() - a.data_ptr()
    if a.shape == b.shape and a.stride() == b.stride() and size == b.element_size() and not delta % size:
        return strides_overlap([(2, abs(delta) // size), *zip(a.shape, a.stride(), strict=True)])
    lo, hi = sorted((t.data_ptr(), t.data_ptr() + t.element_size() * (1 + sum(
        (n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)))) for t in (a, b))
    return hi[0] < lo[1]


def check_apart(call: str, written: dict[str, torch.Tensor], read: dict[str, torch.Tensor | None]) -> None:
    """Raise ShapeError when a tensor ``call`` writes (``written``, by argument name) has
    two elements at one address (an expanded view) or shares memory with another of its
    tensors, written or read: the result would then depend on the order of the writes.
    Tensors only read may share memory among themselves. Reads strides and data pointers
    only."""
    for name, t in written.items():
        if strides_overlap(list(zip(t.shape, t.stride(), strict=True))):
            raise ShapeError(f"{call} would write one address twice: {name} has overlapping strides "
                             f"{t.stride()} for shape {tuple(t.shape)} (an expanded view?)")
    names = list(written)
    for i, name in enumerate(names):
        for other in names[i + 1:]:
            if views_meet(written[name], written[other]):
                raise ShapeError(f"{call} writes {name} and {other}, which share memory: "
                                 "the result would depend on the order of the writes")
    check_reads_apart(call, written, read)


def check_reads_apart(call: str, written: dict[str, torch.Tensor],
                      read: dict[str, torch.Tensor | None]) -> None:
    """Raise ShapeError when a tensor ``call`` reads (``read``; None entries skipped)
    shares memory with one it writes: a write could change an input another part of the
    call has yet to read. (``check_apart`` without the checks of the written tensors
    themselves, for a call that made those already.)"""
    # Per layer of every step (write_kv_cache): ~0.2 us a tensor while no storage is shared.
    storages = {w.untyped_storage().data_ptr() for w in written.values()}
    for other, t in read.items():
        if t is None or t.untyped_storage().data_ptr() not in storages:
            continue
        for name, w in written.items():
            if views_meet(w, t):
                raise ShapeError(f"{call} writes {name}, which shares memory with its input {other}: "
                                 "a write could change what the call has yet to read")
