"""vLLM 0.33 setting a running request's computed tokens back (KV its connector failed
to load, ``kv_load_failure_policy="recompute"``: ``Scheduler._update_requests_with_invalid_blocks``
truncates ``num_computed_tokens`` at the first invalid block and, under this policy, calls
no ``evict_blocks``), beside vLLM's own ``KVCacheManager`` from the wheel: what the plug-in
keeps findable then, on one full-attention group and on hybrid models. Needs vllm
installed."""

from __future__ import annotations

import os
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_hybrid_reference import _hybrid_pair, _window  # noqa: E402
from .test_vllm_plugin import full  # noqa: E402
from .test_vllm_reference import BS, _pair, _request  # noqa: E402

LAYOUTS = {"full": lambda: _pair(), "window5": lambda: _hybrid_pair(30, _window(5)),
           "full+window8": lambda: _hybrid_pair(30, full(BS), _window(8))}


def _set_back(m: Any, rid: str, tokens: int, to: int) -> Any:
    """A request of ``tokens`` tokens, all computed, then set back to ``to`` (its block
    ``to // BS`` turned out invalid)."""
    from vllm.v1.request import RequestStatus

    a = _request(rid, list(range(tokens)), None)
    assert m.allocate_slots(a, tokens) is not None
    a.status, a.num_computed_tokens = RequestStatus.RUNNING, tokens
    a.num_computed_tokens = to  # vLLM's scheduler, after the step's output
    return a


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("goes", ["preempted", "aborted", "popped"])
def test_a_request_that_goes_before_recomputing_its_invalid_blocks_leaves_none_findable(layout, goes):
    # 24 tokens computed, then block 1 turns out invalid: vLLM sets the request back to
    # 4 and would recompute 4..24 in place; it is preempted (or aborted) first. vLLM's
    # own manager leaves blocks 1..5 cached, their KV the failed load's (or computed
    # over it): a later request hits all 24 tokens (wrong KV; asserted below as vLLM's
    # answer). Before: prefixkv freed them findable too (24); now the full blocks past
    # the computed tokens are uncached when the request goes (4)
    from vllm.v1.request import RequestStatus

    hits = []
    for m in LAYOUTS[layout]():
        a = _set_back(m, "a", 24, 4)
        if goes != "preempted":  # (vLLM marks it finished, then frees it)
            a.status = RequestStatus.FINISHED_ABORTED
        if goes == "popped":  # (a connector's held blocks: given back later)
            m.block_pool.free_blocks(m.pop_blocks_for_free(a))
        else:
            m.free(a)
        if goes == "preempted":  # (vLLM frees it running, then resets its count)
            a.status, a.num_computed_tokens = RequestStatus.PREEMPTED, 0
        hits.append(m.get_computed_blocks(_request("c", [*range(24), 5], None))[1])
    assert hits == [4, 24]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("aborted", [False, True])
def test_a_last_token_replayed_after_a_load_keeps_its_block_findable(layout, aborted):
    # an async load of a whole 16-token prompt lands: vLLM sets the request back by one
    # token (its last is recomputed for logits), not for invalid KV. Freed then (as
    # vLLM's own tests free waiting requests, or aborted), its 4 loaded blocks stay
    # findable in both managers (a block-aligned prompt: the set-back ends inside the
    # last full block, whose KV is sound)
    from vllm.v1.request import RequestStatus

    hits = []
    for m in LAYOUTS[layout]():
        a = _request("a", list(range(16)), None)
        assert m.allocate_slots(a, 0, num_external_computed_tokens=16, delay_cache_blocks=True) is not None
        a.status, a.num_computed_tokens = RequestStatus.WAITING_FOR_REMOTE_KVS, 16
        m.cache_blocks(a, 16)  # the load landed
        a.status, a.num_computed_tokens = RequestStatus.WAITING, 15
        if aborted:
            a.status = RequestStatus.FINISHED_ABORTED
        m.free(a)
        hits.append(m.get_computed_blocks(_request("c", [*range(16), 5], None))[1])
    assert hits == [16, 16]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("computed", [8, 6])
