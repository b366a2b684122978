"""tests/sized_model.py's chunk-end checkpoints (``checkpoint``: vLLM's
``num_prefill_checkpoint_blocks``) driven beside vLLM 0.33's own ``KVCacheManager`` with
Mamba checkpoint blocks, on random streams (tests/engines/test_vllm_sized_model.py's
``Pair``): after every call the same tables, free queue, whole-block keys, hits and
copies. Chunks are cut by vLLM's scheduler itself (``Scheduler._mamba_block_aligned_split``
on the layout's settings), which ends a prompt's last chunk past a Mamba block's end when
the worker checkpoints inside it. Needs vllm installed."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from functools import reduce
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sized_model import SizedModel

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import MAMBA_LAYOUTS, _request, _spec  # noqa: E402
from .test_vllm_plugin import config  # noqa: E402
from .test_vllm_sized_model import OP, PARTIAL, PROMPT, Pair, _drive, _pool  # noqa: E402


def checkpoint_vllm(groups: Any, hash_size: int, num_blocks: int, align: int = 0,
                    retention: int | None = None) -> Any:
    """vLLM's manager over ``groups``, every Mamba group with one checkpoint block
    aligned to ``align`` tokens (default: the hash block), its
    ``prefix_cache_retention_interval`` ``retention``."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    specs = [replace(_spec(b, w), num_prefill_checkpoint_blocks=1,
                     prefill_checkpoint_alignment=align or hash_size)
             if w == "mamba" else _spec(b, w) for b, w in groups]
    lcm = reduce(math.lcm, (b for b, _ in groups))
    return KVCacheManager(config(*specs, num_blocks=num_blocks, prefix_cache_retention_interval=retention),
                          max_model_len=256, scheduler_block_size=lcm,
                          hash_block_size=hash_size, enable_kv_cache_events=True)


def scheduler_chunk(step: int, h: int, start: int, n: int, total: int, prompt: int, align: int = 0) -> int:
    """``n`` tokens from ``start`` (of ``total``, a prompt of ``prompt``) as vLLM's
    scheduler cuts them with Mamba blocks of ``step`` at hash block ``h``, checkpoint
    blocks on, aligned to ``align`` (default ``h``) (its own
    ``_mamba_block_aligned_split``, asked with these settings, the request's junction 0)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    sched = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=step), hash_block_size=h, mamba_partial_cache_hit=True,
        use_eagle_block_drop=False, num_hash_lookahead_tokens=0, mamba_has_prefill_checkpoint_blocks=True,
        mamba_prefill_checkpoint_alignment=align or h, mamba_shared_prefix_checkpoint=False,
        max_num_scheduled_tokens=8192, scheduler_config=SimpleNamespace(long_prefill_token_threshold=0))
    req = SimpleNamespace(num_computed_tokens=start, num_prompt_tokens=prompt, num_tokens=total,
                          shared_prefix_boundary=0)
    return Scheduler._mamba_block_aligned_split(sched, req, n)  # type: ignore[arg-type]


class CheckpointPair(Pair):
    """``Pair`` with partial hits and one checkpoint block per Mamba group on both sides,
    aligned to ``align`` tokens (default: the hash block). Each new request carries the
    junction vLLM's ``get_computed_blocks`` reports (its ``shared_prefix_boundary``, as
    vLLM's scheduler sets it), checked equal to the reference's. The chunks are the
    scheduler's cut without its stop at the junction, so that checkpoints land on it
    too (vLLM's unit tests reach its manager's rule there by calling ``allocate_slots``
    directly). ``retention``: vLLM's ``prefix_cache_retention_interval`` on both."""

    def __init__(self, groups: Any, num_blocks: int, align: int = 0, retention: int | None = None) -> None:
        super().__init__(groups, num_blocks, partial=True)
        self.align, self.retention = align, retention
        self.v = checkpoint_vllm(groups, self.h, num_blocks, align, retention)
        self.model = SizedModel(groups, num_blocks, self.h, self.lcm, partial=True, checkpoint=True,
                                ck_align=align, retention=retention)

    def _chunk(self, start: int, n: int, total: int, prompt: int = 0) -> int:
        """vLLM's scheduler's chunk, but one starting inside a Mamba block ends at its end:
        a checkpointing chunk runs past it, and vLLM then caches the block (holding the
        state at ``start``) as the state at its end, which prefixkv never does
        (``test_a_chunk_past_a_block_end_caches_it_on_vllm_only``)."""
        step = reduce(math.lcm, self.mamba)
        n = max(1, scheduler_chunk(step, self.h, start, n, total, prompt, self.align))
        return min(n, step - start % step) if start % step else n


