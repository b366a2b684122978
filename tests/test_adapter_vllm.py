"""The vLLM-shaped adapter: the calls of a vLLM v1 scheduler, and one test per semantic
difference listed in the module docstring of prefixkv.adapters.vllm."""

from __future__ import annotations

import random

import pytest
from vllm_fakes import MM, Lora, Pos, Req, admit, live_hashes, make
from vllm_sim import Sim

from prefixkv import (
    ExtraKeys, ExtraKeysError, PrefixKVError, PromptTooLongError, RequestError, TokenError,
)
from prefixkv.adapters.vllm import (
    BlockIds, ComputedBlocks, VllmAllBlocksCleared, VllmBlockRemoved, VllmBlockStored,
    VllmKVCacheManager, extra_keys_of,
)

BS = 16


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
    s = kv.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (1, 40, 0)  # a only
    mgr.check_invariants()


def test_difference_2_block_zero_is_real_and_usage_counts_every_block():
    kv, mgr = make(4)
    new, _ = admit(kv, Req("a", [1, 2, 3]))
    assert new.block_ids == (0,) and kv.usage == 0.25
    mgr.check_invariants()


def test_difference_3_stats_count_admissions_and_split_preempted():
    kv, mgr = make(3)
    a = Req("a", list(range(1, 41)))
    admit(kv, a)
    assert admit(kv, Req("big", list(range(1, 48))))[0] is None  # short: not counted
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
    mgr.check_invariants()


def test_difference_4_events_in_vllm_shape():
    kv, mgr = make(4)
    a = Req("a", list(range(1, 50)), lora_request=Lora("ad"))
    admit(kv, a)
    (stored,) = kv.take_events()
    assert isinstance(stored, VllmBlockStored) and len(stored.block_hashes) == 3
    assert stored.parent_block_hash is None and stored.token_ids == list(range(1, 49))
    assert (stored.block_size, stored.lora_name, stored.lora_id, stored.medium) == (16, "ad", None, "GPU")
    kv.free(a)
    b = Req("b", [300 + i for i in range(40)])
    admit(kv, b)  # 3 blocks: evicts cached ones
    events = kv.take_events()
    removed = [e for e in events if isinstance(e, VllmBlockRemoved)]
    assert removed and all(h in stored.block_hashes for e in removed for h in e.block_hashes)
    kv.free(b)
    assert kv.reset_prefix_cache()
    assert isinstance(kv.take_events()[-1], VllmAllBlocksCleared)
    kv, mgr = make(8)
    prompt = list(range(1, 40))
    admit(kv, Req("c", prompt))
    assert len(kv.take_events()[0].block_hashes) == 2
    new, _ = admit(kv, Req("dup", prompt, skip_reading_prefix_cache=True))
    assert new == BlockIds((3, 4, 5))  # a duplicate of c's content
    assert kv.take_events() == []  # vLLM would announce the same hashes again
    mgr.check_invariants()


def test_difference_5_free_and_get_block_ids_accept_unknown_ids():
    kv, mgr = make()
    kv.free(Req("never", [1]))
    assert kv.get_block_ids("never") == ([],)
    with pytest.raises(RequestError):
        mgr.free("never")
    mgr.check_invariants()


def test_difference_9_unsupported_arguments_raise_before_any_change():
    kv, mgr = make()
    a = Req("a", list(range(1, 41)))
    for kw in ({"reserved_blocks": 1}, {"num_external_computed_tokens": 16},
               {"num_encoder_tokens": 4}, {"delay_cache_blocks": True}, {"use_eagle": True}):
        with pytest.raises(PrefixKVError, match=f"not supported by prefixkv: {next(iter(kw))}"):
            kv.allocate_slots(a, 40, **kw)
    with pytest.raises(PrefixKVError, match="computed tokens"):
        kv.allocate_slots(Req("c", [1, 2], num_computed_tokens=1), 1)
    assert mgr.num_free_blocks == 16 and kv.get_block_ids("a") == ([],)
    assert not hasattr(kv, "get_num_common_prefix_blocks")
    mgr.check_invariants()


def test_growth_past_known_tokens_while_the_prompt_is_partly_unscheduled():
    """One call schedules the rest of the prompt, the new known tokens and reserves the
    unknown ones, or nothing at all."""
    kv, mgr = make(4)
    a = Req("a", list(range(1, 41)))
    admit(kv, a, num_new=10)
    a.all_token_ids.append(5)
    assert kv.allocate_slots(a, 32, num_lookahead_tokens=30) is None  # 72 slots: 5 blocks
    a.all_token_ids.append(-1)
    with pytest.raises(PrefixKVError):
        kv.allocate_slots(a, 32)      # a bad token: nothing scheduled
    assert (mgr.num_tokens("a"), mgr.num_scheduled_tokens("a")) == (40, 10)
    a.all_token_ids[-1] = 6
    assert kv.allocate_slots(a, 33) == BlockIds((1, 2))  # 42 known + 1 reserved
    assert (mgr.num_tokens("a"), mgr.num_scheduled_tokens("a")) == (42, 42)
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
    kv.manager.check_invariants()


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


