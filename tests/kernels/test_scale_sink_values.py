"""Values inside ``k_scale``/``v_scale`` and ``sinks`` that have no ordinary meaning, and
sinks of any stride: one defined answer on both backends, a typed error in checked mode.

The defined answers (``fp8.py``, the ``sinks`` argument): a scale that is not a finite
number > 0 acts as 0 (the head stores zeros; K read with it gives scores 0, V gives
output 0); a NaN sink is no sink, a ``+inf`` sink makes the row's output 0 and LSE
``+inf``. Each is checked against an independent construction (zeroed queries, no sinks),
not only backend against backend.
"""

from __future__ import annotations

import pytest
import torch

from prefixkv.kernels import (
    MetadataError,
    TensorValueError,
    paged_prefill_attention,
    write_kv_cache,
)
from prefixkv.kernels.fp8 import quantize
from prefixkv.kernels.tiling import TileConfig

from .cases import make_case, tolerance
from .conftest import INTERPRETING, PRIMARY_DEVICE, triton_skip_reason

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(triton_skip_reason() is not None,
                                                                    reason=str(triton_skip_reason())))]
CONFIGS = [TileConfig(32, 16), TileConfig(16, 16, num_splits=3)]  # one tile pass; split-KV and its merge
BAD = [0.0, -0.5, float("nan"), float("inf")]
GEOMETRY = dict(q_lens=[5, 1, 3], kv_lens=[23, 30, 2], num_kv_heads=2, group=2, head_dim=16, block_size=5)


def _attend(backend, case, config=None, **kw):
    extra = dict(config=config) if backend == "triton" else {}
    if backend == "triton":
        from prefixkv.kernels.attention import paged_prefill_attention_triton

        return paged_prefill_attention_triton(*case.args, return_lse=True, **extra, **kw)
    return paged_prefill_attention(*case.args, return_lse=True, backend="torch", **kw)


def _fp8(case):
    """The case's caches as e4m3fn at scale 1 (values are ~N(0, 1): no saturation), q fp16."""
    case.k_cache, case.v_cache = (quantize(c, None, torch.float8_e4m3fn)
                                  for c in (case.k_cache, case.v_cache))
    case.q = case.q.half()
    return case


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", BAD, ids=["zero", "negative", "nan", "inf"])
def test_k_scale_that_is_not_positive_and_finite_makes_scores_zero(backend, bad):
    case = _fp8(make_case(**GEOMETRY, device=PRIMARY_DEVICE, seed=4))
    scale = torch.tensor([1.0, bad], device=PRIMARY_DEVICE)
    ones = torch.ones(2, device=PRIMARY_DEVICE)
    for config in CONFIGS[: 1 if backend == "torch" else 2]:
        got, lse = _attend(backend, case, config, k_scale=scale, v_scale=ones)
        assert torch.isfinite(got).all() and not lse.isnan().any()
        # Oracle: KV head 1's scores are 0 exactly when its query heads (2, 3) are zero.
        case0 = make_case(**GEOMETRY, device=PRIMARY_DEVICE, seed=4)
        case0.k_cache, case0.v_cache, case0.q = case.k_cache, case.v_cache, case.q.clone()
        case0.q[:, 2:] = 0
        want, want_lse = _attend("torch", case0, k_scale=ones, v_scale=ones)
        torch.testing.assert_close(got.float(), want.float(), **tolerance(torch.float16))
        torch.testing.assert_close(lse, want_lse, **tolerance(torch.float16))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", BAD, ids=["zero", "negative", "nan", "inf"])
