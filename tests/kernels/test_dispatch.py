"""Backend choice: reference on CPU by default, Triton when forced, clear errors otherwise."""

from __future__ import annotations

import pytest
import torch

from prefixkv.kernels import (
    ArgumentTypeError,
    BackendError,
    DeviceError,
    paged_prefill_attention,
    resolve_backend,
    use_backend,
)

from .cases import make_case
from .conftest import PRIMARY_DEVICE


def test_auto_picks_the_reference_on_cpu_and_triton_on_cuda():
    assert resolve_backend(None, torch.device("cpu")) == "torch"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "triton"
    assert resolve_backend("torch", torch.device("cuda", 0)) == "torch"


def test_use_backend_sets_the_default_and_restores_it(needs_triton):
    device = torch.device(PRIMARY_DEVICE)
    with use_backend("triton"):
        assert resolve_backend(None, device) == "triton"
        with use_backend("torch"):
            assert resolve_backend(None, device) == "torch"
        assert resolve_backend("torch", device) == "torch"  # explicit wins
    assert resolve_backend(None, torch.device("cpu")) == "torch"


def test_forced_triton_runs_the_kernel(needs_triton, monkeypatch):
    import prefixkv.kernels.attention as attention

    calls = []
    real = attention.paged_prefill_attention_triton
    monkeypatch.setattr(attention, "paged_prefill_attention_triton",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    case = make_case([2], [9], head_dim=16, block_size=4, device=PRIMARY_DEVICE)
    with use_backend("triton"):
        paged_prefill_attention(*case.args)
    assert calls == [1]


def test_unknown_backend_raises():
    with pytest.raises(BackendError, match="'cuda' is not one of"):
        resolve_backend("cuda", torch.device("cpu"))
    with pytest.raises(BackendError, match="'tpu'"):
        with use_backend("tpu"):
            pass


def test_device_may_be_named_and_anything_else_is_a_typed_error():
    assert resolve_backend(None, "cpu") == "torch"
    assert resolve_backend("auto", "cuda:0") == "triton"
    with pytest.raises(ArgumentTypeError, match="device must be a torch.device or a str, got NoneType"):
        resolve_backend(None, None)
    with pytest.raises(ArgumentTypeError, match="got int"):
        resolve_backend("torch", 0)
    with pytest.raises(DeviceError, match="'gpu0'"):
        resolve_backend(None, "gpu0")
    with pytest.raises(BackendError, match="None is not one of"):
        with use_backend(None):
            pass


def test_triton_on_cpu_without_the_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.device("cpu"))
