"""The torch reference against a naive dense attention: this validates the test oracle."""

from __future__ import annotations

import math

import pytest
import torch

from prefixkv.kernels import paged_prefill_attention_reference, write_kv_cache_reference

from .cases import make_case


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