def test_a_request_preempted_in_the_step_that_scheduled_it_leaves_its_new_blocks_unfindable(layout, computed):
    # vLLM's priority policy preempts a running request already scheduled in this step
    # (Scheduler.schedule: "preempted_req in scheduled_running_reqs"): allocate_slots
    # cached its chunk up to 16, then it is freed with the count of before the step.
    # vLLM's own manager leaves the chunk's blocks findable though their KV was never
    # written (a later request hits 16). Before: prefixkv did too; now they go unfindable
    # from the block holding the first uncomputed token on
    from vllm.v1.request import RequestStatus

    hits = []
    for m in LAYOUTS[layout]():
        a = _request("a", list(range(16)), None)
        assert m.allocate_slots(a, computed) is not None
        a.status, a.num_computed_tokens = RequestStatus.RUNNING, computed
        assert m.allocate_slots(a, 16 - computed) is not None  # scheduled, then preempted
        m.free(a)
        a.status, a.num_computed_tokens = RequestStatus.PREEMPTED, 0
        hits.append(m.get_computed_blocks(_request("c", [*range(16), 5], None))[1])
    assert hits == [computed // BS * BS, 16]


@pytest.mark.parametrize("layout", list(LAYOUTS) + ["full+window3"])
def test_async_scheduling_with_rejected_drafts_moves_and_frees_as_vllm_does(layout):
    # async scheduling and speculative decoding together (AsyncScheduler's calls): each
    # step schedules 1 + 3 drafts before the previous step's output is known (counted
    # computed and in flight); that output then rejects some drafts (computed set
    # back). prefixkv schedules known tokens only, so a set-back never reaches below
    # what it cached (no rewind), and windows move at computed less in flight: the
    # tables' null entries and the free count match vLLM's at every step
    from vllm.v1.request import RequestStatus

    pairs = _hybrid_pair(30, full(BS), _window(3)) if layout == "full+window3" else LAYOUTS[layout]()
    answers: list[list[Any]] = []
    for m in pairs:
        seen: list[Any] = []
        a = _request("a", list(range(6)), None)
        assert m.allocate_slots(a, 6) is not None
        a.status, a.num_computed_tokens = RequestStatus.RUNNING, 6
        a.append_output_token_ids(30)
        for step, rejected in enumerate([0, 2, 3, 1, 3, 0, 2, 1]):
            a.spec_token_ids = [40, 41, 42]
            assert m.allocate_slots(a, 4, num_lookahead_tokens=3) is not None
            a.num_computed_tokens += 4
            a.num_in_flight_tokens += 4
            if step:  # the previous step's output lands after this one was scheduled
                a.num_in_flight_tokens -= 4
                a.num_computed_tokens -= rejected
                a.append_output_token_ids([50 + step] * (4 - rejected))
                m.cache_blocks(a, a.num_computed_tokens - a.num_in_flight_tokens)
            if m is pairs[0]:  # (no rewind: what prefixkv cached stays computed)
                assert m.core.num_scheduled_tokens(m.key_of("a")) <= a.num_computed_tokens
            seen.append(([[b == 0 for b in g] for g in m.get_block_ids("a")],
                         m.block_pool.get_num_free_blocks()))
        answers.append(seen)
    assert answers[0] == answers[1]
    assert (layout == "full") == (not any(any(g) for g in answers[0][-1][0]))  # (windows moved)


@pytest.mark.parametrize(("layout", "want"), [("window5", 20), ("full+window8", 8)])
def test_a_recompute_over_what_a_window_released_is_not_cached_again(layout, want):
    # wrongkv-r12: 24 tokens computed, a step at 24 (the window releases its blocks
    # below 20, resp. 17), then block 2 turns out invalid: vLLM sets the request back to
    # 8 and recomputes 8..25, reading the window's null entries there (KV gone). vLLM's
    # own manager leaves the blocks cached, their KV recomputed from that wrong context,
    # and a later request hits all 24 tokens. Before: prefixkv cached the recomputed
    # blocks again, and hit 24 too; now only what was computed over sound KV is found
    # (window5: the window's block 4, 16..19, released to the pool from the first pass)
    from vllm.v1.request import RequestStatus

    hits = []
    for m in LAYOUTS[layout]():
        a = _request("a", list(range(24)), None)
        assert m.allocate_slots(a, 24) is not None
        a.status, a.num_computed_tokens = RequestStatus.RUNNING, 24
        a.append_output_token_ids(100)
        assert m.allocate_slots(a, 1) is not None
        assert list(m.get_block_ids("a")[-1][:4]) == [0, 0, 0, 0]  # (vLLM's null block)
        a.num_computed_tokens = 8                    # (after the step at 24 ran: 25, set back)
        assert m.allocate_slots(a, 17) is not None
        a.num_computed_tokens = 25
        hits.append(m.get_computed_blocks(_request("c", [*range(24), 5], None))[1])
    assert hits == [want, 24]


@pytest.mark.parametrize("evicted", [True, False])
def test_a_plain_model_caches_what_it_recomputes_after_a_set_back_again(evicted):
    # a full-attention model: block 1 on turns out invalid (evict_blocks names them, as
    # vLLM's scheduler does before failing a request) and vLLM sets the request back to
    # 4. Before, the plug-in rewound only hybrid models: the recomputed blocks stayed
    # unfindable while the request lived (4, as vLLM's own manager); now they are cached
    # as recomputed. Set back with no evict_blocks (kv_load_failure_policy="recompute"),
    # they are uncached at the recompute's start (the KV of the failed load is not
    # served meanwhile) and cached again
    from vllm.v1.request import RequestStatus

    hits = []
    for m in LAYOUTS["full"]():
        a = _request("a", list(range(24)), None)
        assert m.allocate_slots(a, 24) is not None
        a.status, a.num_computed_tokens = RequestStatus.RUNNING, 24
        if evicted:
            m.evict_blocks(set(m.get_block_ids("a")[0][1:]))
        a.num_computed_tokens = 4
        assert m.allocate_slots(a, 20) is not None
        a.num_computed_tokens = 24
        hits.append(m.get_computed_blocks(_request("c", [*range(24), 5], None))[1])
    assert hits == [24, 4 if evicted else 24]


def test_a_plain_model_set_back_beside_a_request_sharing_its_blocks_goes_on():
    # b hit a's blocks 0..5; a is set back to 4 (b keeps its count: vLLM recomputes a
    # shared invalid block once). prefixkv's rewind refuses while b holds them, changing
    # nothing: the step goes on as before (the blocks evicted stay unfindable)
    from vllm.v1.request import RequestStatus

    m = LAYOUTS["full"]()[0]
    a = _request("a", list(range(24)), None)
    assert m.allocate_slots(a, 24) is not None
    a.status, a.num_computed_tokens = RequestStatus.RUNNING, 24
    b = _request("b", [*range(24), 7], None)
    blocks, hit = m.get_computed_blocks(b)[:2]
    assert hit == 24 and m.allocate_slots(b, 1, hit, blocks) is not None
    m.evict_blocks(set(m.get_block_ids("a")[0][1:]))
    before = m.get_block_ids("a")
    a.num_computed_tokens = 4
    assert m.allocate_slots(a, 20) is not None
    assert m.get_block_ids("a") == before
    assert m.core.num_scheduled_tokens(m.key_of("a")) == 24
    assert m.get_computed_blocks(_request("c", [*range(24), 5], None))[1] == 4


def test_an_async_load_that_failed_below_its_end_is_recomputed_uncached_on_a_window_model():
    # wrongkv-r12: a 24-token prompt loaded whole (async); the 5-token window takes no
    # block below 20 (the query after the load reads 20..24: vLLM's null block). Block 5
    # fails: vLLM sets the request back to 20, caches what landed, and recomputes
    # 20..24, reading the null entries at 16..19 (KV gone). No rewind is seen (prefixkv
    # scheduled exactly 20). vLLM's own manager serves the recomputed block (24, wrong
    # KV); before, prefixkv did too; now the recompute is tainted: 0
    from vllm.v1.request import RequestStatus

    hits = []
    for m in LAYOUTS["window5"]():
        a = _request("a", list(range(24)), None)
        assert m.allocate_slots(a, 0, num_external_computed_tokens=24, delay_cache_blocks=True) is not None
        a.status, a.num_computed_tokens = RequestStatus.WAITING_FOR_REMOTE_KVS, 24
        assert list(m.get_block_ids("a")[0][:5]) == [0] * 5
        a.num_computed_tokens = 20                   # _update_requests_with_invalid_blocks
        m.cache_blocks(a, 20)                        # _update_waiting_for_remote_kv
        a.status = RequestStatus.WAITING
        assert m.allocate_slots(a, 4) is not None
        a.status, a.num_computed_tokens = RequestStatus.RUNNING, 24
        hits.append(m.get_computed_blocks(_request("c", [*range(24), 5], None))[1])
    assert hits == [0, 24]


@pytest.mark.parametrize(("window", "want"), [(5, 0), (4, 24)])
def test_the_last_token_recomputed_after_a_whole_load_over_a_released_entry_is_not_cached(window, want):
    # a 24-token prompt loaded whole lands; vLLM recomputes its last token (for logits).
    # The window's blocks below the load's end's reach are null: with a window of 5 the
    # query at 23 reads 19, gone, and block 5 gets that position's KV computed over it
    # (vLLM's own manager keeps serving it: 24). Before: prefixkv re-cached block 5 (24);
    # now it is not (0: nothing sound is left to hit). A window of 4 reads 20..23: sound
    from vllm.v1.request import RequestStatus

    hits = []
    for m in _hybrid_pair(30, _window(window)):
        a = _request("a", list(range(24)), None)
        assert m.allocate_slots(a, 0, num_external_computed_tokens=24, delay_cache_blocks=True) is not None
        a.status, a.num_computed_tokens = RequestStatus.WAITING_FOR_REMOTE_KVS, 24
        m.cache_blocks(a, 24)
        a.status, a.num_computed_tokens = RequestStatus.WAITING, 23
        assert m.allocate_slots(a, 1) is not None
        a.status, a.num_computed_tokens = RequestStatus.RUNNING, 24
        hits.append(m.get_computed_blocks(_request("c", [*range(24), 5], None))[1])
    assert hits == [want, 24]
