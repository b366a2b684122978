"""The fp8 KV cache: which dtypes, how its scales are shaped, and the quantisation rule.

A cache of ``float8_e4m3fn`` or ``float8_e5m2`` holds ``x / scale`` rounded to the
nearest fp8 value and saturated to the format's largest finite value (448 for e4m3fn,
57344 for e5m2), so an outlier never becomes ``inf`` or NaN. ``scale`` is fp32, one per
tensor (``[]`` or ``[1]``) or one per KV head (``[num_kv_heads]``), separately for K and
V; reading multiplies it back (attention folds the K scale into the softmax scale and
the V scale into the output, so the dequantised tile never leaves registers).

Scales that are not a finite number > 0. A zero scale is realistic (a head whose values
are all zero has ``amax / 448 = 0``) and means what it says: the head stores 0 and reads
``cache * 0``. A negative, NaN or infinite scale has no meaning; it acts as 0 too, on
both backends, so the cache never holds NaN from a bad scale and attention stays finite:
a K scale of 0 makes every score of that KV head 0 (uniform weights over the keys a row
may attend), a V scale of 0 makes the output 0. ``checked=True`` rejects such a scale
(zero allowed) with :class:`~prefixkv.kernels.errors.TensorValueError`.

Rounding error of one element, for a value inside the format's normal range: at most
half a unit in the last place, i.e. ``2**-4`` (e4m3fn, 3 mantissa bits) or ``2**-3``
(e5m2, 2 mantissa bits) of its magnitude; values below the smallest normal (``2**-6``
and ``2**-14`` times the scale) keep an absolute error of half the subnormal step.
"""

from __future__ import annotations

import functools

import torch

from .errors import ArgumentTypeError, DeviceError, DtypeError, ShapeError, UnsupportedError

__all__ = ["FP8_DTYPES", "RELATIVE_ERROR", "check_scale", "dequantize", "is_fp8", "kernel_scales", "quantize",
           "unit_scale", "valid_scale"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The fp8 cache dtypes: a cache of either takes ``k_scale`` / ``v_scale`` and fp16/bf16 queries."""
RELATIVE_ERROR = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}
"""Largest relative rounding error of one normal element (half an ulp)."""
QUERY_DTYPES = (torch.float16, torch.bfloat16)


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the fp8 cache dtypes."""
    return dtype in FP8_DTYPES


def check_scale(name: str, scale: torch.Tensor | None, cache: torch.Tensor) -> None:
    """Validate the ``k_scale`` / ``v_scale`` of a call on ``cache``.

    ``None`` (scale 1) or an fp32 tensor of ``[]``, ``[1]`` or ``[num_kv_heads]`` on the
    cache's device; only an fp8 cache takes one.

    Raises:
        ArgumentTypeError: a scale that is not a ``torch.Tensor``.
        UnsupportedError: a scale for a cache that is not fp8.
        ShapeError, DtypeError: wrong shape or dtype.
        DeviceError: on another device than the cache.
    """
    if scale is None:
        return
    if not isinstance(scale, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be None or a torch.Tensor, got {type(scale).__name__}")
    if not is_fp8(cache.dtype):
        raise UnsupportedError(f"{name} applies to fp8 caches only ({FP8_DTYPES}); this cache is "
                               f"{cache.dtype}")
    num_kv_heads = cache.shape[2]
    if scale.numel() not in (1, num_kv_heads) or scale.dim() > 1:
        raise ShapeError(f"{name} must be [], [1] or [{num_kv_heads}] (per KV head), got "
                         f"{tuple(scale.shape)}")
    if scale.dtype != torch.float32:
        raise DtypeError(f"{name} dtype {scale.dtype}; expected torch.float32")
    if scale.device != cache.device:
        raise DeviceError(f"{name} is on {scale.device}, expected {cache.device} like the cache")


@functools.cache
def unit_scale(device: torch.device) -> torch.Tensor:
    """A ``[1]`` fp32 tensor of 1.0 on ``device``, made once: the kernels' scale when none is
    given (a fixed address, so a captured CUDA graph keeps pointing at it)."""
    return torch.ones(1, dtype=torch.float32, device=device)


def kernel_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, device: torch.device
                  ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, int]]:
    """The kernels' ``(k, v)`` scale pointers and their per-head strides, for checked
    scales: :func:`unit_scale` where one is None, and stride 0 for a per-tensor scale
    (``[]``/``[1]``: every head reads its one element)."""
    k, v = (unit_scale(device) if t is None else t for t in (k_scale, v_scale))
    return (k, v), (k.stride(0) if k.numel() > 1 else 0, v.stride(0) if v.numel() > 1 else 0)


def _per_head(scale: torch.Tensor | None, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """``[num_kv_heads, 1]`` fp32 scales (1 where ``scale`` is None)."""
    if scale is None:
        return torch.ones(num_kv_heads, 1, device=device)
    return scale.reshape(-1, 1).float().expand(num_kv_heads, 1)


def valid_scale(scale: torch.Tensor) -> torch.Tensor:
    """Where a scale means what it says: finite and > 0 (NaN is neither)."""
    return (scale > 0) & (scale < float("inf"))


def quantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[..., num_kv_heads, head_dim]`` divided by its head's scale, saturated to
    ``dtype``'s finite range and rounded to ``dtype`` (nearest even); a head whose scale
    is not valid (:func:`valid_scale`) stores zeros."""
    top = torch.finfo(dtype).max
    s = _per_head(scale, x.shape[-2], x.device)
    return torch.where(valid_scale(s), (x.float() / s).clamp(-top, top), 0.0).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``x * scale`` for ``x`` ``[..., num_kv_heads, head_dim]`` of any cache dtype; a
    scale that is not valid (:func:`valid_scale`) acts as 0 (so ``x * 0``)."""
    s = _per_head(scale, x.shape[-2], x.device)
    return x.float() * torch.where(valid_scale(s), s, 0.0)
