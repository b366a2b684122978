"""The options the other kernel tests take one at a time, drawn together: sinks with a
softcap, windows (non-causal too, and shorter than a block), forced key splits (one
split included), block size 1 and odd sizes, groups that are not powers of two, fp16,
head_dim 80, requests with fewer keys than queries. Triton (interpreter on CPU) against
the torch reference; unused memory is NaN (cases.make_case)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.kernels.tiling import TileConfig

from .cases import check, make_case
from .conftest import PRIMARY_DEVICE

pytestmark = pytest.mark.usefixtures("needs_triton")


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 3, 16]),
    group=st.sampled_from([1, 3, 5]),
    head_dim=st.sampled_from([8, 80]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    causal=st.booleans(),
    window=st.sampled_from([None, (0, 0), (2, 0), (1, 3)]),
    softcap=st.sampled_from([0.0, 2.0]),
    sinks=st.booleans(),
    num_splits=st.sampled_from([None, 1, 3]),
)
def test_options_together_match_the_reference(data, block_size, group, head_dim, dtype, causal, window,
                                              softcap, sinks, num_splits):
    if causal and window is not None and window[1] > 0:
        window = (window[0], 0)  # causal allows a right edge of 0 only
    q_lens = data.draw(st.lists(st.sampled_from([0, 1, 3, 9]), min_size=1, max_size=3))
    kv_lens = [max(0, q + data.draw(st.sampled_from([-1, 0, 5, 17]))) for q in q_lens]
    case = make_case(q_lens, kv_lens, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size,
                     dtype=dtype, device=PRIMARY_DEVICE, seed=data.draw(st.integers(0, 2**16)))
    options: dict[str, object] = dict(causal=causal, window_size=window, softcap=softcap)
    if sinks:
        gen = torch.Generator().manual_seed(7)
        options["sinks"] = torch.randn(2 * group, generator=gen).to(PRIMARY_DEVICE)
    config = TileConfig(block_m=32, block_n=16, num_stages=1, num_splits=num_splits)
    check(case, dtype, config=config, **options)
