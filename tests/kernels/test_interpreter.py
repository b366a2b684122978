"""The interpreter backport (``kernels/interpreter.py``): loop bounds loaded in a kernel.

triton 3.6's interpreter with numpy >= 2.4 failed every attention test with "only
0-dimensional arrays can be converted to Python scalars" (triton-lang/triton#9171).
"""

from __future__ import annotations

import pytest
import torch

from prefixkv.kernels.interpreter import backport_scalar_index, needs_scalar_index_backport

triton = pytest.importorskip("triton", reason="the kernels extra (triton) is not installed")
tl = pytest.importorskip("triton.language")


@triton.jit
def _count_to_loaded_bound(bounds_ptr, out_ptr):
    acc = 0
    # Bounds loaded from memory: scalars the interpreter keeps as 1-element arrays.
    for _ in range(tl.load(bounds_ptr), tl.load(bounds_ptr + 1), tl.load(bounds_ptr + 2)):
        acc += 1
    tl.store(out_ptr, acc)


@pytest.mark.parametrize(
    ("version", "needed"),
    [("3.5.1", True), ("3.6.0", True), ("3.6.0+git1a2b3c4", True), ("3.7.0", False), ("3.7.1", False),
     ("3.10.0", False), ("4.0.0", False), ("unknown", False)],
)
def test_only_triton_before_3_7_needs_the_backport(version, needed):
    assert needs_scalar_index_backport(version) is needed


def test_loop_with_loaded_bounds_runs(needs_triton, device):
    backport_scalar_index()
    bounds = torch.tensor([3, 40, 5], dtype=torch.int32, device=device)
    out = torch.zeros(1, dtype=torch.int32, device=device)
    _count_to_loaded_bound[(1,)](bounds, out)
    assert out.item() == len(range(3, 40, 5))


def test_backport_only_patches_the_interpreter_of_old_triton(needs_triton):
    from prefixkv.kernels.tiling import interpreting

    assert backport_scalar_index() is (interpreting() and needs_scalar_index_backport(triton.__version__))
