"""Blocks without content freed together are reused in vLLM 0.33's order: its
``KVCacheManager.free`` hands ``BlockPool.free_blocks`` a request's blocks tail first, and
``free_blocks`` puts those with no hash at the front of its free queue in that order, so
the tail is taken first. Before, prefixkv reused them head first (a 9-token prompt with 8
lookahead tokens: [4, 5, 6] where vLLM takes [6, 5, 4]). prefixkv's plug-in and vLLM's own
manager run the same requests; the free orders and the next request's blocks are the same
ids. Needs vllm installed."""

from __future__ import annotations

import os

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_hybrid_reference import _window  # noqa: E402
from .test_vllm_plugin import full  # noqa: E402
from .test_vllm_reference import BS, Side, _free_order, _managers, _request  # noqa: E402


def _admit(s: Side, rid: str, tokens: list[int], lookahead: int) -> list[int]:
    """Admit and compute a whole prompt in one step with ``lookahead`` slots beyond it
    (speculative tokens: blocks that never receive content); its block ids, group by
    group."""
    from vllm.v1.request import RequestStatus

    r = _request(rid, tokens, None)
    blocks, hit, _ = s.m.get_computed_blocks(r)
    assert s.m.allocate_slots(r, len(tokens) - hit, hit, blocks,
                              num_lookahead_tokens=lookahead) is not None
    r.status, r.num_computed_tokens = RequestStatus.RUNNING, len(tokens)
    s.reqs[rid] = r
    return [i for ids in s.m.get_block_ids(rid) for i in ids]


def _free(s: Side, rid: str) -> None:
    from vllm.v1.request import RequestStatus

    r = s.reqs.pop(rid)
    r.status = RequestStatus.FINISHED_STOPPED
    s.m.free(r)


@pytest.mark.parametrize("layout", ["full", "full and sliding window"])
@pytest.mark.parametrize("lookahead", [0, 4, 8])
@pytest.mark.parametrize("prompt", [8, 9, 13])
def test_blocks_freed_without_content_are_reused_tail_first(prompt, lookahead, layout):
    """(A hybrid request: vLLM frees group by group, each group's blocks put at the
    front in turn: the last group's are reused first.)"""
    sides = _managers(16) if layout == "full" else _managers(32, (full(BS), _window(2 * BS)))
    for s in sides:
        _admit(s, "a", list(range(prompt)), lookahead)
        _admit(s, "b", [90] * 5, lookahead)
        _free(s, "a")
        _free(s, "b")
    orders = [_free_order(s) for s in sides]
    # the blocks without content, reused first; the cached ones follow in LRU order,
    # which for a hybrid request differs by design (groups/free_order.py)
    queue = sides[1].m.block_pool.free_block_queue.get_all_free_blocks()
    empty = sum(b.block_hash is None for b in queue)
    assert orders[0][:empty] == orders[1][:empty]
    if layout == "full":
        assert orders[0] == orders[1]
    took = [_admit(s, "c", [70] * 9, 0) for s in sides]
    assert took[0] == took[1]
    sides[0].m.core.check_invariants()


def test_the_case_that_differed():
    """12 blocks, a 9-token prompt, 8 lookahead tokens: three blocks never filled."""
    sides = _managers(12)
    for s in sides:
        _admit(s, "a", list(range(9)), 8)
        _free(s, "a")
    ours, theirs = (_free_order(s)[:3] for s in sides)
    assert ours == theirs == sorted(theirs, reverse=True)
