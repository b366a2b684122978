"""The vLLM plug-in beside vLLM's own manager with fine-grained partial hits and a
full-attention group larger than the hash block (groups/partial_full.py): after every
step the same tables, free counts, hits (a hit inside a full-attention block, found by
its partial entry or whole, copied on write), junctions and copies with their held
blocks, up to the first spare (tests/engines/test_vllm_mamba_sizes.py's ``Sides``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

skip_module_without_vllm()

torch = pytest.importorskip("torch")

from .test_vllm_mamba_sizes import OP, Sides  # noqa: E402
from .test_vllm_sized_model import MAX_LEN, PARTIAL_FULL, PROMPT, STEMS  # noqa: E402


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(PARTIAL_FULL))
@settings(max_examples=30, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_plugin_gives_vllms_tables_hits_and_copies_with_full_attention_larger_than_the_hash_block(
        layout, small, ops, probe):
    groups, h = PARTIAL_FULL[layout]
    sides = Sides(groups, sum(-(-MAX_LEN // b) for b, _ in groups) + 3 if small else 400, partial=True,
                  hash_size=h)
    for op, a, b in ops:
        sides.do(op, a, b)
        sides.compare(probe)
        if any(sides.ms[1].core._index.twins):
            return


def test_a_hit_inside_a_block_found_whole_is_admitted_under_its_lookups_cap():
    # full16+mamba8, hash 4: r1 computes 8 of 13 tokens (Mamba's state at 8), r2 caches
    # 0..15 whole in one full block; r3's hit is 8 (full attention's block found whole
    # under the cap 16, Mamba's state at 8), which a cap of 8 does not find again (vLLM's
    # phase 1 takes no block past the cap): admission looks it up under the lookup's cap
    groups, h = PARTIAL_FULL["full16+mamba8, hash 4"]
    sides = Sides(groups, 400, partial=True, hash_size=h)
    for op in [("add", list(range(13)), 8), ("add", STEMS[0][:17], None), ("add", STEMS[0][:17], None)]:
        sides.do(*op)
        sides.compare([7])
    assert sides.copies == 1 and [list(g) for g in sides.ms[1].get_block_ids("r3")] == [[6, 7], [2, 0, 8]]
