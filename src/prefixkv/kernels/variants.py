"""Compile, before serving, every kernel variant an engine's calls can hit.

Triton compiles one binary per distinct set of ``tl.constexpr`` values and per
specialisation of the other integer arguments (equal to 1, multiple of 16). A variant
first met on the request path costs seconds of JIT. The attention launch keeps the ones
that follow runtime data few and bounded:

==================== =============================== =====================================
value                depends on                      kept bounded by
==================== =============================== =====================================
BLOCK_M, BLOCK_N,    ``max_seqlen_q`` (tile height)  ``choose_tiles``: at most 4 tiles
warps, stages                                        (16/32/64/128 rows), one per power of
                                                     two of ``max_seqlen_q * group``
SPLIT                split-KV or not                 a bool; the split count is a runtime
                                                     int, not a constexpr
RETURN_LSE           ``return_lse`` or SPLIT         a bool
SPLITS_P2 (merge)    split count                     fixed at ``MAX_SPLITS`` (64)
batch, num_splits,   per call                        not specialised (``do_not_specialize``)
block table width,
LSE / workspace
strides
GROUP, HEAD_DIM,     the model and cache             fixed for an engine: in
BLOCK_SIZE, dtypes,                                  :class:`AttentionSpec`
SOFTCAP, HAS_LEFT,
HAS_SINKS, KV_FP8
==================== =============================== =====================================

The batch size no longer appears in any constexpr: the kernel finds each program's
request by scanning ``cu_seqlens_q`` in steps of 64 entries up to the runtime ``batch``.
Triton is imported only when a function here runs (like the rest of the package).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .fp8 import is_fp8
from .workspace import _SPLITS_LIMIT

if TYPE_CHECKING:  # (tiling imports Triton: only when a variant is compiled)
    from .tiling import TileConfig

__all__ = ["AttentionSpec", "attention_variants", "warmup"]


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """What an engine holds fixed across its attention and cache-write calls.

    ``windows``: the ``window_size`` of each kind of layer (None: full attention), e.g.
    ``(None, (127, 0))`` for a model alternating full and sliding-window layers.
    ``kv_scales``: for fp8 caches, ``"tensor"`` or ``"head"`` scales (None: none given).
    ``workspace_splits``: the ``num_splits`` of the :class:`~prefixkv.kernels.SplitWorkspace`
    that calls pass as ``split_workspace`` (the CUDA-graph launch mode; 0: none). With one of
    more than one split every tile runs split, prefills included, so each is warmed split too.
    ``cascade``: the engine also calls :func:`~prefixkv.kernels.cascade_attention`, whose
    two passes compile their own variants (both return the LSE; the prefix pass is
    non-causal, without sinks, and splits its keys whatever its tile; neither has a window).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    cache_dtype: torch.dtype | None = None  # None: dtype
    windows: tuple[tuple[int, int] | None, ...] = (None,)
    causal: bool = True
    softcap: float = 0.0
    sinks: bool = False
    kv_scales: str | None = None
    return_lse: bool = False
    workspace_splits: int = 0
    cascade: bool = False


def attention_variants(spec: AttentionSpec, on_gpu: bool) -> list[tuple[tuple[int, int] | None, TileConfig]]:
    """Every ``(window, TileConfig)`` a call of ``spec`` can compile (``num_splits`` 1 or 2).

    One tile per distinct ``choose_tiles`` pick over ``max_seqlen_q`` = 1, 2, 4, ...
    up to ``max_num_batched_tokens``; tiles of decode-like calls also come split (any
    count up to ``MAX_SPLITS`` compiles the same variants), when ``max_model_len`` leaves
    two splits room, and with ``workspace_splits`` over 1 every tile also comes split
    that many ways (a launch with the workspace splits whatever its tile; the count
    sizes the merge kernel's tile).
    ``on_gpu``: the tiles of CUDA launches (else the interpreter's). These are the variants
    of ``paged_prefill_attention``; :func:`warmup` adds those of cascade's passes.

    Raises:
        UnsupportedError: ``kv_scales`` not None, ``"tensor"`` or ``"head"``; ``windows``
            not a non-empty tuple; ``max_num_seqs``, ``max_num_batched_tokens`` or
            ``max_model_len`` not an int >= 1; ``workspace_splits`` not an int in
            ``[0, 1024]`` (a spec that compiles nothing, or not the variants its calls hit).
    """
    _check_spec(spec)
    return _variants(spec, on_gpu, spec.workspace_splits)


def _variants(spec: AttentionSpec, on_gpu: bool,
              split_all: int) -> list[tuple[tuple[int, int] | None, TileConfig]]:
    """:func:`attention_variants` of a checked ``spec``, every tile also split ``split_all``
    ways when that is over 1."""
    from .tiling import MAX_SPLIT_Q, MIN_KEYS_PER_SPLIT, choose_tiles

    group = spec.num_heads // spec.num_kv_heads
    elem = torch.empty(0, dtype=spec.dtype).element_size()
    q_bound = max(1, min(spec.max_num_batched_tokens, spec.max_model_len))
    may_split = spec.max_model_len >= 2 * MIN_KEYS_PER_SPLIT
    out = []
    for window in spec.windows:
        left = window is not None and window[0] >= 0
        q = 1
        while True:
            tile = choose_tiles(group=group, head_dim=spec.head_dim, max_seqlen_q=q, on_gpu=on_gpu,
                                elem_bytes=elem, window=left, return_lse=spec.return_lse,
                                kv_fp8=is_fp8(spec.cache_dtype or spec.dtype))
            counts = [1, *([2] if may_split and q <= MAX_SPLIT_Q else []),
                      *([split_all] if split_all > 1 else [])]
            for splits in dict.fromkeys(counts):
                variant = (window, dataclasses.replace(tile, num_splits=splits))
                if variant not in out:
                    out.append(variant)
            if q >= q_bound:
                break
            q = min(2 * q, q_bound)
    return out


