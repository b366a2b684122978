"""One-program Triton kernels that apply ``attend._tanh`` or ``attend._tanh_precise`` to a
vector (imported by the softcap tests only where Triton runs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixkv.kernels.attend import _tanh, _tanh_precise


@triton.jit  # type: ignore[untyped-decorator]  # Triton JIT
def _apply(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PRECISE: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton JIT
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    if PRECISE:
        y = _tanh_precise(x)
    else:
        y = _tanh(x)
    tl.store(y_ptr + i, y, mask=i < n)


def tanh_triton(x: torch.Tensor, precise: bool) -> torch.Tensor:
    """``attend._tanh_precise`` (or ``_tanh``) of a float32 vector ``[n]``."""
    y = torch.empty_like(x)
    _apply[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(max(x.numel(), 1)), PRECISE=precise)
    return y
