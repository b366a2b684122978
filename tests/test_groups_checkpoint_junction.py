"""Mamba's chunk-end checkpoints at a request's junction and at vLLM's
``prefill_checkpoint_alignment`` (groups/checkpoints.py), by hand: hash 4, full
attention at 4, Mamba at 8. tests/test_groups_sizes_machine.py (the checkpoint machines'
``add_past_junction``, ``CheckpointAlignedMachine``) holds the manager to
tests/sized_model.py on random streams, which tests/engines/test_vllm_mamba_checkpoints.py
holds to vLLM's manager."""

import pytest

from prefixkv import ConfigError
from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba

A = list(range(1, 41))  # (40 tokens)


def _manager(num_blocks=30, alignment=None):
    sizes = BlockSizes.of([4, 8], partial=True, checkpoints=True, checkpoint_alignment=alignment)
    return HybridKVCacheManager([full_attention(), mamba()], num_blocks, sizes)


def _after_a(m):
    # a in one step: full attention caches its 10 blocks; Mamba holds the states at 36
    # (the prompt's checkpoint) and 40 only: a prompt sharing its first 28 tokens finds
    # 28 in full attention alone, 0 in every group (vLLM's junction: 28)
    assert m.add_request("a", A) is not None
    m.free("a")
    b = A[:28] + [99] * 20
    assert m.lookup(b) == 0 and m.lookup_per_group(b)[0] == 28
    return b


def test_a_checkpoint_at_the_junction_is_cached():
    # b's first chunk (30 tokens) checkpoints at 28 into Mamba entry 2: not an entry's end
    # nor b's prompt's last boundary (44), but its junction: cached as the prefix of 28
    m = _manager()
    b = _after_a(m)
    assert m.add_request("b", b, num_new_tokens=30, junction=28) is not None
    assert m.lookup(A[:28] + [5, 5]) == 28
    m.check_invariants()
    # the next step releases it, still cached
    assert m.extend("b", 10) is not None
    assert m.lookup(A[:28] + [5, 5]) == 28
    m.check_invariants()


def test_without_the_junction_the_checkpoint_is_transient():
    m = _manager()
    b = _after_a(m)
    assert m.add_request("b", b, num_new_tokens=30) is not None
    assert m.lookup(A[:28] + [5, 5]) == 0
    m.check_invariants()


def test_a_checkpoint_off_the_alignment_is_not_taken():
    # from 0 to 30 the checkpoint (28) is 28 tokens past the step's start: a multiple of
    # 4 (taken: 2 Mamba blocks), not of 8 (one block, the step's end, entry 3)
    assert _manager(alignment=4).add_request("a", A, num_new_tokens=30).group_block_ids[1] == (0, 0, 9, 10)
    assert _manager(alignment=8).add_request("a", A, num_new_tokens=30).group_block_ids[1] == (0, 0, 0, 9)


def test_the_alignment_is_checked():
    with pytest.raises(ConfigError, match="checkpoint_alignment"):
        BlockSizes.of([4, 8], partial=True, checkpoints=True, checkpoint_alignment=0)
    with pytest.raises(ConfigError, match="checkpoint_alignment"):
        BlockSizes.of([4, 8], partial=True, checkpoints=True, checkpoint_alignment=True)
    with pytest.raises(ConfigError, match="checkpoint_alignment"):
        BlockSizes.of([4, 8], partial=True, checkpoint_alignment=8)
    assert BlockSizes.of([4, 8], partial=True, checkpoints=True).checkpoint_alignment == 4
    assert BlockSizes.of([4, 8], partial=True).checkpoint_alignment == 0
