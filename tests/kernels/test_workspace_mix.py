"""The CUDA-graph launch mode (a split workspace made once) on random mixed batches with
the options drawn together: decodes and short prefills that split by their own length
beside prefills that do not, sliding windows, softcap, sinks, fp8 caches with per-head
scales, non-causal. One workspace serves every example in turn, as one serves every step
of an engine: nothing an earlier batch left in it may reach a later one. Triton
(interpreter on CPU) against the torch reference; unused memory is NaN."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.kernels import alloc_split_workspace, paged_prefill_attention_reference
from prefixkv.kernels.attention import paged_prefill_attention_triton
from prefixkv.kernels.fp8 import FP8_DTYPES, quantize
from prefixkv.kernels.tiling import TileConfig

from .cases import make_case, tolerance
from .conftest import PRIMARY_DEVICE

pytestmark = pytest.mark.usefixtures("needs_triton")

KV_HEADS, GROUP, DIM, MAX_BATCH = 2, 1, 16, 3
WORKSPACES = {q: alloc_split_workspace(3, MAX_BATCH, KV_HEADS * GROUP, DIM, PRIMARY_DEVICE, split_q=q,
                                       min_keys=6) for q in (1, 3)}


@settings(max_examples=15, deadline=None)
@given(
    data=st.data(),
    split_q=st.sampled_from([1, 3]),
    block_size=st.sampled_from([3, 16]),
    cache=st.sampled_from([None, *FP8_DTYPES]),
    causal=st.booleans(),
    window=st.sampled_from([None, (5, 0), (2, 0)]),
    softcap=st.sampled_from([0.0, 2.0]),
    sinks=st.booleans(),
)
def test_per_request_splits_in_a_reused_workspace_match_the_reference(data, split_q, block_size, cache,
                                                                       causal, window, softcap, sinks):
    q_lens = data.draw(st.lists(st.sampled_from([0, 1, 2, 3, 7]), min_size=1, max_size=MAX_BATCH))
    kv_lens = [q + data.draw(st.sampled_from([0, 5, 13, 25])) for q in q_lens]
    case = make_case(q_lens, kv_lens, num_kv_heads=KV_HEADS, group=GROUP, head_dim=DIM, block_size=block_size,
                     device=PRIMARY_DEVICE, seed=data.draw(st.integers(0, 2**16)))
    options: dict[str, object] = dict(causal=causal, window_size=window, softcap=softcap)
    if sinks:
        options["sinks"] = torch.tensor([0.3, -1.0], device=PRIMARY_DEVICE)
    dtype = torch.float32
    if cache is not None:  # fp8 K/V, a scale per KV head; q in fp16 (the interpreter's bf16 dot is wrong)
        scales = [torch.tensor(s, device=PRIMARY_DEVICE) for s in ([0.5, 1.25], [2.0, 0.75])]
        case.k_cache = quantize(case.k_cache.float(), scales[0], cache)
        case.v_cache = quantize(case.v_cache.float(), scales[1], cache)
        case.q, dtype = case.q.half(), torch.float16
        options.update(k_scale=scales[0], v_scale=scales[1])
    ws = WORKSPACES[split_q]
    got, got_lse = paged_prefill_attention_triton(*case.args, return_lse=True, split_workspace=ws,
                                                  config=TileConfig(16, 16, num_stages=1), **options)
    want, want_lse = paged_prefill_attention_reference(*case.args, return_lse=True, **options)
    assert not got.isnan().any(), "NaN in the output: a masked or unused key leaked"
    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype))
    torch.testing.assert_close(got_lse, want_lse, **tolerance(dtype))
    if not sum(q_lens):
        return  # no launch: the workspace is not touched
    # Each request of at most split_q new tokens went through the workspace, no other.
    tok = ws.row_tok.tolist()
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    for i, (n, s) in enumerate(zip(q_lens, starts, strict=True)):
        rows = tok[i * split_q:i * split_q + split_q]
        if 0 < n <= split_q:
            assert rows[:n] == list(range(s, s + n)), (i, tok)
        else:
            assert set(rows) == {-1}, (i, tok)
