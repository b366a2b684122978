"""A request the pool can never hold is refused with PromptTooLongError before any
change, while a shortage that waiting cures stays a None: in KVCacheManager and the hybrid
manager (``groups.fit``: whatever the cache holds). (prefixkv.integrations.vllm turns it
into vLLM's None: tests/engines/test_vllm_plugin.py.)"""

import pickle

import pytest

from prefixkv import KVCacheManager, PrefixKVError, PromptTooLongError
from prefixkv.groups import BlockSizes, HybridKVCacheManager, chunked_local, full_attention, sliding_window
from prefixkv.groups.fit import least_blocks

PROMPT = list(range(1000))


def snapshot(m):
    return m.free_block_order(), m.stats, m.num_cached_blocks


@pytest.mark.parametrize("kw", [{}, {"num_new_tokens": 16}, {"require_full_fit": True},
                                {"read_cache": False}, {"resumed": True}])
def test_a_prompt_larger_than_the_pool_is_refused_not_left_waiting(kw):
    m = KVCacheManager(4, 16, seed=0)
    m.add_request("x", [7] * 40)
    before = snapshot(m)
    with pytest.raises(PromptTooLongError) as info:
        m.add_request("a", PROMPT, **kw)  # 63 blocks; even chunked, its prefill needs them
    assert (info.value.num_tokens, info.value.needed, info.value.capacity) == (1000, 63, 4)
    assert "1,000 tokens needs at least 63 blocks, and the pool has 4" in str(info.value)
    assert isinstance(info.value, PrefixKVError) and isinstance(info.value, ValueError)
    assert snapshot(m) == before and m.get_block_ids("x") == (0, 1, 2)
    m.check_invariants()
    assert m.lookup(PROMPT) == 0  # a lookup only looks


def test_a_shortage_is_still_a_none_and_the_bound_is_exact():
    m = KVCacheManager(4, 16, seed=0)
    m.add_request("x", [7] * 40)                     # 3 of 4 blocks held
    assert m.add_request("a", list(range(64))) is None  # fits an empty pool: wait
    m.free("x")
    assert m.add_request("a", list(range(64))).block_ids == (2, 3, 1, 0)
    m.free("a")
    with pytest.raises(PromptTooLongError, match="65 tokens needs at least 5 blocks"):
        m.add_request("b", list(range(65)))
    with pytest.raises(PromptTooLongError, match=r"\(with 1 lookahead slots\)"):
        m.add_request("b", list(range(64)), num_lookahead_tokens=1)
    # a chunk and its lookahead that fit, of a prompt that fits: admitted
    assert m.add_request("c", list(range(60)), num_new_tokens=8, num_lookahead_tokens=4)
    m.check_invariants()


def test_the_error_pickles_with_its_numbers():
    e = pickle.loads(pickle.dumps(PromptTooLongError(1000, 63, 4, " (x)")))
    assert (e.num_tokens, e.needed, e.capacity, str(e)) == (1000, 63, 4, str(
        PromptTooLongError(1000, 63, 4, " (x)")))


def test_the_hybrid_manager_refuses_what_no_cache_content_would_let_in():
    h = HybridKVCacheManager([full_attention(), sliding_window(32)], 8, 16, seed=0)
    before = snapshot(h)
    for kw in ({}, {"num_new_tokens": 16}):  # the full group holds all 63 blocks at the end
        with pytest.raises(PromptTooLongError, match=r"needs at least \d+ blocks, and the "
                                                     r"pool has 7 usable \(all groups' blocks"):
            h.add_request("a", PROMPT, **kw)
    assert snapshot(h) == before
    h.check_invariants()


def test_a_windowed_models_long_prompt_fits_in_chunks_and_is_not_refused():
    h = HybridKVCacheManager([sliding_window(32)], 8, 16, seed=0)  # 7 usable blocks
    assert h.add_request("a", PROMPT) is None  # whole: only a cached prefix would fit it
    adm = h.add_request("a", PROMPT, num_new_tokens=16)
    assert adm.group_block_ids == ((1,),)
    for _ in range(61):                         # the window releases as the prefill goes
        assert h.extend("a", 16) is not None
    assert h.extend("a", 1000 - 62 * 16) is not None
    h.check_invariants()
    h.free("a")
    with pytest.raises(PromptTooLongError, match="needs at least 15 blocks"):
        h.add_request("b", PROMPT, num_lookahead_tokens=200)  # 200 slots more: never
    # a whole prompt fits after a long enough hit: here a's, still cached
    assert h.add_request("b", PROMPT).num_cached_tokens == 992
    h.check_invariants()


@pytest.mark.parametrize("groups", [
    (full_attention(),), (sliding_window(32),), (chunked_local(48),),
    (full_attention(), sliding_window(20)), (sliding_window(40), chunked_local(32)),
])
@pytest.mark.parametrize("n, num_new, lookahead, full_fit", [
    (1, None, 0, False), (100, None, 0, False), (100, 16, 0, False), (100, 40, 7, False),
    (100, None, 5, True), (333, 30, 0, True),
])
def test_least_blocks_is_a_bound_no_admission_beats(groups, n, num_new, lookahead, full_fit):
    """Brute force over every hit length the admission could find, and over the prefill
    that follows it: the least an admission holds at its peak is what ``least_blocks``
    says (capacity 0: exact), and past a capacity it is refused only if that is more."""
    bs = 16
    least = least_blocks(groups, bs, n, num_new, lookahead, full_fit, 0)
    peaks = []
    for k in range((n - 1) // bs + 1):
        cached = k * bs
        total = n if num_new is None else min(n, cached + num_new)
        per = -(-(total + lookahead) // bs) - k
        fresh = max(per, -(-n // bs) - k) if full_fit else per
        held = fresh * len(groups) + sum(k - g.num_unread(cached, bs) for g in groups)
        last = sum(-(-n // bs) - g.num_unread(n - 1, bs) for g in groups)
        peaks.append(max(held, last))
    assert least == min(peaks), (least, peaks)
    for capacity in range(least + 3):
        assert (least_blocks(groups, bs, n, num_new, lookahead, full_fit, capacity) > capacity) \
            == (least > capacity)


@pytest.mark.parametrize(("num_new", "full_fit", "needed"), [(None, False, 9), (8, True, 9), (None, True, 9),
                                                             (8, False, None)])
def test_at_two_sizes_the_admission_step_counts_beyond_the_prefills_end(num_new, full_fit, needed):
    """A window of 8 at block 8 beside full attention at 16, 8 usable blocks: a 64-token
    prompt ends its prefill holding 5 (the window's last 2 blocks, 4 of full attention),
    but admitted in one step (or needing its whole sequence to fit) it holds 9 at once,
    whatever its hit: refused by name. In steps of 8 it fits. (mutants-r30:
    ``sized_admission.least_blocks``' count after an admission dropped or negated, its
    full-fit term dropped; open since mutants-r29.)"""
    m = HybridKVCacheManager((sliding_window(8), full_attention()), 9, BlockSizes.of([8, 16], 8, 32))
    if needed is None:
        assert m.add_request("a", PROMPT[:64], num_new_tokens=num_new).group_block_ids == ((1,), (2,))
        return
    with pytest.raises(PromptTooLongError) as info:
        m.add_request("a", PROMPT[:64], num_new_tokens=num_new, require_full_fit=full_fit)
    assert (info.value.num_tokens, info.value.needed, info.value.capacity) == (64, needed, 8)
    assert m.free_block_order() == list(range(1, 9))
