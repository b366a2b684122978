"""Partial hits (groups/partial.py) where one group's blocks of a prefix went and another's
stayed: the hit is what every group still finds (tests the mutation pass showed missing)."""

from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba


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
