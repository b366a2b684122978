"""vLLM's fine-grained partial hits with a full-attention group larger than the hash
block (groups/partial_full.py, groups/fine.py), by hand: the scenes of vLLM 0.33's
tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py (hash block 2, full
attention at 4, Mamba at 4)."""

import pytest

from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba
from prefixkv.groups.results import GroupBlockCopy
from prefixkv.hashing import encode_tokens, token_bytes

PROMPT = [0, 0, 1, 1, 2, 2, 3]


def _manager(num_blocks=24, events=False):
    return HybridKVCacheManager([full_attention(), mamba()], num_blocks,
                                BlockSizes.of([4, 4], 2, partial=True), hash_mode="sha256",
                                enable_events=events, max_events=64)


def test_a_hit_on_full_attentions_partial_entry_is_copied_on_write():
    m = _manager()
    m.add_request("0", PROMPT, num_new_tokens=6)  # (the prompt's last boundary, 6, inside block 1)
    full, state = m.get_block_ids("0")[0][1], m.get_block_ids("0")[1][1]
    m.free("0")
    assert m.cached_block_ids(PROMPT, 6) == (full, state)  # (both partial entries)
    assert m.lookup([0, 0, 1, 1, 2, 2, 3, 3]) == 6
    assert m.lookup_block_ids([0, 0, 1, 1, 2, 2, 3, 3])[0][1] == full
    adm = m.add_request("1", [0, 0, 1, 1, 2, 2, 3, 3], num_new_tokens=2)
    assert adm.num_cached_tokens == 6
    copy = adm.group_block_ids[0][1]
    assert copy != full and len(adm.group_block_ids[0]) == 2  # (the copy, in the source's place)
    ops = m.take_kv_ops()
    assert GroupBlockCopy(full, copy, group_idx=0) in ops and len(ops) == 2
    assert m.cached_block_ids(PROMPT, 6)[0] == full  # (the source keeps its entry: found first)
    m.check_invariants()
    free = m.num_free_blocks
    m.release_copies(ops)
    assert m.num_free_blocks == free + 2  # (both sources: no request holds them now)
    m.check_invariants()


def test_the_copy_holds_the_entry_after_its_source_and_is_cached_once_whole():
    m = _manager()
    m.add_request("0", PROMPT, num_new_tokens=6)
    full = m.get_block_ids("0")[0][1]
    m.free("0")
    m.add_request("1", PROMPT, num_new_tokens=1)  # (hit 6: the same prompt's last boundary)
    copy = m.get_block_ids("1")[0][1]
    assert m.prefix_probe(PROMPT).copies(6, 0) == (full, copy)  # (vLLM caches every copy)
    m.release_copies(m.take_kv_ops())
    assert m.append_tokens("1", [3]) is not None  # (the copy is whole: promoted)
    assert m.cached_block_ids([*PROMPT, 3], 8)[0] == copy
    assert m.prefix_probe(PROMPT).copies(6, 0) == (full, copy)
    m.check_invariants()


def test_promotion_announces_the_entry_removed_the_block_stored_then_the_entry_again():
    m = _manager(events=True)
    m.add_request("0", [*PROMPT, 3], num_new_tokens=6)  # (its last boundary: 6 again)
    whole, entry = [e for e in m.take_events() if e.group_idx == 0]
    assert (whole.block_size, entry.block_size, entry.first_block) == (4, 2, 2)  # (entry: tokens 4..5)
    assert entry.token_bytes == token_bytes(encode_tokens([2, 2]))
    assert m.extend("0", 2) is not None  # (block 1 whole)
    got = [(type(e).__name__, e.block_size if hasattr(e, "token_bytes") else None)
           for e in m.take_events() if e.group_idx == 0]
    assert got == [("GroupBlockRemoved", None), ("GroupBlockStored", 4), ("GroupBlockStored", 2)]
    m.check_invariants()


def test_a_hit_inside_a_block_found_whole_is_copied_too():
    m = HybridKVCacheManager([full_attention(), mamba()], 24, BlockSizes.of([8, 4], 2, partial=True),
                             hash_mode="sha256")
    m.add_request("0", [0, 0, 1, 1, 2, 2, 3, 3, 5], num_new_tokens=4)  # (Mamba's state at 4)
    m.extend("0", 5)
    whole = m.get_block_ids("0")[0][0]
    m.free("0")
    assert m.lookup([0, 0, 1, 1, 2, 2, 3, 3, 6]) == 4  # (block 0 found whole, Mamba's state at 4)
    adm = m.add_request("1", [0, 0, 1, 1, 2, 2, 3, 3, 6], num_new_tokens=1)
    ops = m.take_kv_ops()
    assert GroupBlockCopy(whole, adm.group_block_ids[0][0], group_idx=0) in ops
    m.check_invariants()


