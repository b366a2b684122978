"""vLLM's fine-grained partial hits in the sized manager (groups/partial.py), by hand: the
scenes of vLLM 0.33's tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py
(hash block 2, full attention at 2, Mamba at 4), and the refusals."""

import dataclasses

import pytest

from prefixkv.errors import ConfigError, RequestError
from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba, sliding_window
from prefixkv.groups.events import GroupBlockStored
from prefixkv.groups.results import GroupBlockCopy
from prefixkv.hashing import encode_tokens, token_bytes


def _manager(num_blocks=20):
    return HybridKVCacheManager([full_attention(), mamba()], num_blocks, BlockSizes.of([2, 4], partial=True),
                                hash_mode="sha256")


def test_a_hit_inside_a_mamba_block_is_copied_on_write():
    m = _manager()
    m.add_request("0", [0, 0, 1, 1, 2, 2, 3], num_new_tokens=6)  # (ends at the prompt's last boundary)
    source = m.get_block_ids("0")[1][1]
    m.free("0")
    assert m.take_kv_ops() == []
    assert m.lookup([0, 0, 1, 1, 2, 2, 3, 3]) == 6  # (inside the Mamba block 4..7)
    assert m.lookup_block_ids([0, 0, 1, 1, 2, 2, 3, 3])[1] == (m.null_block_id, source)
    assert m.cached_block_ids([0, 0, 1, 1, 2, 2, 3, 3], 6)[1] == source  # (the partial entry)
    adm = m.add_request("1", [0, 0, 1, 1, 2, 2, 3, 3], num_new_tokens=2)
    assert adm.num_cached_tokens == 6
    copy = adm.group_block_ids[1][1]
    assert copy != source
    assert m.take_kv_ops() == [GroupBlockCopy(source, copy, group_idx=1)]
    free = m.num_free_blocks
    m.check_invariants()
    m.release_copies([GroupBlockCopy(source, copy, group_idx=1)])
    assert m.num_free_blocks == free + 1  # (the source: no request holds it now)
    m.check_invariants()
    with pytest.raises(RequestError):
        m.release_copies([GroupBlockCopy(source, copy, group_idx=1)])  # (given back already)


def test_the_owner_going_on_moves_its_entry_to_a_copy():
    m = _manager()
    m.add_request("0", [0, 0, 1, 1, 2, 2, 3], num_new_tokens=6)
    source = m.get_block_ids("0")[1][1]
    assert m.extend("0", 1) is not None  # (the owner's next step: the prompt's last token)
    (op,) = m.take_kv_ops()
    assert (op.src, op.group_idx) == (source, 1) and op.dst != source
    assert m.get_block_ids("0")[1][1] == source  # (the owner keeps writing its block)
    assert m.lookup_block_ids([0, 0, 1, 1, 2, 2, 4, 4])[1] == (m.null_block_id, op.dst)
    assert m.cached_block_ids([0, 0, 1, 1, 2, 2, 4, 4], 6)[1] == op.dst
    m.free("0")
    assert not m.reset_prefix_cache()  # (the copy still holds its blocks)
    m.release_copies([op])
    m.check_invariants()
    assert m.reset_prefix_cache()


@pytest.mark.parametrize("specs,sizes", [
    ([full_attention(), mamba()], [2, 2]),  # (no Mamba block larger than the hash block)
    ([full_attention(), full_attention(), mamba()], [4, 8, 8]),  # (two full sizes beyond the hash block)
    ([sliding_window(8), mamba()], [2, 4]),  # (a window)
    ([full_attention(), mamba()], [4, 8, 2]),  # (sizes for another number of groups)
])
def test_partial_hits_are_refused_where_not_served(specs, sizes):
    with pytest.raises(ConfigError):
        HybridKVCacheManager(specs, 20, BlockSizes.of(sizes, hash_size=2, partial=True))


def test_a_partial_entry_is_announced_as_one_hash_block_and_moves_silently():
    m = HybridKVCacheManager([full_attention(), mamba()], 20, BlockSizes.of([2, 4], partial=True),
                             hash_mode="sha256", enable_events=True, max_events=64)
    m.add_request("0", [0, 0, 1, 1, 2, 2, 3], num_new_tokens=6)  # (ends at the prompt's last boundary)
    source = m.get_block_ids("0")[1][1]
    (entry,) = [e for e in m.take_events() if e.group_idx == 1]
    assert (entry.block_size, entry.block_ids, entry.first_block) == (2, (source,), 2)  # (tokens 4..5)
    assert entry.token_bytes == token_bytes(encode_tokens([2, 2]))
    stored = [e for e in m._index.snapshot() if isinstance(e, GroupBlockStored)]  # (what is findable)
    assert entry.parent_block_hash == next(e for e in stored if e.group_idx == 0 and e.first_block == 1
                                           ).block_hashes[0]  # (the prefix of 4: full attention's block 1)
    assert m.extend("0", 1) is not None  # (the owner goes on: its entry moves to a copy)
    (op,) = m.take_kv_ops()
    assert [e for e in m.take_events() if e.group_idx == 1] == []  # (moved silently, as vLLM)
    moved = [e for e in m._index.snapshot() if isinstance(e, GroupBlockStored) and e.group_idx == 1]
    assert moved == [dataclasses.replace(entry, block_ids=(op.dst,))]
    m.free("0")
    m.release_copies([op])
    assert m.reset_prefix_cache()


def test_partial_hits_refuse_peek():
    with pytest.raises(ConfigError):
        BlockSizes.of([2, 4], peek=[True, False], partial=True)
    with pytest.raises(ConfigError):
        BlockSizes.of([2, 4], partial=1)
    with pytest.raises(RequestError):
        _manager().release_copies(7)
