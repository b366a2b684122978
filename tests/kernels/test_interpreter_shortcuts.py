"""What tests/triton_interpreter.py relies on, checked on the installed triton: the work it
skips in the interpreter could not have changed a result or a failure."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from triton_interpreter import apply_shortcuts

from .conftest import INTERPRETING

triton = pytest.importorskip("triton", reason="the kernels extra (triton) is not installed")
tl = pytest.importorskip("triton.language")

from prefixkv.kernels.attend import _max  # noqa: E402  (the attention kernel's scan combines with it)

pytestmark = [pytest.mark.usefixtures("needs_triton"),
              pytest.mark.skipif(not INTERPRETING, reason="checks Triton's CPU interpreter")]


@triton.jit
def _square(x):
    return x * x


@triton.jit
def _products(x_ptr, out_ptr):
    x = tl.load(x_ptr + tl.arange(0, 2))
    tl.store(out_ptr + tl.arange(0, 2), _square(x))  # a jit helper inside the launch


def _run_products() -> list[int]:
    x = torch.tensor([3, 1 << 20], dtype=torch.int32)  # (2^20)^2 overflows int32
    out = torch.zeros(2, dtype=torch.int32)
    _products[(1,)](x, out)
    return out.tolist()


def test_the_suite_runs_with_both_skips():
    from triton.runtime import interpreter

    apply_shortcuts()
    assert interpreter.interpreter_builder.options.sanitize_overflow is False
    assert interpreter._patch_lang.once_per_launch


def test_the_interpreter_drops_its_overflow_check():
    """With the checks on (triton's default) an int32 overflow passes unreported and wraps,
    as with them off: the interpreter's device_assert does nothing without ``debug``, which
    it never sets. Fails if a triton starts reporting it; then the skip must go."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    skipped = builder.options
    assert not skipped.debug
    try:
        builder.options = dataclasses.replace(skipped, sanitize_overflow=True)
        checked = _run_products()
    finally:
        builder.options = skipped
    assert checked == _run_products() == [9, 0]  # 2^40 mod 2^32


def test_a_launch_leaves_triton_language_as_it_found_it():
    """Patched once for the launch (the helper's call patches nothing more), restored after."""
    before = {name: getattr(tl, name) for name in ("load", "store", "arange", "range", "reduce")}
    assert all(tl.core.is_builtin(before[name]) for name in ("load", "store", "arange"))
    assert _run_products() == [9, 0]
    assert {name: getattr(tl, name) for name in before} == before


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _then(a1, b1, a2, b2):
    """x -> a1 x + b1, then x -> a2 x + b2: associative, not commutative."""
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _larger_if(a, b):
    if a > b:  # a branch: scanned element by element, as triton does
        return a
    return b


@triton.jit
def _larger_through_a_helper(a, b):
    return _larger_if(a, b)  # the branch is in the helper: scanned element by element too


@triton.jit
def _scans(x_ptr, y_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr):
    rc = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    x = tl.load(x_ptr + rc)
    y = tl.load(y_ptr + rc)
    tl.store(out_ptr + rc, tl.associative_scan(x, 1, _max))  # the attention kernel's scan
    tl.store(out_ptr + R * C + rc, tl.associative_scan(x, 0, _add))  # int32 sums that wrap
    a, b = tl.associative_scan((x, y), 1, _then)
    tl.store(out_ptr + 2 * R * C + rc, a)
    tl.store(out_ptr + 3 * R * C + rc, b)
    a, b = tl.associative_scan((x, y), 1, _then, reverse=True)
    tl.store(out_ptr + 4 * R * C + rc, b)
    tl.store(out_ptr + 5 * R * C + rc, tl.associative_scan(x, 1, _larger_if))
    floats = tl.associative_scan(x.to(tl.float32), 1, _add)  # no float scan is reordered
    tl.store(out_ptr + 6 * R * C + rc, floats.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 7 * R * C + rc, tl.associative_scan(x, 1, _larger_through_a_helper))


def _inputs(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randint(-(1 << 31), 1 << 31, (2, rows, cols), dtype=torch.int64, generator=gen).int()
    x[:, ::3] = torch.randint(-4, 5, x[:, ::3].shape, generator=gen).to(torch.int32)  # small ones too
    return x, y


def _run_scans(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(8, *x.shape, dtype=torch.int32)
    _scans[(1,)](x, y, out, *x.shape)
    return out


@pytest.mark.parametrize(("rows", "cols"), [(1, 64), (4, 8), (2, 1)])
def test_integer_scans_by_doubling_equal_triton_s_element_by_element_scan(rows, cols):
    """max (the attention kernel's), wrapping int32 sums, an associative but not commutative
    pair (affine maps composed in order, forwards and reversed); a combine function with a
    branch, one calling a helper with a branch, and a float scan take triton's own path.
    Fails if the doubling scan changes a bit."""
    from triton.runtime import interpreter

    apply_shortcuts()
    doubling = interpreter.ScanOps.generic_scan
    assert doubling.by_doubling
    x, y = _inputs(rows, cols, seed=rows * cols)
    try:
        interpreter.ScanOps.generic_scan = doubling.original
        want = _run_scans(x, y)
    finally:
        interpreter.ScanOps.generic_scan = doubling
    assert torch.equal(_run_scans(x, y), want)
    assert torch.equal(want[0], torch.cummax(x, 1).values)
    assert torch.equal(want[1], x.to(torch.int64).cumsum(0).to(torch.int32))  # int32 wraps
