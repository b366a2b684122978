"""Mamba's chunk-end checkpoint blocks where every group, the hash block and the
alignment are of ONE size (``BlockSizes.of([b, b], checkpoints=True)``, no partial
hits; groups/checkpoints.py): a checkpoint always ends its entry, so the block holds
the state after exactly that entry's tokens. The sized manager serves them (and Mamba's
retention beside them) beside tests/sized_model.py (checked against vLLM at one size
through the plug-in: tests/engines/test_vllm_one_size_checkpoints.py), by hand and in
the machines of tests/test_groups_sizes_machine.py."""

from __future__ import annotations

import pytest

from machine_rules import case
from prefixkv.errors import ConfigError
from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba
from prefixkv.groups.sized import SizedHybridKVCacheManager
from test_groups_sizes_machine import Junctions, SizedMachine


def _manager(retention=None, num_blocks=40):
    return HybridKVCacheManager([full_attention(), mamba(retention=retention)], num_blocks,
                                BlockSizes.of([8, 8], checkpoints=True), hash_mode="sha256")


def test_one_size_checkpoints_are_served_by_the_sized_calls_without_peek():
    assert type(_manager()) is SizedHybridKVCacheManager
    assert BlockSizes.of([8, 8], checkpoints=True, checkpoint_alignment=4).checkpoint_alignment == 4
    with pytest.raises(ConfigError, match="checkpoints"):
        BlockSizes.of([8, 8], peek=(True, False), checkpoints=True)
    with pytest.raises(ConfigError, match="checkpoints"):
        BlockSizes.of([8, 8], 4, checkpoints=True)  # (hash 4: not one size, no partial hits)


@pytest.mark.parametrize(("retention", "mamba_row", "hits"), [
    # a prompt of 60 cut 40 + 20 (vLLM's test_a_prompts_chunks_checkpoint_and_cache_as_vllms,
    # prefixkv's ids): the first chunk checkpoints at 32 into entry 3, its end at 40 in
    # entry 4 (none under 0: below prefill_end, 60); the second at 56 into entry 6 (the
    # prompt's last boundary), its end at 60 in entry 7. Hits of 40, 33 and 60 tokens
    (None, [None, None, None, None, 7, None, 11, 12], [40, 32, 56]),
    (0, [None, None, None, None, 6, None, 10, 11], [0, 0, 56]),
    (16, [None, None, None, None, 7, None, 11, 12], [32, 32, 56]),
])
def test_a_prompts_chunks_checkpoint_and_cache(retention, mamba_row, hits):
    m = _manager(retention)
    a = list(range(60))
    adm = m.add_request("a", a, num_new_tokens=40)
    assert adm.group_block_ids[1] == ((0, 0, 0, 0, 6) if retention == 0 else (0, 0, 0, 6, 7))
    assert m.extend("a", 20) is not None
    ids = m.get_block_ids("a")
    assert [None if i == m.null_block_id else i for i in ids[1]] == mamba_row
    for n, hit in zip([40, 33, 60], hits, strict=True):
        assert m.lookup(a[:n] + [99]) == hit
    m.check_invariants()


class OneSizeCheckpointMachine(Junctions, SizedMachine):
    """Full attention beside Mamba, both at 8 (hash 8): chunk-end checkpoints."""

    groups = ((8, None), (8, "mamba"))
    checkpoints = True


class OneSizeCheckpointRetentionMachine(OneSizeCheckpointMachine):
    """``OneSizeCheckpointMachine`` under retention 0 (vLLM's default): a prompt's last
    chunk checkpoints only, a Mamba state is kept at the request's marks only."""

    retention = 0


class OneSizeCheckpointSegmentsMachine(Junctions, SizedMachine):
    """Two Mamba groups beside full attention at 8, checkpoints 4 tokens apart from a
    step's start, a state kept every 16 tokens besides the marks (retention 16)."""

    groups = ((8, "mamba"), (8, None), (8, "mamba"))
    checkpoints = True
    checkpoint_alignment = 4
    retention = 16
    extra_blocks = 6


RUN = {"max_examples": 50, "stateful_step_count": 40}
TestOneSizeCheckpointMachine = case(OneSizeCheckpointMachine, **RUN)
TestOneSizeCheckpointRetentionMachine = case(OneSizeCheckpointRetentionMachine, **RUN)
TestOneSizeCheckpointSegmentsMachine = case(OneSizeCheckpointSegmentsMachine, **RUN)
