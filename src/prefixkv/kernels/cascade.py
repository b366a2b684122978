"""Cascade (shared-prefix) attention: a prefix that many requests of a batch share is read
once per group, not once per request, and each request's own part is merged in by
log-sum-exp.

Per request i, in a group whose members share ``P`` tokens (whole blocks)::

    keys   | shared prefix: P tokens (the group's blocks) | own part: seqused_k[i] - P |
    pass 1 (prefix):  every member's query rows in one packed "request" per group,
                      attending the P shared keys without a mask (all of them lie before
                      every member's first new token), LSE out
    pass 2 (own part): the batch as given, each row of the block table shifted by the
                      request's shared blocks and seqused_k reduced by P, LSE out
    merge:            out = (o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2), lse = log of the sum

Softmax over the union of two disjoint key sets is exactly this merge, so the output
equals one pass over all keys up to rounding. Sinks join pass 2 only (counted once).
Sliding windows are not supported here (the prefix pass has no per-row window).

The groups come from the scheduler (``KVCacheManager.shared_prefixes``); they are turned
into metadata tensors on the host by :func:`build_cascade_batch` (``cascade_batch.py``)
with the per-request counts the engine already has, so the launch reads no tensor value
on the host. A call whose two passes would load more keys than the plain call
(``cascade_cost.py``: a chunked prefill's packed rows take the LSE's 128-row tiles, the
plain call 256) runs the plain call instead.

Host work per call on the Triton path, with a group: the prefix pass (on a view of q when
the groups' rows are one range, else a gather of them), one gather of the block table by
the batch's precomputed columns and one subtraction for the own part's keys, the own
pass, and one merge launch in place (``cascade_merge.py``).
"""

from __future__ import annotations

import torch

from . import tiling
from .arguments import check_flags
from .backend import resolve_backend
from .cascade_batch import CascadeBatch, build_cascade_batch
from .cascade_cost import cascade_keys
from .dispatch import paged_prefill_attention
from .errors import DeviceError, DtypeError, MetadataError, ShapeError
from .fp8 import is_fp8
from .overlap import check_reads_apart
from .validation import check_cascade, check_tensors

