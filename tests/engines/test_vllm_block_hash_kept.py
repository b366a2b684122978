"""A cached block's ``block_hash`` read after the last request naming it is gone
(block_hash_view.py ``gone``), beside vLLM 0.33's own manager: vLLM's block keeps its
hash until it is evicted (reused, ``evict_blocks``, ``reset_prefix_cache``), whoever
reads it and whenever; prefixkv's answers the same and never raises.

Directed: the last request freed and dropped (finished; preempted, then dropped
waiting; popped), then the block read for the first time; a reset; eviction and
reuse. Random: test_vllm_reference.py's stream (LoRA
adapters, salts, images, remote loads, preemption, evictions, resets) with each finished
request dropped at once, every block of both pools read at random steps and at the
end (a first read of a block often comes after its request is gone): until either pool removes a block,
the two pools' hashes are the same multiset (but a spare prefixkv empties at its free,
the documented free-duplicate difference), and no read raises. Needs vllm."""

from __future__ import annotations

import gc
import os
from collections import Counter
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from . import test_vllm_reference as ref  # noqa: E402
from .test_vllm_block_hash_objects import _admit, _hashes, _noted, _step  # noqa: E402
from .test_vllm_block_hashes import _noting  # noqa: E402
from .test_vllm_hybrid_reference import _window  # noqa: E402
from .test_vllm_plugin import full  # noqa: E402

BS = ref.BS
LAYOUTS = {"full": None, "full and sliding window": (full(BS), _window(2 * BS))}


def _managers(num_blocks: int, specs: tuple[Any, ...] | None = None) -> tuple[ref.Side, ref.Side]:
    """``ref._managers``' pair, a block's hash read once on each (prefixkv keeps a freed
    request's hashes from the first read on: block_hash_view.py)."""
    sides = ref._managers(num_blocks, specs)
    for s in sides:
        assert s.m.block_pool.blocks[-1].block_hash is None  # (a fresh pool's last: empty)
    return sides


def test_before_any_read_a_free_keeps_nothing_and_a_gone_blocks_read_is_refused_by_name():
    # (the free then costs what it did before block_hash_view.gone)
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    sides = ref._managers(24)
    reqs = _run(sides, "a", list(range(2 * BS + 1)))
    blocks = sides[0].m.get_blocks("a").blocks[0]
    _finish(sides, reqs)
    del reqs
    gc.collect()
    with pytest.raises(UnsupportedByPrefixKV, match="before anything read a block's hash"):
        _ = blocks[0].block_hash
    assert blocks[2].block_hash is None  # (the partial last block: never hashed)


def _every_block(m: Any) -> Counter[tuple[bytes | None, int | None]]:
    return Counter(_hashes(m.block_pool.blocks))


def _same_pools(ours: Any, theirs: Any) -> None:
    """Every block's hash, as multisets: prefixkv's are vLLM's, but a spare emptied at its
    free reads None where vLLM keeps its copy hashed (another block holds that key)."""
    mine, vllms = _every_block(ours), _every_block(theirs)
    extra, missing = mine - vllms, vllms - mine
    assert set(extra) <= {(None, None)}, (extra, missing)
    assert all(h is None or vllms[(h, n)] > 1 for h, n in missing), (extra, missing)


def _run(sides: tuple[ref.Side, ref.Side], rid: str, tokens: list[int], decode: int = 0) -> list[Any]:
    reqs = []
    for s in sides:
        r = _noted(s, rid, tokens)
        _admit(s.m, r)
        for t in range(decode):
            _step(s.m, r, 500 + t)
        reqs.append(r)
    return reqs


def _finish(sides: tuple[ref.Side, ref.Side], reqs: list[Any]) -> None:
    from vllm.v1.request import RequestStatus

    for s, r in zip(sides, reqs, strict=True):
        r.status = RequestStatus.FINISHED_STOPPED
        s.m.free(r)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_cached_block_read_first_after_its_request_is_gone_reads_vllms_hash(layout):
    sides = _managers(24, LAYOUTS[layout])
    reqs = _run(sides, "a", list(range(3 * BS + 1)), decode=BS)
    blocks = [[b for g in s.m.get_blocks("a").blocks for b in g] for s in sides]
    _finish(sides, reqs)
    del reqs
    gc.collect()
    mine, vllms = (_hashes(b) for b in blocks)
    assert mine == vllms and sum(h is not None for h, _ in mine) >= 4, (mine, vllms)
    _same_pools(*(s.m for s in sides))


def test_a_preempted_request_dropped_while_waiting_leaves_its_blocks_hashed():
    # (vLLM frees a preempted request's blocks once; aborted while waiting, it frees none)
    from vllm.v1.request import RequestStatus

    sides = _managers(24)
    reqs = _run(sides, "p", list(range(2 * BS + 2)))
    blocks = [s.m.get_blocks("p").blocks[0] for s in sides]
    for s, r in zip(sides, reqs, strict=True):
        s.m.free(r)
        r.status, r.num_computed_tokens = RequestStatus.PREEMPTED, 0
        r.status = RequestStatus.FINISHED_ABORTED
        s.m.free(r)  # (holds none: nothing happens)
    del reqs
    gc.collect()
    assert _hashes(blocks[0]) == _hashes(blocks[1])
    assert [h is None for h, _ in _hashes(blocks[0])] == [False, False, True]


