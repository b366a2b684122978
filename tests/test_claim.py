"""The one-pass admission (``Index.claim``: probe, verify and take references together),
its exact undo, the parent's-child guess, the prefilling count and the decode edge paths.

block_size is 4 throughout; free orders as in test_manager_scenarios.py.
"""

import pytest

from prefixkv import Admission, ConfigError, DecodeStep, KVCacheManager, RequestError
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window

A = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # three full blocks


def manager(num_blocks: int, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, seed=0, **kw)


def test_a_shortage_after_claiming_free_hits_restores_refcounts_and_the_lru_order():
    m = manager(6)
    assert m.add_request("a", A + [13]) == Admission("a", (0, 1, 2, 3), 0, 13)
    m.free("a")
    assert m.free_block_order() == [3, 4, 5, 2, 1, 0]
    assert m.add_request("x", [50, 51, 52, 53, 54]) == Admission("x", (3, 4), 0, 5)
    before = m.free_block_order()
    assert before == [5, 2, 1, 0]
    # hits blocks 0, 1, 2 (all free, so claimed out of the LRU), then needs 3 more: 1 free
    assert m.add_request("b", A + list(range(100, 112))) is None
    assert m.free_block_order() == before
    assert m.num_free_blocks == 4 and m.stats.requests == 2
    m.check_invariants()
    assert m.add_request("c", A + [99]) == Admission("c", (0, 1, 2, 5), 12, 1)
    m.check_invariants()


def test_require_full_fit_undoes_the_claim_too():
    m = manager(5)
    m.add_request("a", A + [13])
    m.free("a")
    m.add_request("x", [50, 51])                  # holds one block: 4 free
    before = m.free_block_order()
    assert m.add_request("b", A + list(range(100, 108)), num_new_tokens=1,
                         require_full_fit=True) is None  # 5 blocks, 3 of them hits
    assert m.free_block_order() == before
    m.check_invariants()


def test_a_failing_hash_callable_after_the_claim_changes_nothing():
    calls = {"n": 0}

    def flaky(data: bytes) -> bytes:
        calls["n"] += 1
        if calls["n"] > 4:
            raise RuntimeError("hash service down")
        return data[-16:].rjust(16, b"\0")

    m = KVCacheManager(8, 4, hash_mode=flaky, enable_events=True)
    m.add_request("a", A + [13])  # 3 full blocks hashed (+ the root)
    m.free("a")
    before = m.free_block_order()
    with pytest.raises(ConfigError):
        m.add_request("b", A + [20, 21, 22, 23, 24])  # hits 3 free blocks, hashes one more
    assert m.free_block_order() == before
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_a_stale_child_guess_falls_back_to_the_probe_and_never_hits_wrong_content():
    m = manager(4)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    assert m.add_request("a", x + y + [0]) == Admission("a", (0, 1, 2), 0, 9)
    m.free("a")  # block 0 holds x; its child guess: block 1, holding y after x
    assert m.add_request("h", x + [0]) == Admission("h", (0, 2), 4, 1)  # holds x
    assert m.add_request("c", z + y) == Admission("c", (3, 1), 0, 8)  # evicts block 1: y after z
    assert m.lookup(x + y + [0]) == 4  # the guess (block 1) has y's tokens, another parent
    m.free("c")  # 1 then 3 join the LRU tail first
    assert m.add_request("d", x + y + [0]) == Admission("d", (0, 1, 3), 4, 5)
    assert m.lookup(z + y + [0]) == 0 and m.lookup(x + y + [0]) == 8
    m.check_invariants()