def _check_spec(spec: AttentionSpec) -> None:
    from .errors import UnsupportedError

    if spec.kv_scales not in (None, "tensor", "head"):
        raise UnsupportedError(f"kv_scales must be None, 'tensor' or 'head', got {spec.kv_scales!r}")
    if not isinstance(spec.windows, tuple) or not spec.windows:
        raise UnsupportedError(f"windows must be a non-empty tuple of window sizes (None: full attention), "
                               f"got {spec.windows!r}")
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        n = getattr(spec, name)
        if type(n) is not int or n < 1:
            raise UnsupportedError(f"{name} must be an int >= 1, got {n!r}")
    n = spec.workspace_splits
    if type(spec.cascade) is not bool:
        raise UnsupportedError(f"cascade must be True or False, got {spec.cascade!r}")
    if type(n) is not int or not 0 <= n <= _SPLITS_LIMIT:
        raise UnsupportedError(f"workspace_splits must be an int in [0, {_SPLITS_LIMIT}] "
                               f"(0: no split_workspace), got {n!r}")


def _scales(spec: AttentionSpec,
            device: torch.device | str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(k_scale, v_scale)`` of the spec's kind (None, None without fp8 scales)."""
    if spec.kv_scales is None:
        return None, None
    n = spec.num_kv_heads if spec.kv_scales == "head" else 1
    return torch.ones(n, device=device), torch.ones(n, device=device)


def _cascade_passes(spec: AttentionSpec, on_gpu: bool) -> list[tuple[AttentionSpec, bool, list[
        tuple[tuple[int, int] | None, TileConfig]]]]:
    """``(spec, causal, variants)`` of the launches of ``cascade_attention`` calls: the own
    part (the call's options, LSE out, no window and no workspace) and the prefix pass
    (non-causal, no sinks, LSE out, any tile split: few tiles split their keys)."""
    own = dataclasses.replace(spec, windows=(None,), return_lse=True, workspace_splits=0)
    prefix = dataclasses.replace(own, sinks=False)
    return [(own, spec.causal, _variants(own, on_gpu, 0)), (prefix, False, _variants(prefix, on_gpu, 2))]


def warmup(spec: AttentionSpec, device: torch.device | str) -> int:
    """Launch each variant of :func:`attention_variants` (and, with ``spec.cascade``, of
    cascade's two passes and its merge) and the cache write once, on a one-token problem, so Triton
    compiles (and caches) them before serving; returns the number of launches. Writes
    nothing but its own scratch tensors.

    Raises:
        KernelInputError: ``spec`` describes calls the kernels reject (same checks), or
            is refused by :func:`attention_variants` (before any launch).
    """
    from . import tiling
    from .attention import paged_prefill_attention_triton
    from .write_kv import write_kv_cache_triton

    _check_spec(spec)
    device = torch.device(device)
    cache_dtype = spec.cache_dtype or spec.dtype
    cache = torch.zeros(1, spec.block_size, spec.num_kv_heads, spec.head_dim, device=device).to(cache_dtype)
    key = torch.zeros(1, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype, device=device)
    k_scale, v_scale = _scales(spec, device)
    write_kv_cache_triton(key, key, cache, cache.clone(), torch.zeros(1, dtype=torch.int64, device=device),
                          k_scale=k_scale, v_scale=v_scale)
    q = torch.zeros(1, spec.num_heads, spec.head_dim, dtype=spec.dtype, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
    used = torch.ones(1, dtype=torch.int32, device=device)
    on_gpu = tiling.gpu_tiles(device)
    passes = [(spec, spec.causal, attention_variants(spec, on_gpu))]
    if spec.cascade:
        passes += _cascade_passes(spec, on_gpu)
    for launch, causal, variants in passes:
        sinks = torch.zeros(spec.num_heads, device=device) if launch.sinks else None
        for window, config in variants:
            paged_prefill_attention_triton(q, cache, cache, table, cu, used, 1, 1, causal=causal,
                                           window_size=window, softcap=spec.softcap,
                                           return_lse=launch.return_lse, sinks=sinks, config=config,
                                           k_scale=k_scale, v_scale=v_scale)
    if spec.cascade:  # the merge of its two passes: one more kernel
        from .cascade_merge import merge_rows

        lse = torch.zeros(spec.num_heads, 1, device=device)
        merge_rows(q.clone(), lse, q, lse.clone(), torch.zeros(1, dtype=torch.int64, device=device))
    return 1 + sum(len(variants) for _, _, variants in passes) + spec.cascade
