"""Legal but unusual calls the other kernel tests do not make: a block table with no
column, metadata that is column-major or strided, one block named twice, host bounds
(``max_seqlen_q``/``max_seqlen_k``) far from the device values, windows of width 0 with
sinks. Each: the torch reference's answer on both backends, and an independent
construction where there is one (kern-r10's adversarial sweep found no defect here;
these keep it so).
"""

from __future__ import annotations

import pytest
import torch

from prefixkv.kernels import alloc_split_workspace, paged_prefill_attention

from .cases import make_case, tolerance
from .conftest import PRIMARY_DEVICE, triton_skip_reason

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(triton_skip_reason() is not None,
                                                                    reason=str(triton_skip_reason())))]
TOL = tolerance(torch.float32)


def _case(seed=3, q_lens=(3, 1), kv_lens=(12, 7)):
    return make_case(list(q_lens), list(kv_lens), num_kv_heads=2, group=2, head_dim=16, block_size=5,
                     device=PRIMARY_DEVICE, seed=seed)


def _both(args, **options):
    """(Triton, torch) results of one call, each as (out, lse)."""
    return [paged_prefill_attention(*args, return_lse=True, backend=b, **options)
            for b in ("triton", "torch")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_block_table_with_no_column_attends_no_key(backend):
    case = _case()
    args = list(case.args)
    args[3], args[7] = args[3][:, :0], 0  # seqused_k (12, 7) clamps to the table's 0 slots
    out, lse = paged_prefill_attention(*args, return_lse=True, backend=backend)
    assert not out.any() and torch.isneginf(lse).all()


@pytest.mark.usefixtures("needs_triton")
def test_column_major_and_strided_metadata_read_as_their_values():
    case = _case()
    args = list(case.args)
    args[3] = case.block_table.t().contiguous().t()  # column-major
    cu = torch.zeros(3 * case.cu_seqlens_q.numel(), dtype=torch.int32, device=PRIMARY_DEVICE)
    cu[::3] = case.cu_seqlens_q
    used = torch.zeros(2 * case.seqused_k.numel(), dtype=torch.int32, device=PRIMARY_DEVICE)
    used[::2] = case.seqused_k
    args[4], args[5] = cu[::3], used[::2]
    got, want = _both(args)
    plain = paged_prefill_attention(*case.args, return_lse=True, backend="torch")
    for a, b in ((got, want), (want, plain)):
        torch.testing.assert_close(a[0], b[0], **TOL)
        torch.testing.assert_close(a[1], b[1], **TOL)


@pytest.mark.usefixtures("needs_triton")
def test_one_block_named_twice_is_read_twice():
    # Request 0 lists its first block again as its second, request 1 starts with it: each
    # reads those keys twice / as its own, the same on both backends as on dense copies.
    case = _case()
    table = case.block_table.clone()
    first = int(table[0, 0])
    table[0, 1], table[1, 0] = first, first
    args = list(case.args)
    args[3] = table
    got, want = _both(args)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
    # Independent: request 1's single query over keys whose first block is request 0's first.
    k0, v0 = case.dense_k[0][:5], case.dense_v[0][:5]
    k1 = torch.cat([k0, case.dense_k[1][5:]])
    v1 = torch.cat([v0, case.dense_v[1][5:]])
    q = case.q[3]  # [num_heads, head_dim]; group 2: heads 2h, 2h+1 read KV head h
    s = torch.einsum("hd,khd->hk", q, k1.repeat_interleave(2, 1)) * 16 ** -0.5
    want_row = torch.einsum("hk,khd->hd", torch.softmax(s, 1), v1.repeat_interleave(2, 1))
    torch.testing.assert_close(got[0][3], want_row, **TOL)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("max_q, max_k", [(0, 0), (1, 1), (1000, 0), (0, 10**6)])
@pytest.mark.parametrize("workspace", [False, True], ids=["plain", "workspace"])
def test_host_bounds_far_from_the_device_values_change_nothing(max_q, max_k, workspace):
    # The host ints only size tiles and splits: any value, the same answer.
    case = _case(q_lens=(3, 1, 2), kv_lens=(40, 7, 2))
    args = list(case.args)
    args[6], args[7] = max_q, min(max_k, case.block_table.shape[1] * 5)
    ws = alloc_split_workspace(3, 3, 4, 16, PRIMARY_DEVICE, split_q=2, min_keys=4) if workspace else None
    got = paged_prefill_attention(*args, return_lse=True, split_workspace=ws, backend="triton")
    want = paged_prefill_attention(*case.args, return_lse=True, backend="torch")
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("causal", [True, False])
def test_a_window_of_width_zero_with_sinks_is_each_query_against_its_own_key_and_the_sink(causal):
    case = _case()
    sinks = torch.tensor([0.5, -1e30, float("-inf"), 3.0], device=PRIMARY_DEVICE)
    got, want = _both(case.args, window_size=(0, 0), causal=causal, sinks=sinks)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
    # Independent: one key of score s and a sink z: weight 1 / (1 + e^(z - s)) on its value.
    q, k, v = case.q[0], case.dense_k[0][9], case.dense_v[0][9]  # request 0's first query is key 9
    s = (q * k.repeat_interleave(2, 0)).sum(-1) * 16 ** -0.5  # [num_heads]
    w = torch.sigmoid(s - sinks.cpu().to(s.device))
    torch.testing.assert_close(got[0][0], w[:, None] * v.repeat_interleave(2, 0), **TOL)
