"""A sliding window's ``extra_retained_tokens`` (vLLM 0.33's SlidingWindowSpec: the
window's trailing edge extended for multi-module speculative decoding, whose drafter
re-prefills the last tokens and reads that many tokens below the window). vLLM keeps
those blocks until the window passes them (``get_num_skipped_tokens``); a manager that
releases them first hands vLLM's worker a block that may hold another request's KV by
then. prefixkv's plug-in and vLLM's own manager, side by side: the same blocks released
at every step. Needs vllm installed."""

from __future__ import annotations

import os
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_plugin import full  # noqa: E402
from .test_vllm_reference import BS, MAX_LEN, NULL, _managers, _request  # noqa: E402


def _window(tokens: int, retained: int) -> Any:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32,
                             sliding_window=tokens, extra_retained_tokens=retained)


def _released(side: Any, rid: str) -> list[list[int]]:
    return [[j for j, b in enumerate(ids) if b == NULL] for ids in side.m.get_block_ids(rid)]


@pytest.mark.parametrize("retained", [0, 1, 3, 5, 9])
@pytest.mark.parametrize("window", [3, 8])
def test_blocks_below_the_window_stay_while_vllm_retains_them(window, retained):
    sides = _managers(2 * MAX_LEN // BS + 4, (full(BS), _window(window, retained)))
    reqs = [_request("r0", list(range(21)), None) for _ in sides]
    for s, r in zip(sides, reqs, strict=True):
        blocks, hit, _ = s.m.get_computed_blocks(r)
        assert s.m.allocate_slots(r, r.num_tokens, hit, blocks) is not None
        r.num_computed_tokens = r.num_tokens
        r.append_output_token_ids(7)
    assert _released(sides[0], "r0") == _released(sides[1], "r0")
    while reqs[0].num_tokens < MAX_LEN - 1:  # decode: one token a step
        for s, r in zip(sides, reqs, strict=True):
            assert s.m.allocate_slots(r, 1) is not None
            r.num_computed_tokens += 1
            r.append_output_token_ids(7)
        assert _released(sides[0], "r0") == _released(sides[1], "r0"), reqs[0].num_computed_tokens
        assert sides[0].m.block_pool.get_num_free_blocks() == sides[1].m.block_pool.get_num_free_blocks()
