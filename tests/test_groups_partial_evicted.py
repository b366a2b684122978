"""Partial hits (groups/partial.py): the cases mutants-r25's mutation pass found no test
of (a Mamba state kept past evicted full-attention blocks, an owner's request id admitted
again, a spare partial entry moved, Mamba blocks of the hash block's size)."""

import pytest

from prefixkv.errors import ConfigError, RequestError
from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba
from prefixkv.groups.results import GroupBlockCopy


def _manager(num_blocks=12):
    return HybridKVCacheManager([full_attention(), mamba()], num_blocks, BlockSizes.of([2, 4], partial=True),
                                hash_mode="sha256")


def test_a_mamba_state_kept_past_evicted_full_attention_blocks_is_no_hit():
    # hash 2, full attention at 2, Mamba at 4: the prompt's 8 tokens are full blocks 1-4
    # and the Mamba state at 8 (block 5); freed, then other prompts evict full blocks 4
    # and 3 (the free queue's tail-first order) while the Mamba state at 8 stays cached
    m = _manager()
    p = [0, 0, 1, 1, 2, 2, 3, 3, 4]
    m.add_request("0", p, num_new_tokens=8)
    assert m.get_block_ids("0") == ((1, 2, 3, 4), (0, 5))
    m.free("0")
    m.add_request("x", [9, 9, 8, 8, 7, 7, 6], num_new_tokens=6)
    m.add_request("y0", [50, 51, 52], num_new_tokens=2)
    m.add_request("y1", [51, 51, 52], num_new_tokens=2)
    assert m.get_block_ids("y1") == ((4,), (3,))  # (full blocks 4 and 3 evicted)
    assert [m.cached_block_ids(p, n) for n in (2, 4, 6, 8)] == [(1, None), (2, None), (None, None), (None, 5)]
    # the Mamba state at 8 holds no hit: the full-attention KV below it went (and the
    # Mamba blocks at 4 were never kept: no hit at 4 either)
    assert m.lookup(p) == 0
    assert m.lookup_block_ids(p) == ((), ())
    m.free("x")
    adm = m.add_request("z", p, num_new_tokens=8)
    assert adm.num_cached_tokens == 0
    assert 5 not in adm.group_block_ids[1] and m.take_kv_ops() == []
    m.check_invariants()


def test_a_request_id_admitted_again_owns_its_new_entry_alone():
    # "0" ends a step at its prompt's last boundary (a partial entry it owns) and is
    # freed without growing (vLLM preempts it); admitted again with another prompt, it
    # owns the entry of that prompt alone: its next growth moves that entry to a copy
    m = _manager(20)
    m.add_request("0", [0, 0, 1, 1, 2, 2, 3], num_new_tokens=6)
    m.free("0")
    p = [7, 7, 8, 8, 9, 9, 10]
    m.add_request("0", p, num_new_tokens=6)
    assert m.get_block_ids("0") == ((5, 6, 7), (0, 8))
    assert m.num_pending_copies("0") == 1
    assert m.owned_entries("0") == [(1, 8)]  # (group, block: the entry its growth moves)
    assert m.extend("0", 1) == ((9,), ())
    assert m.owned_entries("0") == []
    assert m.take_kv_ops() == [GroupBlockCopy(8, 10, group_idx=1)]
    assert m.get_block_ids("0")[1] == (0, 8)  # (the owner keeps writing its block)
    assert m.cached_block_ids(p[:6] + [11, 11], 6) == (7, 10)  # (the state at 6 is the copy's)
    assert m.lookup_block_ids(p[:6] + [11, 11]) == ((5, 6, 7), (0, 10))
    m.check_invariants()
    with pytest.raises(RequestError):
        m.owned_entries("gone")


def test_a_spare_partial_entry_moves_to_a_spare_copy():
    # a and b compute one prompt to its last boundary in the same step (b reads no
    # cache): b's Mamba block is a spare of a's entry; b's growth moves the spare
    m = _manager(20)
    p = [0, 0, 1, 1, 2, 2, 3]
    m.add_request("a", p, num_new_tokens=6)
    m.add_request("b", p, num_new_tokens=6, read_cache=False)
    assert (m.get_block_ids("a"), m.get_block_ids("b")) == (((1, 2, 3), (0, 4)), ((5, 6, 7), (0, 8)))
    assert m.extend("b", 1) == ((9,), ())
    assert m.take_kv_ops() == [GroupBlockCopy(8, 10, group_idx=1)]
    m.check_invariants()
    assert m.lookup_block_ids(p[:6] + [9, 9]) == ((1, 2, 3), (0, 4))  # (the primary: a's)
    m.free("a")
    m.release_copies([GroupBlockCopy(8, 10, group_idx=1)])
    m.check_invariants()
    assert m.lookup_block_ids(p[:6] + [9, 9]) == ((1, 2, 3), (0, 4))


def test_partial_hits_with_mamba_blocks_of_the_hash_blocks_size_are_refused():
    # (no Mamba block larger than the hash block: nothing falls inside one)
    with pytest.raises(ConfigError):
        HybridKVCacheManager([full_attention(), mamba()], 20, BlockSizes.of([2, 2], partial=True))


def test_a_load_past_a_partial_hits_mamba_block_leaves_the_cached_state_alone():
    # the hit of 6 tokens ends inside Mamba block 1 (4..7), a load brings 6..9 and the
    # step computes 10..11: the first query sits at 10, in block 2, so the request holds
    # no Mamba block of the hit (no copy); the load writes the state at 12 into a fresh
    # block, never into the cached state at 6 (block 4); the load's blocks are taken
    # first, group after group, then the step's (vLLM's order: groups/loads.py)
    m = _manager(20)
    m.add_request("0", [0, 0, 1, 1, 2, 2, 3], num_new_tokens=6)
    assert m.get_block_ids("0")[1] == (0, 4)
    m.free("0")
    p = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
    adm = m.add_request("1", p, num_new_tokens=6, num_external_tokens=4)
    assert adm.num_cached_tokens == 6
    assert adm.group_block_ids == ((1, 2, 3, 5, 6, 8), (0, 0, 7))
    assert m.take_kv_ops() == []
    m.check_invariants()
    assert m.lookup_block_ids(p[:7] + [9]) == ((1, 2, 3), (0, 4))


def test_a_hit_one_token_into_a_mamba_block_is_copied_on_write():
    # hash block 1, full attention at 1, Mamba at 4: the state at 5 (one token into the
    # Mamba block 4..7) is found and copied, as at any other point inside the block
    sizes = BlockSizes.of([1, 4], hash_size=1, partial=True)
    m = HybridKVCacheManager([full_attention(), mamba()], 20, sizes, hash_mode="sha256")
    m.add_request("0", [0, 1, 2, 3, 4, 5], num_new_tokens=5)
    assert m.get_block_ids("0") == ((1, 2, 3, 4, 5), (0, 6))
    m.free("0")
    p = [0, 1, 2, 3, 4, 9, 9]
    assert m.lookup(p) == 5
    assert m.lookup_block_ids(p) == ((1, 2, 3, 4, 5), (0, 6))
    adm = m.add_request("1", p, num_new_tokens=2)
    assert adm.group_block_ids == ((1, 2, 3, 4, 5, 7, 8), (0, 9))
    assert m.take_kv_ops() == [GroupBlockCopy(6, 9, group_idx=1)]
    m.check_invariants()