def test_full_attention_alone_serves_its_partial_entry():
    m = _manager()
    m.add_request("0", PROMPT, num_new_tokens=6)  # (full attention's entry at 6; Mamba's too)
    m.free("0")
    # (vLLM's lookup of full attention alone, the junction's first group: whole block 0,
    # then the entry at 6 inside block 1)
    assert m.lookup_per_group([0, 0, 1, 1, 2, 2, 3, 3])[0] == 6


def test_a_copy_freed_as_a_spare_returns_empty_in_the_order_given():
    # (two requests copy the same entry on write and cache the same whole block; the
    # second's copy is a spare of the first's: freed with the copies, it returns empty,
    # before the Mamba copy given after it, as vLLM's free_blocks orders them)
    m = HybridKVCacheManager([full_attention(), mamba()], 40, BlockSizes.of([8, 16], 4, partial=True),
                             hash_mode="sha256")
    stem = [1 + k % 7 for k in range(16)]
    m.add_request("0", stem[:13], num_new_tokens=12)  # (the entries at 12)
    m.add_request("1", stem[:15] + [0])
    m.add_request("2", stem[:15] + [0])
    copies = m.take_kv_ops()
    m.free("2")
    m.release_copies(copies)
    assert m.free_block_order()[:2] == [copies[2].dst, copies[3].dst]
    m.check_invariants()


def test_a_free_primary_takes_its_freed_spares_place_among_the_cached_ones():
    # (the scene above with both copying requests freed first: their copies 4 and 5 go
    # cached, then 6 and 7, their spares, go empty; vLLM keeps 6 and 7 cached after 4
    # and 5, so under the twin rule 4 takes 6's place, then 5 takes 7's: 4 before 5)
    m = HybridKVCacheManager([full_attention(), mamba()], 40, BlockSizes.of([8, 16], 4, partial=True),
                             hash_mode="sha256")
    stem = [1 + k % 7 for k in range(16)]
    m.add_request("0", stem[:13], num_new_tokens=12)
    m.add_request("1", stem[:15] + [0])
    m.add_request("2", stem[:15] + [0])
    copies = m.take_kv_ops()
    first, spare = copies[:2], copies[2:]
    m.free("1")
    m.free("2")
    m.release_copies(copies)
    order = m.free_block_order()
    assert order[:2] == [c.dst for c in spare]  # (returned empty, reused in the order given)
    assert order[-2:] == [c.dst for c in first]
    m.check_invariants()


def test_a_hit_stops_at_a_gap_in_full_attention():
    # (a full-attention group may find a whole block without the one before it: the
    # machines reach it (session 29: TestFineWideMachine, its reference vetted against
    # vLLM's manager, has the same gap); the hit stops at the first block not found: here
    # the gap is made by hand)
    m = _manager()
    prompt = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
    m.add_request("0", prompt, num_new_tokens=4)
    m.extend("0", 4)
    m.extend("0", 4)  # (full attention's blocks 0..2 whole, Mamba's states at 4, 8 and 12)
    first, middle = (m._pool.blocks[i] for i in m.get_block_ids("0")[0][:2])
    m.free("0")
    assert m.lookup(prompt) == 12
    m._index.drop_one(middle)  # (block 1 forgotten, blocks 0 and 2 still found)
    m._pool.emptied([middle])
    m.check_invariants()
    assert m.lookup(prompt) == 4  # (block 0 whole and Mamba's state at 4: not block 2)
    assert m.lookup_block_ids(prompt)[0] == (first.block_id,)


def test_an_admission_that_does_not_hold_its_tail_leaves_the_copy_without_the_entry():
    # (vLLM's delay_cache_blocks: its cache_blocks, which gives the copy the entry, runs later)
    m = _manager(events=True)
    m.add_request("0", PROMPT, num_new_tokens=6)
    full = m.get_block_ids("0")[0][1]
    m.free("0")
    m.take_events()
    m.add_request("1", PROMPT, num_new_tokens=1, hold_tail=False)  # (hit 6: the prompt's last boundary)
    copy = m.get_block_ids("1")[0][1]
    assert m.prefix_probe(PROMPT).copies(6, 0) == (full,)  # (held: (full, copy), as the test above)
    assert not [e for e in m.take_events() if e.group_idx == 0]  # (nothing announced)
    m.release_copies(m.take_kv_ops())
    assert m.append_tokens("1", [3]) is not None  # (a growth past the hit: the copy, whole, gets it)
    assert m.cached_block_ids([*PROMPT, 3], 8)[0] == copy
    assert m.prefix_probe(PROMPT).copies(6, 0) == (full, copy)
    m.check_invariants()


def test_hold_tail_must_be_a_bool():

    from prefixkv.errors import RequestError

    m = _manager()
    free = m.num_free_blocks
    with pytest.raises(RequestError, match="hold_tail"):
        m.add_request("0", PROMPT, num_new_tokens=6, hold_tail=0)
    assert m.num_free_blocks == free  # (nothing changed)
    m.check_invariants()
