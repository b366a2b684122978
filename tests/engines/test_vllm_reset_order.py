"""``reset_prefix_cache`` keeps the free order, block for block as vLLM 0.33's own
``KVCacheManager`` does (its ``BlockPool.reset_prefix_cache`` drops the hashes and
leaves its free queue as it was): prefixkv's plug-in and vLLM's manager run one
sequence of requests, and their free orders before the reset, after it, and the blocks
the next request takes are the same ids. (Before reset-r18, prefixkv's reset put every
block back in id order, so the next request took the blocks freed last, whose KV an
offload connector's store job may still read: vLLM's offloading connector test
``test_request_finished_mixed_full_attn_and_sliding_window``.) Needs vllm installed."""

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


def _admit(s: Side, rid: str, tokens: list[int]) -> tuple[int, tuple[list[int], ...]]:
    """Admit and compute a whole prompt in one step, as vLLM's scheduler does; its hit
    and block ids per group."""
    from vllm.v1.request import RequestStatus

    r = _request(rid, tokens, None)
    blocks, hit, _ = s.m.get_computed_blocks(r)
    assert s.m.allocate_slots(r, len(tokens) - hit, hit, blocks) is not None
    r.status, r.num_computed_tokens = RequestStatus.RUNNING, len(tokens)
    s.reqs[rid] = r
    return hit, s.m.get_block_ids(rid)


def _free(s: Side, rid: str) -> None:
    from vllm.v1.request import RequestStatus

    r = s.reqs.pop(rid)
    r.status = RequestStatus.FINISHED_STOPPED
    s.m.free(r)


def _run(sides: tuple[Side, Side], forked: bool) -> None:
    """One sequence on both sides: requests freed in an order that leaves empty blocks
    (partial ones, never used ones) and cached ones in an LRU order far from id order;
    ``forked``: one request shares the first's prefix (a hit)."""
    for s in sides:
        _admit(s, "a", list(range(10)))
        if forked:
            assert _admit(s, "b", list(range(6)) + [50] * 7)[0] == BS
        _admit(s, "c", [70] * 5)
        if forked:
            _free(s, "b")
        _free(s, "a")
        assert _admit(s, "d", list(range(4)) + [60] * 3)[0] == BS
        _free(s, "c")
        _free(s, "d")


# (a hybrid layout with a fork: the orders differ before the reset, by design, below)
@pytest.mark.parametrize(("layout", "forked"), [
        ("full", False), ("full", True), ("full and sliding window", False)])
def test_the_free_order_after_a_reset_is_vllms_block_for_block(layout, forked):
    sides = _managers(12) if layout == "full" else _managers(16, (full(BS), _window(2 * BS)))
    _run(sides, forked)
    before = [_free_order(s) for s in sides]
    assert before[0] == before[1]
    assert before[0] != sorted(before[0])  # (a reset in id order would differ)
    assert [s.m.reset_prefix_cache() for s in sides] == [True, True]
    after = [_free_order(s) for s in sides]
    assert after[0] == after[1] == before[0]
    took = [_admit(s, "e", [80] * 9) for s in sides]
    assert took[0] == took[1], took
    sides[0].m.core.check_invariants()


@pytest.mark.parametrize("layout", ["full", "full and sliding window"])
def test_a_reset_keeps_each_managers_own_free_order(layout):
    """Where prefixkv's free order differs from vLLM's by design (a hybrid request's
    blocks no hit can use go first: groups/free_order.py), each keeps its own."""
    sides = _managers(24, (full(BS),) if layout == "full" else (full(BS), _window(2 * BS)))
    _run(sides, True)
    before = [_free_order(s) for s in sides]
    assert [s.m.reset_prefix_cache() for s in sides] == [True, True]
    assert [_free_order(s) for s in sides] == before
    sides[0].m.core.check_invariants()