@pytest.mark.parametrize("layout", list(PARTIAL))
@settings(max_examples=60, deadline=None)
@given(extra=st.integers(0, 6), ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT,
       scale=st.sampled_from([1, 1, 2, 3, 4]))
def test_the_reference_checkpoints_as_vllms_manager(layout, extra, ops, probe, scale):
    # (checkpoints aligned to the hash block, or to ``scale`` of them: vLLM's
    # ``prefill_checkpoint_alignment``, which its tests set to 16 with hash blocks of 2)
    groups = PARTIAL[layout]
    pair = CheckpointPair(groups, _pool(groups, extra), 0 if scale == 1 else scale * reduce(math.gcd, (
        b for b, _ in groups)))
    _drive(pair, ops, probe)


@pytest.mark.parametrize("layout", list(PARTIAL))
@pytest.mark.parametrize("segments", [0, 2, 3])
@settings(max_examples=30, deadline=None)
@given(extra=st.integers(0, 6), ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT,
       scale=st.sampled_from([1, 2]))
def test_the_reference_checkpoints_as_vllms_manager_under_retention(layout, segments, extra, ops, probe,
                                                                     scale):
    # vLLM's prefix_cache_retention_interval beside checkpoints: 0 (its CacheConfig's
    # default: a prompt's last chunk checkpoints only, Mamba keeps the states at the
    # request's marks) and ``segments`` scheduler blocks (one state per segment too)
    groups = PARTIAL[layout]
    lcm = reduce(math.lcm, (b for b, _ in groups))
    pair = CheckpointPair(groups, _pool(groups, extra), 0 if scale == 1 else scale * reduce(math.gcd, (
        b for b, _ in groups)), retention=segments * lcm)
    _drive(pair, ops, probe)


