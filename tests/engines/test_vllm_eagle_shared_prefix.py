"""prefixkv's vLLM plug-in beside vLLM 0.33's own ``KVCacheManager`` with EAGLE beside
Mamba, full attention and Mamba at one block larger than the hash block (vLLM's
fine-grained partial hits), and Mamba's shared-prefix checkpoints
(``enable_mamba_shared_prefix_checkpoint``): each request's chunks end where vLLM's own
``Scheduler._mamba_block_aligned_split`` ends them (at the junction
``get_computed_blocks`` reported, when the manager says it records there), and a
sibling's hit afterwards is the same on both managers. The scenes of vLLM's
test_mamba_eagle_resume_checkpoint.py, with token ids prefixkv takes (vLLM's use
negative ones) and no connector-loaded tokens (refused beside EAGLE). Needs vllm installed."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import _request, _spec  # noqa: E402
from .test_vllm_plugin import config  # noqa: E402

PREFIX = list(range(1, 5001))


def _pair(block: int, h: int, shared_prefix: bool = True) -> tuple[Any, ...]:
    """vLLM's manager and prefixkv's over full attention and Mamba at ``block``, hash
    block ``h``, with EAGLE."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager

    init_none_hash(sha256)
    c = config(_spec(block, None), _spec(block, "mamba"), num_blocks=2048)
    return tuple(make(c, max_model_len=1 << 16, scheduler_block_size=block, hash_block_size=h, use_eagle=True,
                      enable_mamba_shared_prefix_checkpoint=shared_prefix)
                 for make in (VllmManager, KVCacheManager))


def _split(m: Any, block: int, h: int) -> Any:
    """``self`` for vLLM's ``Scheduler._mamba_block_aligned_split`` over manager ``m``
    (its gates as ``Scheduler.__init__`` derives them)."""
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block), scheduler_config=SimpleNamespace(
            long_prefill_token_threshold=0), max_num_scheduled_tokens=1 << 20, use_eagle=True,
        use_eagle_block_drop=True, num_hash_lookahead_tokens=0, hash_block_size=h,
        mamba_has_prefill_checkpoint_blocks=False, mamba_partial_cache_hit=True,
        mamba_shared_prefix_checkpoint=m.mamba_shared_prefix_checkpoint)


def _prefill(m: Any, block: int, h: int, rid: str, tokens: list[int]) -> tuple[int, int, list[int]]:
    """``tokens`` admitted and computed in the chunks vLLM's scheduler cuts, then freed:
    the hit, the junction and the chunk ends."""
    from vllm.v1.core.sched.scheduler import Scheduler

    stub, r = _split(m, block, h), _request(rid, tokens, h)
    blocks, hit, r.shared_prefix_boundary = m.get_computed_blocks(r)
    ends, first = [], True
    while r.num_computed_tokens + (hit if first else 0) < r.num_tokens:
        start = r.num_computed_tokens + (hit if first else 0)
        n = Scheduler._mamba_block_aligned_split(stub, r, r.num_tokens - start, hit if first else 0, 0)
        assert n > 0
        m.new_step_starts()
        assert m.allocate_slots(r, n, hit if first else 0, blocks if first else None) is not None
        r.num_computed_tokens = start + n
        ends.append(r.num_computed_tokens)
        _, held = m.take_kv_cache_block_copies()
        m.block_pool.free_blocks(held)
        first = False
    junction = r.shared_prefix_boundary
    m.free(r)
    m.new_step_starts()
    return hit, junction, ends


def _hit(m: Any, h: int, tokens: list[int]) -> int:
    return int(m.get_computed_blocks(_request("sibling", tokens, h))[1])


def test_mamba_is_checkpointed_where_a_sibling_resumes_below_the_block_grid():
    # vLLM's test_sibling_resumes_below_the_block_grid_when_the_prefix_ends_early: 24
    # shared tokens then each request's own 16, blocks of 16, hash block 4. The first
    # follower's full attention matches block 0 (16), EAGLE drops a hash block: junction
    # 12, where its chunk ends and Mamba's state is recorded; the next sibling resumes at
    # 12. Without the checkpoints it resumes at 0. Both managers alike.
    for shared_prefix, want in ((True, 12), (False, 0)):
        got = []
        for m in _pair(16, 4, shared_prefix):
            owner = _prefill(m, 16, 4, "owner", PREFIX[:24] + [9001] * 16)
            follower = _prefill(m, 16, 4, "follower", PREFIX[:24] + [9002] * 16)
            got.append((owner, follower, _hit(m, 4, PREFIX[:24] + [9003] * 16)))
        assert got[0] == got[1]
        assert got[0][1][1] == 12 and got[0][2] == want, got[0]
        assert (12 in got[0][1][2]) == shared_prefix


@pytest.mark.parametrize("block", [16, 128, 512])
@pytest.mark.parametrize("h", [4, 32])
def test_sibling_hits_with_shared_prefix_checkpoints_are_vllms(block, h):
    # vLLM's sweep (test_scheduler_never_stops_where_the_manager_refuses), its producer
    # computed here instead of loaded: prompts of several lengths, a consumer sharing
    # their hash blocks then a suffix, a sibling after it; hits, junctions and chunk
    # ends the same on both managers, and the sibling never below the junction.
    if h >= block:
        return
    for n in (2 * block - h, 3 * block + h + 1, 4 * block - 1):
        shared = n // h * h
        got = []
        for m in _pair(block, h):
            producer = _prefill(m, block, h, "producer", PREFIX[:n])
            consumer = _prefill(m, block, h, "consumer", PREFIX[:shared] + [9001] * (block + 3))
            got.append((producer, consumer, _hit(m, h, PREFIX[:shared] + [9002] * (block + 3))))
        assert got[0] == got[1], (n, got)
        junction = got[0][1][1]
        assert not junction or got[0][2] >= junction, (n, got[0])


def test_the_prompt_drops_one_hash_block_for_a_sibling():
    # vLLM's test_mamba_prefix_cache_drops_hash_block: a prompt of 1600, blocks of 1024,
    # hash block 64; a sibling sharing it resumes at 1600 - 64 (Mamba's entry there)
    got = []
    for m in _pair(1024, 64):
        _prefill(m, 1024, 64, "a", PREFIX[:1600])
        got.append(_hit(m, 64, PREFIX[:1600] + [9001] * 500))
    assert got == [1536, 1536]
