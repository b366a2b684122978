"""Why the bf16 kernel cases run on CUDA only: the Triton interpreter's bf16 ``tl.dot``.

test_attention.py::test_half_precision[bf16] and test_engine_shapes.py's bf16 cases skip on
the CPU with this reason (``conftest.BF16_DOT``). The interpreter loads and converts bf16 exactly
(checked below), but ``tl.dot`` of two bf16 tiles returns values near 1e10 where the
product's are below 20: it multiplies the operands' 16-bit patterns, not their values.
fp16 tiles give the exact product. This test fails once an interpreter computes bf16
``tl.dot`` right: then those cases can run here, and their skips should go.
"""

from __future__ import annotations

import pytest

from .conftest import BF16_DOT, INTERPRETING, torch

triton = pytest.importorskip("triton", reason="the kernels extra (triton) is not installed")
tl = pytest.importorskip("triton.language")

pytestmark = [pytest.mark.usefixtures("needs_triton"),
              pytest.mark.skipif(not INTERPRETING, reason="a fault of the CPU interpreter: "
                                 "compiled kernels on CUDA compute bf16 tl.dot right")]

@triton.jit
def _dot16(a_ptr, b_ptr, c_ptr):
    i = tl.arange(0, 16)
    tile = i[:, None] * 16 + i[None, :]
    tl.store(c_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))


@triton.jit
def _to_fp32(x_ptr, out_ptr):
    i = tl.arange(0, 16)
    tl.store(out_ptr + i, tl.load(x_ptr + i).to(tl.float32))


def _dot(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=gen).to(dtype) for _ in range(2))
    out = torch.empty(16, 16)
    _dot16[(1,)](a, b, out)
    return out, a.float() @ b.float()


def test_bf16_dot_is_wrong_in_the_interpreter() -> None:
    got, want = _dot(torch.bfloat16)
    assert want.abs().max() < 20
    assert got.abs().min() > 1e6, f"the interpreter's bf16 tl.dot looks right now: unskip ({BF16_DOT})"


def test_fp16_dot_and_bf16_loads_are_right() -> None:
    got, want = _dot(torch.float16)
    torch.testing.assert_close(got, want)
    x = torch.randn(16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = torch.empty(16)
    _to_fp32[(1,)](x, out)
    assert torch.equal(out, x.float())
