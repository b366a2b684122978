"""The vLLM-shaped adapter: the calls of a vLLM v1 scheduler, and one test per semantic
difference listed in the module docstring of prefixkv.adapters.vllm."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from prefixkv import ExtraKeys, KVCacheManager, PrefixKVError, RequestError
from prefixkv.adapters.vllm import (
    BlockIds, ComputedBlocks, VllmAllBlocksCleared, VllmBlockRemoved, VllmBlockStored,
    VllmKVCacheManager, extra_keys_of,
)

BS = 16


@dataclass
class Lora:
    lora_name: str


@dataclass
class Pos:
    offset: int
    length: int


@dataclass
class MM:
    identifier: str
    mm_position: Pos


@dataclass
class Req:
    """The fields of vLLM's Request that the adapter reads."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    cache_salt: str | None = None
    lora_request: Lora | None = None
    mm_features: list[MM] = field(default_factory=list)


def make(num_blocks=16, **kw):
    mgr = KVCacheManager(num_blocks, BS, enable_events=True, **kw)
    return VllmKVCacheManager(mgr), mgr


def admit(kv, req, num_new=None):
    blocks, hit = kv.get_computed_blocks(req)
    n = len(req.all_token_ids) - hit if num_new is None else num_new
    new = kv.allocate_slots(req, n, hit, blocks)
    if new is not None:
        req.num_computed_tokens = hit + n  # what vLLM's scheduler does after the step
    return new, hit


def test_admission_returns_only_new_blocks_and_ids_in_vllm_shape():
    kv, mgr = make()
    a = Req("a", list(range(1, 41)))
    new, hit = admit(kv, a)
    assert hit == 0 and new == BlockIds((0, 1, 2)) and new.get_block_ids() == ([0, 1, 2],)
    b = Req("b", list(range(1, 33)) + [99] * 8)
    blocks, hit = kv.get_computed_blocks(b)
    assert (blocks, hit) == (ComputedBlocks(32), 32) and blocks.get_block_ids() == ([],)
    new = kv.allocate_slots(b, 8, hit, blocks)
    assert new == BlockIds((3,))
    assert kv.get_block_ids("b") == ([0, 1, 3],)
    mgr.check_invariants()


def test_decode_appends_sampled_tokens_and_caches_generated_blocks():
    kv, mgr = make()
    a = Req("a", list(range(1, 31)))
    admit(kv, a)
    for t in range(5):  # sampled tokens join all_token_ids before the next allocate_slots
        a.all_token_ids.append(200 + t)
        new = kv.allocate_slots(a, 1)
        assert new is not None
        a.num_computed_tokens += 1
        mgr.check_invariants()
    assert kv.get_block_ids("a") == ([0, 1, 2],)
    b = Req("b", a.all_token_ids[:32] + [7])
    assert kv.get_computed_blocks(b)[1] == 32  # the block completed by decoding is cached


def test_chunked_prefill_extends():
    kv, mgr = make()
    a = Req("a", list(range(1, 51)))
    new, _ = admit(kv, a, num_new=20)
    assert new.block_ids == (0, 1) and mgr.num_scheduled_tokens("a") == 20
    assert kv.allocate_slots(a, 30) == BlockIds((2, 3))
    assert kv.allocate_slots(a, 30) == kv.empty_kv_cache_blocks  # already has the slots
    mgr.check_invariants()


def test_difference_1_hit_changed_between_lookup_and_allocate_raises_and_releases():
    kv, mgr = make()
    a = Req("a", list(range(1, 41)))
    admit(kv, a)
    kv.free(a)
    b = Req("b", list(range(1, 41)))
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 32
    assert kv.reset_prefix_cache()
    with pytest.raises(RequestError, match="not the 32"):
        kv.allocate_slots(b, 8, hit, blocks)
    assert mgr.num_free_blocks == 16 and kv.get_block_ids("b") == ([],)
    mgr.check_invariants()


def test_difference_2_block_zero_is_real_and_usage_counts_every_block():
    kv, _ = make(4)
    new, _ = admit(kv, Req("a", [1, 2, 3]))
    assert new.block_ids == (0,) and kv.usage == 0.25


def test_difference_3_stats_count_admissions_and_split_preempted():
    kv, mgr = make(3)
    a = Req("a", list(range(1, 41)))
    admit(kv, a)
    assert admit(kv, Req("big", list(range(1, 60))))[0] is None  # short: not counted
    kv.free(a)  # preempted: vLLM frees it and resets num_computed_tokens
    a.num_computed_tokens, a.num_preemptions = 0, 1
    admit(kv, a)
    s = kv.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (1, 40, 0)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 40, 32)
    assert not s.reset
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.make_prefix_cache_stats().reset and not kv.make_prefix_cache_stats().reset
    assert VllmKVCacheManager(mgr, log_stats=False).make_prefix_cache_stats() is None