def test_item5_hit_changed_withdraws_the_blocks_it_scheduled():
    """The cache changes between get_computed_blocks and allocate_slots: the adapter
    raises, and the full blocks it had scheduled (KV never computed) are not findable
    and are announced removed."""
    kv, mgr = make(8)
    prompt = list(range(1, 65))
    a = Req("a", prompt[:40])
    admit(kv, a)
    kv.free(a)
    b = Req("b", prompt)
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 32
    assert kv.reset_prefix_cache()
    events = kv.take_events()
    with pytest.raises(RequestError, match="not the 32"):
        kv.allocate_slots(b, 32, hit, blocks)  # the core now hits 0 and schedules 0..31
    events += kv.take_events()
    assert mgr.lookup(prompt) == 0 and kv.get_computed_blocks(Req("c", prompt))[1] == 0
    assert live_hashes(events) == set()
    assert mgr.num_free_blocks == 8 and kv.get_block_ids("b") == ([],)
    mgr.check_invariants()


def test_item6_async_scheduling_reserves_slots_for_unknown_tokens():
    """vLLM schedules the next step before the sampled token is known: the slot of
    position 32 must exist when allocate_slots(req, 1) returns."""
    kv, mgr = make(8)
    a = Req("a", list(range(1, 33)))
    admit(kv, a)                       # num_computed_tokens = 32 (optimistic)
    new = kv.allocate_slots(a, 1)      # position 32, token not known yet
    assert new == BlockIds((2,)) and kv.get_block_ids("a") == ([0, 1, 2],)
    assert mgr.num_tokens("a") == 32
    mgr.check_invariants()
    a.num_computed_tokens = 33
    a.all_token_ids.append(500)        # position 32's token arrives
    assert kv.allocate_slots(a, 1) == BlockIds(())  # 32 appended, 33 reserved: same block
    assert (mgr.num_tokens("a"), mgr.num_scheduled_tokens("a")) == (33, 33)
    mgr.check_invariants()
    for t in range(15):                # fill block 2 up to position 47
        a.num_computed_tokens += 1
        a.all_token_ids.append(600 + t)
        assert kv.allocate_slots(a, 1) is not None
        mgr.check_invariants()
    assert kv.get_block_ids("a") == ([0, 1, 2, 3],)  # position 48 reserved in block 3
    b = Req("b", a.all_token_ids[:48] + [1])
    assert kv.get_computed_blocks(b)[1] == 48  # block 2, filled by decoding, is cached


def test_item6_short_pool_changes_nothing():
    kv, mgr = make(2)
    a = Req("a", list(range(1, 33)))
    admit(kv, a)
    assert kv.allocate_slots(a, 1) is None
    assert kv.get_block_ids("a") == ([0, 1],) and mgr.num_scheduled_tokens("a") == 32
    mgr.check_invariants()


def test_item7_lookahead_slots_for_speculative_decoding():
    kv, mgr = make(16)
    a = Req("a", list(range(1, 21)))
    blocks, hit = kv.get_computed_blocks(a)
    new = kv.allocate_slots(a, 20, hit, blocks, num_lookahead_tokens=28)
    assert new == BlockIds((0, 1, 2))   # 48 slots
    mgr.check_invariants()
    a.num_computed_tokens = 20
    a.all_token_ids.append(100)         # the sampled token; 3 draft tokens proposed
    assert kv.allocate_slots(a, 1 + 3, num_lookahead_tokens=28) == BlockIds((3,))  # 20+4+28
    assert (mgr.num_tokens("a"), mgr.num_scheduled_tokens("a")) == (21, 21)  # drafts not cached
    mgr.check_invariants()
    a.all_token_ids += [101, 102]       # one draft accepted, plus the bonus token
    a.num_computed_tokens = 22
    assert kv.allocate_slots(a, 1, num_lookahead_tokens=28) == BlockIds(())
    assert mgr.num_scheduled_tokens("a") == 23
    mgr.check_invariants()


