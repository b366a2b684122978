"""prefixkv.integrations.vllm on its own: what it refuses (each refusal names the thing),
and the calls vLLM's own tests reach only through the scheduler (deferred frees, a
waiting request with computed tokens, events, stats). Needs vllm installed
(``make install-vllm``; ``make test`` installs it). vLLM's modules, and prefixkv's
integration that imports them, are imported by the tests and helpers that use them
(``skip_module_without_vllm`` says why)."""

from __future__ import annotations

import os
import pathlib
import runpy
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pytest

from prefixkv import ConfigError, RequestError

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's own CPU platform (see vllm_cpu.py)
skip_module_without_vllm()
torch = pytest.importorskip("torch")

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
    from vllm.v1.request import Request

    from prefixkv.integrations.vllm import KVCacheManager

BS = 16


def full(bs: int = BS) -> FullAttentionSpec:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)


def window(tokens: int = 32) -> SlidingWindowSpec:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32,
                             sliding_window=tokens)


def mamba() -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=BS, shapes=((2, 4),), dtypes=(torch.float32,))


def cross_attention() -> Any:
    from vllm.v1.kv_cache_interface import CrossAttentionSpec

    return CrossAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)


def config(*specs, num_blocks: int = 11, **kw) -> KVCacheConfig:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)],
                         **kw)


def manager(*specs, **kw) -> KVCacheManager:
    from prefixkv.integrations.vllm import KVCacheManager

    specs = specs or (full(),)
    return KVCacheManager(config(*specs), max_model_len=8192, scheduler_block_size=BS,
                          hash_block_size=BS, **kw)


def request(rid: str, tokens: list[int]) -> Request:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=4)
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=params, pooling_params=None)


@pytest.mark.parametrize(("specs", "kw", "named"), [
    ((full, lambda: replace(mamba(), mamba_cache_mode="all")), {}, "mamba_cache_mode='align'"),
    ((cross_attention,), {}, "cross-attention"),
    ((full, lambda: full(32)), {}, "different block sizes"),
    ((full,), {"dcp_world_size": 2}, "context parallelism"),
    ((full, window, lambda: window(64)), {"use_eagle": True}, "EAGLE"),
    ((full, window), {"num_hash_lookahead_tokens": 2}, "lookahead hashing"),  # (beside a window)
])
def test_what_prefixkv_does_not_offer_is_refused_by_name(specs, kw, named):
    from prefixkv.integrations.vllm import UnsupportedByPrefixKV

    with pytest.raises(UnsupportedByPrefixKV, match=named) as info:
        manager(*(make() for make in specs), **kw)
    assert isinstance(info.value, ConfigError)