__all__ = ["CascadeBatch", "build_cascade_batch", "cascade_attention", "merge_attention"]


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the union of two disjoint key sets from each set's result.

    ``out_*``: ``[rows, num_heads, head_dim]``; ``lse_*``: ``[num_heads, rows]`` fp32
    (natural log; ``-inf``: the set had no key for that row). Returns fp32 ``(out, lse)``.
    A row neither set saw gets 0 and ``-inf``; a ``+inf`` LSE (a ``+inf`` sink) takes the
    row, as in the kernels.

    Raises:
        ArgumentTypeError: an argument is not a ``torch.Tensor``.
        ShapeError, DtypeError, DeviceError: the four do not describe the same rows and
            heads (no broadcasting), an LSE is not fp32 or an output not floating point,
            or they are not on one device.
    """
    _check_merge(out_a, lse_a, out_b, lse_b)
    m = torch.maximum(lse_a, lse_b)
    # Only an all -inf row needs a stand-in max: a +inf max must stay, so that the other
    # set's weight exp(lse - inf) is 0 and the +inf set takes the row (LSE +inf).
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w_a, w_b = (torch.where(lse == float("inf"), 1.0, torch.exp(lse - m_safe)) for lse in (lse_a, lse_b))
    total = w_a + w_b
    safe = torch.where(total == 0, torch.ones_like(total), total)
    out = (out_a.float() * w_a.T[..., None] + out_b.float() * w_b.T[..., None]) / safe.T[..., None]
    lse = torch.where(total == 0, float("-inf"), m_safe + torch.log(safe))
    return out, lse


def _check_merge(out_a: object, lse_a: object, out_b: object, lse_b: object) -> None:
    check_tensors(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    assert isinstance(out_a, torch.Tensor) and isinstance(lse_a, torch.Tensor)
    assert isinstance(out_b, torch.Tensor) and isinstance(lse_b, torch.Tensor)
    if out_a.dim() != 3 or out_b.shape != out_a.shape:
        raise ShapeError(f"out_a and out_b must both be [rows, num_heads, head_dim], got "
                         f"{tuple(out_a.shape)} and {tuple(out_b.shape)}")
    want = (out_a.shape[1], out_a.shape[0])
    if lse_a.shape != want or lse_b.shape != want:
        raise ShapeError(f"lse_a and lse_b must be [num_heads, rows] = {list(want)}, got "
                         f"{tuple(lse_a.shape)} and {tuple(lse_b.shape)}")
    if lse_a.dtype != torch.float32 or lse_b.dtype != torch.float32:
        raise DtypeError(f"lse_a/lse_b dtypes {lse_a.dtype}/{lse_b.dtype}; both must be torch.float32")
    if not (out_a.is_floating_point() and out_b.is_floating_point()):
        raise DtypeError(f"out_a/out_b dtypes {out_a.dtype}/{out_b.dtype} must be floating point")
    for name, t in (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if t.device != out_a.device:
            raise DeviceError(f"{name} is on {t.device}, expected {out_a.device} like out_a")


def cascade_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    cascade: CascadeBatch,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: str | None = None,
    checked: bool = False,
    force: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`~prefixkv.kernels.paged_prefill_attention` of the same batch (same arguments,
    same result up to rounding, no sliding window), reading each group's shared prefix
    once per query tile of the group instead of once per request's tile. ``out`` may be
    ``q`` itself.

    ``cascade``: from :func:`build_cascade_batch` for this batch (its counts: checked
    against ``q``'s rows and the block table's width on every call, against the values of
    ``cu_seqlens_q`` and ``seqused_k`` with ``checked``). Two attention passes and a
    merge of the groups' rows (no host synchronisation). Where the two passes would load
    as many keys as the plain call or more (:func:`~prefixkv.kernels.cascade_keys` with
    the launches' tiles: a chunked prefill's packed rows take the LSE's 128-row tiles, the
    plain call 256), or no group is kept, the plain call runs instead, unless ``force``.
    Measured on an H100 (run 7, before the per-call index builds and copies were cut and
    before this choice): 1.18x the plain kernel on decode steps replayed in a CUDA graph
    after a shared 4k-token prefix, 2.49x after 16k; called eagerly its launches were
    host-bound (0.34x); a chunked prefill read twice the keys and took 3x as long (now:
    the plain call). Group decoding requests (docs/kv_layout.md).

    Raises:
        ArgumentTypeError: ``q``, ``k_cache``, ``block_table``, ``cu_seqlens_q`` or
            ``seqused_k`` is not a ``torch.Tensor``.
        ShapeError: ``cascade`` does not fit this batch (its requests, q's rows, a block
            table narrower than its requests' blocks, a ``block_size`` other than the
            cache's), ``out`` shares memory with ``block_table`` or the cascade's tensors;
            and everything ``paged_prefill_attention`` raises, before any write.
        DeviceError: the cascade's tensors or ``block_table`` are not on q's device.
        UnsupportedError: ``force`` is not a bool.
        MetadataError: ``checked`` and ``cu_seqlens_q`` or ``seqused_k`` are not the counts
            the cascade was built from (a batch of other ``num_new`` with as many rows).
    """
    check_flags(force=force)
    _check_fits(cascade, q, k_cache, block_table, cu_seqlens_q, seqused_k, checked)
    if isinstance(out, torch.Tensor):  # pass 2 checks out against its own arguments only
        check_reads_apart("cascade_attention", {"out": out}, {
            "block_table": block_table, "cascade.shift_blocks": cascade.shift_blocks,
            "cascade.rows": cascade.rows, "cascade.block_table": cascade.block_table,
            "cascade.cu_seqlens_q": cascade.cu_seqlens_q, "cascade.seqused_k": cascade.seqused_k,
            "cascade.own_cols": cascade.own_cols, "cascade.shift_tokens": cascade.shift_tokens})

    def attend(q_: torch.Tensor, table: torch.Tensor, cu: torch.Tensor, used: torch.Tensor, max_q: int,
               max_k: int, causal_: bool, out_: torch.Tensor | None, lse_: bool, sinks_: torch.Tensor | None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return paged_prefill_attention(q_, k_cache, v_cache, table, cu, used, max_q, max_k,
                                       softmax_scale=softmax_scale, causal=causal_, softcap=softcap, out=out_,
                                       return_lse=lse_, sinks=sinks_, k_scale=k_scale, v_scale=v_scale,
                                       backend=backend, checked=checked)

    if not force and not _pays(cascade, q, k_cache, max_seqlen_q, return_lse):
        return attend(q, block_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, causal, out,
                      return_lse, sinks)

    rows = cascade.rows
    if rows.numel():
        # Pass 1 first: it reads the groups' q rows before pass 2 writes out, which may be q.
        # All shared keys precede every row: no mask (and, on few tiles, the keys split).
        span = cascade.rows_span
        q_rows = q[span[0]:span[1]] if span is not None else q.index_select(0, rows)
        pre, pre_lse = attend(q_rows, cascade.block_table, cascade.cu_seqlens_q, cascade.seqused_k,
                              cascade.max_seqlen_q, cascade.max_seqlen_k, False, None, True, None)
    own_table = block_table.gather(1, cascade.own_cols)  # [batch, own_width]: from each first own block
    own_used = seqused_k - cascade.shift_tokens  # [batch]: keys past the shared prefix
    own_max = min(max_seqlen_k, own_table.shape[1] * cascade.block_size) if isinstance(max_seqlen_k, int) \
        else max_seqlen_k  # (not an int: pass 2 names it)
    out, lse = attend(q, own_table, cu_seqlens_q, own_used, max_seqlen_q, own_max, causal, out, True, sinks)
    if rows.numel():
        if resolve_backend(backend, q.device) == "triton":
            from .cascade_merge import merge_rows

            merge_rows(out, lse, pre, pre_lse, rows)  # in place: the rows' own part with their prefix
        else:
            merged, merged_lse = merge_attention(out.index_select(0, rows), lse.index_select(1, rows), pre,
                                                 pre_lse)
            out.index_copy_(0, rows, merged.to(out.dtype))
            lse.index_copy_(1, rows, merged_lse)
    return (out, lse) if return_lse else out


def _check_fits(cascade: CascadeBatch, q: object, k_cache: object, block_table: object, cu_seqlens_q: object,
                seqused_k: object, checked: bool) -> None:
    """The cascade was built for this batch, as far as the host can tell (docstring of
    :func:`cascade_attention`); ``checked``: also by the metadata's values (a sync)."""
    check_cascade(cascade.shift_blocks, cascade.rows, cascade.block_table, cascade.max_seqlen_k, q, k_cache,
                  block_table)
    check_tensors(cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k)
    assert isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor)
    assert isinstance(block_table, torch.Tensor) and isinstance(seqused_k, torch.Tensor)
    assert isinstance(cu_seqlens_q, torch.Tensor)
    if q.shape[0] != cascade.total_q:
        raise ShapeError(f"cascade is for {cascade.total_q} rows of q (the new tokens of its "
                         f"{len(cascade.num_new)} requests); q has {q.shape[0]}")
    if k_cache.dim() == 4 and k_cache.shape[1] != cascade.block_size:
        raise ShapeError(f"cascade was built for blocks of {cascade.block_size} tokens; the cache's blocks "
                         f"hold {k_cache.shape[1]}")
    if block_table.shape[1] < cascade.table_width:
        raise ShapeError(f"block_table has {block_table.shape[1]} columns; the cascade's requests fill up "
                         f"to {cascade.table_width} blocks")
    for name in ("shift_blocks", "rows", "block_table", "cu_seqlens_q", "seqused_k", "own_cols",
                 "shift_tokens"):
        t = getattr(cascade, name)
        if t.device != q.device:
            raise DeviceError(f"cascade.{name} is on {t.device}, expected {q.device} like q")
    if block_table.device != q.device:
        raise DeviceError(f"block_table is on {block_table.device}, expected {q.device} like q")
    if checked:
        starts = [0]
        for n in cascade.num_new:
            starts.append(starts[-1] + n)
        _same_counts("cu_seqlens_q", cu_seqlens_q, starts, "new tokens")
        _same_counts("seqused_k", seqused_k, list(cascade.seq_lens), "keys")


