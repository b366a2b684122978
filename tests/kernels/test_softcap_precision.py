"""Softcap's tanh on the Triton path: float32 precision over the whole range of caps and
logits, against torch.tanh in float64 and a float64 dense attention.

``scores -> softcap * tanh(scores / softcap)``: with a large cap, ``scores / softcap`` is
small, and tanh must keep its relative precision there, or the cap multiplies an absolute
error of ~1e-7 into the scores (1e-3 at a cap of 1e4). Caps up to
``attention.EXP_TANH_MAX_CAP`` take tanh's exp form (``attend._tanh``, absolute error
~1e-7), larger ones its precise form (``attend._tanh_precise``).
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
# A GPU's exp2 and fp32 division are approximate (2 ulp each): its bounds are twice the interpreter's.
SLACK = 2 if PRIMARY_DEVICE == "cuda" else 1
MAGS = torch.logspace(-30, 7, 1500, dtype=torch.float64).float()  # tiny .. past saturation
SPECIALS = [0.0, -0.0, 0.5, -0.5, float("inf"), float("-inf"), 3.4e38, -3.4e38]


def _tanh_triton(x: torch.Tensor, precise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's tanh of ``x``, torch.tanh in float64) on the host, float64."""
    from .tanh_probe import tanh_triton  # imports triton

    x = x.to(PRIMARY_DEVICE)
    return tanh_triton(x, precise).cpu().double(), torch.tanh(x.cpu().double())


@pytest.mark.parametrize("precise", [True, False], ids=["precise", "exp-form"])
def test_tanh_saturates_exactly_and_is_nan_only_for_nan(precise):
    got, _ = _tanh_triton(torch.tensor(SPECIALS + [float("nan")]), precise)
    assert got[4:8].tolist() == [1.0, -1.0, 1.0, -1.0]
    assert got[:4].abs().tolist()[:2] == [0.0, 0.0] and torch.isnan(got[-1])
    got, _ = _tanh_triton(torch.cat([MAGS, -MAGS]), precise)
    assert torch.isfinite(got).all() and (got.abs() <= 1.0).all()


def test_precise_tanh_keeps_float32_relative_precision_over_the_whole_range():
    x = torch.cat([MAGS, -MAGS, torch.tensor(SPECIALS)])
    got, want = _tanh_triton(x, precise=True)
    rel = (got - want).abs() / want.abs().clamp_min(1e-300)
    worst = int(rel.argmax())
    # torch.tanh in float32 is within ~1 ulp; allow 4 (8 on a GPU).
    x_w, got_w, want_w = (float(t[worst]) for t in (x, got, want))
    assert rel.max() <= 4 * SLACK * ULP, f"tanh({x_w!r}) = {got_w!r}, not {want_w!r}"
    assert math.copysign(1.0, float(got[-7])) == -1.0  # tanh(-0.0) = -0.0


def test_exp_form_tanh_is_within_two_ulp_of_one_and_loses_relative_precision_near_zero():
    # What EXP_TANH_MAX_CAP rests on: an absolute bound, so a capped score is off by at most
    # cap * 2.4e-7 (4.8e-7 on a GPU); near 0 the relative error is large (why larger caps take
    # the precise form).
    got, want = _tanh_triton(torch.cat([MAGS, -MAGS]), precise=False)
    assert (got - want).abs().max() <= 2 * SLACK * ULP
    tiny = torch.cat([MAGS, MAGS]) < 1e-7
    assert ((got - want).abs() / want.abs())[tiny].max() > 0.5


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


@pytest.mark.parametrize("softcap, slack", [(1e2, 3.0), (1e3, 1.0), (1e4, 1.0)])
def test_large_caps_keep_the_scores_float32_exact(softcap, slack):
    # Scores of order 1 under a cap of 1e2..1e4: tanh's argument is 1e-2..1e-5, where the
    # old 1 - 2 / (e^2x + 1) kept only an absolute 1e-7 (scores off by up to 1.2e-3).
    case = make_case([1, 1, 1], [37, 54, 9], num_kv_heads=2, group=2, head_dim=32, block_size=5,
                     device=PRIMARY_DEVICE, seed=11)
    scale = 2.0  # scores of about +-10
    got, got_lse = paged_prefill_attention(*case.args, softmax_scale=scale, softcap=softcap,
                                           return_lse=True, backend="triton")
    want, want_lse = _dense64(case, scale, softcap)
    # The torch backend (float32 too) is within 3e-6 / 7e-6 here; the exp form alone was 2e-5 /
    # 7e-5 off at a cap of 1e3 and 1.4e-4 / 9e-4 at 1e4. A cap of 100 keeps the exp form (2e-6 /
    # 7e-6 in the interpreter): slack for a GPU's approximate exp2 and division.
    torch.testing.assert_close(got.cpu().double(), want.cpu(), atol=8e-6 * slack, rtol=0)
    torch.testing.assert_close(got_lse.cpu().double(), want_lse.cpu(), atol=2e-5 * slack, rtol=0)


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


@pytest.mark.parametrize("softcap, mode", [(0.0, 0), (30.0, 1), (50.0, 1), (100.0, 1), (100.5, 2), (1e4, 2)])
def test_the_launch_takes_the_precise_tanh_only_past_the_exp_forms_range(monkeypatch, softcap, mode):
    from prefixkv.kernels import attention

    assert attention.softcap_mode(softcap) == mode
    modes = []
    kernel = attention._paged_prefill_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                modes.append(kwargs["SOFTCAP"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(attention, "_paged_prefill_kernel", Recorder())
    case = make_case([2, 1], [9, 6], num_kv_heads=1, group=1, head_dim=16, block_size=4,
                     device=PRIMARY_DEVICE, seed=2)
    got = paged_prefill_attention(*case.args, softcap=softcap, backend="triton")
    want = paged_prefill_attention(*case.args, softcap=softcap, backend="torch")
    torch.testing.assert_close(got, want, **tolerance(torch.float32))
    assert modes == [mode]