def test_v_scale_that_is_not_positive_and_finite_makes_output_zero(backend, bad):
    case = _fp8(make_case(**GEOMETRY, device=PRIMARY_DEVICE, seed=6))
    ones = torch.ones(2, device=PRIMARY_DEVICE)
    v_scale = torch.tensor([bad, 1.0], device=PRIMARY_DEVICE)
    got, lse = _attend(backend, case, CONFIGS[0], k_scale=ones, v_scale=v_scale)
    want, want_lse = _attend("torch", case, k_scale=ones, v_scale=ones)
    assert (got[:, :2] == 0).all()  # KV head 0 serves query heads 0 and 1
    torch.testing.assert_close(got[:, 2:].float(), want[:, 2:].float(), **tolerance(torch.float16))
    torch.testing.assert_close(lse, want_lse, **tolerance(torch.float16))  # the weights do not change


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", BAD, ids=["zero", "negative", "nan", "inf"])
def test_write_with_a_bad_scale_stores_zeros_in_that_head_only(backend, bad):
    gen = torch.Generator().manual_seed(2)
    key, value = (torch.randn(4, 2, 16, generator=gen).half().to(PRIMARY_DEVICE) for _ in range(2))
    caches = [torch.full((2, 5, 2, 16), 7.0).to(torch.float8_e4m3fn).to(PRIMARY_DEVICE) for _ in range(2)]
    slots = torch.tensor([0, 3, -1, 9], device=PRIMARY_DEVICE)
    scale = torch.tensor([bad, 0.5], device=PRIMARY_DEVICE)
    write_kv_cache(key, value, *caches, slots, k_scale=scale, v_scale=scale.flip(0), backend=backend)
    rows = caches[0].view(10, 2, 16)[[0, 3, 9]].float().cpu()
    assert (rows[:, 0] == 0).all() and torch.isfinite(rows).all()
    want = quantize(key[[0, 1, 3]].cpu(), torch.tensor([1.0, 0.5]), torch.float8_e4m3fn).float()
    if not INTERPRETING:  # the interpreter's fp32 -> fp8 rounding is off by an ulp at times (test_fp8)
        assert torch.equal(rows[:, 1], want[:, 1])
    torch.testing.assert_close(rows[:, 1], want[:, 1], atol=0.0, rtol=2.0**-3)
    assert (caches[1].view(10, 2, 16)[[0, 3, 9], 1].float() == 0).all()  # v: the bad scale is head 1's
    assert (caches[0].view(10, 2, 16)[[1, 2]].float() == 7.0).all()  # unwritten slots untouched


