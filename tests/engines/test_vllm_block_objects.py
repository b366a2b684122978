"""The plug-in's ``KVCacheBlock`` objects beside vLLM 0.33's own (block_objects.py):
``ref_cnt`` of every block object read from prefixkv's pool, equal to vLLM's.

``compare_counts``, which test_vllm_block_hashes.py's random stream (one full-attention
group; full attention beside a sliding window) asks after every call: each live
request's blocks, group by group and block by block, have vLLM's counts (the null block
left out: vLLM never counts it); until the two pools' contents part (an eviction, then
hits may differ), the pool's blocks show the same counts, as a multiset; every block
the free queue lists reads 0. Here: the counts of blocks ``pop_blocks_for_free`` handed
out, until ``free_blocks`` takes them back, and a write of ``ref_cnt``, refused. Needs
vllm."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from . import test_vllm_reference as ref  # noqa: E402

BS = ref.BS


def _counts(m: Any, request_id: str) -> list[list[int]]:
    return [[b.ref_cnt for b in g if not b.is_null] for g in m.get_blocks(request_id).blocks]


def compare_counts(sides: tuple[ref.Side, ref.Side]) -> None:
    """The counts of both sides' block objects agree (the module's docstring says which)."""
    ours, theirs = sides
    for slot in ours.live & theirs.live:
        r, v = ours.reqs[slot], theirs.reqs[slot]
        if list(r.all_token_ids) == list(v.all_token_ids):
            assert _counts(ours.m, r.request_id) == _counts(theirs.m, v.request_id), slot
    if not (ours.evicted or theirs.evicted or ours.diverged):
        mine, vllms = (Counter(b.ref_cnt for b in s.m.block_pool.blocks if not b.is_null) for s in sides)
        assert mine == vllms
    assert all(b.ref_cnt == 0 for b in ours.m.block_pool.free_block_queue.get_all_free_blocks())


def test_popped_blocks_count_until_freed_and_a_count_is_not_written():
    from vllm.v1.request import RequestStatus

    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    seen = []
    for s in ref._managers(12):
        reqs = [ref._request(rid, list(range(3 * BS + 1)), None) for rid in ("a", "b")]
        for r in reqs:
            blocks, hit, _ = s.m.get_computed_blocks(r)
            assert s.m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
            r.status, r.num_computed_tokens = RequestStatus.RUNNING, r.num_tokens
            s.m.cache_blocks(r, r.num_tokens)
        popped = s.m.pop_blocks_for_free(reqs[0])
        counts = [_counts(s.m, "b"), [b.ref_cnt for b in popped]]
        s.m.free(reqs[1])
        counts.append([b.ref_cnt for b in popped])
        s.m.block_pool.free_blocks(reversed(popped))
        counts.append([b.ref_cnt for b in popped])
        seen.append(counts)
    assert seen[0] == seen[1] == [[[2, 2, 2, 1]], [2, 2, 2, 1], [1, 1, 1, 1], [0, 0, 0, 0]], seen
    block = ref._managers(12)[0].m.block_pool.blocks[1]
    with pytest.raises(UnsupportedByPrefixKV, match="ref_cnt"):
        block.ref_cnt += 1
    assert block.ref_cnt == 0
