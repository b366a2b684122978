"""``KVCacheManager.rewind``: a request's blocks whose KV turned out invalid
(``uncache_blocks``) are recomputed in place and then cached again; never before, and
never a block computed on top of invalid KV."""

from __future__ import annotations

import pytest

from prefixkv import KVCacheManager, RequestError

BS = 4


def test_a_block_recomputed_after_uncache_blocks_is_found_again():
    m = KVCacheManager(16, BS, hash_mode="sha256", enable_events=True)
    m.add_request("a", list(range(13)))
    ids = m.get_block_ids("a")
    m.uncache_blocks([ids[1]])  # a load into block 1 failed
    assert m.lookup(list(range(14))) == 4
    # the engine sets a back to block 1 and recomputes tokens 4..12 into the same blocks
    m.rewind("a", 4)
    m.check_invariants()
    assert m.lookup(list(range(14))) == 4  # not before it is recomputed
    assert m.extend("a", 9) == ()
    m.check_invariants()
    # before: 4 (blocks 1 and 2 were never cached again while a lived: missed hits)
    assert m.lookup(list(range(14))) == 12
    assert m.lookup_block_ids(list(range(14))) == ids[:3]
    m.free("a")
    assert m.add_request("b", list(range(14))).num_cached_tokens == 12
    m.check_invariants()


def test_blocks_computed_on_top_of_invalid_kv_stay_unfound():
    m = KVCacheManager(16, BS, hash_mode="sha256")
    m.add_request("a", list(range(13)))
    ids = m.get_block_ids("a")
    m.uncache_blocks([ids[1]])
    m.rewind("a", 8)  # (an engine rewinding past the invalid block: block 2 is on top of it)
    assert m.extend("a", 5) == ()
    m.check_invariants()
    assert m.lookup(list(range(14))) == 4
    m.rewind("a", 2)  # into block 0: it and what follows are recomputed
    assert m.lookup(list(range(14))) == 0
    m.extend("a", 11)
    assert m.lookup(list(range(14))) == 12
    m.check_invariants()


def test_rewind_into_the_prompt_counts_the_request_as_prefilling_again():
    m = KVCacheManager(16, BS)
    m.add_request("a", list(range(9)))
    m.append_tokens("a", [9])
    m.rewind("a", 10)  # nothing to take back: still decoding
    assert m.append_step(["a"], [10]).short == ()
    m.rewind("a", 6)
    m.check_invariants()
    with pytest.raises(RequestError, match="not yet scheduled"):
        m.append_tokens("a", [1])
    with pytest.raises(RequestError):
        m.append_step(["a"], [1])
    assert m.extend("a", 5) == ()
    assert m.num_scheduled_tokens("a") == 11 and m.get_block_ids("a") == m.get_block_ids("a")
    m.append_step(["a"], [11])
    m.check_invariants()


def test_bad_rewinds_raise_before_any_change():
    m = KVCacheManager(16, BS)
    m.add_request("a", list(range(13)))
    m.add_request("b", list(range(9)))  # hits a's blocks 0 and 1
    m.check_invariants()
    before = (m.free_block_order(), m.num_cached_blocks, m.get_block_ids("a"), m.num_scheduled_tokens("a"))
    for bad in (-1, 14, 1.0, True, "4", None):
        with pytest.raises(RequestError):
            m.rewind("a", bad)
    with pytest.raises(RequestError, match="held by other requests"):
        m.rewind("a", 4)  # block 1 is b's too
    with pytest.raises(RequestError):
        m.rewind("nobody", 0)
    assert (m.free_block_order(), m.num_cached_blocks, m.get_block_ids("a"),
            m.num_scheduled_tokens("a")) == before
    m.rewind("a", 8)  # block 2 is a's alone
    m.check_invariants()


def test_a_rewind_past_a_hit_with_a_host_tier_keeps_the_tier_sound():
    # found by a random-order fuzz: with a host tier, rewinding a request into a block it
    # hit emptied the parent of another request's cached child, which the tier's walk
    # must then no longer trust (as uncache_blocks does); before, InvariantError: a block
    # found but its parent's content not on the device
    m = KVCacheManager(12, BS, hash_mode="sha256", host_blocks=4)
    m.add_request("gone", list(range(9)))
    m.free("gone")  # blocks 0 and 1 cached, 1 a child of 0
    m.add_request("a", list(range(4)) + [99, 98])  # hits block 0 only
    m.rewind("a", 0)
    m.check_invariants()
    assert m.lookup(list(range(9))) == 0
    m.extend("a", 6)
    m.check_invariants()
    assert m.lookup(list(range(4)) + [99]) == 4
