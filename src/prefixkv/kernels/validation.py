"""Argument checks shared by every backend, so that all of them reject the same calls, in
the same order (the checks on any one argument, which these build on, are in
``arguments.py``).

Only shapes, dtypes, devices and Python scalars are inspected, so the checks never
synchronise with the device, but for checked mode (``checked=True``): its reads of the
values (``checked.py``) come last, once every other check has passed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .arguments import _real, _same_device, check_flags, check_tensors
from .checked import check_attention_values, check_scale_sink_values, check_slot_values
from .errors import DtypeError, ShapeError, UnsupportedError
from .fp8 import FP8_DTYPES, QUERY_DTYPES, check_scale, is_fp8
from .overlap import caches_overlap, check_apart, check_reads_apart
from .reach import WINDOW_CAP, check_int32_reach, check_window_reach
from .workspace import check_split_workspace

if TYPE_CHECKING:
    from .call import AttentionCall

__all__ = [
    "AttentionShape", "check_write_kv", "check_attention", "check_sinks", "check_tensors", "check_flags",
    "CACHE_DTYPES", "MAX_HEAD_DIM",
]

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, *FP8_DTYPES)
MAX_HEAD_DIM = 256
FLOAT_LIMIT = torch.finfo(torch.float32).max / 2  # half of float32's max: times log2(e) it stays finite
FLOAT_TINY = torch.finfo(torch.float32).tiny  # float32's smallest normal number
INDEX_DTYPE = torch.int32
SLOT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """The sizes of one validated attention call, with its options normalised."""

    total_q: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    batch: int
    max_blocks: int
    softmax_scale: float
    window_left: int  # -1: unbounded
    window_right: int  # -1: unbounded (0 when causal)
    softcap: float  # 0.0: off

    @property
    def group(self) -> int:
        """Query heads sharing one KV head (1: MHA, num_heads: MQA)."""
        return self.num_heads // self.num_kv_heads


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ShapeError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {k_cache.dim()} dims {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ShapeError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise DtypeError(
            f"k_cache/v_cache dtypes {k_cache.dtype}/{v_cache.dtype}; both must be one of {CACHE_DTYPES}"
        )
    head_dim = k_cache.shape[3]
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise UnsupportedError(f"head_dim {head_dim} must be a multiple of 8 in [8, {MAX_HEAD_DIM}]")
    if k_cache.shape[1] < 1 or k_cache.shape[2] < 1:
        raise ShapeError(f"block_size and num_kv_heads must be >= 1, got cache shape {tuple(k_cache.shape)}")
    _same_device("v_cache", v_cache, k_cache.device)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_int32_reach(name, t, (1, 2, 3), "block")


def _check_input_dtype(name: str, t: torch.Tensor, cache_dtype: torch.dtype,
                       fp8_inputs: tuple[torch.dtype, ...]) -> None:
    """Inputs match the cache's dtype; an fp8 cache takes any of ``fp8_inputs`` instead."""
    if is_fp8(cache_dtype):
        if t.dtype not in fp8_inputs:
            raise DtypeError(f"{name} dtype {t.dtype}: an fp8 cache takes {name} in one of {fp8_inputs}")
    elif t.dtype != cache_dtype:
        raise DtypeError(f"{name} dtype {t.dtype} != cache dtype {cache_dtype}")


