"""Mamba's chunk-end checkpoint blocks in the sized manager (groups/checkpoints.py,
``BlockSizes.checkpoints``): vLLM's scenes by hand (hash 4, full attention at 4, Mamba at
8), and the refusals. tests/test_groups_sizes_machine.py (``CheckpointMachine``) holds
the manager to tests/sized_model.py's ``checkpoint`` on random streams."""

import pytest

from prefixkv import ConfigError
from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba


def _manager(num_blocks=12):
    sizes = BlockSizes.of([4, 8], partial=True, checkpoints=True)
    return HybridKVCacheManager([full_attention(), mamba()], num_blocks, sizes)


def test_a_prompt_checkpoints_at_its_last_hash_boundary_in_one_chunk():
    # 13 tokens in one step: the state at 12 goes to entry 0 (block 5), the step's end
    # to entry 1 (block 6); block 5 is found as the prefix of 12, inside Mamba entry 1
    m = _manager()
    adm = m.add_request("a", list(range(13)))
    assert adm.group_block_ids == ((1, 2, 3, 4), (5, 6))
    assert m.free_block_order() == [7, 8, 9, 10, 11]
    assert m.lookup_block_ids(list(range(13)) + [5]) == ((1, 2, 3), (0, 5))
    m.check_invariants()
    # the next step releases the checkpoint (below its start's state), cached: at the tail
    assert m.append_tokens("a", [7]) is not None
    assert m.get_block_ids("a") == ((1, 2, 3, 4), (0, 6))
    assert m.free_block_order() == [7, 8, 9, 10, 11, 5]
    m.free("a")
    # b hits it: 12 tokens, the state copied on write (block 5 into 4)
    adm = m.add_request("b", list(range(12)) + [9, 9, 9])
    assert adm.num_cached_tokens == 12 and adm.group_block_ids[1] == (0, 4)
    assert [(c.src, c.dst) for c in m.take_kv_ops()] == [(5, 4)]
    m.check_invariants()


def test_an_intermediate_checkpoint_is_never_found():
    # a first chunk of 16 of a 30-token prompt checkpoints at 12 into entry 0: not the
    # prompt's last boundary (28) nor an entry's end: its block is found by nobody
    m = _manager(20)
    adm = m.add_request("a", list(range(30)), num_new_tokens=16)
    assert adm.group_block_ids[1] == (5, 6)
    assert m.lookup(list(range(13))) == 0
    assert m.lookup(list(range(17))) == 16  # (the chunk's end, entry 1's own state)
    m.check_invariants()


def test_checkpoints_need_partial_hits():
    with pytest.raises(ConfigError, match="checkpoints"):
        BlockSizes.of([4, 8], checkpoints=True)
    with pytest.raises(ConfigError, match="checkpoints"):
        BlockSizes.of([4, 8], partial=True, checkpoints=1)


def test_require_full_fit_counts_the_prompts_checkpoint():
    # a first chunk of 4 of a 13-token prompt: the step takes a Mamba block only, but
    # the whole prompt in one step would checkpoint too (vLLM's full-sequence count)
    m = _manager(7)  # (6 usable: the 4 full attention and 2 Mamba the whole prompt takes)
    assert m.add_request("a", list(range(13)), num_new_tokens=4, require_full_fit=True) is not None
    m = _manager(6)
    assert m.add_request("a", list(range(13)), num_new_tokens=4, require_full_fit=True) is None
    assert m.add_request("a", list(range(13)), num_new_tokens=4) is not None
