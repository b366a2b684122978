"""Accounting of the replay: hits, computed/saved prefill, fragmentation, preemption."""

from __future__ import annotations

import pytest

from prefixkv import ContiguousAllocator, KVCacheManager, PagedAllocator
from prefixkv.bench.replay import BenchError, replay
from prefixkv.bench.workloads import BenchRequest, Workload, builtin


class Recording:
    """Wraps an allocator and keeps every Admission it hands out."""

    def __init__(self, inner):
        self.inner = inner
        self.admissions = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def add_request(self, *args, **kwargs):
        adm = self.inner.add_request(*args, **kwargs)
        if adm is not None:
            self.admissions.append(adm)
        return adm


def _workload(*reqs: BenchRequest) -> Workload:
    return Workload("hand", "hand-made", tuple(reqs), 64)


@pytest.mark.parametrize("name,pool", [("chat", 4096), ("system-prompt", 4096), ("pressure", 96)])
def test_saved_tokens_equal_sum_of_hits(name, pool):
    wl = builtin(name, scale=0.1, seed=3)
    alloc = Recording(KVCacheManager(pool, 16, seed=0))
    res = replay(alloc, wl, "prefixkv")
    assert res.prefill_saved == sum(a.num_cached_tokens for a in alloc.admissions)
    assert res.prefill_saved == alloc.inner.stats.hits
    assert res.prefill_computed == sum(a.num_new_tokens for a in alloc.admissions)
    assert res.admissions == len(alloc.admissions) == res.requests + res.preemptions
    assert res.decoded_tokens == sum(len(r.output) for r in wl.requests)
    assert alloc.inner.num_free_blocks == pool
    alloc.inner.check_invariants()
    if res.preemptions == 0:
        assert res.prefill_saved + res.prefill_computed == wl.total_prompt_tokens()


@pytest.mark.parametrize("name,computed,saved", [("paged", 16, 0), ("prefixkv", 12, 4)])
def test_preemption_recomputes_hand_computed(name, computed, saved):
    # Pool of 4 blocks of 4. A and B: 4 prompt tokens, 5 output tokens each. After four
    # steps both hold 2 full blocks; A's fifth token needs a third: B (newest) is
    # preempted and comes back with its 8 known tokens as the prompt. B's second block
    # (released first) is the one A takes; its first block stays cached for prefixkv.
    a = BenchRequest("a", (1, 2, 3, 4), (5,) * 5)
    b = BenchRequest("b", (9, 8, 7, 6), (5,) * 5)
    alloc = Recording(KVCacheManager(4, 4, seed=0, enable_caching=name == "prefixkv"))
    res = replay(alloc, _workload(a, b), name)
    assert res.preemptions == 1
    assert [x.request_id for x in alloc.admissions] == ["a", "b", "b"]
    assert (res.prefill_computed, res.prefill_saved) == (computed, saved)
    assert res.decoded_tokens == 10
    assert res.peak_blocks == 4
    alloc.inner.check_invariants()


def test_contiguous_fragmentation_hand_computed():
    # span = 8 tokens = 2 blocks of 4.  A: 3 prompt + 2 out, B: 6 prompt + 1 out.
    # step 1: after decode A holds 4/8 slots, B 7/8; 4 blocks held -> 16 reserved, 5 unused.
    # step 2: B finished; A holds 5/8 -> 8 reserved, 3 unused.   8 / 24 = 1/3.
    wl = _workload(BenchRequest("a", (1, 2, 3), (4, 5)), BenchRequest("b", (1,) * 6, (7,)))
    res = replay(ContiguousAllocator(8, 4, max_model_len=8), wl, "contiguous")
    assert (res.reserved_slot_steps, res.unused_slot_steps) == (24, 8)
    assert res.fragmentation == pytest.approx(1 / 3)
    assert (res.peak_blocks, res.steps, res.max_running, res.decoded_tokens) == (4, 2, 2, 3)
    assert (res.prefill_computed, res.prefill_saved, res.hit_rate) == (9, 0, 0.0)


def test_paged_fragmentation_hand_computed():
    # A: 3 prompt + 2 out in blocks of 4. step 1: 4 tokens in 1 block (0 unused of 4);
    # step 2: 5 tokens in 2 blocks (3 unused of 8).   3 / 12.
    wl = _workload(BenchRequest("a", (1, 2, 3), (4, 5)))
    res = replay(PagedAllocator(8, 4), wl, "paged")
    assert (res.reserved_slot_steps, res.unused_slot_steps) == (12, 3)
    assert res.fragmentation == 0.25
    assert res.peak_blocks == 2


def test_chat_turn_waits_for_previous_turn():
    first = BenchRequest("t0", (1,) * 8, (2,) * 5)
    second = BenchRequest("t1", first.prompt + first.output + (3,) * 3, (4,), after="t0")
    alloc = Recording(KVCacheManager(16, 4, seed=0))
    res = replay(alloc, _workload(first, second), "prefixkv")
    assert [a.request_id for a in alloc.admissions] == ["t0", "t1"]
    assert alloc.admissions[1].num_cached_tokens == 12  # 13 prompt+output tokens: 3 full blocks
    assert res.prefill_saved_pairs == 12 * 13 // 2  # query i attends to keys 0..i
    assert res.steps == 6  # five decode steps for t0, then one for t1
    assert res.max_running == 1


def test_request_larger_than_pool_is_a_clear_error():
    wl = _workload(BenchRequest("big", (1,) * 40, (2,)))
    with pytest.raises(BenchError, match="'big'.*pool of 4 blocks"):
        replay(PagedAllocator(4, 4), wl, "paged")
    grows = _workload(BenchRequest("grows", (1,) * 15, (2,) * 4))
    with pytest.raises(BenchError, match="'grows' needs more than the whole pool"):
        replay(PagedAllocator(4, 4), grows, "paged")


def test_to_dict_has_derived_metrics():
    wl = _workload(BenchRequest("a", (1, 2, 3), (4, 5)))
    d = replay(PagedAllocator(8, 4), wl, "paged").to_dict()
    assert {"hit_rate", "fragmentation", "us_per_admission", "us_per_decoded_token"} <= set(d)
    assert d["allocator"] == "paged" and d["pool_blocks"] == 8
