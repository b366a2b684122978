"""The plug-in's ``coordinator.find_longest_cache_hit_per_group`` (integrations/vllm/
per_group.py) beyond the side-by-side streams that compare it with vLLM's
(test_vllm_fine_full.py ``same_hits_per_group``, test_vllm_lookahead_mamba.py): exact
values on both managers, its input checks and what it refuses, by name. Needs vllm
installed."""

from __future__ import annotations

import os
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import MAMBA_LAYOUTS, _plugin, _request, _vllm  # noqa: E402
from .test_vllm_sized_model import PARTIAL_FULL  # noqa: E402


def _both(groups: Any, h: int, lcm: int) -> list[Any]:
    return [make(groups, h, lcm) for make in (_vllm, _plugin)]


def test_each_group_alone_under_the_cap_as_vllm():
    # full8+mamba16, hash 4: r computes 0..13 of its 14 tokens in one step, so full
    # attention holds block 0 whole, the partial entry at 12 (its prompt's last boundary
    # before its last token) in block 1, and Mamba its state at 12 (the step's end, a
    # partial entry of its block 0). A reader of the same 14 tokens and more, each cap:
    # full attention alone finds 8 (block 0 whole) then 12 (the entry); Mamba the longest
    # state within the cap: 12, or none below it
    groups, h = PARTIAL_FULL["full8+mamba16, hash 4"]
    tokens = list(range(14))
    got = []
    for m in _both(groups, h, 16):
        r = _request("r", tokens, h)
        if hasattr(m, "prepared_prompts"):
            m.prepared_prompts.note(r)
        assert m.allocate_slots(r, 12) is not None
        r.num_computed_tokens = 12
        m.new_step_starts()
        reader = _request("p", tokens + [99, 98, 97], h)
        if hasattr(m, "prepared_prompts"):
            m.prepared_prompts.note(reader)
        seen = []
        for cap in (0, 4, 8, 11, 12, 16, 64):
            blocks, hits = m.coordinator.find_longest_cache_hit_per_group(reader.block_hashes, cap)
            seen.append((cap, hits, [[b.block_id for b in g] for g in blocks]))
        got.append(seen)
    assert got[0] == got[1] == [(0, (0, 0), [[], []]), (4, (0, 0), [[], []]), (8, (8, 0), [[1], []]),
                                (11, (8, 0), [[1], []]), (12, (12, 12), [[1, 2], [3]]),
                                (16, (12, 12), [[1, 2], [3]]), (64, (12, 12), [[1, 2], [3]])], got


def test_what_find_longest_cache_hit_per_group_checks_and_refuses():
    from prefixkv.errors import RequestError
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    groups, h = PARTIAL_FULL["full8+mamba16, hash 4"]
    m = _plugin(groups, h, 16)
    r = _request("r", list(range(14)), h)
    m.prepared_prompts.note(r)
    find = m.coordinator.find_longest_cache_hit_per_group
    assert find([], 64) == (([], []), (0, 0))
    for cap in (-1, 1.5, None):
        with pytest.raises(RequestError, match="max_cache_hit_length"):
            find(r.block_hashes, cap)
    with pytest.raises(RequestError, match="BlockHash"):
        find(["x"], 64)
    with pytest.raises(UnsupportedByPrefixKV, match="no live request"):
        find([b"\x00" * 32], 64)  # (a hash no noted request holds)
    with pytest.raises(UnsupportedByPrefixKV, match="no live request"):
        find(r.block_hashes[1:], 64)  # (not a request's first hashes)
    for layout in ("full16+mamba8", "window20@16+full8+mamba16"):  # (no partial hits; a window)
        groups = MAMBA_LAYOUTS[layout]
        with pytest.raises(UnsupportedByPrefixKV, match="fine-grained partial hits"):
            _plugin(groups, 8, 16 if layout == "full16+mamba8" else 16).coordinator \
                .find_longest_cache_hit_per_group([], 16)