def test_item7_full_sequence_must_fit_gates_admission():
    kv, mgr = make(5)
    admit(kv, Req("x", [9]))            # holds block 0
    a = Req("a", list(range(1, 66)))    # 5 blocks, 4 free
    blocks, hit = kv.get_computed_blocks(a)
    assert kv.allocate_slots(a, 16, hit, blocks, full_sequence_must_fit=True) is None
    assert mgr.num_free_blocks == 4 and kv.make_prefix_cache_stats().requests == 1
    assert kv.allocate_slots(a, 16, hit, blocks) == BlockIds((1,))  # first chunk fits
    a.num_computed_tokens = 16
    assert kv.allocate_slots(a, 16, full_sequence_must_fit=True) is None  # running, too
    assert mgr.num_scheduled_tokens("a") == 16
    mgr.check_invariants()


def test_item7_skip_reading_prefix_cache():
    """Prompt-logprobs and pooling requests compute every position: no hit is used and
    their lookup is not counted, but what they compute is cached for others."""
    kv, mgr = make(16)
    prompt = list(range(1, 41))
    a = Req("a", prompt)
    admit(kv, a)
    kv.make_prefix_cache_stats()
    p = Req("p", prompt, skip_reading_prefix_cache=True)
    new, hit = admit(kv, p)
    assert hit == 0 and new == BlockIds((3, 4, 5))
    s = kv.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (0, 0, 0)
    kv.free(a)
    kv.free(p)
    assert kv.get_computed_blocks(Req("q", prompt))[1] == 32
    assert mgr.free_block_order()[-2:] == [1, 0]  # a's chain; p's twins are evicted first
    mgr.check_invariants()


def test_item7_unimplemented_arguments_are_rejected_before_any_change():
    kv, mgr = make()
    a = Req("a", list(range(1, 41)))
    for kw in ({"reserved_blocks": 1}, {"num_external_computed_tokens": 16},
               {"num_encoder_tokens": 4}, {"delay_cache_blocks": True}, {"use_eagle": True}):
        with pytest.raises(PrefixKVError, match=next(iter(kw))):
            kv.allocate_slots(a, 40, **kw)
    for kw in ({"num_lookahead_tokens": -1}, {"full_sequence_must_fit": 1},
               {"has_scheduled_reqs": "no"}):
        with pytest.raises(PrefixKVError):
            kv.allocate_slots(a, 40, **kw)
    with pytest.raises(PrefixKVError, match="num_new_tokens"):
        kv.allocate_slots(a, 0)
    assert kv.allocate_slots(a, 40, has_scheduled_reqs=False) is not None  # no watermark
    assert mgr.num_free_blocks == 13
    mgr.check_invariants()


def test_item7_events_carry_lora_id_and_the_core_medium(monkeypatch):
    kv, mgr = make(8)
    admit(kv, Req("a", list(range(1, 40)), lora_request=Lora("ad", 7)))
    (stored,) = kv.take_events()
    assert (stored.lora_name, stored.lora_id, stored.medium) == ("ad", 7, "GPU")
    from prefixkv.events import BlockRemoved, BlockStored
    cpu = [BlockStored(b"h1", None, tuple(range(16)), 3, None, medium="CPU"),
           BlockRemoved(b"h0", 4, medium="CPU")]
    monkeypatch.setattr(mgr, "take_events", lambda: cpu)
    stored, removed = kv.take_events()
    assert (stored.medium, removed.medium) == ("CPU", "CPU")
    mgr.check_invariants()


def test_difference_6_free_withdraws_blocks_scheduled_but_not_computed():
    """A request allocated in this step and preempted before the step runs (vLLM's
    priority preemption): num_computed_tokens still counts only what was computed, so the
    block its allocation completed is withdrawn."""
    kv, mgr = make(8)
    a = Req("a", list(range(1, 32)))
    admit(kv, a)
    a.all_token_ids.append(77)
    assert kv.allocate_slots(a, 1) is not None  # completes block 1 (position 31)
    kv.free(a)                                   # num_computed_tokens is still 31
    assert mgr.lookup(a.all_token_ids + [1]) == 16
    mgr.check_invariants()


def test_difference_7_full_sequence_must_fit_counts_the_lookahead():
    """4 free blocks, a 64-token prompt scheduled 16 at a time with 16 lookahead slots:
    vLLM admits (64 tokens fit; 32 slots now), prefixkv asks for 80 slots. (In a pool of
    4 blocks, where they could never be free, it raises PromptTooLongError: difference
    11.)"""
    kv, mgr = make(5)
    admit(kv, Req("x", [9] * 10))  # holds block 0
    a = Req("a", list(range(1, 65)))
    blocks, hit = kv.get_computed_blocks(a)
    assert kv.allocate_slots(a, 16, hit, blocks, num_lookahead_tokens=16,
                             full_sequence_must_fit=True) is None
    assert kv.allocate_slots(a, 16, hit, blocks, full_sequence_must_fit=True) == BlockIds((1,))
    mgr.check_invariants()


