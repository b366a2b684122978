"""Whether cache views share memory: a write through one element would land on another.

``write_kv_cache`` scatters into ``k_cache`` and ``v_cache`` through their strides. A
cache made by ``expand`` (a stride 0), or ``v_cache`` passed as the same memory as
``k_cache``, makes distinct slots one address: the write then silently loses tokens (or
every K to its V). Views that interleave without sharing an element stay allowed, such
as K and V as ``kv[:, 0]`` and ``kv[:, 1]`` of one ``[num_blocks, 2, block_size, heads,
head_dim]`` tensor (FlashInfer's layout). Only strides and data pointers are read.
"""

from __future__ import annotations

import torch

__all__ = ["strides_overlap", "caches_overlap"]


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
    # Meta tensors (compile-key sweeps) have no memory: every data pointer reads 0.
    if (k_cache.numel() == 0 or k_cache.device.type == "meta"
            or k_cache.untyped_storage().data_ptr() != v_cache.untyped_storage().data_ptr()):
        return None
    delta, size = v_cache.data_ptr() - k_cache.data_ptr(), k_cache.element_size()
    if k_cache.stride() != v_cache.stride() or delta % size:
        # Same storage, different layouts: refuse only when their byte ranges meet.
        ranges = sorted((t.data_ptr(), t.data_ptr() + size * (1 + sum(
            (n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)))) for t in (k_cache, v_cache))
        meet = ranges[1][0] < ranges[0][1]
    else:  # one layout at two offsets: a dim of size 2 and stride |delta| must not overlap the rest
        meet = strides_overlap([(2, abs(delta) // size), *zip(k_cache.shape, k_cache.stride(), strict=True)])
    return "v_cache shares memory with k_cache (writing V would overwrite K)" if meet else None
