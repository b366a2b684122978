"""vLLM's free block queue as its tests walk it (free_links.py): ``fake_free_list_head``,
``fake_free_list_tail`` and each block's ``next_free_block`` / ``prev_free_block``, read
from prefixkv's free order. prefixkv's plug-in and vLLM's own manager run the same
requests side by side (an exact scene, where the lists walked from either end are the same block ids; then
seeded random admissions, growth and frees, where the walk is prefixkv's free order and
as long as vLLM's); a block in use has no links, and writing a link is refused with the
pool unchanged. Needs vllm installed."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_hybrid_reference import _window  # noqa: E402
from .test_vllm_plugin import full  # noqa: E402
from .test_vllm_reference import BS, _managers  # noqa: E402
from .vllm_steps import admit as _admit  # noqa: E402
from .vllm_steps import random_step  # noqa: E402


def _walk(m: Any) -> tuple[list[int], list[int]]:
    """The free list's block ids from the head forward and from the tail backward (the
    ends' own links checked on the way)."""
    q = m.block_pool.free_block_queue
    head, tail = q.fake_free_list_head, q.fake_free_list_tail
    assert head.prev_free_block is None and tail.next_free_block is None
    forward, b = [], head.next_free_block
    while b is not tail:
        forward.append(b.block_id)
        b = b.next_free_block
    backward, b = [], tail.prev_free_block
    while b is not head:
        backward.append(b.block_id)
        b = b.prev_free_block
    return forward, backward


def test_the_walks_of_a_scene_are_vllms():
    """Exact values (11 blocks, 10 usable): a fresh pool, two prompts admitted (one of
    3 full blocks and a partial one, one of 2 blocks), the first freed (its partial
    block first in the queue, its cached blocks at the end, tail first), then the
    second."""
    walks = []
    for m in (s.m for s in _managers(11)):
        steps = [_walk(m)]
        a = _admit(m, "a", list(range(3 * BS + 1)))
        b = _admit(m, "b", [50 + i for i in range(2 * BS)])
        steps.append(_walk(m))
        m.free(a)
        steps.append(_walk(m))
        m.free(b)
        steps.append(_walk(m))
        walks.append(steps)
    assert walks[0] == walks[1]
    fresh, both, one, none = walks[0]
    assert fresh == ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [10, 9, 8, 7, 6, 5, 4, 3, 2, 1])
    assert both == ([7, 8, 9, 10], [10, 9, 8, 7])
    assert one == ([4, 7, 8, 9, 10, 3, 2, 1], [1, 2, 3, 10, 9, 8, 7, 4])
    assert none == ([4, 7, 8, 9, 10, 3, 2, 1, 6, 5], [5, 6, 1, 2, 3, 10, 9, 8, 7, 4])


def test_a_block_in_use_has_no_links_and_links_are_read_only():
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    m = _managers(11)[0].m
    _admit(m, "a", list(range(2 * BS)))
    before = _walk(m)
    for b in m.get_blocks("a").blocks[0]:
        assert b.prev_free_block is None and b.next_free_block is None
    q = m.block_pool.free_block_queue
    free = q.fake_free_list_head.next_free_block
    for obj, name in ((free, "next_free_block"), (free, "prev_free_block"),
                      (q.fake_free_list_head, "next_free_block"), (q.fake_free_list_tail, "prev_free_block")):
        with pytest.raises(UnsupportedByPrefixKV, match=f"{name} = .*prefixkv's pool keeps"):
            setattr(obj, name, q.fake_free_list_tail)
    assert _walk(m) == before
    m.core.check_invariants()


def test_a_dry_pool_links_its_ends_as_vllms():
    """(vLLM's test_prefill ends so: every block taken, head and tail linked.)"""
    for m in (s.m for s in _managers(5)):
        assert _admit(m, "a", list(range(4 * BS))) is not None
        q = m.block_pool.free_block_queue
        assert q.num_free_blocks == 0
        assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail
        assert q.fake_free_list_tail.prev_free_block is q.fake_free_list_head


@pytest.mark.parametrize("layout", ["full", "full and window"])
@pytest.mark.parametrize("seed", range(4))
def test_the_walks_follow_prefixkvs_free_order_through_random_steps(seed, layout):
    """The walk is prefixkv's free order (``get_all_free_blocks``), which is not always
    vLLM's (which of the cached blocks goes first differs: docs/integration.md); as
    many blocks as vLLM's, each linked iff free."""
    rnd = random.Random(seed)
    specs = (full(BS),) if layout == "full" else (full(BS), _window(2 * BS))
    sides = [s.m for s in _managers(24 if layout == "full" else 40, specs)]
    live: dict[str, list[Any]] = {}
    for step in range(40):
        random_step(rnd, sides, live, step)
        walks = [_walk(m) for m in sides]
        assert len(walks[0][0]) == len(walks[1][0]), f"seed {seed}, step {step}"
        ours = sides[0]
        forward, backward = walks[0]
        assert forward == [b.block_id for b in ours.block_pool.free_block_queue.get_all_free_blocks()]
        assert backward == forward[::-1]
        free = set(forward)
        for b in ours.block_pool.blocks[1:]:  # (a block is linked iff no request holds it)
            assert (b.block_id in free) == (b.ref_cnt == 0), (b.block_id, b.ref_cnt)
            assert (b.next_free_block is None) == (b.block_id not in free)
        ours.core.check_invariants()
