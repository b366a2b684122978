"""Chained blocks: a new content recorded only as its parent's ``child`` (no dict entry),
and every case where a content must be keyed in the dicts instead: a first block, a
sibling displaced by a newer one, a content with spares and its children. Each case runs
with events off (the index's fast paths: ``store_filled``, batch eviction) and on. With a
host tier below: blocks loaded from slots are chained too, and a chained block whose
parent's content leaves the device is keyed, since the walk may reach that content in a
slot.

block_size is 4 throughout. The first test looks at the index's dicts to show the
mechanism; the rest judge by hits, exact ids and ``check_invariants``.
"""

import pytest

from prefixkv import Admission, BlockLoads, BlockOffloads, ExtraKeys, KVCacheManager

A = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # three full blocks

EVENTS = pytest.mark.parametrize("events", [False, True], ids=["fast", "events"])


def manager(num_blocks: int, events: bool) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, seed=0, enable_events=events)


def chained(index) -> int:
    """The index's chained blocks, pending runs' blocks included (``index/pending.py``)."""
    return index._num_chained + sum(len(r.blocks) for r in index.run_counts.pending)


@EVENTS
def test_a_prompt_keys_its_first_block_only_and_eviction_deletes_no_entry(events):
    m = manager(10, events)
    prompt = list(range(100, 132))  # 8 full blocks
    assert m.add_request("a", prompt + [7]) == Admission("a", tuple(range(9)), 0, 33)
    index = m._index
    assert (len(index._by_chunk), chained(index), m.num_cached_blocks) == (1, 7, 8)
    m.free("a")
    assert m.lookup(prompt + [7]) == 32
    # a new prompt of 9 blocks evicts 8 cached ones (the least recently used first)
    assert m.add_request("b", list(range(200, 236)) + [7]) is not None
    assert len(index._by_chunk) + chained(index) == m.num_cached_blocks == 9
    assert m.lookup(prompt + [7]) == 0
    m.check_invariants()
    if events:
        assert sum(len(e.block_hashes) for e in m.take_events()
                   if type(e).__name__ == "BlockRemoved") == 8


@EVENTS
def test_a_sibling_displaced_by_a_newer_one_is_keyed_and_both_stay_found(events):
    m = manager(12, events)
    m.add_request("a", A + [13])
    m.free("a")
    b = A[:8] + [20, 21, 22, 23, 24]
    assert m.add_request("b", b) == Admission("b", (0, 1, 3, 4), 8, 5)  # 3: a's partial
    m.check_invariants()
    m.free("b")
    assert m.lookup(A + [13]) == 12 and m.lookup(b) == 12
    c = A[:8] + [30, 31, 32, 33, 34]  # a third branch: b's block is displaced in turn
    assert m.add_request("c", c) == Admission("c", (0, 1, 4, 5), 8, 5)
    m.free("c")
    assert [m.lookup(p) for p in (A + [13], b, c)] == [12, 12, 12]
    m.check_invariants()


@EVENTS
def test_forks_decoding_equal_tokens_make_a_spare_of_the_chained_block(events):
    m = manager(8, events)
    m.add_request("a", [1, 2, 3, 4, 5, 6])
    f = m.fork("a", "c")
    assert f is not None and f.block_ids == (0, 2)
    for t in (7, 8):  # one token a call: the decode path (store_filled)
        assert m.append_tokens("a", [t]) == () and m.append_tokens("c", [t]) == ()
    # block 1 (a's) was recorded first; c's block 2 holds equal content: it is a spare
    assert m.get_block_ids("a") == (0, 1) and m.get_block_ids("c") == (0, 2)
    m.check_invariants()
    assert m.num_cached_blocks == 2
    assert m.append_tokens("c", [9, 10, 11, 12, 13]) == (3, 4)  # 3: a child of the spare
    m.check_invariants()
    m.free("a")
    m.check_invariants()
    assert m.lookup(list(range(1, 14))) == 12  # found below the spare's content
    m.free("c")
    assert m.lookup(list(range(1, 14))) == 12 and m.num_cached_blocks == 3
    m.check_invariants()


