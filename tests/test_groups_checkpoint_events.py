"""A checkpoint cached at the prompt's last hash boundary is announced as vLLM's
``cache_partial_block`` announces a partial entry: one hash block, the last before the
boundary (its hash, parent hash, tokens and index), with the checkpoint's block id
(groups/checkpoints.py ``record``). Hash 4, full attention at 4, Mamba at 8."""

from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba


def test_a_checkpoint_at_the_prompts_last_boundary_is_announced_as_its_last_hash_block():
    m = HybridKVCacheManager([full_attention(), mamba()], 12,
                             BlockSizes.of([4, 8], partial=True, checkpoints=True), enable_events=True)
    # 13 tokens in one step: the state at 12 (the last boundary) goes to Mamba entry 0
    assert m.add_request("a", list(range(13))).group_block_ids == ((1, 2, 3, 4), (5, 6))
    events = m.take_events()
    full = {e.first_block: e for e in events if e.group_idx == 0}
    (ck,) = [e for e in events if e.group_idx == 1]
    last = full[2]  # hash block 2: tokens 8..11, the last before 12
    assert ck.block_ids == (5,)
    assert (ck.block_hashes, ck.parent_block_hash, ck.token_bytes, ck.first_block, ck.extra) == \
        (last.block_hashes, last.parent_block_hash, last.token_bytes, 2, None)