def _sinks(*values):
    return torch.tensor(values, dtype=torch.float32, device=PRIMARY_DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", CONFIGS, ids=["tiles", "split"])
def test_nan_sink_is_no_sink_and_inf_sink_takes_the_row(backend, config):
    case = make_case(**GEOMETRY, device=PRIMARY_DEVICE, seed=8)
    got, lse = _attend(backend, case, config, sinks=_sinks(0.5, float("nan"), float("inf"), float("-inf")))
    plain, plain_lse = _attend("torch", case)
    with_sink, sink_lse = _attend("torch", case, sinks=_sinks(0.5, float("-inf"), 0.0, float("-inf")))
    tol = tolerance(torch.float32)
    torch.testing.assert_close(got[:, 0], with_sink[:, 0], **tol)  # an ordinary sink
    torch.testing.assert_close(lse[0], sink_lse[0], **tol)
    for h in (1, 3):  # NaN and -inf: as without a sink
        torch.testing.assert_close(got[:, h], plain[:, h], **tol)
        torch.testing.assert_close(lse[h], plain_lse[h], **tol)
    assert (got[:, 2] == 0).all() and (lse[2] == float("inf")).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", CONFIGS, ids=["tiles", "split"])
def test_sinks_of_any_stride(backend, config):
    case = make_case(**GEOMETRY, device=PRIMARY_DEVICE, seed=9)
    strided = (torch.randn(8, generator=torch.Generator().manual_seed(0)) * 3).to(PRIMARY_DEVICE)[::2]
    assert not strided.is_contiguous()
    got, lse = _attend(backend, case, config, sinks=strided)
    want, want_lse = _attend("torch", case, sinks=strided.contiguous())
    torch.testing.assert_close(got, want, **tolerance(torch.float32))
    torch.testing.assert_close(lse, want_lse, **tolerance(torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where, value", [("k_scale", -1.0), ("v_scale", float("nan")),
                                          ("k_scale", float("inf")), ("sinks", float("nan")),
                                          ("sinks", float("inf"))], ids=str)
def test_checked_mode_rejects_meaningless_values(backend, where, value):
    case = _fp8(make_case(**GEOMETRY, device=PRIMARY_DEVICE, seed=1))
    kw = dict(k_scale=torch.ones(2), v_scale=torch.ones(2), sinks=torch.zeros(4))
    kw = {k: v.to(PRIMARY_DEVICE) for k, v in kw.items()}
    kw[where][1] = value
    out = torch.full_like(case.q, 5.0)
    with pytest.raises(TensorValueError, match=rf"{where}\[1\]") as err:
        paged_prefill_attention(*case.args, out=out, checked=True, backend=backend, **kw)
    assert isinstance(err.value, MetadataError) and (out == 5.0).all()  # nothing written
    if where != "sinks":
        key = case.q[:, :2]
        caches = [c.clone() for c in (case.k_cache, case.v_cache)]
        slots = torch.arange(key.shape[0], device=PRIMARY_DEVICE)
        with pytest.raises(TensorValueError, match=where):
            write_kv_cache(key, key, *caches, slots, k_scale=kw["k_scale"], v_scale=kw["v_scale"],
                           checked=True, backend=backend)
        assert torch.equal(caches[0].view(torch.uint8), case.k_cache.view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_checked_mode_accepts_zero_scale_and_minus_inf_sink(backend):
    case = _fp8(make_case(**GEOMETRY, device=PRIMARY_DEVICE, seed=1))
    zero_one = torch.tensor([0.0, 1.0], device=PRIMARY_DEVICE)
    out = paged_prefill_attention(*case.args, checked=True, backend=backend, k_scale=zero_one,
                                  v_scale=zero_one, sinks=_sinks(0.0, float("-inf"), 1.0, 2.0))
    assert torch.isfinite(out).all()


def _strided(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that is a non-contiguous view (every other row of a twice-as-long tensor)."""
    room = torch.full((2 * t.shape[0], *t.shape[1:]), float("nan") if t.is_floating_point() else -7,
                      dtype=t.dtype, device=t.device)
    room[::2] = t
    return room[::2]


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("config", CONFIGS, ids=["tiles", "split"])
def test_every_tensor_argument_of_any_stride(config):
    """The audit of 22.5: each tensor the kernels read, as a strided view, against contiguous
    copies through the reference (caches as one half of an interleaved K/V tensor)."""
    case = _fp8(make_case(**GEOMETRY, device=PRIMARY_DEVICE, seed=11))
    scales = [torch.tensor(s, device=PRIMARY_DEVICE) for s in ([0.7, 1.3], [1.1, 0.9])]
    sinks = torch.tensor([0.1, -1.0, 2.0, 0.0], device=PRIMARY_DEVICE)
    want, want_lse = _attend("torch", case, k_scale=scales[0], v_scale=scales[1], sinks=sinks)
    kv = torch.stack([case.k_cache, case.v_cache], dim=1)  # [num_blocks, 2, block_size, heads, dim]
    case.k_cache, case.v_cache = kv[:, 0], kv[:, 1]
    case.cu_seqlens_q, case.seqused_k = _strided(case.cu_seqlens_q), _strided(case.seqused_k)
    case.q = _strided(case.q)
    got, got_lse = _attend("triton", case, config, k_scale=_strided(scales[0]), v_scale=_strided(scales[1]),
                           sinks=_strided(sinks))
    torch.testing.assert_close(got.float(), want.float(), **tolerance(torch.float16))
    torch.testing.assert_close(got_lse, want_lse, **tolerance(torch.float16))
    # write_kv_cache: strided key, value, slots, scales and caches. Values are fp8 numbers
    # times power-of-two scales, so x / scale is exact and no rounding (nor the interpreter's
    # fp8 rounding fault) enters.
    pow2 = [torch.tensor([0.5, 2.0], device=PRIMARY_DEVICE), torch.tensor([4.0, 0.25], device=PRIMARY_DEVICE)]
    key, value = (_strided((quantize(torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(i)), None,
                                     torch.float8_e4m3fn).float().to(PRIMARY_DEVICE) * s[:, None]).half())
                  for i, s in ((1, pow2[0]), (2, pow2[1])))
    slots = _strided(torch.tensor([4, -1, 12], device=PRIMARY_DEVICE))
    outs = []
    for backend in ("triton", "torch"):
        kv = torch.zeros(4, 2, 5, 2, 16, device=PRIMARY_DEVICE).to(torch.float8_e4m3fn)
        write_kv_cache(key, value, kv[:, 0], kv[:, 1], slots, k_scale=_strided(pow2[0]),
                       v_scale=_strided(pow2[1]), backend=backend)
        outs.append(kv.float())
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0