def check_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    checked: bool = False,
) -> None:
    """Validate a ``write_kv_cache`` call (any backend; ``checked``: its slots and scales
    too, last); see :func:`prefixkv.kernels.write_kv_cache`."""
    check_tensors(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_flags(checked=checked)
    _check_caches(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ShapeError(
                f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, "
                f"got {tuple(t.shape)}"
            )
        _check_input_dtype(name, t, k_cache.dtype, (*QUERY_DTYPES, torch.float32))
        _same_device(name, t, k_cache.device)
        check_int32_reach(name, t, (1, 2), "token")
    if value.shape[0] != key.shape[0]:
        raise ShapeError(f"key has {key.shape[0]} tokens, value has {value.shape[0]}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ShapeError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in SLOT_DTYPES:
        raise DtypeError(f"slot_mapping dtype {slot_mapping.dtype}; expected one of {SLOT_DTYPES}")
    _same_device("slot_mapping", slot_mapping, k_cache.device)
    check_scale("k_scale", k_scale, k_cache)
    check_scale("v_scale", v_scale, v_cache)
    overlap = caches_overlap(k_cache, v_cache)
    if overlap is not None:
        raise ShapeError(f"write_kv_cache would write one cache address twice: {overlap}")
    check_reads_apart("write_kv_cache", {"k_cache": k_cache, "v_cache": v_cache},
                      {"key": key, "value": value, "slot_mapping": slot_mapping, "k_scale": k_scale,
                       "v_scale": v_scale})
    if checked:
        check_slot_values(slot_mapping, k_cache.shape[0], k_cache.shape[1])
        check_scale_sink_values(k_scale, v_scale)


def _window(window_size: object, causal: bool) -> tuple[int, int]:
    if window_size is None:
        left, right = -1, -1
    else:
        pair = list(window_size) if isinstance(window_size, (tuple, list)) else []
        ints = [w for w in pair if isinstance(w, int) and not isinstance(w, bool)]
        if len(pair) != 2 or len(ints) != 2 or min(ints) < -1:
            raise UnsupportedError(
                f"window_size must be None or a pair (left, right) of ints >= -1 (-1: unbounded), "
                f"got {window_size!r}"
            )
        left, right = ints
    if causal:
        if right > 0:
            raise UnsupportedError(f"causal=True allows window right -1 or 0, got {right}")
        right = 0
    # Wider than WINDOW_CAP is unbounded in effect (every key of a row of at most
    # 2^30 - total_q keys is inside it, see check_window_reach), and fits int32.
    return min(left, WINDOW_CAP), min(right, WINDOW_CAP)


def check_attention(call: AttentionCall) -> AttentionShape:
    """Validate a ``paged_prefill_attention`` call and return its sizes and options, in
    this order on every backend: the arguments, the ``split_workspace`` against them, and
    with ``checked`` the metadata, scale and sink values (a device synchronisation).

    Raises:
        everything :func:`prefixkv.kernels.paged_prefill_attention` documents but
        ``BackendError``.
    """
    q, k_cache, block_table = call.q, call.k_cache, call.block_table
    cu_seqlens_q, seqused_k = call.cu_seqlens_q, call.seqused_k
    out, softmax_scale, softcap, return_lse = call.out, call.softmax_scale, call.softcap, call.return_lse
    check_tensors(q=q, k_cache=k_cache, v_cache=call.v_cache, block_table=block_table,
                  cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k)
    if out is not None:
        check_tensors(out=out)
    check_flags(causal=call.causal, return_lse=return_lse, checked=call.checked)
    _check_caches(k_cache, call.v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if num_blocks < 1:  # a bad block id reads block num_blocks - 1: there must be one
        raise ShapeError(f"k_cache has no block (shape {tuple(k_cache.shape)}); attention needs at least one")
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ShapeError(f"q must be [total_q, num_heads, {head_dim}], got {tuple(q.shape)}")
    num_heads = q.shape[1]
    if num_heads < 1 or num_heads % num_kv_heads:
        raise ShapeError(f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
    _check_input_dtype("q", q, k_cache.dtype, QUERY_DTYPES)
    check_int32_reach("q", q, (1, 2), "token")
    if return_lse and (num_heads - 1) * q.shape[0] >= 2**31:  # the LSE is [num_heads, total_q]
        raise ShapeError(f"return_lse with {num_heads} heads x {q.shape[0]} rows: the LSE's head offsets "
                         "pass 2^31 elements (int32 in the kernels)")
    device = q.device
    _same_device("k_cache", k_cache, device)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
        raise ShapeError(f"cu_seqlens_q must be [batch + 1], got {tuple(cu_seqlens_q.shape)}")
    batch = cu_seqlens_q.shape[0] - 1
    if seqused_k.dim() != 1 or seqused_k.shape[0] != batch:
        raise ShapeError(f"seqused_k must be [{batch}] (batch from cu_seqlens_q), got "
                         f"{tuple(seqused_k.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ShapeError(f"block_table must be [{batch}, max_blocks], got {tuple(block_table.shape)}")
    for name, t in (("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q), ("seqused_k", seqused_k)):
        if t.dtype != INDEX_DTYPE:
            raise DtypeError(f"{name} dtype {t.dtype}; expected {INDEX_DTYPE}")
        _same_device(name, t, device)
    for name, n in (("max_seqlen_q", call.max_seqlen_q), ("max_seqlen_k", call.max_seqlen_k)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise UnsupportedError(f"{name} must be a Python int >= 0, got {n!r}")
    if call.max_seqlen_k > block_table.shape[1] * block_size:
        raise ShapeError(
            f"max_seqlen_k {call.max_seqlen_k} > block_table capacity "
            f"{block_table.shape[1]} blocks x {block_size} slots"
        )
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    # Both are scaled by log2(e) in float32 in the kernels: at most FLOAT_LIMIT stays finite.
    if not (_real(softmax_scale) and 0 < softmax_scale <= FLOAT_LIMIT):
        raise UnsupportedError(f"softmax_scale must be a float in (0, {FLOAT_LIMIT:.3g}], "
                               f"got {softmax_scale!r}")
    if not (_real(softcap) and (softcap == 0 or FLOAT_TINY <= softcap <= FLOAT_LIMIT)):
        raise UnsupportedError(f"softcap must be 0 (off) or a float in [{FLOAT_TINY:.3g}, "
                               f"{FLOAT_LIMIT:.3g}], got {softcap!r}")
    # Scores are divided by softcap in float32 (the kernel multiplies by the ratio): a cap
    # that is 0 in float32, or a ratio that is inf, makes a score of 0 NaN (0 / 0, 0 * inf).
    if softcap > 0 and softmax_scale / softcap > FLOAT_LIMIT:
        raise UnsupportedError(f"softmax_scale / softcap must be at most {FLOAT_LIMIT:.3g} (float32), got "
                               f"{softmax_scale!r} / {softcap!r}")
    left, right = _window(call.window_size, call.causal)
    check_window_reach(left, right, block_table.shape[1] * block_size, q.shape[0])
    if out is not None:
        if out.shape != q.shape:
            raise ShapeError(f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
        if out.dtype != q.dtype:
            raise DtypeError(f"out dtype {out.dtype} != q dtype {q.dtype}")
        _same_device("out", out, device)
        check_int32_reach("out", out, (1, 2), "token")
        # out may be q itself (each row's output lands where only its own query was read)
        same_q = out.data_ptr() == q.data_ptr() and out.stride() == q.stride()
        check_apart("paged_prefill_attention", {"out": out},
                    call.tensors() | {"out": None, "q": None if same_q else q})
    check_sinks(call.sinks, q)
    check_scale("k_scale", call.k_scale, k_cache)
    check_scale("v_scale", call.v_scale, call.v_cache)
    shape = AttentionShape(
        total_q=q.shape[0], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        num_blocks=num_blocks, block_size=block_size, batch=batch, max_blocks=block_table.shape[1],
        softmax_scale=float(softmax_scale), window_left=left, window_right=right, softcap=float(softcap),
    )
    if call.split_workspace is not None:
        check_split_workspace(call.split_workspace, shape, q.device, call.tensors())
    if call.checked:  # last: it reads the values (a device synchronisation)
        check_attention_values(block_table, cu_seqlens_q, seqused_k, shape.total_q, num_blocks, block_size)
        check_scale_sink_values(call.k_scale, call.v_scale, call.sinks)
    return shape


def check_cascade(shift_blocks: torch.Tensor, rows: torch.Tensor, prefix_table: torch.Tensor,
                  prefix_keys: int, q: object, k_cache: object, block_table: object) -> None:
    """A cascade batch (its ``shift_blocks`` ``[batch]``, ``rows``, and ``prefix_table``
    ``[num_groups, width]`` of ``prefix_keys`` = its ``max_seqlen_k``) fits the call: one
    shift per request, no more rows than q has, and a prefix of whole blocks of the cache's
    size (the groups' longest is ``width`` blocks).

    Raises:
        ArgumentTypeError: ``q``, ``k_cache`` or ``block_table`` is not a ``torch.Tensor``.
        ShapeError: the cascade is for another batch, or was built for another block size.
    """
    check_tensors(q=q, k_cache=k_cache, block_table=block_table)
    assert isinstance(q, torch.Tensor) and isinstance(block_table, torch.Tensor)
    assert isinstance(k_cache, torch.Tensor)
    batch = block_table.shape[0] if block_table.dim() == 2 else -1
    if shift_blocks.shape != (batch,) or rows.numel() > q.shape[0]:
        raise ShapeError(f"cascade is for {shift_blocks.shape[0]} requests and {rows.numel()} rows; this "
                         f"batch has {batch} requests and {q.shape[0]} rows")
    block_size = k_cache.shape[1] if k_cache.dim() == 4 else -1
    if prefix_table.shape[0] and prefix_keys != prefix_table.shape[1] * block_size:
        raise ShapeError(f"cascade was built for blocks of {prefix_keys / prefix_table.shape[1]:g} tokens "
                         f"(its longest prefix: {prefix_keys} tokens in {prefix_table.shape[1]} blocks); the "
                         f"cache's blocks hold {block_size}")


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Validate attention sinks: None, or an fp32 ``[num_heads]`` tensor on q's device.

    Raises:
        ArgumentTypeError: not a ``torch.Tensor``.
        ShapeError, DtypeError, DeviceError: wrong shape, dtype or device.
    """
    if sinks is None:
        return
    check_tensors(sinks=sinks)
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
        raise ShapeError(f"sinks must be [num_heads] = [{q.shape[1]}], got {tuple(sinks.shape)}")
    if sinks.dtype != torch.float32:
        raise DtypeError(f"sinks dtype {sinks.dtype}; expected torch.float32")
    _same_device("sinks", sinks, q.device)
