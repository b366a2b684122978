"""The prefill cost estimate, by hand."""

from __future__ import annotations

import pytest

from prefixkv.bench.cost import PrefillCost, allocator_share


def test_llama3_8b_shape():
    cost = PrefillCost()
    # per layer: q 4096x4096, k and v 4096x1024 each, o 4096x4096, MLP 3 x 4096x14336
    per_layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336
    assert cost.linear_params == 32 * per_layer == 6_979_321_856
    assert cost.flops(1, 0) == 2 * 6_979_321_856
    assert cost.flops(0, 10) == 4 * 32 * 32 * 128 * 10
    assert cost.seconds(1000, 0) == pytest.approx(2 * 6_979_321_856 * 1000 / 400e12)
    assert "Llama-3-8B-like" in cost.describe() and "400 TFLOP/s" in cost.describe()


def test_tiny_shape_by_hand():
    tiny = PrefillCost("tiny", layers=1, hidden=2, heads=1, kv_heads=1, head_dim=2,
                       intermediate=3, tflops=1e-12)  # 1 FLOP/s
    # q, k, v, o: 2x2 each = 16; MLP 3 x 2x3 = 18 -> 34 weights; 2 tokens -> 136 FLOPs;
    # 3 pairs x 4 x head_dim 2 -> 24 FLOPs
    assert tiny.linear_params == 34
    assert tiny.seconds(2, 3) == pytest.approx(136 + 24)
    result = {"prefill_saved": 2, "prefill_saved_pairs": 3, "admit_ns": 40e9, "decode_ns": 40e9}
    assert allocator_share(result, tiny) == pytest.approx(80 / 160)
    assert allocator_share({**result, "prefill_saved": 0}, tiny) is None