@EVENTS
def test_a_decode_block_equal_to_a_keyed_sibling_becomes_its_spare(events):
    m = manager(10, events)
    m.add_request("a", [1, 2, 3, 4, 5, 6])
    m.fork("a", "c1")
    m.fork("a", "c2")
    for r, toks in (("a", [7, 8]), ("c1", [9, 10]), ("c2", [7, 8])):
        for t in toks:  # one token a call: the decode path (store_filled)
            m.append_tokens(r, [t])
        if r == "c1":   # a's block (chained under block 0) is displaced: keyed now
            before = m.num_cached_blocks
    # c2's block equals a's, found by the dict probe
    assert m.num_cached_blocks == before == 3
    m.check_invariants()
    for r in ("a", "c1", "c2"):
        m.free(r)
    assert m.lookup([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    assert m.lookup([1, 2, 3, 4, 5, 6, 9, 10, 0]) == 8
    m.check_invariants()


@EVENTS
def test_one_append_step_fills_equal_and_different_blocks_under_one_parent(events):
    m = manager(12, events)
    m.add_request("a", [1, 2, 3, 4, 5, 6, 7])
    for c in ("b", "c", "d"):
        m.fork("a", c)
    got = m.append_step(["a", "b", "c", "d"], [8, 9, 8, 9])
    assert sorted(got.grown) == [] and got.short == ()
    m.check_invariants()
    assert m.num_cached_blocks == 3  # block 0, and one content for each of 8 and 9
    for r in "abcd":
        m.free(r)
    assert m.lookup([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    assert m.lookup([1, 2, 3, 4, 5, 6, 7, 9, 0]) == 8
    m.check_invariants()


@EVENTS
def test_a_block_aligned_resend_keys_the_content_and_its_children_while_a_spare_is_held(events):
    m = manager(12, events)
    m.add_request("a", A)
    m.free("a")
    # the last block is always computed: it becomes a spare of the cached (chained) one
    assert m.add_request("b", A) == Admission("b", (0, 1, 3), 8, 4)
    m.check_invariants()
    assert m.append_tokens("b", [13, 14, 15, 16]) == (4,)  # block 3 filled: under the spare
    m.check_invariants()
    assert m.lookup(A + [13, 14, 15, 16, 0]) == 16
    m.free("b")
    m.check_invariants()
    assert m.lookup(A + [13, 14, 15, 16, 0]) == 16
    # with the spare gone, a new child of the content is chained again
    assert m.add_request("c", A + [40, 41, 42, 43, 0]) == Admission("c", (0, 1, 2, 3, 5), 12, 5)
    m.check_invariants()


@EVENTS
def test_a_decode_block_equal_to_a_content_keyed_by_its_triple_becomes_its_spare(events):
    m = manager(12, events)
    for rid, prompt in (("y", [1, 2, 3, 4, 0]),                 # [1,2,3,4] first: keyed
                        ("x", [5, 6, 7, 8, 1, 2, 3, 4, 0]),     # chained under [5,6,7,8]
                        ("z", [5, 6, 7, 8, 9, 9, 9, 9, 0])):    # displaces it: by its triple
        m.add_request(rid, prompt)
        m.free(rid)
    assert m._index._by_key  # the second [1,2,3,4] is keyed by (parent, tokens, extra)
    m.add_request("d", [5, 6, 7, 8, 1, 2, 3])
    before = m.num_cached_blocks
    assert m.append_tokens("d", [4]) == ()  # fills x's content again: a spare, not a copy
    assert m.num_cached_blocks == before
    m.check_invariants()
    m.free("d")
    assert m.lookup([5, 6, 7, 8, 1, 2, 3, 4, 0]) == 8
    m.check_invariants()


@EVENTS
def test_a_block_filled_under_a_content_with_a_held_spare_is_keyed(events):
    m = manager(12, events)
    m.add_request("a", A)
    m.free("a")
    assert m.add_request("c", A + [13]).num_cached_tokens == 12  # holds the primary of A's
    assert m.add_request("b", A).num_cached_tokens == 8           # last block; b its spare
    for t in (14, 15, 16):  # one token a call: c fills a block under the primary
        m.append_tokens("c", [t])
    m.check_invariants()  # keyed, not chained: b's request finds it by probing
    m.free("b")
    m.free("c")
    assert m.lookup(A + [13, 14, 15, 16, 0]) == 16
    m.check_invariants()


def tiered(num_blocks: int, events: bool, host_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, seed=0, enable_events=events, host_blocks=host_blocks)


@EVENTS
def test_with_a_tier_new_and_loaded_blocks_are_chained(events):
    m = tiered(4, events)
    index = m._index
    assert m.add_request("a", A + [13]) == Admission("a", (0, 1, 2, 3), 0, 13)
    assert (len(index._by_chunk), index._num_chained) == (1, 2)  # as without a tier
    m.take_kv_ops()
    m.free("a")
    b = list(range(40, 53))
    m.add_request("b", b)  # evicts a's three blocks (tail first): offloaded
    assert m.take_kv_ops() == [BlockOffloads((2, 1, 0), (0, 1, 2))]
    m.free("b")
    adm = m.add_request("c", A + [13])  # all three from the host, into fresh blocks
    assert (adm.num_cached_tokens, m.stats.host_hits) == (12, 12)
    # b's blocks went to the host; c's first block is keyed, the two loaded after it chained
    assert (len(index._by_chunk), index._num_chained) == (1, 2)
    m.check_invariants()
    m.take_kv_ops()
    m.append_tokens("c", [14, 15, 16])  # fills a block under a loaded one: chained too
    assert index._num_chained == 3
    m.free("c")
    assert m.lookup(A + [13, 14, 15, 16, 0]) == 16 and m.lookup(b) == 12
    m.check_invariants()


@EVENTS
def test_with_a_tier_blocks_chained_under_a_content_uncached_from_the_device_go_with_it(events):
    m = tiered(8, events)
    a8 = A[:8]
    m.add_request("a", a8 + [9])
    m.take_kv_ops()
    m.free("a")
    m.add_request("f", list(range(100, 132)))  # a's two blocks go to host slots
    assert m.take_kv_ops() == [BlockOffloads((1, 0), (0, 1))]
    m.free("f")
    # r1: block 0 from the host; block 1 (its last, never probed) is computed again and
    # takes the id of the slot that keeps it. r2 hits both in the same step and chains
    # two new blocks under them. Then r1 is dropped before its step ran, and r2 is not:
    # an engine breaking the contract of ``free(num_computed_tokens=...)`` (r2 reads KV
    # never written). The index must stay exact and consistent all the same.
    assert m.add_request("r1", a8).num_cached_tokens == 4
    r = a8 + list(range(10, 18)) + [18]
    assert m.add_request("r2", r).num_cached_tokens == 8
    m.free("r1", num_computed_tokens=4)  # r1's block 1 was never computed: unfindable
    m.check_invariants()  # r2's two blocks computed on top of it went with it
    m.take_kv_ops()
    m.free("r2")  # (they return empty)
    # the walk: block 0 on the device, block 1 in its slot; r2's blocks were computed on
    # KV never written: not found under the slot's content (before, 16: the keyed one,
    # and the one chained under it)
    assert m.lookup(r) == 8
    # (r2's blocks (0, 1, 7, 6, 5) went empty tail first, as vLLM reuses them: 5, 6, 7, 1)
    assert m.add_request("r3", r) == Admission("r3", (0, 5, 6, 7, 1), 8, 9)
    assert m.take_kv_ops()[-1] == BlockLoads((0,), (5,))  # only block 1 is loaded
    m.check_invariants()



def _spares_of_an_aborted_salted_prompt(m, blocks, cached=()):
    """A cached unsalted block of 9s (then the blocks of ``cached``, each a prompt freed
    after it), then a salted prompt of ``blocks`` blocks of 9s (its second and later
    blocks are chained: their key is the token bytes, the unsalted content's key) that
    another request hits before its step ran; both are dropped (the first one first),
    so the hit blocks become spares of no content."""
    salted = ExtraKeys(cache_salt="a")
    for i, prompt in enumerate([[9] * 4 + [1], *cached]):
        m.add_request(i, prompt)
        m.free(i)
    m.add_request("s", [9] * 4 * blocks + [1], extra=salted)
    m.add_request("o", [9] * 4 * blocks + [2], extra=salted)
    m.free("s", num_computed_tokens=0)
    m.free("o", num_computed_tokens=0)


@EVENTS
def test_a_chained_spare_freed_leaves_the_unrelated_content_under_its_key_in_place(events):
    """``release_spare`` took the block under the spare's key for its primary: another
    content with the same token bytes, moved to the most recently used end of the LRU."""
    m = manager(10, events)
    _spares_of_an_aborted_salted_prompt(m, 2, cached=([5] * 4 + [1], [6] * 4 + [1]))
    m.check_invariants()
    lru = [m._pool.blocks[b].key for b in m.free_block_order() if m._pool.blocks[b].key]
    assert [key[:4] for key in lru] == [bytes([9, 0, 0, 0]), bytes([5, 0, 0, 0]),
                                        bytes([6, 0, 0, 0])]  # the order they were used in


@EVENTS
def test_two_chained_spares_with_the_token_bytes_of_one_free_content_are_freed_together(events):
    """Both spares named the same free block as their primary: the second ``remove`` of
    it from the LRU failed an assertion halfway through the release (the pool left
    corrupted)."""
    m = manager(10, events)
    _spares_of_an_aborted_salted_prompt(m, 3)
    m.check_invariants()
    assert m.num_free_blocks == 10 and m.lookup([9] * 4 + [0]) == 4
