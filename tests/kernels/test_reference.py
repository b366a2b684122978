"""The torch reference against a naive dense attention and a hand-worked row: this validates
the test oracle."""

from __future__ import annotations

import math

import pytest
import torch

from prefixkv.kernels import (
    paged_prefill_attention,
    paged_prefill_attention_reference,
    write_kv_cache_reference,
)

from .cases import make_case
from .conftest import PRIMARY_DEVICE, triton_skip_reason


def naive_attention(case, *, scale, causal, window, softcap):
    """Dense float64 attention, one (request, head, query) at a time, from the dense copies."""
    outs, lses = [], []
    group = case.q.shape[1] // case.k_cache.shape[2]
    start = 0
    for q_len, kv_len, k, v in zip(case.q_lens, case.kv_lens, case.dense_k, case.dense_v, strict=True):
        q = case.q[start:start + q_len].double()
        start += q_len
        out = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q_len), -math.inf, dtype=torch.float64)
        for h in range(q.shape[1]):
            kh, vh = k[:, h // group].double(), v[:, h // group].double()
            for i in range(q_len):
                pos = kv_len - q_len + i
                keys = [j for j in range(kv_len)
                        if (not causal or j <= pos)
                        and (window is None or window[0] < 0 or j >= pos - window[0])
                        and (window is None or window[1] < 0 or j <= pos + window[1])]
                if not keys:
                    continue
                s = (kh[keys] @ q[i, h]) * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                lse[h, i] = torch.logsumexp(s, 0)
                out[i, h] = torch.softmax(s, 0) @ vh[keys]
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize(
    "causal, window, softcap",
    [(True, None, 0.0), (True, (6, 0), 0.0), (False, None, 3.0), (False, (4, 2), 0.0), (True, (-1, 0), 2.0)],
)
def test_reference_matches_naive_dense(causal, window, softcap):
    case = make_case([3, 1, 5], [9, 6, 5], num_kv_heads=2, group=2, head_dim=8, block_size=3, seed=1)
    out, lse = paged_prefill_attention_reference(
        *case.args, softmax_scale=0.3, causal=causal, window_size=window, softcap=softcap, return_lse=True
    )
    want_out, want_lse = naive_attention(case, scale=0.3, causal=causal, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_reference_rows_without_keys_are_zero_with_minus_inf_lse():
    # 4 new tokens but only 2 keys: the first two queries sit before position 0.
    case = make_case([4], [2], head_dim=8, block_size=2)
    out, lse = paged_prefill_attention_reference(*case.args, return_lse=True)
    assert not out.isnan().any()
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    assert torch.isneginf(lse[:, :2]).all() and torch.isfinite(lse[:, 2:]).all()


def test_reference_writes_into_out():
    case = make_case([2, 3], [5, 3], head_dim=8, block_size=4)
    out = torch.empty_like(case.q)
    assert paged_prefill_attention_reference(*case.args, out=out) is out
    torch.testing.assert_close(out, paged_prefill_attention_reference(*case.args))


def test_reference_write_kv_skips_minus_one():
    k_cache = torch.zeros(3, 4, 1, 8)
    v_cache = torch.zeros(3, 4, 1, 8)
    key, value = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    write_kv_cache_reference(key, value, k_cache, v_cache, torch.tensor([9, -1, 0]))
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[0, 0], value[2])
    assert int((k_cache != 0).any(-1).sum()) == 2


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    triton_skip_reason() is not None, reason=str(triton_skip_reason())))])
def test_a_hand_worked_row_with_sink_softcap_and_window(backend):
    # One query q = e0 over four keys k_j = j * e0 (values v_j = (j + 1) * e1), one slot per
    # block, the blocks in reverse order. Scale 1, softcap 2, window (1, 0) and sink 0.5:
    # the row sees keys 2 and 3 (scores 2, 3 -> 2 tanh(1), 2 tanh(1.5)) and the sink.
    k_cache, v_cache = torch.full((5, 1, 1, 8), float("nan")), torch.full((5, 1, 1, 8), float("nan"))
    table = torch.tensor([[3, 2, 1, 0]], dtype=torch.int32)
    for j, block in enumerate(table[0].tolist()):
        k_cache[block] = 0.0
        v_cache[block] = 0.0
        k_cache[block, 0, 0, 0] = float(j)
        v_cache[block, 0, 0, 1] = float(j + 1)
    q = torch.zeros(1, 1, 8)
    q[0, 0, 0] = 1.0
    c2, c3 = 2 * math.tanh(1.0), 2 * math.tanh(1.5)
    total = math.exp(c2) + math.exp(c3) + math.exp(0.5)
    cu, used = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    device = PRIMARY_DEVICE if backend == "triton" else "cpu"  # compiled Triton takes CUDA tensors
    args = [t.to(device) for t in (q, k_cache, v_cache, table, cu, used)]
    out, lse = paged_prefill_attention(
        *args, 1, 4, softmax_scale=1.0, softcap=2.0, window_size=(1, 0),
        sinks=torch.tensor([0.5], device=device), return_lse=True, backend=backend)
    want = torch.zeros(8)
    want[1] = (3 * math.exp(c2) + 4 * math.exp(c3)) / total
    torch.testing.assert_close(out[0, 0].cpu(), want, atol=1e-5, rtol=1e-5)
    assert lse.shape == (1, 1) and math.isclose(lse.item(), math.log(total), rel_tol=1e-5)
