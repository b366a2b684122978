"""Kernel tests: run the Triton path in its CPU interpreter when no GPU is present.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined, i.e. before
``prefixkv.kernels.attention`` / ``write_kv`` are imported; this conftest runs first.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the kernels extra (torch) is not installed")

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("prefixkv") is None:  # running from a checkout without `pip install -e`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

HAS_TRITON = importlib.util.find_spec("triton") is not None
# The interpreter computes with numpy, which torch does not pull in.
CAN_INTERPRET = HAS_TRITON and importlib.util.find_spec("numpy") is not None


def triton_skip_reason() -> str | None:
    """Why the Triton path cannot run here, or None when it can."""
    if not HAS_TRITON:
        return "triton is not installed"
    if not HAS_CUDA and not CAN_INTERPRET:
        return "no CUDA and numpy is missing, so the Triton interpreter cannot run"
    if not HAS_CUDA and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return "no CUDA and TRITON_INTERPRET is off"
    return None


# Both backends of the public calls, for tests that hold them to one contract.
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(triton_skip_reason() is not None,
                                                                   reason=str(triton_skip_reason())))]

# Why bf16 kernel cases skip on the CPU (tests/kernels/test_interpreter_bf16.py shows it, and
# fails once an interpreter computes it right).
BF16_DOT = ("the Triton interpreter's bf16 tl.dot multiplies the operands' 16-bit patterns "
            "(a 16x16 product of N(0, 1) values comes out near 1e10; test_interpreter_bf16.py): "
            "bf16 runs on CUDA only")

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# The Triton path runs CPU tensors only in the interpreter. On a GPU machine, run the
# suite without TRITON_INTERPRET to test the compiled kernels on CUDA tensors.
DEVICES = (["cpu"] if INTERPRETING else []) + (["cuda"] if HAS_CUDA else [])
PRIMARY_DEVICE = "cuda" if HAS_CUDA and not INTERPRETING else "cpu"


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Every device the Triton path can run on here: CPU (interpreter), CUDA."""
    return request.param


@pytest.fixture
def needs_triton() -> None:
    reason = triton_skip_reason()
    if reason:
        pytest.skip(reason)


def pytest_configure(config: pytest.Config) -> None:
    # A run cut short names the tests it did not finish (tests/kernels/unfinished.py).
    from .unfinished import register

    register(config)