def test_difference_4_events_in_vllm_shape():
    kv, mgr = make(4)
    a = Req("a", list(range(1, 50)), lora_request=Lora("ad"))
    admit(kv, a)
    (stored,) = kv.take_events()
    assert isinstance(stored, VllmBlockStored) and len(stored.block_hashes) == 3
    assert stored.parent_block_hash is None and stored.token_ids == list(range(1, 49))
    assert (stored.block_size, stored.lora_name, stored.lora_id, stored.medium) == (16, "ad", None, "GPU")
    kv.free(a)
    admit(kv, Req("b", [300 + i for i in range(40)]))  # 3 blocks: evicts cached ones
    events = kv.take_events()
    removed = [e for e in events if isinstance(e, VllmBlockRemoved)]
    assert removed and all(h in stored.block_hashes for e in removed for h in e.block_hashes)
    kv.free(Req("b", []))
    assert kv.reset_prefix_cache()
    assert isinstance(kv.take_events()[-1], VllmAllBlocksCleared)


def test_difference_5_free_and_get_block_ids_accept_unknown_ids():
    kv, mgr = make()
    kv.free(Req("never", [1]))
    assert kv.get_block_ids("never") == ([],)
    with pytest.raises(RequestError):
        mgr.free("never")


def test_difference_6_unsupported_calls_raise_before_any_change():
    kv, mgr = make()
    a = Req("a", list(range(1, 41)))
    for kw in ({"num_lookahead_tokens": 2}, {"num_external_computed_tokens": 16},
               {"num_encoder_tokens": 4}, {"delay_cache_blocks": True}):
        with pytest.raises(PrefixKVError, match="not supported"):
            kv.allocate_slots(a, 40, **kw)
    with pytest.raises(PrefixKVError, match="computed tokens"):
        kv.allocate_slots(Req("c", [1, 2], num_computed_tokens=1), 1)
    admit(kv, a, num_new=10)
    a.all_token_ids.append(5)
    with pytest.raises(PrefixKVError, match="unscheduled"):
        kv.allocate_slots(a, 31)
    assert mgr.num_scheduled_tokens("a") == 10
    mgr.check_invariants()


def test_shortage_returns_none_and_changes_nothing():
    kv, mgr = make(2)
    a = Req("a", list(range(1, 33)))
    admit(kv, a)
    a.all_token_ids.append(9)
    assert kv.allocate_slots(a, 1) is None
    assert mgr.num_scheduled_tokens("a") == 32 and kv.get_block_ids("a") == ([0, 1],)
    assert kv.allocate_slots(Req("b", [1]), 1) is None
    mgr.check_invariants()


def test_extra_keys_from_salt_lora_and_multimodal():
    assert extra_keys_of(Req("a", [1])) is None
    r = Req("a", [1] * 20, cache_salt="t1", lora_request=Lora("x"), mm_features=[MM("img", Pos(2, 4))])
    keys = extra_keys_of(r)
    assert (keys.lora, keys.cache_salt, keys.mm[0].offset, keys.mm[0].length) == ("x", "t1", 2, 4)
    given = ExtraKeys(cache_salt="s")
    r.extra_keys = given
    assert extra_keys_of(r) is given
    kv, _ = make()
    admit(kv, Req("p", list(range(1, 41)), cache_salt="t1"))
    assert kv.get_computed_blocks(Req("q", list(range(1, 41)), cache_salt="t2"))[1] == 0
    assert kv.get_computed_blocks(Req("q", list(range(1, 41)), cache_salt="t1"))[1] == 32


def test_vllm_style_scheduler_loop_with_preemption():
    """A compact vLLM-like loop: admit waiting requests, decode running ones, preempt the
    newest on shortage; invariants hold every step and everything is freed at the end."""
    rng = random.Random(0)
    kv, mgr = make(12)
    shared = [rng.randrange(1, 1000) for _ in range(32)]
    waiting = [Req(f"r{i}", shared + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 20))])
               for i in range(8)]
    goal = {r.request_id: len(r.all_token_ids) + 24 for r in waiting}
    running: list[Req] = []
    preemptions = 0
    while waiting or running:
        for r in list(running):
            if r not in running:
                continue
            r.all_token_ids.append(rng.randrange(1, 1000))  # the token sampled last step
            while kv.allocate_slots(r, 1) is None:
                victim = running.pop()
                kv.free(victim)
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                waiting.insert(0, victim)
                preemptions += 1
                if victim is r:
                    break
            else:
                r.num_computed_tokens += 1
        while waiting:
            new, _ = admit(kv, waiting[0])
            if new is None:
                break
            running.append(waiting.pop(0))
        for r in [r for r in running if len(r.all_token_ids) >= goal[r.request_id]]:
            running.remove(r)
            kv.free(r)
        mgr.check_invariants()
    assert preemptions > 0 and mgr.num_free_blocks == 12 and kv.usage == 0.0
    stats = kv.make_prefix_cache_stats()
    assert stats.requests == 8 and stats.preempted_requests == preemptions and stats.hits > 0


def test_adapter_imports_without_torch():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; sys.modules['triton'] = None; "
            "import prefixkv.adapters.vllm")
    subprocess.run([sys.executable, "-c", code], check=True)