def test_a_reset_then_reuse_reads_none_and_the_new_hash():
    sides = _managers(12)
    reqs = _run(sides, "a", list(range(2 * BS + 1)))
    blocks = [s.m.get_blocks("a").blocks[0] for s in sides]
    _finish(sides, reqs)
    del reqs
    gc.collect()
    assert all(s.m.reset_prefix_cache() for s in sides)
    assert _hashes(blocks[0]) == _hashes(blocks[1]) == [(None, None)] * 3
    held = []  # (the scheduler holds its running requests)
    for i in range(4):  # requests that take every block: the old ones reused, hashed anew
        held.append(_run(sides, f"c{i}", [100 + i] * (2 * BS)))
    _same_pools(*(s.m for s in sides))
    assert Counter(_hashes(blocks[0])) == Counter(_hashes(blocks[1]))


def test_a_block_evicted_and_reused_after_its_request_went_reads_its_new_hash():
    sides = _managers(12)
    reqs = _run(sides, "a", list(range(2 * BS + 1)))
    _finish(sides, reqs)
    del reqs
    gc.collect()
    held = [_run(sides, f"c{i}", [100 + i] * (BS + 1)) for i in range(4)]  # (evicts some of a's)
    _finish(sides, held[0])
    del held[0]
    gc.collect()
    _same_pools(*(s.m for s in sides))


def test_a_block_freed_by_a_popped_request_keeps_its_hash_after_the_request_goes():
    # (pop_blocks_for_free: the blocks handed back later with block_pool.free_blocks)
    sides = _managers(12)
    reqs = _run(sides, "a", list(range(2 * BS + 1)))
    popped = [s.m.pop_blocks_for_free(r) for s, r in zip(sides, reqs, strict=True)]
    del reqs
    gc.collect()
    for s, blocks in zip(sides, popped, strict=True):
        s.m.block_pool.free_blocks(reversed(blocks))
    assert _hashes(popped[0]) == _hashes(popped[1])
    _same_pools(*(s.m for s in sides))


def _drop_finished(s: ref.Side) -> None:
    for slot in [q for q, r in s.reqs.items() if r.is_finished()]:
        del s.reqs[slot]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@settings(max_examples=25, deadline=None)
@given(num_blocks=st.integers(ref.MAX_LEN // BS + 1, 30),
       ops=st.lists(st.tuples(ref.OP, st.sampled_from([False] * 5 + [True])), min_size=8, max_size=30))
def test_every_blocks_hash_is_vllms_with_finished_requests_dropped(layout, num_blocks, ops):
    specs = LAYOUTS[layout]
    sides = _managers(num_blocks if specs is None else 2 * num_blocks, specs)
    with mock.patch.object(ref, "_request", _noting(sides[0].m)):
        for serial, ((op, slot, k, prompt, more), look) in enumerate(ops):
            look = look or serial == len(ops) - 1  # (and at the end: blocks never read before)
            strict = not (sides[0].evicted or sides[1].evicted)
            ref._do(sides, op, slot, k, prompt, more, serial, strict)
            for s in sides:
                s.note_events()
                _drop_finished(s)
            if not look:
                continue
            gc.collect()  # (the dropped requests go)
            if sides[0].evicted or sides[1].evicted or sides[0].diverged:
                _every_block(sides[0].m)  # (each pool evicted its own: no read raises)
            else:
                _same_pools(sides[0].m, sides[1].m)


def test_reading_each_steps_new_block_costs_the_same_on_long_requests():
    # (a connector asking each step's new blocks: each live request's blocks are kept from
    # where its last pass stopped, not walked again from its start; beside a window the
    # hybrid manager's get_block_ids, which the pass reads, is O(blocks) itself)
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.request import RequestStatus

    from prefixkv.bench.opcodes import count_opcodes
    from prefixkv.integrations.vllm import KVCacheManager as Ours

    from .test_vllm_plugin import config

    init_none_hash(sha256)

    def cost(blocks: int) -> int:
        specs = (full(BS),)
        m = Ours(config(*specs, num_blocks=len(specs) * 4 * (blocks + 4)), max_model_len=blocks * BS + 4 * BS,
                 scheduler_block_size=BS, hash_block_size=BS)
        reqs = []
        for i in range(4):
            r = ref._request(f"r{i}", [(i * 997 + t * 31) % 1000 for t in range(blocks * BS)], None)
            m.prepared_prompts.note(r)
            assert m.allocate_slots(r, blocks * BS) is not None
            r.status, r.num_computed_tokens = RequestStatus.RUNNING, blocks * BS
            reqs.append(r)
        assert m.get_blocks("r0").blocks[0][0].block_hash is not None  # (the first pass)
        for r in reqs:  # (a step: each request fills one block more)
            for _ in range(BS):
                r.append_output_token_ids(7)
                assert m.allocate_slots(r, 1) is not None
                r.num_computed_tokens += 1
        new = m.get_blocks("r3").blocks[0][blocks]
        gc.disable()  # (a collection's callbacks would be counted)
        try:
            return count_opcodes(lambda: new.block_hash)
        finally:
            gc.enable()

    assert cost(64) == cost(8)