@pytest.mark.parametrize("layout", list(MAMBA_LAYOUTS))
@pytest.mark.parametrize("segments", [0, 2])
@settings(max_examples=30, deadline=None)
@given(extra=st.integers(0, 6), ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_sized_reference_retains_mamba_states_as_vllms_manager(layout, segments, extra, ops, probe):
    # Mamba's sparse retention without partial hits nor checkpoints (a window's too,
    # beside it): its states at the request's marks, rounded down to the lcm, and one
    # per ``segments`` lcm blocks
    groups = MAMBA_LAYOUTS[layout]
    lcm = reduce(math.lcm, (b for b, _ in groups))
    _drive(Pair(groups, _pool(groups, extra), retention=segments * lcm), ops, probe)


def test_a_chunk_past_a_block_end_caches_it_on_vllm_only():
    # full8+mamba16 (hash 8): a's 30 tokens checkpoint at 24 (block 5, entry 0 of its
    # Mamba table, keyed at 24). b hits it (24 tokens, copied on write into block 9) and
    # computes 30 more in one chunk, as vLLM's scheduler cuts it (it checkpoints at 48,
    # block 10): the chunk runs past 32, and vLLM caches b's copy, entry 1, as the state
    # at 32; the worker never writes it (it holds the state at 24). The reference does not.
    pair = CheckpointPair(((8, None), (16, "mamba")), 40)
    a, b = list(range(30)), list(range(24)) + [99] * 30
    pair.do("add", a, None)
    pair.do("free", 0, 0)
    assert scheduler_chunk(16, 8, 24, 30, 54, 54) == 30
    r = _request("b", b, 8)
    blocks, hit, *_ = pair.v.get_computed_blocks(r)
    assert hit == 24 and pair.model.add("b", b, None, 30) == 24
    assert pair.v.allocate_slots(r, 30, hit, blocks) is not None
    assert [list(ids) for ids in pair.v.get_block_ids("b")] == pair.model.reqs["b"].tables
    assert pair.model.reqs["b"].tables[1] == [0, 9, 10, 11] and pair.model.take_copies() == [(5, 9)]
    cached = {blk.block_id: blk.block_hash_num_tokens for blk in pair.v.block_pool.blocks
              if blk.block_hash is not None and blk.block_id in (9, 10)}
    assert cached == {9: 32, 10: 48}  # (vLLM: the copy as the state at 32, the checkpoint at 48)
    assert [(len(k[2]), v) for k, v in pair.model.holders.items() if k[0] == 1] == [(24, [5]), (48, [10])]


def test_an_intermediate_chunk_checkpoint_is_never_cached():
    # full8+mamba16 (hash 8), a prompt of 60: vLLM's scheduler cuts a first chunk of 40
    # at 32 (a Mamba block's end); it checkpoints at 24 into entry 0 (block 5), which is
    # neither the prompt's last boundary (56) nor an entry's end: cached by neither.
    pair = CheckpointPair(((8, None), (16, "mamba")), 40)
    a = list(range(60))
    pair.do("add", a, 40)
    pair.note_events()
    pair.compare(a)
    assert pair.model.reqs["r1"].tables == [[1, 2, 3, 4], [5, 6]]
    assert pair.model.reqs["r1"].checkpoints == {1: (24, 0)}
    pool = pair.v.block_pool
    cached = {b.block_id: b.block_hash_num_tokens for b in pool.blocks if b.block_hash is not None}
    assert cached == {1: 8, 2: 16, 3: 24, 4: 32, 6: 32}


def test_under_zero_retention_only_the_prompts_last_chunk_checkpoints():
    # full8+mamba16 (hash 8), a prompt of 60 cut 40 (at 32) + 28, retention 0: the first
    # chunk would checkpoint at 24 (dense retention: block 5 at entry 0); vLLM passes
    # prefill_end (60) and it takes none; the last chunk checkpoints at 56, the prompt's
    # last hash boundary (entry 2), cached as that prefix; the state at 32 (entry 1)
    # stays uncached (not at a mark: 59 -> 56 -> the block ending at 48)
    pair = CheckpointPair(((8, None), (16, "mamba")), 40, retention=0)
    a = list(range(60))
    pair.do("add", a, 40)
    pair.note_events()
    pair.compare(a)
    assert pair.model.reqs["r1"].tables == [[1, 2, 3, 4], [0, 5]] and not pair.model.reqs["r1"].checkpoints
    pair.do("extend", 0, 28)
    pair.note_events()
    pair.compare(a)
    assert pair.model.reqs["r1"].tables == [[1, 2, 3, 4, 6, 7, 8, 9], [0, 5, 10, 11]]
    assert pair.model.reqs["r1"].checkpoints == {1: (56, 2)}
    pool = pair.v.block_pool
    cached = {b.block_id: b.block_hash_num_tokens for b in pool.blocks if b.block_hash is not None}
    assert cached == {1: 8, 2: 16, 3: 24, 4: 32, 6: 40, 7: 48, 8: 56, 10: 56}


@pytest.mark.parametrize("step", [16, 24, 32])
def test_with_the_schedulers_stop_at_the_junction_no_checkpoint_lands_on_it(step):
    # vLLM's own Scheduler._mamba_block_aligned_split, the request's junction set (as its
    # scheduler sets shared_prefix_boundary from get_computed_blocks), hash blocks of 8:
    # over every chunk start (a hash boundary), junction past it, chunk size and prompt
    # here, the chunk it cuts never checkpoints at the junction (vLLM's checkpoint rule,
    # its own functions): the junction rule of _cache_partial_tail_block is reached by
    # direct allocate_slots calls only (CheckpointPair's chunks skip the stop)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        get_mamba_prefill_checkpoint_position,
        is_mamba_prefill_checkpoint_valid,
    )

    h = 8
    sched = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=step), hash_block_size=h, mamba_partial_cache_hit=True,
        use_eagle_block_drop=False, num_hash_lookahead_tokens=0, mamba_has_prefill_checkpoint_blocks=True,
        mamba_prefill_checkpoint_alignment=h, mamba_shared_prefix_checkpoint=False,
        max_num_scheduled_tokens=8192, scheduler_config=SimpleNamespace(long_prefill_token_threshold=0))
    checked = 0
    for prompt in range(9, 100, 7):
        for start in range(0, prompt, h):
            for junction in range(start + h, prompt, h):
                req = SimpleNamespace(num_computed_tokens=start, num_prompt_tokens=prompt, num_tokens=prompt,
                                      shared_prefix_boundary=junction)
                for n in range(1, prompt - start + 1):
                    end = start + Scheduler._mamba_block_aligned_split(sched, req, n)  # type: ignore[arg-type]
                    c = get_mamba_prefill_checkpoint_position(end, h, False)
                    if is_mamba_prefill_checkpoint_valid(start, end, c, h, step, h):
                        checked += 1
                        assert c != junction, (prompt, start, junction, n, end)
    assert checked > 100
