"""The benchmark's accounting on hand-computed cases (not its timings)."""

from prefixkv import ContiguousAllocator, KVCacheManager, PagedAllocator
from prefixkv.bench.capacity import requests_that_fit
from prefixkv.bench.replay import replay
from prefixkv.bench.workloads import BenchRequest, Workload, builtin


class Recording(KVCacheManager):
    """Sums what the admissions themselves report."""

    hits = 0
    computed = 0

    def add_request(self, *args, **kwargs):
        adm = super().add_request(*args, **kwargs)
        if adm is not None:
            self.hits += adm.num_cached_tokens
            self.computed += adm.num_new_tokens
        return adm


def test_saved_tokens_are_the_sum_of_hits_also_under_preemption():
    for name, pool in (("chat", 4096), ("pressure", 300)):
        wl = builtin(name, scale=0.1, seed=1)
        alloc = Recording(pool, 16, seed=0)
        res = replay(alloc, wl, "prefixkv")
        assert res.prefill_saved == alloc.hits > 0 and res.prefill_computed == alloc.computed
        assert res.decoded_tokens == sum(len(r.output) for r in wl.requests)
        alloc.check_invariants()
        assert alloc.num_free_blocks == pool
    assert res.preemptions > 0  # the small pool does preempt


def test_without_preemption_every_prompt_token_is_computed_or_saved():
    wl = builtin("system-prompt", scale=0.05)
    res = replay(KVCacheManager(4096, 16, seed=0), wl, "prefixkv")
    assert res.preemptions == 0
    assert res.prefill_computed + res.prefill_saved == wl.total_prompt_tokens()


def test_contiguous_fragmentation_by_hand():
    # one request: 4 prompt tokens, 2 outputs; max_model_len 8 reserves 2 blocks of 4.
    # step 1: 5 tokens held of 8 reserved -> 3 unused; step 2: 6 held -> 2 unused.
    wl = Workload("one", "", (BenchRequest("r", (1, 2, 3, 4), (5, 6)),), 32)
    res = replay(ContiguousAllocator(8, 4, max_model_len=8), wl, "contiguous")
    assert (res.unused_slot_steps, res.reserved_slot_steps) == (3 + 2, 8 + 8)
    assert res.fragmentation == 5 / 16
    paged = replay(PagedAllocator(8, 4), wl, "paged")  # 2 blocks from the first decode on
    assert (paged.unused_slot_steps, paged.reserved_slot_steps) == (3 + 2, 8 + 8)


def test_requests_that_fit_by_hand():
    shared = tuple(range(100, 108))  # two full blocks of 4
    reqs = [BenchRequest(f"r{i}", shared + (i, i), (9,)) for i in range(8)]
    # prefixkv: the first takes 3 blocks, each next one 1 (its partial block): 3 + 5 = 8
    assert requests_that_fit(KVCacheManager(8, 4, seed=0), reqs) == 6
    assert requests_that_fit(PagedAllocator(8, 4), reqs) == 2
    assert requests_that_fit(ContiguousAllocator(8, 4, max_model_len=12), reqs) == 2