def test_difference_8_get_computed_blocks_returns_two_values():
    kv, mgr = make()
    admit(kv, Req("a", list(range(1, 41))))
    assert kv.get_computed_blocks(Req("b", list(range(1, 41)))) == (ComputedBlocks(32), 32)
    mgr.check_invariants()


def test_difference_10_token_ids_outside_uint32_are_rejected():
    """vLLM's own tests use -1 as a placeholder token; prefixkv has one canonical token
    encoding and rejects ids outside it, before any change."""
    kv, mgr = make()
    with pytest.raises(TokenError):
        kv.get_computed_blocks(Req("a", [5, -1, 7]))
    with pytest.raises(TokenError):
        kv.allocate_slots(Req("a", [5, -1, 7]), 3)
    assert kv.get_block_ids("a") == ([],) and mgr.num_free_blocks == 16
    mgr.check_invariants()


@pytest.mark.parametrize("seed, asynchronous, drafts, lookahead", [
    (0, False, 0, 0), (1, False, 3, 3), (2, True, 0, 0), (3, True, 0, 2), (4, False, 2, 0)])
def test_engine_loop_never_reads_kv_it_did_not_write(seed, asynchronous, drafts, lookahead):
    """A vLLM-like engine (tests/vllm_sim.py) over a small pool: chunked prefill, shared
    prefixes, speculative or asynchronous decoding, preemption. Every hit reads exactly
    the tokens it stands for, no step writes a shared block, invariants hold each step."""
    sim = Sim(seed, num_blocks=24, asynchronous=asynchronous, drafts=drafts,
              lookahead=lookahead)
    sim.add_shared_prefix_requests(random.Random(seed), 10, 20)
    sim.run()
    assert sim.mgr.num_free_blocks == 24 and sim.preemptions > 0 and sim.hits > 0
    assert sim.rejected > 0 or not drafts


def test_malformed_requests_raise_before_any_change():
    kv, mgr = make()
    a = Req("a", list(range(1, 21)))
    admit(kv, a)
    a.all_token_ids.append(9)
    for bad in ({"num_lookahead_tokens": 0.0}, {"num_new_tokens": True}):
        with pytest.raises(RequestError):
            kv.allocate_slots(a, **{"num_new_tokens": 1, **bad})
    a.num_computed_tokens = -1
    with pytest.raises(RequestError, match="num_computed_tokens"):
        kv.allocate_slots(a, 1)
    with pytest.raises(RequestError, match="num_computed_tokens"):
        kv.free(a)
    a.num_computed_tokens = 20
    del a.all_token_ids[5:]
    with pytest.raises(RequestError, match="fewer than the 20"):
        kv.allocate_slots(a, 1)
    assert kv.get_block_ids("a") == ([0, 1],) and mgr.num_scheduled_tokens("a") == 20
    with pytest.raises(RequestError, match="skip_reading_prefix_cache"):
        kv.get_computed_blocks(Req("b", [1, 2], skip_reading_prefix_cache="yes"))
    with pytest.raises(ExtraKeysError):
        kv.allocate_slots(Req("b", [1, 2], mm_features=[MM("img", Pos(-1, 2))]), 2)
    with pytest.raises(RequestError, match="num_new_computed_tokens"):
        kv.allocate_slots(Req("b", [1] * 40, skip_reading_prefix_cache=True), 8, 32)
    assert kv.get_block_ids("b") == ([],) and mgr.num_free_blocks == 14
    mgr.check_invariants()


def test_difference_11_a_request_that_can_never_fit_raises_instead_of_waiting():
    """vLLM's scheduler would get None for it at every step; vLLM refuses such a prompt
    before it reaches the scheduler (past ``max_model_len``, checked at startup against
    the KV cache). Here ``allocate_slots`` raises, before any change."""
    kv, mgr = make(4)
    before = (mgr.free_block_order(), mgr.stats)
    with pytest.raises(PromptTooLongError, match="1,000 tokens needs at least 63 blocks"):
        admit(kv, Req("a", list(range(1000))))
    with pytest.raises(PromptTooLongError, match="64 tokens needs at least 5 blocks"):
        admit(kv, Req("a", list(range(64))), num_lookahead_tokens=1)
    assert (mgr.free_block_order(), mgr.stats) == before and kv.get_block_ids("a") == ([],)
    assert admit(kv, Req("b", list(range(64))))[0] is not None
    mgr.check_invariants()
