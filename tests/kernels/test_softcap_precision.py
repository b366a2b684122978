"""Softcap's tanh on the Triton path: float32 precision over the whole range of caps and
logits, against torch.tanh in float64 and a float64 dense attention.

``scores -> softcap * tanh(scores / softcap)``: with a large cap, ``scores / softcap`` is
small, and tanh must keep its relative precision there, or the cap multiplies an absolute
error of ~1e-7 into the scores (1e-3 at a cap of 1e4).
"""

from __future__ import annotations

import math

import pytest
import torch

from prefixkv.kernels import paged_prefill_attention

from .cases import make_case, tolerance
from .conftest import PRIMARY_DEVICE

pytestmark = pytest.mark.usefixtures("needs_triton")

ULP = 2.0 ** -23  # float32's relative spacing at 1


def _tanh_triton(x: torch.Tensor) -> torch.Tensor:
    from .tanh_probe import tanh_triton  # imports triton

    return tanh_triton(x)


def test_tanh_keeps_float32_precision_over_the_whole_range():
    mags = torch.logspace(-30, 7, 1500, dtype=torch.float64).float()  # tiny .. past saturation
    specials = torch.tensor([0.0, -0.0, 0.5, -0.5, float("inf"), float("-inf"), 3.4e38, -3.4e38])
    x = torch.cat([mags, -mags, specials]).to(PRIMARY_DEVICE)
    got = _tanh_triton(x).cpu().double()
    want = torch.tanh(x.cpu().double())
    assert torch.isfinite(got).all()
    assert (got.abs() <= 1.0).all()
    rel = (got - want).abs() / want.abs().clamp_min(1e-300)
    worst = int(rel.argmax())
    # torch.tanh in float32 is within ~1 ulp; allow 4 (the GPU's exp2 and division are approximate).
    x_w, got_w, want_w = (float(t[worst]) for t in (x, got, want))
    assert rel.max() <= 4 * ULP, f"tanh({x_w!r}) = {got_w!r}, not {want_w!r}"
    assert got[-4:].tolist() == [1.0, -1.0, 1.0, -1.0]  # saturates exactly
    assert math.copysign(1.0, float(got[-7])) == -1.0  # tanh(-0.0) = -0.0
    assert torch.isnan(_tanh_triton(torch.tensor([float("nan")], device=PRIMARY_DEVICE))).all()


def _dense64(case, scale: float, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal float64 attention of a case whose requests have one query each."""
    group = case.q.shape[1] // case.k_cache.shape[2]
    outs, lses = [], []
    for r, (k, v) in enumerate(zip(case.dense_k, case.dense_v, strict=True)):
        k64 = k.double().repeat_interleave(group, 1).transpose(0, 1)  # [num_heads, kv_len, head_dim]
        v64 = v.double().repeat_interleave(group, 1).transpose(0, 1)
        q64 = case.q[r].double()  # [num_heads, head_dim]
        s = torch.einsum("hd,hkd->hk", q64, k64) * scale
        s = softcap * torch.tanh(s / softcap)
        lses.append(torch.logsumexp(s, 1))
        outs.append(torch.einsum("hk,hkd->hd", torch.softmax(s, 1), v64))
    return torch.stack(outs), torch.stack(lses, 1)


@pytest.mark.parametrize("softcap", [1e2, 1e3, 1e4])
def test_large_caps_keep_the_scores_float32_exact(softcap):
    # Scores of order 1 under a cap of 1e2..1e4: tanh's argument is 1e-2..1e-5, where the
    # old 1 - 2 / (e^2x + 1) kept only an absolute 1e-7 (scores off by up to 1.2e-3).
    case = make_case([1, 1, 1], [37, 54, 9], num_kv_heads=2, group=2, head_dim=32, block_size=5,
                     device=PRIMARY_DEVICE, seed=11)
    scale = 2.0  # scores of about +-10
    got, got_lse = paged_prefill_attention(*case.args, softmax_scale=scale, softcap=softcap,
                                           return_lse=True, backend="triton")
    want, want_lse = _dense64(case, scale, softcap)
    # The torch backend (float32 too) is within 3e-6 / 7e-6 here; the old tanh was 2e-5 / 7e-5 off at a
    # cap of 1e3 and 1.4e-4 / 9e-4 at 1e4.
    torch.testing.assert_close(got.cpu().double(), want, atol=8e-6, rtol=0)
    torch.testing.assert_close(got_lse.cpu().double(), want_lse, atol=2e-5, rtol=0)


@pytest.mark.parametrize("softcap", [1.0, 30.0, 1e4])
@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e5], ids=["tiny", "unit", "huge"])
def test_caps_and_logits_over_the_range_match_the_reference(softcap, scale):
    # Logits from ~1e-30 to ~1e6 (and as negative): both backends, no NaN or inf anywhere.
    case = make_case([3, 1], [21, 8], num_kv_heads=1, group=2, head_dim=16, block_size=5,
                     device=PRIMARY_DEVICE, seed=5)
    results = [paged_prefill_attention(*case.args, softmax_scale=scale, softcap=softcap, return_lse=True,
                                       backend=backend) for backend in ("triton", "torch")]
    (got, got_lse), (want, want_lse) = results
    assert torch.isfinite(got).all() and torch.isfinite(got_lse).all()
    torch.testing.assert_close(got, want, **tolerance(torch.float32))
    # LSE ~ softcap at huge logits: its float32 rounding is relative to that.
    torch.testing.assert_close(got_lse, want_lse, atol=2e-4 * softcap, rtol=2e-4)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("scale, softcap", [(None, 1.1754943508222875e-38), (1e30, 1e30 / 1.7e38)],
                         ids=["smallest-cap", "largest-ratio"])
def test_the_smallest_caps_accepted_give_uniform_attention(backend, scale, softcap):
    # Every capped score is within +-softcap (~0): each row is the mean of the values it
    # sees, a zero query too (its score 0 was 0 / 0 or 0 * inf with smaller caps).
    case = make_case([2, 1], [9, 6], num_kv_heads=1, group=1, head_dim=16, block_size=4,
                     device=PRIMARY_DEVICE, seed=2)
    case.q[0] = 0.0
    out = paged_prefill_attention(*case.args, softmax_scale=scale, softcap=softcap, backend=backend)
    k0, k1 = case.dense_v
    want = torch.stack([k0[:8].mean(0), k0.mean(0), k1.mean(0)])  # causal: row 0 sees keys 0..7
    torch.testing.assert_close(out.cpu(), want.cpu(), **tolerance(torch.float32))