def _same_counts(name: str, t: torch.Tensor, want: list[int], what: str) -> None:
    got = t.tolist() if t.dim() == 1 else None
    if got != want:
        i = next((i for i, (a, b) in enumerate(zip(got or [], want, strict=False)) if a != b), None)
        where = f"entry {i}: {got[i]} where the cascade has {want[i]}" if got and i is not None else \
            f"{got!r} where the cascade has {want}"
        raise MetadataError(f"cascade was built from other {what} than this batch's {name} ({where})")


def _pays(cascade: CascadeBatch, q: torch.Tensor, k_cache: torch.Tensor, max_seqlen_q: int,
          return_lse: bool) -> bool:
    """Cascade's passes load fewer keys than the plain call (True for shapes no launch
    takes: the passes then raise what the plain call would)."""
    if not cascade.prefix_groups:
        return False
    if q.dim() != 3 or k_cache.dim() != 4 or not k_cache.shape[2] or q.shape[1] % k_cache.shape[2] \
            or not isinstance(max_seqlen_q, int):
        return True
    return cascade_keys(cascade, group=q.shape[1] // k_cache.shape[2], head_dim=q.shape[2],
                        max_seqlen_q=max(1, max_seqlen_q), on_gpu=tiling.gpu_tiles(q.device),
                        elem_bytes=q.element_size(), return_lse=return_lse,
                        kv_fp8=is_fp8(k_cache.dtype)).pays
