"""Public entry points: pick the Triton kernels for CUDA tensors, the torch reference elsewhere.

The choice is made per call from the tensors' device (``backend.py``: ``BACKENDS``,
:func:`use_backend` and :func:`resolve_backend`, re-exported here); nothing is probed at
import time and Triton is imported only when the Triton path is first taken. Tests force
a backend with ``backend=`` or :func:`use_backend` (the Triton path runs on CPU tensors
only under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, overload

import torch

from .backend import BACKENDS, resolve_backend, use_backend
from .reference import paged_prefill_attention_reference, write_kv_cache_reference
from .validation import check_tensors

if TYPE_CHECKING:
    from .workspace import SplitWorkspace

__all__ = ["BACKENDS", "write_kv_cache", "paged_prefill_attention", "use_backend", "resolve_backend"]


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: str | None = None,
    checked: bool = False,
) -> None:
    """Write each new token's K and V into its cache slot, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype (an fp8
            cache takes fp16, bf16 or fp32 and quantises them).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD),
            fp16, bf16, fp32, ``float8_e4m3fn`` or ``float8_e5m2``.
        k_scale, v_scale: fp8 caches only: fp32 ``[]``/``[1]`` (per tensor) or
            ``[num_kv_heads]``; the cache stores ``x / scale`` rounded to nearest and
            saturated to the format's largest finite value (None: scale 1). A scale that
            is not a finite number > 0 (0, negative, NaN, inf) acts as 0: the head stores
            zeros. See :mod:`prefixkv.kernels.fp8` for the error bound.
        slot_mapping: ``[num_tokens]`` int64 (or int32); token t goes to block
            ``slot // block_size``, row ``slot % block_size``; ``-1`` skips the token
            (padding), and so does any slot outside ``[0, num_blocks * block_size)``
            (named by ``checked=True``). Slots should be distinct, or the last writer
            wins in no defined order (``checked=True`` refuses a slot given twice).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``; see :func:`resolve_backend`.
        checked: read ``slot_mapping`` and the scales on the host (a device
            synchronisation) and raise on a slot outside ``[-1, num_blocks * block_size)``,
            a slot given twice, or a negative, NaN or infinite scale, before any write.

    Raises:
        ShapeError, DtypeError, DeviceError, UnsupportedError: bad tensors (also caches
            in which two slots share memory: an expanded view, or ``v_cache`` overlapping
            ``k_cache``; and an input that shares memory with a cache, such as a ``key``
            that is a view of ``k_cache``; and a cache block or key/value token whose
            offsets reach 2^31 elements), before any write.
        ArgumentTypeError: a tensor argument is not a ``torch.Tensor``.
        MetadataError: ``checked=True`` and a slot is out of range or given twice
            (-1 aside), before any write.
        TensorValueError: ``checked=True`` and a scale is negative, NaN or infinite (a
            ``MetadataError``), before any write.
        BackendError: see :func:`resolve_backend`.
    """
    check_tensors(k_cache=k_cache)
    write = write_kv_cache_reference
    if resolve_backend(backend, k_cache.device) == "triton":
        from . import write_kv  # Triton is imported only here

        write = write_kv.write_kv_cache_triton
    write(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale, checked=checked)


@overload
def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
    return_lse: Literal[False] = False,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: str | None = None,
    checked: bool = False,
    split_workspace: SplitWorkspace | None = None,
) -> torch.Tensor: ...


@overload
def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
    return_lse: Literal[True],
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: str | None = None,
    checked: bool = False,
    split_workspace: SplitWorkspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: str | None = None,
    checked: bool = False,
    split_workspace: SplitWorkspace | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: str | None = None,
    checked: bool = False,
    split_workspace: SplitWorkspace | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a varlen batch of new tokens over their paged, cached prefix and themselves.

    Request i owns query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` (``q_len`` tokens) and
    ``seqused_k[i]`` keys, already in the cache: ``| cached prefix | new tokens |``. Query
    t of the request sits at key position ``seqused_k[i] - q_len + t`` (bottom-right
    alignment); decode is ``q_len = 1``, chunked prefill any ``q_len <= seqused_k[i]``.

    Args:
        q: ``[total_q, num_heads, head_dim]``; ``num_heads`` a multiple of ``num_kv_heads``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype,
            or fp8 (``float8_e4m3fn``/``float8_e5m2``) with q fp16 or bf16; at least one block.
        block_table: ``[batch, max_blocks]`` int32; row i lists request i's block ids in
            order; entries past ``ceil(seqused_k[i] / block_size)`` are never read. An
            id outside ``[0, num_blocks)`` reads block ``num_blocks - 1`` instead (a
            wrong block, never memory outside the cache).
        cu_seqlens_q: ``[batch + 1]`` int32, non-decreasing from 0 to ``total_q``.
            Otherwise each entry is clamped to ``[0, total_q]`` and raised to the
            largest entry before it; rows of q no request then owns get zeros and LSE
            ``-inf``.
        seqused_k: ``[batch]`` int32, keys per request (cached prefix + new tokens),
            clamped to ``[0, max_blocks * block_size]``.
        max_seqlen_q, max_seqlen_k: host ints bounding ``q_len`` and ``seqused_k``; they
            size the tiles and are never checked against the device values.
        softmax_scale: default ``head_dim ** -0.5``.
        causal: mask keys after each query's own position.
        window_size: ``None`` or ``(left, right)`` as in FlashAttention: query at position
            p attends keys ``p - left .. p + right``; ``-1`` is unbounded; with ``causal``
            right must be -1 or 0; a side wider than 2^30 is clamped to 2^30 (unbounded in
            effect).
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (after scaling);
            0 or in ``[1.18e-38, 1.7e38]``, with ``softmax_scale / softcap <= 1.7e38``.
        out: optional ``[total_q, num_heads, head_dim]`` tensor of q's dtype to write into
            (any strides in which no two entries share memory): ``q`` itself (in place),
            or memory that no other argument shares (ShapeError otherwise).
        return_lse: also return the natural-log LSE, ``[num_heads, total_q]`` fp32.
        sinks: optional fp32 ``[num_heads]`` attention sinks (as in gpt-oss): one more
            logit per head in every row's softmax denominator, with no value; the LSE
            includes it. Any stride. ``-inf`` (and NaN) is no sink; ``+inf`` takes the
            whole softmax: the row's output is 0 and its LSE ``+inf``.
        k_scale, v_scale: fp8 caches only, as in :func:`write_kv_cache`: K and V are
            read as ``cache * scale`` (None: 1); a scale that is not a finite number > 0
            acts as 0 (a K scale of 0 makes that KV head's scores 0, a V scale of 0 its
            output 0).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``; see :func:`resolve_backend`.
        split_workspace: a :class:`SplitWorkspace` from :func:`alloc_split_workspace`,
            made once: the Triton launch then has a fixed grid (its split count, whatever
            ``max_seqlen_k``) and allocates nothing for split-KV, so a CUDA graph can
            capture it; and in any batch, prefills included, each request of at most
            ``split_q`` new tokens splits its keys by its own length (a long decode beside
            a prefill). The torch path checks it and computes without splits. Its
            tensors share no memory with each other or the call's (else ShapeError).
        checked: read ``block_table``, ``cu_seqlens_q``, ``seqused_k``, the scales and
            the sinks on the host (a device synchronisation, not for CUDA graphs) and raise
            instead of clamping (a zero scale and a ``-inf`` sink stay allowed).

    Returns:
        ``out``, or ``(out, lse)`` with ``return_lse``. A query row that attends no key
        (e.g. ``q_len > seqused_k``) gets zeros and LSE ``-inf`` (with sinks: its sink),
        never NaN.

    Raises:
        ShapeError, DtypeError, DeviceError, UnsupportedError: bad arguments (also a flag
            that is not a bool, a float option that is a bool; a cache block or q/out token
            whose offsets reach 2^31 elements; a window side > 0 with
            ``max_blocks * block_size + total_q + side >= 2^31``), before any write.
        ArgumentTypeError: a tensor argument is not a ``torch.Tensor``.
        MetadataError: ``checked=True`` and a metadata value is out of range (see
            ``checked``), naming the request and the value, before any write.
        TensorValueError: ``checked=True`` and a scale is negative, NaN or infinite, or a
            sink NaN or ``+inf`` (a ``MetadataError``), before any write.
        BackendError: see :func:`resolve_backend`.
    """
    check_tensors(q=q)
    attend = paged_prefill_attention_reference
    if resolve_backend(backend, q.device) == "triton":
        from . import attention  # Triton is imported only here

        attend = attention.paged_prefill_attention_triton
    return attend(q, k_cache, v_cache, block_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
                  softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                  out=out, return_lse=return_lse, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                  checked=checked, split_workspace=split_workspace)