@pytest.mark.parametrize("specs", [(full,), (full, window)], ids=["full", "full+window"])
def test_the_mamba_shared_prefix_checkpoint_flag_is_taken_and_does_nothing_as_in_vllm(specs):
    """vLLM 0.33's manager acts on ``enable_mamba_shared_prefix_checkpoint`` only with
    partial-block hits (a Mamba group whose block is larger than the hash block:
    ``coordinator.enable_partial_hash_hits``), which prefixkv refuses; otherwise it takes
    the flag and does nothing. The plug-in refused the flag on any layout, so vLLM's own
    tests/v1/streaming_input/test_scheduler_streaming.py::TestStreamingScheduler (whose
    ``cache_config`` is a MagicMock: every attribute truthy) built no scheduler on
    prefixkv: all 10 of its tests failed there."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs

    theirs = Theirs(config(*(make() for make in specs)), max_model_len=8192, scheduler_block_size=BS,
                    hash_block_size=BS, enable_caching=True, enable_mamba_shared_prefix_checkpoint=True)
    ours = manager(*(make() for make in specs), enable_mamba_shared_prefix_checkpoint=True)
    assert theirs.mamba_shared_prefix_checkpoint is ours.mamba_shared_prefix_checkpoint is False


def test_hisparse_and_other_hash_block_sizes_are_refused():
    from prefixkv.integrations.vllm import KVCacheManager, UnsupportedByPrefixKV

    with pytest.raises(UnsupportedByPrefixKV, match=r"HiSparse .* this layout \(\['FullAttentionSpec'\]\)"):
        KVCacheManager(config(full(), hisparse_host_num_blocks=8), max_model_len=64,
                       scheduler_block_size=BS, hash_block_size=BS)
    with pytest.raises(UnsupportedByPrefixKV, match="hash 8"):
        KVCacheManager(config(full()), max_model_len=64, scheduler_block_size=BS, hash_block_size=8)


def test_one_full_group_and_hybrid_groups_pick_their_manager():
    from prefixkv.core.manager import KVCacheManager as Core
    from prefixkv.groups import HybridKVCacheManager

    assert type(manager().core) is Core
    assert type(manager(full(), window()).core) is HybridKVCacheManager


def test_results_are_vllms_blocks_with_vllms_ids_and_a_hit_is_reused():
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.metrics.stats import PrefixCacheStats

    m = manager(log_stats=True, enable_kv_cache_events=True)
    a = request("a", list(range(40)))
    blocks, hit, boundary = m.get_computed_blocks(a)
    assert (hit, boundary) == (0, 0) and blocks is m.empty_kv_cache_blocks
    new = m.allocate_slots(a, 40, hit, blocks)
    assert isinstance(new, KVCacheBlocks) and new.get_block_ids() == ([1, 2, 3],)
    events = m.take_events()
    assert [type(e) for e in events] == [BlockStored] and len(events[0].block_hashes) == 2
    assert events[0].token_ids == list(range(32)) and events[0].block_size == BS
    a.num_computed_tokens = 40
    b = request("b", list(range(36)))
    blocks, hit, _ = m.get_computed_blocks(b)
    assert hit == 32 and blocks.get_block_ids() == ([1, 2],)
    m.record_prefix_cache_stats(b, hit)
    new = m.allocate_slots(b, 4, hit, blocks)
    assert new.get_block_ids() == ([4],) and m.get_block_ids("b") == ([1, 2, 4],)
    stats = m.make_prefix_cache_stats()
    assert isinstance(stats, PrefixCacheStats) and (stats.queries, stats.hits) == (36, 32)


def test_deferred_free_holds_the_blocks_until_the_pool_takes_them_back():
    m = manager()
    a = request("a", list(range(20)))
    m.allocate_slots(a, 20)
    free_before = m.block_pool.get_num_free_blocks()
    popped = m.pop_blocks_for_free(a)
    assert [b.block_id for b in popped] == [1, 2]
    assert m.get_block_ids("a") == ([],) and m.block_pool.get_num_free_blocks() == free_before
    m.block_pool.free_blocks(reversed(popped))
    assert m.block_pool.get_num_free_blocks() == free_before + 2
    with pytest.raises(RequestError):
        m.block_pool.free_blocks(popped)  # given back already


def test_a_waiting_request_with_computed_tokens_is_admitted_past_them():
    m = manager()
    r = request("r", list(range(31)))
    r.num_computed_tokens = 30  # its KV was written elsewhere (a disaggregated decode)
    new = m.allocate_slots(r, 1)
    assert new.get_block_ids() == ([1, 2],) and m.num_cached_tokens("r") == 16


def test_delayed_caching_caches_when_the_load_lands():
    m = manager()
    r = request("r", list(range(40)))
    m.allocate_slots(r, 0, num_external_computed_tokens=32, delay_cache_blocks=True)
    assert m.num_cached_tokens("r") == 0
    r.num_computed_tokens = 32
    m.cache_blocks(r, 32)
    assert m.num_cached_tokens("r") == 32


def test_encoder_tokens_are_refused():
    from prefixkv.integrations.vllm import UnsupportedByPrefixKV

    with pytest.raises(UnsupportedByPrefixKV, match="encoder"):
        manager().allocate_slots(request("r", [1, 2, 3]), 3, num_encoder_tokens=4)


def test_a_request_the_pool_can_never_hold_gets_vllms_none():
    m = manager()  # 10 usable blocks of 16
    assert m.allocate_slots(request("big", list(range(200))), 200) is None
    assert m.block_pool.get_num_free_blocks() == 10 and m.get_block_ids("big") == ([],)


def test_an_async_load_is_admitted_when_the_whole_prompt_fits():
    # vLLM's full_sequence_must_fit: the prompt's 8 blocks fit the 10 free ones; the
    # load's 64 slots are inside the prompt, not on top of it
    m = manager()
    r = request("r", list(range(128)))
    new = m.allocate_slots(r, 0, num_external_computed_tokens=64, delay_cache_blocks=True,
                           full_sequence_must_fit=True)
    assert new is not None and new.get_block_ids() == ([1, 2, 3, 4],)
    assert m.allocate_slots(request("s", list(range(500, 676))), 0, num_external_computed_tokens=16,
                            delay_cache_blocks=True, full_sequence_must_fit=True) is None  # 11 > 6


def test_a_freed_request_leaves_what_was_cached_findable():
    # vLLM's scheduler counts scheduled tokens as computed when it schedules them; the
    # manager does not second-guess it from a waiting request's num_computed_tokens (as
    # vLLM's own tests free them: test_prefix_caching.py; a running or finished one's:
    # test_vllm_recompute_reference.py)
    m = manager()
    a = request("a", list(range(16)))
    m.allocate_slots(a, 16)
    assert a.num_computed_tokens == 0
    m.free(a)
    blocks, hit, _ = m.get_computed_blocks(request("b", list(range(20))))
    assert hit == 16 and blocks.get_block_ids() == ([1],)


def test_a_hybrid_hit_comes_with_its_blocks_per_group():
    from prefixkv.integrations.vllm import KVCacheManager

    # full attention and a 32-token window: a query at 80 reads 49..80, so of a 5-block
    # hit the window group needs blocks 3 and 4; vLLM's null block stands for 0..2
    m = KVCacheManager(config(full(), window(), num_blocks=21), max_model_len=8192, scheduler_block_size=BS,
                       hash_block_size=BS)
    a = request("a", list(range(80)))
    m.allocate_slots(a, 80)
    full_ids, window_ids = m.get_block_ids("a")
    a.num_computed_tokens = 80
    m.free(a)
    b = request("b", list(range(80)) + [7])
    blocks, hit, _ = m.get_computed_blocks(b)
    assert hit == 80
    assert blocks.get_block_ids() == (full_ids, [0, 0, 0, *window_ids[3:]])
    assert [x.is_null for x in blocks.blocks[1]] == [True] * 3 + [False] * 2
    m.allocate_slots(b, 1, hit, blocks)
    assert [ids[:5] for ids in m.get_block_ids("b")] == list(blocks.get_block_ids())


@pytest.mark.parametrize("live", [False, True])
@pytest.mark.parametrize("arg, bad", [("num_new_tokens", -5), ("num_new_tokens", None),
                                      ("num_new_computed_tokens", -16), ("num_lookahead_tokens", -3),
                                      ("num_external_computed_tokens", -1), ("reserved_blocks", -1),
                                      ("num_lookahead_tokens", 1.5)])
def test_a_bad_count_is_a_request_error_before_any_change(live, arg, bad):
    # before: a negative num_new_tokens admitted the request with one token scheduled,
    # None raised TypeError
    m = manager()
    r = request("r", list(range(40)))
    if live:
        assert m.allocate_slots(r, 40) is not None
        r.num_computed_tokens = 40
    before = (m.get_block_ids("r"), m.block_pool.get_num_free_blocks())
    kw: dict[str, Any] = {"num_new_tokens": 1, arg: bad}
    with pytest.raises(RequestError, match=arg):
        m.allocate_slots(r, **kw)
    assert (m.get_block_ids("r"), m.block_pool.get_num_free_blocks()) == before
    m.core.check_invariants()


@pytest.mark.parametrize("ids", [{"x"}, {1.5}, None])
def test_evicting_what_is_not_block_ids_is_a_request_error(ids):
    m = manager()
    with pytest.raises(RequestError):
        m.evict_blocks(ids)


def test_evicted_blocks_of_a_hybrid_model_are_no_longer_hit():
    # before: AttributeError (the hybrid manager had no uncache_blocks)
    m = manager(full(), window())
    a = request("a", list(range(40)))
    m.allocate_slots(a, 40)
    ids = m.get_block_ids("a")
    m.evict_blocks({*ids[0][1:], *ids[1][1:]})
    m.core.check_invariants()
    assert m.get_computed_blocks(request("b", list(range(40))))[1] == BS


def test_evict_blocks_takes_what_a_request_computed_on_a_hit_of_a_block_computed_on_the_failed_one():
    # b computed block 0 again (a spare of a's) and block 1 on it; c hit b's block 1 and
    # computed block 2 on it; d computed both again (its block 1 a spare of b's, sound).
    # b's block 0 failed to load: before, c's block 2 stayed found (a hit of 48 tokens)
    from prefixkv.integrations.vllm import KVCacheManager

    m = KVCacheManager(config(full(), window(), num_blocks=40), max_model_len=8192,
                       scheduler_block_size=BS, hash_block_size=BS)
    p0, p1, p2 = list(range(BS)), list(range(100, 100 + BS)), list(range(200, 200 + BS))
    assert m.allocate_slots(request("a", p0 + [0]), 17) is not None
    assert m.allocate_slots(request("b", p0 + p1 + [8]), 33) is not None  # no hit asked
    c = request("c", p0 + p1 + p2 + [1])
    blocks, n, _ = m.get_computed_blocks(c)
    assert n == 32 and m.allocate_slots(c, 49 - n, n, blocks) is not None
    assert m.allocate_slots(request("d", p0 + p1 + [5]), 33) is not None  # no hit asked
    b_ids, c_ids = m.get_block_ids("b"), m.get_block_ids("c")
    assert all(cg[1] == bg[1] for bg, cg in zip(b_ids, c_ids, strict=True))
    m.evict_blocks({ids[0] for ids in b_ids})
    m.core.check_invariants()
    assert m.get_computed_blocks(request("e", p0 + p1 + p2 + [0]))[1] == 32  # before: 48


def test_scheduler_example_schedules_every_step_as_vllm_does(capsys):
    """examples/vllm_scheduler.py: vLLM's scheduler class picked from
    ``SchedulerConfig.scheduler_cls`` runs on prefixkv's manager, hits the shared prompt
    and schedules the same tokens in every step as vLLM's own (it asserts both)."""
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "vllm_scheduler.py"
    runpy.run_path(str(path))["main"]()
    out = capsys.readouterr().out
    assert "step 4: b computed 32, scheduled 5" in out
    assert "b found 32 tokens cached; every step equals vLLM's own scheduler's" in out


def test_a_decode_steps_slots_cost_no_pass_over_the_requests_blocks():
    """``allocate_slots`` for one more token of a live request counts its blocks
    (``num_blocks_held``) instead of listing their ids: O(1) whatever its length."""
    m = manager()
    tokens = list(range(100, 100 + 8 * BS + 3))
    r = request("a", tokens)
    blocks, hit, _ = m.get_computed_blocks(r)
    assert m.allocate_slots(r, len(tokens) - hit, hit, blocks) is not None
    r.num_computed_tokens = len(tokens)
    core = m.core
    held = core.num_blocks_held(m.key_of("a"))
    assert held == len(core.get_block_ids(m.key_of("a"))) == 9

    def listed(key):
        raise AssertionError("a decode step listed the request's block ids")
    core.get_block_ids = listed
    for _ in range(BS):  # (one of them opens a block)
        r.append_output_token_ids(7)
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    del core.get_block_ids
    assert core.num_blocks_held(m.key_of("a")) == len(core.get_block_ids(m.key_of("a"))) == 10