def test_decoded_tokens_fill_blocks_findable_by_later_prompts_and_twins_stay_spares():
    m = manager(8)
    m.add_request("a", [1, 2, 3])
    m.add_request("b", [1, 2, 3])
    assert m.append_step(["a", "b"], [4, 4]) == DecodeStep((), ())  # both fill block 0
    assert m.append_step(["a", "b"], [5, 5]) == DecodeStep((("a", (2,)), ("b", (3,))), ())
    assert m.num_cached_blocks == 1  # one content, b's copy a spare
    assert m.lookup([1, 2, 3, 4, 9]) == 4
    m.free("a")
    assert m.lookup([1, 2, 3, 4, 9]) == 4  # the spare keeps it findable
    m.check_invariants()
    assert m.append_tokens("b", [6]) == ()
    assert m.append_tokens("b", [7]) == ()
    assert m.append_tokens("b", [8]) == ()  # fills block 3 through the one-token edge path
    assert m.lookup([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    m.check_invariants()


@pytest.mark.parametrize("make", [
    lambda: manager(64),
    lambda: HybridKVCacheManager([full_attention(), sliding_window(8)], 200, 4, seed=0),
], ids=["core", "hybrid"])  # the hybrid manager borrows the core's step checks
def test_append_step_over_many_requests_refuses_one_still_prefilling(make):
    m = make()
    ids = [f"r{i}" for i in range(20)]
    for rid in ids:
        m.add_request(rid, [7, 8, 9])
    m.add_request("long", list(range(100, 120)), num_new_tokens=8)
    for step_ids in (ids + ["long"], ["r0", "long"]):
        with pytest.raises(RequestError, match="not yet scheduled"):
            m.append_step(step_ids, [1] * len(step_ids))
    with pytest.raises(RequestError, match="not live|unknown"):
        m.append_step(["r0", "nobody"], [1, 1])
    assert m.num_scheduled_tokens("r0") == 3
    m.extend("long", 12)  # its prefill is done: the step may include it
    step = m.append_step(ids + ["long"], [1] * 21)
    assert step.short == () and m.num_tokens("long") == 21
    with pytest.raises(RequestError, match="twice"):
        m.append_step(ids + ["r0"], [1] * 21)
    m.check_invariants()


def test_an_admission_read_later_still_shows_the_blocks_it_was_given():
    m = manager(8)
    adm = m.add_request("a", [1, 2, 3, 4, 5])  # blocks 0, 1; its ids are read on demand
    assert m.append_step(["a"], [6]) == DecodeStep((), ())
    assert m.append_tokens("a", [7, 8, 9]) == (2,)
    assert m.reserve("a", 8) == (3, 4)
    assert adm.block_ids == (0, 1) and m.get_block_ids("a") == (0, 1, 2, 3, 4)
    m.free("a")
    assert adm == Admission("a", (0, 1), 0, 5)


@pytest.mark.parametrize("events", [False, True])
@pytest.mark.parametrize("how", ["evicted", "evicted, one block taken", "reset"])
def test_a_chain_whose_blocks_lost_their_content_is_not_claimed_after_its_head(events, how):
    # Blocks 0, 1, 2 hold A, B, C recorded in one store (a chain a faster claim might
    # compare in one go: events-r9.md). Here all three lose their content and block 0
    # alone holds A again, recorded by itself: 1 and 2 must not be handed out after it.
    m = manager(4, enable_events=events)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    assert m.add_request("a", a + b + c + [0]) == Admission("a", (0, 1, 2, 3), 0, 13)
    m.free("a")
    if how == "reset":  # the free order is kept (3, empty, then the chain tail first): a
        # request on 3, 2, 1 leaves block 0 to hold A alone
        assert m.reset_prefix_cache() and m.free_block_order() == [3, 2, 1, 0]
        assert m.add_request("p", [11] * 4 + [12] * 4 + [13] * 3).block_ids == (3, 2, 1)
    else:  # evicted: 3, 2, 1, 0 take other content, freed head first
        assert m.add_request("e", [11] * 4 + [12] * 4 + [13] * 4 + [14] * 4).block_ids == (3, 2, 1, 0)
        m.free("e")
    if how != "evicted":  # one block, taken alone (``take_one``)
        assert m.add_request("f", a) == Admission("f", (0,), 0, 4)
    else:
        assert m.add_request("f", a + [0]).block_ids[0] == 0
    m.free("f")
    if how == "reset":
        m.free("p")
    got = m.add_request("g", a + b + c + [0])
    assert got.block_ids[0] == 0 and got.num_cached_tokens == 4
    m.check_invariants()


def test_a_chain_with_its_last_block_taken_alone_is_claimed_up_to_that_block():
    m = manager(4)  # no events: ``take_one`` evicts through the index's ``drop_one``
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    assert m.add_request("a", a + b + c + [0]) == Admission("a", (0, 1, 2, 3), 0, 13)
    m.free("a")  # 0, 1, 2 chained; 3 (partial) is empty
    assert m.add_request("x", [20] * 4) == Admission("x", (3,), 0, 4)
    assert m.add_request("y", [21] * 4) == Admission("y", (2,), 0, 4)  # C evicted alone
    m.free("y")
    m.free("x")
    got = m.add_request("g", a + b + c + [0])
    assert got.block_ids[:2] == (0, 1) and got.num_cached_tokens == 8
    m.check_invariants()


LONG = list(range(1000, 1032))  # eight full blocks: a head and a run of seven


@pytest.mark.parametrize("prepared", [False, True])
def test_a_capped_hit_stops_inside_a_run_at_the_cap(prepared):
    """The claim compares a run with the prompt's token bytes in one piece, which go on
    past the blocks it may hit: the cap (and the last token's block) bound it."""
    m = manager(16)
    m.add_request("a", LONG + [1])
    m.free("a")
    p = LONG + [2]
    got = m.add_request("b", m.prepare(p) if prepared else p, max_hit_tokens=13)
    assert got.num_cached_tokens == 12 and got.block_ids[:3] == (0, 1, 2)
    m.check_invariants()
    m.free("b")
    got = m.add_request("c", m.prepare(LONG) if prepared else LONG)  # (the last block: computed)
    assert got.num_cached_tokens == 28 and got.block_ids[:7] == (0, 1, 2, 3, 4, 5, 6)
    m.check_invariants()


@pytest.mark.parametrize("prepared", [False, True])
@pytest.mark.parametrize("parts", [1, 2, 5, 7])
def test_a_prompt_that_parts_from_a_run_is_claimed_up_to_where_they_part(prepared, parts):
    m = manager(16)
    m.add_request("a", LONG + [1])
    m.free("a")
    p = LONG[:4 * parts] + [7] * (32 - 4 * parts) + [3]  # block ``parts`` differs
    got = m.add_request("b", m.prepare(p) if prepared else p)
    assert got.num_cached_tokens == 4 * parts
    assert got.block_ids[:parts] == tuple(range(parts))
    m.check_invariants()
    m.free("b")
    got = m.add_request("c", LONG + [5])  # both parts found again (the rest: a run of its own)
    assert got.num_cached_tokens == 32 and got.block_ids[:8] == tuple(range(8))
    m.check_invariants()
