"""prefixkv's vLLM plug-in beside vLLM 0.33's own ``KVCacheManager`` with a
``prefix_cache_retention_interval`` beside Mamba groups of another block size than the
other groups' (integrations/vllm/retention.py gives it to prefixkv's Mamba groups:
``mamba(retention=R)``): test_vllm_mamba_sizes.py's random streams (``Sides``), without
checkpoint blocks (with them: test_vllm_mamba_checkpoint_plugin.py), on its Mamba layouts
and those of vLLM's fine-grained partial hits. Needs vllm installed."""

from __future__ import annotations

import math
import os
from functools import reduce
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import MAMBA_LAYOUTS, _spec, _vllm  # noqa: E402
from .test_vllm_mamba_sizes import OP, Sides  # noqa: E402
from .test_vllm_plugin import config  # noqa: E402
from .test_vllm_sized_model import MAX_LEN, PARTIAL, PROMPT  # noqa: E402


class RetentionSides(Sides):
    """``Sides`` with vLLM's ``prefix_cache_retention_interval`` ``retention`` on both."""

    def __init__(self, groups: Any, num_blocks: int, partial: bool, retention: int) -> None:
        from prefixkv.integrations.vllm import KVCacheManager

        super().__init__(groups, num_blocks, partial=partial)
        self.ms = [_vllm(groups, self.h, self.lcm, num_blocks, retention=retention),
                   KVCacheManager(config(*(_spec(b, w) for b, w in groups), num_blocks=num_blocks,
                                         prefix_cache_retention_interval=retention),
                                  max_model_len=256, scheduler_block_size=self.lcm, hash_block_size=self.h)]
        assert all(g.retention == retention for g in self.ms[1].core.groups if g.sparse)


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(MAMBA_LAYOUTS) + [f"partial hits: {k}" for k in PARTIAL])
@pytest.mark.parametrize("segments", [0, 2])
@settings(max_examples=20, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_plugin_retains_mamba_states_as_vllms_manager(layout, segments, small, ops, probe):
    # (small: a pool a little over one longest request; up to the first spare, as
    # test_vllm_mamba_sizes.py)
    partial = layout.startswith("partial hits: ")
    groups = PARTIAL[layout[14:]] if partial else MAMBA_LAYOUTS[layout]
    lcm = reduce(math.lcm, (b for b, _ in groups))
    sides = RetentionSides(groups, sum(-(-MAX_LEN // b) for b, _ in groups) + 4 if small else 400, partial,
                           segments * lcm)
    for op, a, b in ops:
        sides.do(op, a, b)
        sides.compare(probe)
        if any(sides.ms[1].core._index.twins):
            return
