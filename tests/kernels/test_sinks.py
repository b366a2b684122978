"""Attention sinks: the kernel against the reference, and the reference against an identity.

A sink adds ``exp(sink)`` to a row's softmax denominator and nothing to its numerator, so
``out_sink = out * sigmoid(lse - sink)`` and ``lse_sink = logaddexp(lse, sink)`` where
``out``/``lse`` are the sink-free results: an independent check of the reference.
"""

from __future__ import annotations

import pytest
import torch

from prefixkv.kernels import (
    ArgumentTypeError,
    DeviceError,
    DtypeError,
    ShapeError,
    paged_prefill_attention_reference,
)
from prefixkv.kernels.tiling import TileConfig

from .cases import check, make_case
from .conftest import PRIMARY_DEVICE

GEOMETRY = ([9, 1, 0, 3], [97, 54, 5, 2])  # prefix prefill, decode, an empty request, q_len > kv_len


def _sinks(num_heads: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_heads, generator=gen) * 2).to(PRIMARY_DEVICE)


def test_reference_sink_is_one_more_logit_without_value():
    case = make_case(*GEOMETRY, num_kv_heads=2, group=2, block_size=5, device=PRIMARY_DEVICE)
    sinks = _sinks(4)
    out, lse = paged_prefill_attention_reference(*case.args, return_lse=True)
    got, got_lse = paged_prefill_attention_reference(*case.args, return_lse=True, sinks=sinks)
    sink = sinks[:, None]  # [num_heads, 1] against lse [num_heads, total_q]
    want = out * torch.sigmoid(lse - sink).transpose(0, 1)[..., None]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, torch.logaddexp(lse, sink.expand_as(lse)))
    # Rows that attend no key (q_len > kv_len): output 0 and LSE = the sink.
    empty = torch.isinf(lse)
    assert empty.any() and (got[empty.transpose(0, 1)] == 0).all()
    assert torch.equal(got_lse[empty], sink.expand_as(lse)[empty])


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("config", [TileConfig(32, 16), TileConfig(16, 16, num_splits=3)],
                         ids=["tiles", "split"])
@pytest.mark.parametrize("options", [{}, dict(window_size=(20, 0)), dict(softcap=5.0)], ids=str)
def test_kernel_matches_reference(config, options):
    case = make_case(*GEOMETRY, num_kv_heads=2, group=2, block_size=5, device=PRIMARY_DEVICE, seed=5)
    check(case, torch.float32, config=config, sinks=_sinks(4, seed=1), **options)


@pytest.mark.usefixtures("needs_triton")
def test_kernel_large_sinks_dominate_and_small_ones_vanish():
    case = make_case([4, 1], [40, 17], num_kv_heads=1, group=2, block_size=16, device=PRIMARY_DEVICE, seed=2)
    check(case, torch.float32, sinks=torch.full((2,), 60.0, device=PRIMARY_DEVICE))  # out ~ 0
    check(case, torch.float32, sinks=torch.full((2,), -60.0, device=PRIMARY_DEVICE))  # as without sinks


@pytest.mark.parametrize("sinks, error", [
    (torch.zeros(3), ShapeError),
    (torch.zeros(4, 1), ShapeError),
    (torch.zeros(4, dtype=torch.float16), DtypeError),
    (torch.zeros(4, device="meta"), DeviceError),
    ([0.0] * 4, ArgumentTypeError),
], ids=["heads", "rank", "dtype", "device", "list"])
def test_bad_sinks_are_rejected(sinks, error):
    case = make_case([2], [5], num_kv_heads=2, group=2, device="cpu")
    with pytest.raises(error, match="sinks"):
        paged_prefill_attention_reference(*case.args, sinks=sinks)
